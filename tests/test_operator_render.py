"""render: layouts, runtime arguments, shutdown, revision hash, and every object valid for Kubernetes."""
import json
import math
import subprocess
import sys
import time
from typing import Any

import kubernetes_validate
import pytest

from specdecode.operator import names
from specdecode.operator.render import (
    EXIT_MARGIN_SECONDS,
    PRE_STOP_SECONDS,
    build_shared,
    build_workloads,
    pod_template,
    render,
    revision,
)
from specdecode.operator.resolve import Resolved, resolve
from specdecode.runtime.config import ServerConfig, SpeculativeConfig

K8S_VERSIONS = ["1.30", kubernetes_validate.latest_version()]
NOT_BUNDLED = {"ServiceMonitor", "LeaderWorkerSet"}  # CRDs of other projects: checked by hand below
WORKLOAD_KINDS = {"Deployment", "StatefulSet", "LeaderWorkerSet"}


def cr(name: str = "demo", **spec: Any) -> dict[str, Any]:
    body = {"model": {"uri": "smollm2-135m"}, "image": "specdecode/runtime:test", **spec}
    return {"apiVersion": names.API_VERSION, "kind": names.KIND, "metadata": {"name": name, "namespace": "llm"},
            "spec": body}


def resolved(**spec: Any) -> Resolved:
    answer = resolve(cr(**spec))
    assert answer.allowed, answer.message
    return answer.resolved


def kinds(objs: list[dict[str, Any]]) -> list[str]:
    return [o["kind"] for o in objs]


def runtime(obj: dict[str, Any]) -> dict[str, Any]:
    spec = obj["spec"]
    template = spec.get("template") or spec["leaderWorkerTemplate"]["workerTemplate"]
    (container,) = template["spec"]["containers"]
    return container


def env(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


def arg(container: dict[str, Any], flag: str) -> str:
    args = container["args"]
    return args[args.index(flag) + 1]


EVERYTHING = dict(
    replicas=2,
    speculative={"method": "ngram", "numSpeculativeTokens": 6, "promptLookupMin": 2,
                 "loadControl": {"batchSizeTable": [{"maxBatchSize": 8, "numSpeculativeTokens": 4}]}},
    resources={"requests": {"cpu": "4", "memory": "16Gi"}, "limits": {"memory": 32}, "shmSize": "8Gi"},
    serviceMonitor={"enabled": True, "labels": {"release": "prom"}},
    podDisruptionBudget={"enabled": True, "maxUnavailable": "50%"},
    rollout={"trafficRouting": {"httpRoute": "llm-gateway"}},
    service={"type": "LoadBalancer", "port": 80, "annotations": {"a": "b"}},
    pod={
        "nodeSelector": {"gpu": "h100"},
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
            {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]}]}}},
        "imagePullSecrets": [{"name": "regcred"}],
        "serviceAccountName": "llm",
        "priorityClassName": "high",
        "labels": {"team": "ml"},
        "annotations": {"note": "x"},
        "env": [{"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}}],
        "volumes": [{"name": "extra", "configMap": {"name": "templates"}}],
        "volumeMounts": [{"name": "extra", "mountPath": "/etc/templates"}],
        "runtimeClassName": "nvidia",
        "schedulerName": "gpu-scheduler",
        "topologySpreadConstraints": [{"maxSkew": 1, "topologyKey": "topology.kubernetes.io/zone",
                                       "whenUnsatisfiable": "ScheduleAnyway", "matchLabelKeys": [names.LABEL_REVISION],
                                       "labelSelector": {"matchLabels": {names.LABEL_INSTANCE: "demo"}}}],
        "securityContext": {"supplementalGroups": [44], "seccompProfile": {"type": "Localhost",
                                                                           "localhostProfile": "profiles/llm.json"}},
        "containerSecurityContext": {"readOnlyRootFilesystem": True},
        "leaderWorkerSetAnnotations": {"leaderworkerset.sigs.k8s.io/exclusive-topology": "cloud.google.com/gke-nodepool"},
    },
)
LAYOUTS = {
    "tp-in-pod": dict(parallelism={"tensor": 4}),
    "pp-sts": dict(parallelism={"tensor": 2, "pipeline": 2}, model={"uri": "pvc://weights/qwen/7b"}),
    "pp-tp1": dict(parallelism={"pipeline": 2}),
    "pp-stage-across-pods": dict(parallelism={"tensor": 2, "pipeline": 2}, resources={"gpusPerPod": 1}),
    "pp-cpu": dict(parallelism={"tensor": 2, "pipeline": 2}, resources={"gpusPerPod": 0}),
    "pp-mtp-gated": dict(parallelism={"pipeline": 3}, gates=["mtp-pipeline-parallel"],
                         speculative={"method": "mtp", "mtpPath": "pvc://heads/qwen-mtp"}),
    "tp-across-pods": dict(parallelism={"tensor": 4}, resources={"gpusPerPod": 2}, model={"uri": "hf://Qwen/Qwen2.5-7B"}),
    "cpu": dict(resources={"gpusPerPod": 0}, model={"uri": "file:///models/smollm2"}),
    "mtp-hf": dict(model={"uri": "hf://Qwen/Qwen2.5-7B", "cacheClaim": "hf-cache"},
                   speculative={"method": "mtp", "mtpPath": "hf://org/qwen-mtp", "numSpeculativeTokens": 2}),
    "eagle3-hf": dict(model={"uri": "hf://meta-llama/Llama-3.1-8B-Instruct"},
                      speculative={"method": "eagle3", "eagle3Path": "hf://org/llama-eagle3", "numSpeculativeTokens": 3}),
}


def test_tp_in_one_pod_is_a_deployment():
    r = resolved(parallelism={"tensor": 4}, replicas=3)
    objs = render(r)
    assert kinds(objs) == ["Deployment", "Service"]
    deployment, service = objs
    rev = revision(r)
    assert deployment["metadata"]["name"] == f"demo-{rev}" and deployment["metadata"]["namespace"] == "llm"
    assert deployment["spec"]["replicas"] == 3
    assert deployment["spec"]["selector"]["matchLabels"][names.LABEL_REVISION] == rev
    assert deployment["spec"]["template"]["metadata"]["labels"][names.LABEL_REVISION] == rev
    container = runtime(deployment)
    assert container["resources"] == {"requests": {"cpu": "2", "memory": "8Gi", "nvidia.com/gpu": "4"},
                                      "limits": {"nvidia.com/gpu": "4"}}  # Burstable: requested, not limited
    assert arg(container, "--tensor-parallel-size") == "4" and "--pipeline-parallel-size" not in container["args"]
    assert "env" not in container  # no rendezvous inside one pod
    assert service["spec"]["selector"] == names.selector_labels("demo")  # stable and canary pods alike


def test_runtime_arguments_come_from_the_shared_config():
    r = resolved(speculative={"method": "ngram", "numSpeculativeTokens": 6, "verify": "greedy"},
                 model={"uri": "smollm2-135m", "servedName": "smol"}, extraArgs=["--max-model-len", "2048"])
    container = runtime(render(r)[0])
    assert container["command"] == ["specdecode"] and container["args"][0] == "serve"
    assert arg(container, "--model") == "smollm2-135m" and arg(container, "--served-model-name") == "smol"
    assert (arg(container, "--host"), arg(container, "--port")) == ("0.0.0.0", "8000")
    raw = arg(container, "--speculative-config")
    assert json.loads(raw) == {"method": "ngram", "num_speculative_tokens": 6, "verify": "greedy"}  # snake_case
    assert SpeculativeConfig.model_validate_json(raw) == r.spec.speculative  # the runtime reads it back
    assert container["args"][-2:] == ["--max-model-len", "2048"]


def test_probes_volumes_and_pass_through():
    r = resolved(probes={"startupTimeoutSeconds": 600, "periodSeconds": 5}, **{k: v for k, v in EVERYTHING.items()})
    deployment = render(r)[0]
    pod = deployment["spec"]["template"]["spec"]
    container = runtime(deployment)
    assert container["startupProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    assert container["startupProbe"]["failureThreshold"] * container["startupProbe"]["periodSeconds"] == 600
    assert container["livenessProbe"]["httpGet"]["path"] == "/health"
    assert {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "8Gi"}} in pod["volumes"]
    assert {"name": "dshm", "mountPath": "/dev/shm"} in container["volumeMounts"]
    assert container["resources"]["requests"] == {"cpu": "4", "memory": "16Gi", "nvidia.com/gpu": "1"}
    assert container["resources"]["limits"] == {"memory": "32", "nvidia.com/gpu": "1"}
    assert pod["nodeSelector"] == {"gpu": "h100"} and pod["tolerations"][0]["key"] == "nvidia.com/gpu"
    assert pod["imagePullSecrets"] == [{"name": "regcred"}] and pod["serviceAccountName"] == "llm"
    assert pod["priorityClassName"] == "high" and "nodeAffinity" in pod["affinity"]
    assert env(container)["HF_TOKEN"]["secretKeyRef"]["name"] == "hf"
    assert {"name": "extra", "mountPath": "/etc/templates"} in container["volumeMounts"]
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert labels["team"] == "ml" and labels[names.LABEL_INSTANCE] == "demo"
    assert deployment["spec"]["template"]["metadata"]["annotations"] == {"note": "x"}


@pytest.mark.parametrize(("extra_args", "drain"), [([], 600), (["--drain-timeout", "120"], 120),
                                                  (["--drain-timeout=90.5"], 90.5)])
def test_shutdown_waits_for_the_endpoints_then_the_whole_drain(extra_args, drain):
    """The grace period covers the preStop wait, the runtime's drain as its own parser reads it
    (default: ServerConfig's) and the margin to exit."""
    from specdecode.runtime.cli import build_parser

    (deployment, _service) = render(resolved(extraArgs=extra_args))
    container, pod = runtime(deployment), deployment["spec"]["template"]["spec"]
    parsed = build_parser().parse_args(container["args"]).drain_timeout
    assert (parsed or ServerConfig().drain_timeout_s) == drain
    assert pod["terminationGracePeriodSeconds"] == PRE_STOP_SECONDS + math.ceil(drain) + EXIT_MARGIN_SECONDS
    command = container["lifecycle"]["preStop"]["exec"]["command"]
    assert command[:2] == ["python", "-c"] and command[3:5] == [str(PRE_STOP_SECONDS), str(names.HTTP_PORT)]


def test_the_pre_stop_hook_holds_a_worker_while_its_leader_drains():
    """The hook as the kubelet runs it (0 s endpoint wait, 1 s for a serving leader): a leader or a
    one-pod replica goes on to SIGTERM at once; a worker waits while its leader drains (``/ready``
    503) and goes when the leader stops answering; a worker whose leader keeps serving (it alone is
    evicted) goes once the leader has been ready for the set time, not at the end of its grace period."""
    from http.server import BaseHTTPRequestHandler, HTTPServer
    from threading import Thread

    class Leader(BaseHTTPRequestHandler):
        status = 503  # draining

        def do_GET(self) -> None:  # noqa: N802 - http.server's spelling
            self.send_response(self.status if self.path == "/ready" else 200)
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    command = runtime(render(resolved())[0])["lifecycle"]["preStop"]["exec"]["command"]
    leader = HTTPServer(("127.0.0.1", 0), Leader)
    Thread(target=leader.serve_forever, daemon=True).start()
    hook = [sys.executable, *command[1:3], "0", str(leader.server_address[1]), "1"]
    group = {"MASTER_ADDR": "127.0.0.1"}
    assert subprocess.run(hook, env=group | {"NODE_RANK": "0"}, timeout=10).returncode == 0
    assert subprocess.run(hook, env={}, timeout=10).returncode == 0
    worker = subprocess.Popen(hook, env=group | {"NODE_RANK": "1"})
    time.sleep(3.0)
    assert worker.poll() is None  # the leader still drains
    Leader.status = 200  # serving, not going: the worker alone is
    assert worker.wait(timeout=10) == 0
    Leader.status = 503
    worker = subprocess.Popen(hook, env=group | {"NODE_RANK": "1"})
    time.sleep(1.0)
    assert worker.poll() is None
    leader.shutdown()
    leader.server_close()
    assert worker.wait(timeout=10) == 0


def test_selector_labels_win_over_user_pod_labels():
    r = resolved(pod={"labels": {names.LABEL_INSTANCE: "someone-else"}})
    assert render(r)[0]["spec"]["template"]["metadata"]["labels"][names.LABEL_INSTANCE] == "demo"


def test_model_sources():
    pvc = runtime(render(resolved(model={"uri": "pvc://weights/qwen/7b"}))[0])
    assert arg(pvc, "--model") == "/mnt/models/qwen/7b"
    assert {"name": "model", "mountPath": "/mnt/models", "readOnly": True} in pvc["volumeMounts"]
    hf = render(resolved(model={"uri": "hf://Qwen/Qwen2.5-7B", "cacheClaim": "hf-cache"}))[0]["spec"]["template"]["spec"]
    (fetch,) = hf["initContainers"]
    assert fetch["command"][-2:] == ["Qwen/Qwen2.5-7B", "/mnt/models/Qwen/Qwen2.5-7B"]
    assert {"name": "model", "persistentVolumeClaim": {"claimName": "hf-cache"}} in hf["volumes"]
    local = runtime(render(resolved(model={"uri": "file:///opt/models/smol.gguf"}))[0])
    assert arg(local, "--model") == "/opt/models/smol.gguf"


# Each head field as the spec names it, the runtime's field, and what the pod gets: volume, mount, fetch container.
HEADS = {"mtp": ("mtpPath", "mtp_path", "mtp", "/mnt/mtp", names.FETCH_MTP_CONTAINER),
         "eagle3": ("eagle3Path", "eagle3_path", "eagle3", "/mnt/eagle3", names.FETCH_EAGLE3_CONTAINER)}


def head_pod(method: str, model: str, heads: str, **model_fields: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """(pod spec, runtime container) of a ``method`` spec with ``heads`` as its head field."""
    r = resolved(model={"uri": model, **model_fields}, speculative={"method": method, HEADS[method][0]: heads})
    workload = render(r)[0]
    return workload["spec"]["template"]["spec"], runtime(workload)


@pytest.mark.parametrize("method", HEADS)
@pytest.mark.parametrize(("heads", "inside"), [
    ("pvc://head-claim/smollm2-heads", "/smollm2-heads"),
    ("hf://org/smollm2-heads", "/org/smollm2-heads"),
    ("file:///opt/heads/smollm2-heads", "/opt/heads/smollm2-heads"),
])
def test_heads_are_brought_in_as_the_model_is_and_passed_as_a_local_path(method, heads, inside):
    _, config_field, volume, mount, fetch_container = HEADS[method]
    inside = inside if heads.startswith("file://") else mount + inside
    pod, container = head_pod(method, "smollm2-135m", heads)
    raw = arg(container, "--speculative-config")
    assert json.loads(raw) == {"method": method, config_field: inside}
    assert getattr(SpeculativeConfig.model_validate_json(raw), config_field) == inside  # the runtime reads it back
    mounted = {"name": volume, "mountPath": mount, "readOnly": True}
    if heads.startswith("pvc://"):
        assert {"name": volume, "persistentVolumeClaim": {"claimName": "head-claim", "readOnly": True}} in pod["volumes"]
        assert mounted in container["volumeMounts"] and "initContainers" not in pod
    elif heads.startswith("hf://"):
        (fetch,) = pod["initContainers"]
        assert fetch["name"] == fetch_container and fetch["command"][-2:] == ["org/smollm2-heads", inside]
        assert fetch["volumeMounts"] == [{"name": volume, "mountPath": mount}]
        assert {"name": volume, "emptyDir": {}} in pod["volumes"] and mounted in container["volumeMounts"]
    else:
        assert all(v["name"] != volume for v in pod["volumes"]) and "initContainers" not in pod


@pytest.mark.parametrize("method", HEADS)
def test_model_and_heads_from_two_sources_get_a_volume_each(method):
    _, _, volume, _, fetch_container = HEADS[method]
    pod, container = head_pod(method, "pvc://weights/qwen/7b", "pvc://heads/qwen-heads")
    claims = {v["name"]: v["persistentVolumeClaim"]["claimName"] for v in pod["volumes"] if "persistentVolumeClaim" in v}
    assert claims == {"model": "weights", volume: "heads"}
    assert arg(container, "--model") == "/mnt/models/qwen/7b"
    pod, _ = head_pod(method, "hf://Qwen/Qwen2.5-7B", "hf://org/qwen-heads", cacheClaim="hf-cache")
    assert [c["name"] for c in pod["initContainers"]] == [names.FETCH_CONTAINER, fetch_container]
    cached = [v["name"] for v in pod["volumes"] if v.get("persistentVolumeClaim") == {"claimName": "hf-cache"}]
    assert cached == ["model", volume]  # one download cache for both
    pod, _ = head_pod(method, "file:///models/qwen", "hf://org/qwen-heads", cacheClaim="hf-cache")  # heads alone hf://
    assert {"name": volume, "persistentVolumeClaim": {"claimName": "hf-cache"}} in pod["volumes"]


def test_containers_leave_their_log_tail_as_termination_message():
    pod, container = head_pod("mtp", "hf://Qwen/Qwen2.5-7B", "hf://org/qwen-mtp")
    assert container["terminationMessagePolicy"] == "FallbackToLogsOnError"
    assert "terminationMessagePath" not in container  # Kubernetes' default, /dev/termination-log
    assert {c["terminationMessagePolicy"] for c in pod["initContainers"]} == {"FallbackToLogsOnError"}


def test_pipeline_parallel_is_a_statefulset_and_headless_service_per_replica():
    r = resolved(parallelism={"tensor": 2, "pipeline": 3}, replicas=2)
    objs = render(r)
    assert kinds(objs) == ["Service", "StatefulSet", "Service", "StatefulSet", "Service"]
    rev = revision(r)
    for group in (0, 1):
        headless, sts = objs[2 * group], objs[2 * group + 1]
        name = names.group_name("demo", rev, group)
        assert headless["metadata"]["name"] == sts["metadata"]["name"] == sts["spec"]["serviceName"] == name
        assert headless["spec"]["clusterIP"] == "None" and headless["spec"]["publishNotReadyAddresses"]
        assert headless["spec"]["selector"] == sts["spec"]["selector"]["matchLabels"]
        assert sts["spec"]["replicas"] == 3 and sts["spec"]["podManagementPolicy"] == "Parallel"
        container = runtime(sts)
        e = env(container)
        assert e["MASTER_ADDR"] == f"{name}-0.{name}.llm.svc" and e["MASTER_PORT"] == "29500" and e["NNODES"] == "3"
        assert e["NODE_RANK"]["fieldRef"]["fieldPath"] == f"metadata.labels['{names.LABEL_STS_POD_INDEX}']"
        assert arg(container, "--pipeline-parallel-size") == "3" and arg(container, "--tensor-parallel-size") == "2"
        assert container["resources"]["limits"] == {"nvidia.com/gpu": "2"}
    service = objs[-1]
    assert service["spec"]["selector"] == {**names.selector_labels("demo"), names.LABEL_STS_POD_INDEX: "0"}


def test_leader_worker_set_when_the_cluster_serves_it():
    r = resolved(parallelism={"tensor": 8}, resources={"gpusPerPod": 4}, replicas=2)
    objs = render(r, leader_worker_set=True)
    assert kinds(objs) == ["LeaderWorkerSet", "Service"]
    lws, service = objs
    assert lws["apiVersion"] == "leaderworkerset.x-k8s.io/v1" and lws["spec"]["replicas"] == 2
    assert lws["spec"]["leaderWorkerTemplate"]["size"] == 2
    e = env(runtime(lws))
    assert e["MASTER_ADDR"] == "$(LWS_LEADER_ADDRESS)"
    assert e["NODE_RANK"]["fieldRef"]["fieldPath"] == f"metadata.labels['{names.LABEL_LWS_WORKER_INDEX}']"
    assert service["spec"]["selector"][names.LABEL_LWS_WORKER_INDEX] == "0"


def test_service_monitor_and_pdb():
    objs = render(resolved(**EVERYTHING))
    by_kind = {o["kind"]: o for o in objs if o["kind"] != "Service"}
    monitor, pdb = by_kind["ServiceMonitor"], by_kind["PodDisruptionBudget"]
    (service,) = [o for o in objs if o["kind"] == "Service" and o["metadata"]["name"] == names.service_name("demo")]
    assert monitor["metadata"]["labels"]["release"] == "prom"
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] == service["spec"]["ports"][0]["name"] and endpoint["path"] == "/metrics"
    (relabel,) = endpoint["relabelings"]
    assert relabel["sourceLabels"] == ["__meta_kubernetes_pod_label_specdecode_io_revision"]
    assert relabel["targetLabel"] == "revision"
    assert pdb["spec"]["maxUnavailable"] == "50%" and pdb["spec"]["selector"]["matchLabels"] == names.selector_labels("demo")
    assert service["spec"]["type"] == "LoadBalancer" and service["spec"]["ports"][0]["port"] == 80


def test_traffic_routing_adds_a_stable_and_a_canary_service():
    r = resolved(**{**EVERYTHING, **LAYOUTS["pp-sts"]})
    objs = build_shared(r, "old", "new")
    services = {o["metadata"]["name"]: o for o in objs if o["kind"] == "Service"}
    assert set(services) == {"demo", "demo-stable", "demo-canary"}
    api = services["demo"]
    for name, rev in (("demo-stable", "old"), ("demo-canary", "new")):
        service = services[name]
        assert service["spec"]["selector"] == {**api["spec"]["selector"], names.LABEL_REVISION: rev}  # leaders only
        assert service["spec"]["type"] == "ClusterIP" and service["spec"]["ports"] == api["spec"]["ports"]
        assert service["metadata"]["labels"][names.LABEL_COMPONENT] == names.COMPONENT_ROUTE_BACKEND
        assert names.LABEL_REVISION not in service["metadata"]["labels"]  # shared, not one revision's object
    (monitor,) = [o for o in objs if o["kind"] == "ServiceMonitor"]  # scrapes through the API Service only
    selects = monitor["spec"]["selector"]["matchLabels"].items()
    assert [n for n, o in services.items() if selects <= o["metadata"]["labels"].items()] == ["demo"]
    no_canary = {o["metadata"]["name"]: o for o in build_shared(r, "old")}
    assert no_canary["demo-canary"]["spec"]["selector"][names.LABEL_REVISION] == "old"
    assert [o["metadata"]["name"] for o in build_shared(resolved(), "old") if o["kind"] == "Service"] == ["demo"]


def test_each_route_service_selects_the_leaders_of_its_own_revisions_kind():
    """A canary of another workload kind (an explicit change of kind): the traffic Service and the
    stable backend keep the stable's leader label, the canary backend selects the canary's."""
    r = resolved(**LAYOUTS["pp-sts"], rollout={"trafficRouting": {"httpRoute": "gw"}})
    services = {o["metadata"]["name"]: o["spec"]["selector"] for o in build_shared(
        r, "old", "new", leader_worker_set=False, canary_leader_worker_set=True)}
    for name in ("demo", "demo-stable"):
        assert services[name][names.LABEL_STS_POD_INDEX] == "0" and names.LABEL_LWS_WORKER_INDEX not in services[name]
    assert services["demo-canary"][names.LABEL_LWS_WORKER_INDEX] == "0"
    assert names.LABEL_STS_POD_INDEX not in services["demo-canary"]


def test_revision_is_stable_and_follows_the_pod_template():
    base = revision(resolved(speculative={"method": "ngram"}))
    assert base == revision(resolved(speculative={"method": "ngram"}))
    assert len(base) == names.REVISION_LENGTH
    # what the pods do not see makes no new revision
    assert base == revision(resolved(speculative={"method": "ngram"}, replicas=5))
    assert base == revision(resolved(speculative={"method": "ngram"}, rollout={"analysis": {"minAcceptanceRate": 0.4}}))
    assert base == revision(resolved(speculative={"method": "ngram"}, rollout={"trafficRouting": {"httpRoute": "r"}}))
    assert base == revision(resolved(speculative={"method": "ngram", "numSpeculativeTokens": 4}))  # the default spelled out
    # what they do see makes one
    changed = {
        revision(resolved(speculative={"method": "ngram", "numSpeculativeTokens": 5})),
        revision(resolved(speculative={"method": "ngram"}, image="specdecode/runtime:other")),
        revision(resolved(speculative={"method": "ngram"}, pod={"env": [{"name": "X", "value": "1"}]})),
        revision(resolved(speculative={"method": "suffix"})),
    }
    assert base not in changed and len(changed) == 4


def test_replicas_are_a_parameter_for_the_rollout():
    r = resolved(parallelism={"pipeline": 2}, replicas=4)
    rev = revision(r)
    assert [o["metadata"]["name"] for o in build_workloads(r, rev, 1)] == [f"demo-{rev}-0"] * 2
    assert build_workloads(r, rev, 0) == []
    assert render(resolved(replicas=4), replicas=1)[0]["spec"]["replicas"] == 1


def test_pod_template_is_not_shared_between_renders():
    r = resolved()
    render(r)[0]["spec"]["template"]["metadata"]["labels"]["x"] = "y"
    assert "x" not in pod_template(r)["metadata"]["labels"]


def all_rendered() -> list[tuple[str, dict[str, Any]]]:
    out = []
    for layout, spec in LAYOUTS.items():
        merged = {**EVERYTHING, **spec, "resources": {**EVERYTHING["resources"], **spec.get("resources", {})}}
        for lws in (False, True):
            for obj in render(resolved(**merged), leader_worker_set=lws):
                out.append((f"{layout}{'-lws' if lws else ''}/{obj['kind']}/{obj['metadata']['name']}", obj))
    return out


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_every_rendered_object_passes_kubernetes_validate_strict(version):
    checked = set()
    for label, obj in all_rendered():
        if obj["kind"] in NOT_BUNDLED:
            with pytest.raises(kubernetes_validate.SchemaNotFoundError):
                kubernetes_validate.validate(obj, version, strict=True)
            continue
        kubernetes_validate.validate(obj, version, strict=True)
        checked.add(obj["kind"])
    assert checked == {"Deployment", "StatefulSet", "Service", "PodDisruptionBudget"}


def test_leader_worker_set_pod_template_passes_as_a_pod_template():
    """LeaderWorkerSet is not bundled: its workerTemplate is a PodTemplateSpec, validated as one."""
    r = resolved(**{**EVERYTHING, **LAYOUTS["pp-sts"]})
    (lws, *_rest) = render(r, leader_worker_set=True)
    template = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"},
                "template": lws["spec"]["leaderWorkerTemplate"]["workerTemplate"]}
    for version in K8S_VERSIONS:
        kubernetes_validate.validate(template, version, strict=True)


# (tensor, pipeline, pods per group) of each layout, as its spec asks for it.
GROUPS = {"tp-in-pod": (4, 1, 1), "pp-sts": (2, 2, 2), "pp-tp1": (1, 2, 2), "pp-stage-across-pods": (2, 2, 4),
          "pp-cpu": (2, 2, 2), "pp-mtp-gated": (1, 3, 3), "tp-across-pods": (4, 1, 2), "cpu": (1, 1, 1),
          "mtp-hf": (1, 1, 1), "eagle3-hf": (1, 1, 1)}


def group_size(workload: dict[str, Any]) -> int:
    """Pods in one parallel group of a rendered workload."""
    if workload["kind"] == "Deployment":
        return 1
    if workload["kind"] == "LeaderWorkerSet":
        return workload["spec"]["leaderWorkerTemplate"]["size"]
    return workload["spec"]["replicas"]


def pod_of(workload: dict[str, Any]) -> dict[str, Any]:
    spec = workload["spec"]
    return (spec.get("template") or spec["leaderWorkerTemplate"]["workerTemplate"])["spec"]


def test_cluster_pod_fields_reach_every_pod_of_every_layout():
    """spec.pod's scheduling and security fields go into every workload's pods as written (the
    security contexts merged over the operator's), and leaderWorkerSetAnnotations onto the
    LeaderWorkerSet itself."""
    given = EVERYTHING["pod"]
    workloads = [(label, obj) for label, obj in all_rendered() if obj["kind"] in WORKLOAD_KINDS]
    assert {obj["kind"] for _, obj in workloads} == WORKLOAD_KINDS
    for label, obj in workloads:
        pod = pod_of(obj)
        for field in ("runtimeClassName", "schedulerName", "priorityClassName", "topologySpreadConstraints"):
            assert pod[field] == given[field], (label, field)
        assert pod["securityContext"] == {"runAsNonRoot": True, "runAsUser": 10001, "runAsGroup": 10001,
                                          "fsGroup": 10001, "fsGroupChangePolicy": "OnRootMismatch",
                                          **given["securityContext"]}, label
        for container in (*pod.get("initContainers", ()), *pod["containers"]):
            assert container["securityContext"] == {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]},
                                                    "readOnlyRootFilesystem": True}, (label, container["name"])
        annotations = obj["metadata"].get("annotations")
        assert annotations == (given["leaderWorkerSetAnnotations"] if obj["kind"] == "LeaderWorkerSet" else None), label


def default_workloads() -> list[tuple[str, dict[str, Any]]]:
    """Every admissible layout's workloads, each kind it can run as, with nothing but the layout set."""
    return [(f"{layout}{'-lws' if lws else ''}", obj) for layout, spec in LAYOUTS.items() for lws in (False, True)
            for obj in render(resolved(**spec), leader_worker_set=lws) if obj["kind"] in WORKLOAD_KINDS]


def qos_class(pod: dict[str, Any]) -> str:
    """The pod's QoS class as the kubelet computes it (``GetPodQOS``), from cpu and memory only."""
    containers = [*pod.get("initContainers", ()), *pod["containers"]]
    amounts = [{kind: {k: v for k, v in c.get("resources", {}).get(kind, {}).items() if k in ("cpu", "memory")}
                for kind in ("requests", "limits")} for c in containers]
    if not any(a["requests"] or a["limits"] for a in amounts):
        return "BestEffort"
    guaranteed = all(a["limits"].keys() == {"cpu", "memory"} and a["requests"] in ({}, a["limits"]) for a in amounts)
    return "Guaranteed" if guaranteed else "Burstable"


# /dev/shm by default: 1Gi + 1Gi per rank in the pod (GPUs per pod, or tensor on CPU).
DEFAULT_SHM = {"tp-in-pod": "5Gi", "pp-sts": "3Gi", "pp-tp1": "2Gi", "pp-stage-across-pods": "2Gi", "pp-cpu": "3Gi",
               "pp-mtp-gated": "2Gi", "tp-across-pods": "3Gi", "cpu": "2Gi", "mtp-hf": "2Gi",
               "eagle3-hf": "2Gi"}


def test_every_layouts_pods_request_cpu_and_memory_unlimited_and_size_shm_by_ranks():
    """Burstable QoS by default: cpu and memory requested, not limited (a memory limit would count
    /dev/shm against the runtime), so a pod is neither the first evicted nor capped."""
    assert DEFAULT_SHM.keys() == LAYOUTS.keys()
    for label, obj in default_workloads():
        pod = pod_of(obj)
        (container,) = pod["containers"]
        assert qos_class(pod) == "Burstable", label
        assert {"cpu": "2", "memory": "8Gi"}.items() <= container["resources"]["requests"].items(), label
        assert not {"cpu", "memory"} & container["resources"].get("limits", {}).keys(), label
        (shm,) = [v for v in pod["volumes"] if v["name"] == names.SHM_VOLUME]
        assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": DEFAULT_SHM[label.removesuffix("-lws")]}, label


@pytest.mark.parametrize(("resources", "requests", "limits"), [
    ({"requests": {"cpu": "8"}}, {"cpu": "8", "memory": "8Gi"}, {}),  # one request given: the other defaults
    ({"limits": {"memory": "64Gi"}}, {"cpu": "2"}, {"memory": "64Gi"}),  # a lone limit is the request
    ({"requests": {"memory": "1Gi"}, "limits": {"cpu": "4"}}, {"memory": "1Gi"}, {"cpu": "4"}),
    ({"requests": {"cpu": "1", "memory": "2Gi"}, "limits": {"cpu": "1", "memory": "2Gi"}, "shmSize": "1Gi"},
     {"cpu": "1", "memory": "2Gi"}, {"cpu": "1", "memory": "2Gi"}),  # Guaranteed, when asked for
])
def test_requests_and_limits_override_the_defaults_resource_by_resource(resources, requests, limits):
    pod = pod_of(render(resolved(resources={"gpusPerPod": 0, **resources}))[0])
    assert pod["containers"][0]["resources"] == {"requests": requests, **({"limits": limits} if limits else {})}
    assert qos_class(pod) == ("Guaranteed" if limits.keys() == {"cpu", "memory"} else "Burstable")


def test_every_admissible_layouts_runtime_arguments_parse_with_the_runtimes_own_parser():
    """render and the runtime's CLI cannot drift apart: each rendered runtime container's command
    and args parse with ``specdecode``'s parser and build its engine config with each pod's env
    (``NODE_RANK`` as the pod index gives it), and the group's pods together run every global rank
    of tensor × pipeline exactly once, none spanning two stages."""
    from specdecode.runtime.cli import build_parser
    from specdecode.runtime.serve_flags import engine_config

    assert GROUPS.keys() == LAYOUTS.keys()
    checked = set()
    for label, obj in all_rendered():
        if obj["kind"] not in {"Deployment", "StatefulSet", "LeaderWorkerSet"}:
            continue
        tensor, pipeline, pods = GROUPS[label.split("/")[0].removesuffix("-lws")]
        assert group_size(obj) == pods, label
        container = runtime(obj)
        assert container["command"] == ["specdecode"], label
        args = build_parser().parse_args(container["args"])
        pod_env = {k: v for k, v in env(container).items() if isinstance(v, str)}
        assert ("NNODES" in pod_env) is (pods > 1), label
        ranks = []
        for node_rank in range(pods):
            cfg = engine_config(args, pod_env | ({"NODE_RANK": str(node_rank)} if pods > 1 else {}))
            parallel = cfg.parallel
            assert (parallel.tensor_parallel_size, parallel.pipeline_parallel_size) == (tensor, pipeline), label
            assert parallel.num_nodes == pods and parallel.node_rank == node_rank, label
            assert len({parallel.stage_of(rank) for rank in parallel.local_ranks}) == 1, label
            ranks += parallel.local_ranks
        assert sorted(ranks) == list(range(tensor * pipeline)), label
        rendered = json.loads(arg(container, "--speculative-config"))
        assert cfg.speculative.method.value == rendered["method"], label
        checked.add(label.split("/")[0])
    assert checked == {f"{layout}{lws}" for layout in LAYOUTS for lws in ("", "-lws")}
