"""The Helm chart charts/specdecode: strict lint, rendered with default and non-default values,
every object valid for Kubernetes 1.30 and the newest schema kubernetes-validate bundles; and the
chart agrees with the code it stands for (CRD, operator command and webhook, RBAC for what
render() builds, the values table in its README).

kubernetes-validate has no schema for the Prometheus Operator's and cert-manager's kinds
(ServiceMonitor, Issuer, Certificate): those get the minimal checks below (shape, and that they
point at the objects the chart renders). What offline rendering cannot show (``lookup`` reusing
the webhook certificate on upgrade, RBAC enforcement) is listed in the chart's README.
"""
import base64
import json
import re
import subprocess
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import helm_python as helm
import kubernetes_validate
import pytest
import yaml
from kubernetes_validate.utils import SchemaNotFoundError
from pod_security import CONTROLS

from specdecode.operator import names
from specdecode.operator.render import render as render_runtime
from specdecode.operator.resolve import resolve

REPO = Path(__file__).resolve().parents[1]
CHART = REPO / "charts" / "specdecode"
RELEASE, NAMESPACE = "specdecode", "specdecode-system"
KUBERNETES_VERSIONS = ["1.30", kubernetes_validate.latest_version()]
# The contract with the operator (issue 4): how the image is run, where admission is served.
FULLNAME = f"{RELEASE}-operator"
OPERATOR_COMMAND = ["kopf", "run", "--standalone", "--all-namespaces", "--liveness=http://0.0.0.0:8080/healthz",
                    "-m", "specdecode.operator.handlers"]
WEBHOOK_PATH = "/validate-specdecodedeployment"

CUSTOM_VALUES = {
    "image": {"repository": "registry.example.com/ml/specdecode-operator", "tag": "1.2.3", "pullPolicy": "Always"},
    "resources": {"requests": {"cpu": "250m", "memory": "200Mi"}, "limits": {"cpu": "1", "memory": "400Mi"}},
    "nodeSelector": {"kubernetes.io/os": "linux", "pool": "system"},
    "webhook": {"enabled": False},
    "serviceMonitor": {"enabled": True, "interval": "15s", "labels": {"release": "prometheus"}},
    "dashboard": {"enabled": False},
}
CERT_MANAGER_VALUES = {"webhook": {"certManager": {"enabled": True}}}
VALUE_SETS = {"defaults": {}, "custom": CUSTOM_VALUES, "cert-manager": CERT_MANAGER_VALUES}
# Served by other projects' CRDs; kubernetes-validate bundles no schema for them.
FOREIGN_KINDS = {("monitoring.coreos.com/v1", "ServiceMonitor"), ("cert-manager.io/v1", "Issuer"),
                 ("cert-manager.io/v1", "Certificate")}
CLUSTER_SCOPED = {"ClusterRole", "ClusterRoleBinding", "ValidatingWebhookConfiguration"}

Obj = dict[str, Any]


@pytest.fixture(scope="module")
def chart() -> helm.Chart:
    return helm.Chart.load(CHART)


def render(chart: helm.Chart, values: Obj) -> list[Obj]:
    manifests = chart.render(values, name=RELEASE, namespace=NAMESPACE, is_install=True)
    return [obj for text in manifests.values() for obj in yaml.safe_load_all(text) if obj]


@pytest.fixture(scope="module")
def rendered(chart) -> dict[str, list[Obj]]:
    return {name: render(chart, values) for name, values in VALUE_SETS.items()}


def only(objs: list[Obj], kind: str) -> Obj:
    (obj,) = [o for o in objs if o["kind"] == kind]
    return obj


def kinds(objs: list[Obj]) -> set[str]:
    return {o["kind"] for o in objs}


def operator_container(objs: list[Obj]) -> Obj:
    (container,) = only(objs, "StatefulSet")["spec"]["template"]["spec"]["containers"]
    return container


def container_env(container: Obj) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


def container_ports(container: Obj) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in container["ports"]}


# -- lint and schema -----------------------------------------------------------------------------


@pytest.mark.parametrize("values", VALUE_SETS.values(), ids=VALUE_SETS.keys())
def test_lint_is_clean(values):
    report = helm.lint(CHART, values, strict=True, kube_version="v1.30.0", namespace=NAMESPACE)
    findings = [m for m in report["messages"] if m["severity"] >= 2]  # 1 = info ("icon is recommended")
    assert report["total_charts_linted"] == 1 and not report["errors"] and not findings, report


@pytest.mark.parametrize("values", [{"webhook": {"enable": False}}, {"image": {"tag": 3}},
                                   {"webhook": {"failurePolicy": "Sometimes"}}, {"replicaCount": 2}])
def test_values_schema_refuses_unknown_or_mistyped_values(chart, values):
    with pytest.raises(helm.HelmValuesError):
        chart.validate_schema(values)
    assert helm.lint(CHART, values, strict=True, kube_version="v1.30.0")["errors"]


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("values_name", VALUE_SETS)
def test_every_object_passes_the_kubernetes_schema(rendered, values_name, version):
    for obj in rendered[values_name]:
        if (obj["apiVersion"], obj["kind"]) in FOREIGN_KINDS:
            # the skip hides nothing: there really is no schema to validate against
            with pytest.raises(SchemaNotFoundError):
                kubernetes_validate.validate(obj, version, strict=True)
        else:
            kubernetes_validate.validate(obj, version, strict=True)


def test_each_value_set_renders_its_objects(rendered):
    common = {"ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Service", "StatefulSet", "PodDisruptionBudget",
              "Lease", "Role", "RoleBinding"}
    assert kinds(rendered["defaults"]) == common | {"Secret", "ValidatingWebhookConfiguration", "ConfigMap"}
    assert kinds(rendered["custom"]) == common | {"ServiceMonitor"}
    assert kinds(rendered["cert-manager"]) == common | {"Issuer", "Certificate", "ValidatingWebhookConfiguration",
                                                         "ConfigMap"}
    for objs in rendered.values():
        namespaced = [o for o in objs if o["kind"] not in CLUSTER_SCOPED]
        assert {o["metadata"]["namespace"] for o in namespaced} == {NAMESPACE}


# -- the operator StatefulSet --------------------------------------------------------------------


def test_operator_runs_the_contracted_command_hardened(rendered):
    objs = rendered["defaults"]
    pod = only(objs, "StatefulSet")["spec"]["template"]["spec"]
    container = operator_container(objs)
    assert container["command"] == OPERATOR_COMMAND
    assert container["image"] == "specdecode/operator:0.1.0"  # the chart's appVersion
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] > 0
    security = container["securityContext"]
    assert security["readOnlyRootFilesystem"] is True and security["allowPrivilegeEscalation"] is False
    assert security["capabilities"]["drop"] == ["ALL"]
    assert container["resources"]["requests"] and container["resources"]["limits"]["memory"]
    assert pod["serviceAccountName"] == only(objs, "ServiceAccount")["metadata"]["name"]


@pytest.mark.parametrize("control", CONTROLS)
def test_operator_pod_holds_the_restricted_pod_security_control(rendered, control):
    """The operator's own pod, with every value set, meets the restricted profile too (the control
    as tests/pod_security.py names it)."""
    for values_name, objs in rendered.items():
        assert CONTROLS[control](only(objs, "StatefulSet")["spec"]["template"]) == [], values_name


def test_two_replicas_share_a_lease_and_survive_a_drain(rendered, chart):
    """Every replica runs the same command and competes for the release's Lease (its name, its
    namespace, its timing and the pod's name as holder in the environment); the Role lets the
    operator read and replace that Lease alone."""
    objs = rendered["defaults"]
    operator, pdb = only(objs, "StatefulSet"), only(objs, "PodDisruptionBudget")
    assert operator["spec"]["replicas"] == 2 and operator["spec"]["podManagementPolicy"] == "Parallel"
    lease = only(objs, "Lease")["metadata"]
    env = container_env(operator_container(objs))
    assert env["POD_ID"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    assert env["POD_NAMESPACE"] == {"fieldRef": {"fieldPath": "metadata.namespace"}} and lease["namespace"] == NAMESPACE
    assert env["SPECDECODE_LEASE_NAME"] == lease["name"] == FULLNAME
    assert [env[f"SPECDECODE_LEASE_{key}_SECONDS"] for key in ("DURATION", "RENEW_DEADLINE", "RETRY_PERIOD")] == [
        "15", "10", "2"]
    role, binding = only(objs, "Role"), only(objs, "RoleBinding")
    assert role["rules"] == [{"apiGroups": ["coordination.k8s.io"], "resources": ["leases"],
                              "resourceNames": [lease["name"]], "verbs": ["get", "update"]}]
    assert binding["roleRef"]["name"] == role["metadata"]["name"] and binding["subjects"][0]["name"] == (
        only(objs, "ServiceAccount")["metadata"]["name"])
    with pytest.raises(Exception, match="renewDeadlineSeconds"):
        render(chart, {"leaderElection": {"leaseDurationSeconds": 10, "renewDeadlineSeconds": 10,
                                          "retryPeriodSeconds": 2}})
    assert pdb["spec"]["maxUnavailable"] == 1
    assert pdb["spec"]["selector"]["matchLabels"].items() <= operator["spec"]["template"]["metadata"]["labels"].items()
    spread = operator["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"]
    assert spread["preferredDuringSchedulingIgnoredDuringExecution"][0]["podAffinityTerm"]["topologyKey"] == (
        "kubernetes.io/hostname")
    single = render(chart, {"replicas": 1})
    assert "PodDisruptionBudget" not in kinds(single) and only(single, "StatefulSet")["spec"]["replicas"] == 1


def test_probes_and_ports_agree_with_the_command(rendered):
    container = operator_container(rendered["defaults"])
    ports, env = container_ports(container), container_env(container)
    (flag,) = [a for a in container["command"] if a.startswith("--liveness=")]
    liveness = urlsplit(flag.removeprefix("--liveness="))
    assert container["livenessProbe"]["httpGet"] == {"path": liveness.path, "port": "health"}
    assert ports["health"] == liveness.port == 8080
    assert int(env["SPECDECODE_METRICS_PORT"]) == ports["metrics"] == 8081
    assert int(env["SPECDECODE_WEBHOOK_PORT"]) == ports["webhook"] == 9443
    assert container["readinessProbe"]["tcpSocket"] == {"port": "webhook"}


def test_operator_pods_never_match_a_runtime_service_selector(rendered):
    """The Services the operator renders select app.kubernetes.io/name=specdecode + instance."""
    labels = only(rendered["defaults"], "StatefulSet")["spec"]["template"]["metadata"]["labels"]
    assert labels[names.LABEL_NAME] != names.APP
    assert not names.selector_labels(RELEASE).items() <= labels.items()


def test_custom_values_reach_the_pod_and_webhook_off_leaves_no_trace(rendered):
    objs = rendered["custom"]
    pod = only(objs, "StatefulSet")["spec"]["template"]["spec"]
    container = operator_container(objs)
    image = CUSTOM_VALUES["image"]
    assert container["image"] == f"{image['repository']}:{image['tag']}"
    assert container["imagePullPolicy"] == image["pullPolicy"]
    assert container["resources"] == CUSTOM_VALUES["resources"]
    assert pod["nodeSelector"] == CUSTOM_VALUES["nodeSelector"]
    assert not {"SPECDECODE_WEBHOOK_PORT", "SPECDECODE_WEBHOOK_CERT_DIR"} & container_env(container).keys()
    assert "webhook" not in container_ports(container)
    assert [v["name"] for v in pod["volumes"]] == ["tmp"]
    assert container["readinessProbe"]["httpGet"]["port"] == "health"
    assert [p["name"] for p in only(objs, "Service")["spec"]["ports"]] == ["metrics"]


# -- the admission webhook -----------------------------------------------------------------------


def service_port(service: Obj, name: str) -> Obj:
    (port,) = [p for p in service["spec"]["ports"] if p["name"] == name]
    return port


def test_webhook_reaches_the_operator_for_our_resource(rendered):
    objs = rendered["defaults"]
    service, container = only(objs, "Service"), operator_container(objs)
    (webhook,) = only(objs, "ValidatingWebhookConfiguration")["webhooks"]
    target = webhook["clientConfig"]["service"]
    assert (target["name"], target["namespace"]) == (service["metadata"]["name"], NAMESPACE)
    assert target["path"] == WEBHOOK_PATH
    port = service_port(service, "webhook")
    assert target["port"] == port["port"] == 443 and port["targetPort"] == "webhook"
    assert container_ports(container)["webhook"] == int(container_env(container)["SPECDECODE_WEBHOOK_PORT"])
    pod_labels = only(objs, "StatefulSet")["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    (rule,) = webhook["rules"]
    assert rule == {"apiGroups": [names.GROUP], "apiVersions": [names.VERSION], "operations": ["CREATE", "UPDATE"],
                    "resources": [names.PLURAL], "scope": "Namespaced"}
    assert webhook["sideEffects"] == "None" and webhook["failurePolicy"] == "Fail"


def test_webhook_path_is_spelled_once_in_the_chart():
    spellings = [p for p in (CHART / "templates").iterdir() if WEBHOOK_PATH in p.read_text(encoding="utf-8")]
    assert [p.name for p in spellings] == ["_helpers.tpl"]


def pem(data: str, path: Path) -> Path:
    path.write_bytes(base64.b64decode(data))
    return path


def openssl(*args: str) -> str:
    return subprocess.run(["openssl", *args], check=True, capture_output=True, text=True, timeout=30).stdout


def test_helm_generated_certificate_is_trusted_and_names_the_service(rendered, tmp_path):
    objs = rendered["defaults"]
    secret, service, operator = only(objs, "Secret"), only(objs, "Service"), only(objs, "StatefulSet")
    (webhook,) = only(objs, "ValidatingWebhookConfiguration")["webhooks"]
    assert secret["type"] == "kubernetes.io/tls"
    assert webhook["clientConfig"]["caBundle"] == secret["data"]["ca.crt"]
    ca, cert = pem(secret["data"]["ca.crt"], tmp_path / "ca.pem"), pem(secret["data"]["tls.crt"], tmp_path / "tls.pem")
    assert openssl("verify", "-CAfile", str(ca), str(cert)).strip().endswith("OK")
    host = f"{service['metadata']['name']}.{NAMESPACE}.svc"
    assert f"DNS:{host}" in openssl("x509", "-in", str(cert), "-noout", "-ext", "subjectAltName")
    key = pem(secret["data"]["tls.key"], tmp_path / "tls.key")
    key_modulus = openssl("rsa", "-in", str(key), "-noout", "-modulus")
    assert openssl("x509", "-in", str(cert), "-noout", "-modulus") == key_modulus
    # the pod mounts this Secret where SPECDECODE_WEBHOOK_CERT_DIR says
    pod = operator["spec"]["template"]["spec"]
    (volume,) = [v for v in pod["volumes"] if v.get("secret", {}).get("secretName") == secret["metadata"]["name"]]
    (mount,) = [m for m in operator_container(objs)["volumeMounts"] if m["name"] == volume["name"]]
    assert mount["mountPath"] == container_env(operator_container(objs))["SPECDECODE_WEBHOOK_CERT_DIR"]


def test_cert_manager_issues_the_secret_the_pod_mounts(rendered):
    """The serving certificate's side; the chain behind it (root, CA, caBundle) is checked, and
    issued with real keys, in test_chart_certificates.py."""
    objs = rendered["cert-manager"]
    (certificate,) = [o for o in objs if o["kind"] == "Certificate" and not o["spec"].get("isCA")]
    service = only(objs, "Service")
    (webhook,) = only(objs, "ValidatingWebhookConfiguration")["webhooks"]
    assert "caBundle" not in webhook["clientConfig"]
    # minimal checks for kinds kubernetes-validate has no schema for: shape and references
    assert set(certificate["spec"]) == {"secretName", "dnsNames", "issuerRef"}
    assert certificate["spec"]["dnsNames"] == [f"{service['metadata']['name']}.{NAMESPACE}.svc"]
    issuers = {o["metadata"]["name"]: o["spec"] for o in objs if o["kind"] == "Issuer"}
    issuer_ref = certificate["spec"]["issuerRef"]
    assert issuer_ref["kind"] == "Issuer" and "ca" in issuers[issuer_ref["name"]]  # the chart's CA Issuer
    volumes = only(objs, "StatefulSet")["spec"]["template"]["spec"]["volumes"]
    assert {"name": "webhook-tls", "secret": {"secretName": certificate["spec"]["secretName"]}} in volumes


def test_cert_manager_with_the_users_issuer_creates_none(chart):
    issuer = {"name": "corporate-ca", "kind": "ClusterIssuer"}
    objs = render(chart, {"webhook": {"certManager": {"enabled": True, "issuerRef": issuer}}})
    assert "Issuer" not in kinds(objs) and only(objs, "Certificate")["spec"]["issuerRef"] == issuer


# -- RBAC ----------------------------------------------------------------------------------------

# What the operator's code calls (kube.Cluster, kopf): applied kinds are listed, applied (create
# when missing, patch) and deleted; the workloads are watched too (their readiness moves rollouts).
APPLIED = ["list", "create", "patch", "delete"]
WATCHED = ["list", "watch", "create", "patch", "delete"]
EXPECTED_RULES = {
    ("specdecode.io", "specdecodedeployments"): ["get", "list", "watch", "patch"],
    ("specdecode.io", "specdecodedeployments/status"): ["patch"],
    ("specdecode.io", "specdecodedeployments/finalizers"): ["update"],  # blockOwnerDeletion on the children
    ("apps", "deployments"): WATCHED,
    ("apps", "statefulsets"): WATCHED,
    ("leaderworkerset.x-k8s.io", "leaderworkersets"): WATCHED,
    ("", "services"): APPLIED,
    ("policy", "poddisruptionbudgets"): APPLIED,
    ("monitoring.coreos.com", "servicemonitors"): APPLIED,
    ("gateway.networking.k8s.io", "httproutes"): ["get", "patch"],
    ("", "pods"): ["list", "watch", "delete"],  # delete: a StatefulSet group restarted whole
    ("", "events"): ["create", "list"],
    ("apiextensions.k8s.io", "customresourcedefinitions"): ["list", "watch"],
}


def granted(cluster_role: Obj) -> dict[tuple[str, str], list[str]]:
    grants: dict[tuple[str, str], list[str]] = {}
    for rule in cluster_role["rules"]:
        assert set(rule) == {"apiGroups", "resources", "verbs"}, rule  # no nonResourceURLs, no resourceNames
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                grants.setdefault((group, resource), []).extend(rule["verbs"])
    return grants


def test_cluster_role_is_exactly_least_privilege(rendered):
    objs = rendered["defaults"]
    role, binding = only(objs, "ClusterRole"), only(objs, "ClusterRoleBinding")
    assert granted(role) == EXPECTED_RULES
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": only(objs, "ServiceAccount")["metadata"]["name"],
                                    "namespace": NAMESPACE}]


def sdd(**spec: Any) -> Obj:
    return {"apiVersion": names.API_VERSION, "kind": names.KIND, "metadata": {"name": "demo", "namespace": "llm"},
            "spec": {"model": {"uri": "smollm2-135m"}, "image": "specdecode/runtime:test",
                     "serviceMonitor": {"enabled": True}, "podDisruptionBudget": {"enabled": True}, **spec}}


def test_cluster_role_manages_every_kind_render_builds(rendered):
    grants = granted(only(rendered["defaults"], "ClusterRole"))
    built = []
    across_pods = {"parallelism": {"tensor": 4}, "resources": {"gpusPerPod": 2}}
    for spec, lws in [({}, False), (across_pods, False), (across_pods, True)]:
        answer = resolve(sdd(**spec))
        assert answer.allowed, answer.message
        built += render_runtime(answer.resolved, leader_worker_set=lws)
    assert {o["kind"] for o in built} >= {"Deployment", "StatefulSet", "LeaderWorkerSet", "Service",
                                         "ServiceMonitor", "PodDisruptionBudget"}
    for obj in built:
        group = obj["apiVersion"].rpartition("/")[0]
        resource = obj["kind"].lower() + "s"
        assert set(APPLIED) <= set(grants.get((group, resource), [])), f"cannot manage {obj['kind']}"


# -- monitoring: ServiceMonitor and dashboard ----------------------------------------------------


def test_operator_service_monitor_keeps_the_resources_namespace_label(rendered):
    objs = rendered["custom"]
    monitor, service = only(objs, "ServiceMonitor"), only(objs, "Service")
    # minimal checks for a kind kubernetes-validate has no schema for: shape and references
    assert set(monitor["spec"]) == {"selector", "endpoints"}
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    (endpoint,) = monitor["spec"]["endpoints"]
    assert set(endpoint) == {"port", "path", "interval", "honorLabels"}
    assert service_port(service, endpoint["port"])["port"] == 8081 and endpoint["path"] == "/metrics"
    assert endpoint["interval"] == "15s" and monitor["metadata"]["labels"]["release"] == "prometheus"
    assert endpoint["honorLabels"] is True  # the operator's series name the SpecDecodeDeployment's namespace


def test_dashboard_config_map_embeds_the_dashboard_file(rendered):
    config_map = only(rendered["defaults"], "ConfigMap")
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    (key,) = config_map["data"]
    dashboard = (CHART / "dashboards" / "specdecode.json").read_text(encoding="utf-8")
    assert json.loads(config_map["data"][key]) == json.loads(dashboard)


# -- CRD, values table ---------------------------------------------------------------------------


def test_chart_installs_no_crd_the_crd_is_its_own_charts(chart):
    assert not chart.crds  # the SpecDecodeDeployment CRD: charts/specdecode-crds; no peering API any more


def documented_values() -> dict[str, tuple[str, str]]:
    """`name` → (type, default) from the values table of the chart's README."""
    rows = re.findall(r"^\| `([^`]+)` \| (\w+) \| `(.*?)` \| .+ \|$",
                      (CHART / "README.md").read_text(encoding="utf-8"), re.MULTILINE)
    return {name: (type_, default) for name, type_, default in rows}


def schema_node(schema: Obj, node: Obj) -> Obj:
    ref = node.get("$ref")
    return schema["definitions"][ref.rsplit("/", 1)[-1]] if ref else node


def value_leaves(values: Obj, schema: Obj, node: Obj, prefix: str = "") -> dict[str, Any]:
    """Every value a user sets as a whole: objects with a closed schema are walked into; Kubernetes
    objects and maps passed through (resources, labels, …) are one value each."""
    leaves = {}
    for key, value in values.items():
        sub = schema_node(schema, node["properties"][key])
        if "properties" in sub:
            leaves.update(value_leaves(value, schema, sub, f"{prefix}{key}."))
        else:
            leaves[f"{prefix}{key}"] = value
    return leaves


JSON_TYPES = {bool: "boolean", int: "integer", str: "string", list: "list", dict: "object"}


def test_readme_documents_every_value_with_its_type_and_default():
    values = yaml.safe_load((CHART / "values.yaml").read_text(encoding="utf-8"))
    schema = json.loads((CHART / "values.schema.json").read_text(encoding="utf-8"))
    leaves, documented = value_leaves(values, schema, schema), documented_values()
    assert sorted(documented) == sorted(leaves)
    for name, value in leaves.items():
        type_, default = documented[name]
        assert type_ == JSON_TYPES[type(value)], name
        assert json.loads(default) == value, name
