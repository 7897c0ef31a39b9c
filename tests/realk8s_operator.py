"""The Helm chart installed on the real control plane (realk8s.py) as Helm would install it, and the
operator run as the chart's StatefulSet runs a replica of it, under the chart's ServiceAccount.

The chart is rendered by the same code path as tests/test_chart.py (``render``), with free ports
for its health, metrics and webhook values; its CRDs were installed with the control plane (Helm's
crds/ folder goes first). Every template object is created in Helm's install order, except those
of an API the server does not serve (1.20 has no ``policy/v1``): Helm would fail there, the tier
goes on and ``Release.unserved`` lists them. Two things differ from a cluster with nodes: the
webhook Secret holds a certificate this module makes for 127.0.0.1 (``caBundle`` its CA), and the
webhook's ``clientConfig.service`` becomes ``url: https://127.0.0.1:<webhook port><path>`` — no
kube-proxy routes a Service here. The workload is created, but no kubelet runs its pods: the
operator runs here as a process with the container's command and environment (the downward API's
pod name filled in), the Secret's files where the pod mounts them, and a kubeconfig holding a
token of the chart's ServiceAccount (TokenRequest API), so that the API server authenticates it as
``system:serviceaccount:<namespace>:<name>`` and RBAC applies. The session's operator is the
StatefulSet's ordinal 0; a test may start ordinal 1 beside it (its own ports: one host here, a
network namespace per pod there), and stop, kill and start a replica again (its log grows on).
The release's ``leaderElection`` is ``LEASE`` (failover in seconds).

``permissions``, ``granted``, ``unprovable`` and ``denied`` read least privilege off the audit log: which (group,
resource, verb) the operator's user used, which were denied, against what the ClusterRole grants.
"""
from __future__ import annotations

import base64
import os
import shutil
import socket
import sys
from collections.abc import Iterator
from datetime import datetime, timezone
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import helm_python as helm
import kubernetes
import kubernetes.dynamic
import pytest
from kubernetes.dynamic.exceptions import ResourceNotFoundError
from local_process import free_port
from operator_harness import healthy
from realk8s import ControlPlane, Process, make_ca, make_serving_cert, wait_until, write_kubeconfig
from test_chart import CHART, NAMESPACE, render

from specdecode.operator import kube, names
from specdecode.operator.leadership import MICRO_TIME

Obj = dict[str, Any]
TOKEN_SECONDS = 4 * 3600
# Helm's install order (pkg/releaseutil/kind_sorter.go) for the kinds the chart renders; others last.
INSTALL_ORDER = ("Namespace", "PodDisruptionBudget", "ServiceAccount", "Secret", "ConfigMap", "ClusterRole",
                 "ClusterRoleBinding", "Role", "RoleBinding", "Service", "Deployment", "StatefulSet")
WORKLOADS = ("Deployment", "StatefulSet")
VENV_BIN = Path(sys.executable).parent
# The chart's leaderElection (default 15 s, 10 s, 2 s), values a user may set: how long a leader killed
# without a word holds the others back, how long one that cannot renew goes on, how often it renews.
# Shorter here so that a failover takes seconds; the renew deadline leaves a leader on a busy
# machine several tries.
LEASE = {"leaseDurationSeconds": 8, "renewDeadlineSeconds": 5, "retryPeriodSeconds": 1}
LEADING, STANDING_BY = "): leading", ": standing by"  # what leadership.Elector logs as it starts and stops leading


@dataclass(frozen=True)
class Ports:
    """An operator pod's health (liveness), metrics and webhook ports: the chart's values."""

    health: int
    metrics: int
    webhook: int

    @classmethod
    def free(cls) -> Ports:
        return cls(free_port(), free_port(), free_port())

    def values(self) -> Obj:
        return {"ports": {"health": self.health, "metrics": self.metrics}, "webhook": {"port": self.webhook}}


@dataclass(frozen=True)
class Release:
    objects: list[Obj]  # as rendered, with the webhook by URL
    unserved: list[Obj]  # of those, the ones whose API the server does not serve (not created)
    health_port: int
    metrics_port: int
    webhook_port: int
    values: Obj  # what the chart was rendered with

    @property
    def ports(self) -> Ports:
        return Ports(self.health_port, self.metrics_port, self.webhook_port)

    def only(self, kind: str) -> Obj:
        (obj,) = [o for o in self.objects if o["kind"] == kind]
        return obj

    @property
    def service_account(self) -> Obj:
        return self.only("ServiceAccount")

    @property
    def username(self) -> str:
        meta = self.service_account["metadata"]
        return f"system:serviceaccount:{meta['namespace']}:{meta['name']}"

    @property
    def workload(self) -> Obj:
        (workload,) = [o for o in self.objects if o["kind"] in WORKLOADS]
        return workload

    @property
    def pod(self) -> Obj:
        return self.workload["spec"]["template"]["spec"]

    @property
    def container(self) -> Obj:
        (container,) = self.pod["containers"]
        return container

    def container_with(self, ports: Ports) -> Obj:
        """The operator container as the chart renders it with other ports (and the same values else)."""
        if ports == self.ports:
            return self.container
        (workload,) = [o for o in render(helm.Chart.load(CHART), {**self.values, **ports.values()})
                       if o["kind"] in WORKLOADS]
        (container,) = workload["spec"]["template"]["spec"]["containers"]
        return container

    def pod_name(self, ordinal: int = 0) -> str:
        """The name the workload gives its pod (a StatefulSet's ordinal; a Deployment's made up)."""
        name = self.workload["metadata"]["name"]
        return f"{name}-{ordinal}" if self.workload["kind"] == "StatefulSet" else f"{name}-0000000000-{ordinal:05d}"


def webhook_by_url(objects: list[Obj], port: int, ca: bytes, tls: tuple[bytes, bytes]) -> list[Obj]:
    """The chart's objects with the test's certificate in the webhook Secret and ``caBundle``, and
    the webhook called at 127.0.0.1:``port`` instead of through its Service."""
    out = []
    for obj in objects:
        if obj["kind"] == "Secret" and obj["type"] == "kubernetes.io/tls":
            obj = {**obj, "data": {"ca.crt": _b64(ca), "tls.crt": _b64(tls[0]), "tls.key": _b64(tls[1])}}
        if obj["kind"] == "ValidatingWebhookConfiguration":
            hooks = []
            for hook in obj["webhooks"]:
                service = hook["clientConfig"]["service"]
                client = {"url": f"https://127.0.0.1:{port}{service['path']}", "caBundle": _b64(ca)}
                hooks.append({**hook, "clientConfig": client})
            obj = {**obj, "webhooks": hooks}
        out.append(obj)
    return out


def install(client: kubernetes.client.ApiClient, objects: list[Obj], discovery_cache: Path) -> list[Obj]:
    """``helm install --create-namespace``: the namespace, then each object in Helm's order; those
    of an API the server does not serve are left out and returned."""
    dynamic = kubernetes.dynamic.DynamicClient(client, cache_file=str(discovery_cache))
    kubernetes.client.CoreV1Api(client).create_namespace({"metadata": {"name": NAMESPACE}})
    rank = {kind: i for i, kind in enumerate(INSTALL_ORDER)}
    unserved = []
    for obj in sorted(objects, key=lambda o: rank.get(o["kind"], len(rank))):
        try:
            resource = dynamic.resources.get(api_version=obj["apiVersion"], kind=obj["kind"])
        except ResourceNotFoundError:
            unserved.append(obj)
            continue
        resource.create(body=obj, namespace=obj["metadata"].get("namespace"))
    return unserved


def install_chart(plane: ControlPlane, root: Path) -> Release:
    ports = Ports.free()
    values = {**ports.values(), "leaderElection": LEASE}
    ca = make_ca(root / "webhook-ca", "specdecode-webhook-ca")
    tls = make_serving_cert(root / "webhook-ca", ca)
    objects = webhook_by_url(render(helm.Chart.load(CHART), values), ports.webhook, ca[0].read_bytes(),
                             (tls[0].read_bytes(), tls[1].read_bytes()))
    with plane.client() as client:
        unserved = install(client, objects, root / "discovery.json")
    return Release(objects, unserved, ports.health, ports.metrics, ports.webhook, values)


# -- the operator ---------------------------------------------------------------------------------


@dataclass
class Operator:
    """One replica of the chart's StatefulSet, a process here listening on ``ports``; it can be
    stopped (SIGTERM) or killed (SIGKILL) and started again."""

    process: Process
    release: Release
    ports: Ports
    plane: ControlPlane
    run_from: int = 0  # where the log of its latest start begins

    @property
    def liveness_url(self) -> str:
        return f"http://127.0.0.1:{self.ports.health}/healthz"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.ports.metrics}/metrics"

    def log(self) -> str:
        """Everything it logged, across restarts."""
        return self.process.log.read_text(errors="replace")

    def leading(self) -> bool:
        """Whether it leads since its latest start, as it logs each change (it starts standing by)."""
        log = self.log()[self.run_from:]
        return log.rfind(LEADING) > log.rfind(STANDING_BY)

    def stop(self) -> None:
        """SIGTERM (kopf closes its watches: the audit log shows a watch only once it ends)."""
        self.process.stop()

    def kill(self) -> None:
        """SIGKILL: no clean exit, so the Lease it holds stays its own until the lease duration runs out."""
        self.process.kill()

    def start(self) -> None:
        """Start it again once stopped or killed: the same command and environment (a fresh token
        is not needed: it lasts the session), logging on after what it logged before."""
        self.run_from = len(self.log())
        self.process.start_again()
        self.wait_ready()

    def wait_ready(self) -> None:
        """Until its liveness endpoint and webhook answer; stopped if it does not get there."""
        try:
            wait_until(lambda: healthy(self.liveness_url), "the operator's liveness endpoint",
                       [self.process, *self.plane.processes])
            wait_until(lambda: _listening(self.ports.webhook), "the operator's webhook port", [self.process])
        except BaseException:
            self.process.stop()
            raise


def service_account_token(client: kubernetes.client.ApiClient, service_account: Obj) -> str:
    """A token of ``service_account`` from the TokenRequest API (what the kubelet mounts in its pod)."""
    meta = service_account["metadata"]
    answer = kubernetes.client.CoreV1Api(client).create_namespaced_service_account_token(
        meta["name"], meta["namespace"], {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
                                          "spec": {"audiences": [], "expirationSeconds": TOKEN_SECONDS}})
    return answer.status.token


def container_environment(container: Obj, pod_name: str, mounts: dict[str, Path]) -> dict[str, str]:
    """The container's ``env`` as the kubelet sets it: the downward API's pod name and namespace,
    paths of mounted volumes moved to where they are here."""
    env = {}
    for entry in container.get("env", []):
        if "value" in entry:
            env[entry["name"]] = str(mounts.get(entry["value"], entry["value"]))
            continue
        field = entry["valueFrom"]["fieldRef"]["fieldPath"]  # anything else: not supported here
        env[entry["name"]] = {"metadata.name": pod_name, "metadata.namespace": NAMESPACE}[field]
    return env


def mount_volumes(client: kubernetes.client.ApiClient, release: Release, root: Path) -> dict[str, Path]:
    """Each volume the container mounts, as a folder here (a Secret's keys as files, as the
    kubelet writes them; an emptyDir empty), by mount path."""
    volumes = {v["name"]: v for v in release.pod.get("volumes", [])}
    mounts = {}
    for mount in release.container.get("volumeMounts", []):
        volume, folder = volumes[mount["name"]], root / "volumes" / mount["name"]
        folder.mkdir(parents=True)
        if "secret" in volume:
            secret = kubernetes.client.CoreV1Api(client).read_namespaced_secret(volume["secret"]["secretName"],
                                                                                 NAMESPACE)
            for key, value in secret.data.items():
                (folder / key).write_bytes(base64.b64decode(value))
                (folder / key).chmod(0o600)
        mounts[mount["mountPath"]] = folder
    return mounts


def start_operator(plane: ControlPlane, release: Release, root: Path, ordinal: int = 0,
                   ports: Ports | None = None) -> Operator:
    """``kopf run`` with the container's command, as the chart's ServiceAccount, until its
    liveness endpoint and webhook answer. This process' environment goes along without any
    cluster credentials of its own. ``ordinal``: which pod of the StatefulSet (its name, the
    Lease's holder when it leads); ``ports``: its own, where another replica runs on this host (pods each
    have a network namespace of their own; processes here share one), else the chart's."""
    ports = ports or release.ports
    container = release.container_with(ports)
    with plane.client() as client:
        kubeconfig = write_kubeconfig(root / "operator.kubeconfig", plane.url, plane.ca, "operator",
                                      service_account_token(client, release.service_account))
        mounts = mount_volumes(client, release, root)
    env = {k: v for k, v in os.environ.items() if k != "KUBECONFIG" and not k.startswith("KUBERNETES_")}
    env |= container_environment(container, release.pod_name(ordinal), mounts)
    env |= {"KUBECONFIG": str(kubeconfig), "PATH": f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}"}
    command = [shutil.which(container["command"][0], path=str(VENV_BIN)), *container["command"][1:]]
    operator = Operator(Process.start(f"operator-{ordinal}", command, root / "operator.log", env=env, cwd=root),
                        release, ports, plane)
    operator.wait_ready()
    return operator


# -- the release's Lease ----------------------------------------------------------------------------


def lease(client: kubernetes.client.ApiClient, release: Release) -> Obj:
    """The release's Lease as stored (the API's spelling)."""
    meta = release.only("Lease")["metadata"]
    return client.sanitize_for_serialization(
        kubernetes.client.CoordinationV1Api(client).read_namespaced_lease(meta["name"], meta["namespace"]))


def hand_lease(client: kubernetes.client.ApiClient, release: Release, holder: str | None) -> None:
    """Write the Lease as ``holder`` holding it, renewed now for an hour (None: released, as a
    clean exit leaves it), guarded by its resourceVersion as every writer's; a write beaten by the
    operator's renewal is made again on what it wrote."""
    meta = release.only("Lease")["metadata"]
    api = kubernetes.client.CoordinationV1Api(client)
    now = datetime.now(timezone.utc).strftime(MICRO_TIME)
    spec = {"holderIdentity": holder, "leaseDurationSeconds": 3600, "acquireTime": now, "renewTime": now}
    while True:
        stored = lease(client, release)
        try:
            api.replace_namespaced_lease(meta["name"], meta["namespace"], {**stored, "spec": spec})
            return
        except kubernetes.client.ApiException as exc:
            if exc.status != 409:
                raise


def _listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    except OSError:
        return False
    return True


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


# -- least privilege from the audit log -----------------------------------------------------------

Permission = tuple[str, str, str]  # (API group, resource[/subresource], verb)
CHILD_RESOURCES = {(k.group, k.plural) for k in kube.CHILD_KINDS}
OWNER_FINALIZERS = (names.GROUP, f"{names.PLURAL}/finalizers", "update")


def permissions(event: Obj) -> set[Permission]:
    """What the API server authorized for an audit event's request (none for a non-resource URL
    such as discovery): its verb on its resource; for an apply that created the object (201),
    ``create`` too, which the server authorizes without a request of its own; and for a child the
    operator created, ``update`` on its owner's finalizers, which OwnerReferencesPermissionEnforcement
    authorizes for the child's blockOwnerDeletion reference to the SpecDecodeDeployment."""
    ref = event.get("objectRef")
    if not ref or "resource" not in ref:
        return set()
    group, resource = ref.get("apiGroup", ""), ref["resource"]
    out = {(group, resource + (f"/{ref['subresource']}" if ref.get("subresource") else ""), event["verb"])}
    created = event.get("responseStatus", {}).get("code") == 201 and not ref.get("subresource")
    if created and event["verb"] == "patch":
        out.add((group, resource, "create"))
    if created and (group, resource) in CHILD_RESOURCES:
        out.add(OWNER_FINALIZERS)
    return out


def granted(cluster_role: Obj) -> set[Permission]:
    return {(group, resource, verb) for rule in cluster_role["rules"] for group in rule["apiGroups"]
            for resource in rule["resources"] for verb in rule["verbs"]}


def unprovable(grants: set[Permission], served: set[str]) -> set[Permission]:
    """Grants for a kind the operator uses at an API version this server does not serve although it
    serves the group (1.20: ``policy/v1`` PodDisruptionBudgets, only ``policy/v1beta1`` there)."""
    served_groups = {version.rpartition("/")[0] for version in served}
    missing = {(k.group, k.plural) for k in kube.KINDS.values()
               if k.api_version not in served and k.group in served_groups}
    return {p for p in grants if (p[0], p[1].split("/")[0]) in missing}


def denied(event: Obj) -> bool:
    """Whether RBAC denied the request (the authorizer's audit annotation); a 403 from admission (a
    webhook, a quota) is the cluster's answer to what was asked, not a missing permission."""
    return (event.get("annotations") or {}).get("authorization.k8s.io/decision") == "forbid"


def describe(event: Obj) -> str:
    status = event.get("responseStatus", {})
    return f"{event['verb']} {event['requestURI']}: {status.get('code')} {status.get('message', '')}".strip()


# -- fixtures -------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def release(control_plane: ControlPlane, tmp_path_factory: pytest.TempPathFactory) -> Release:
    return install_chart(control_plane, tmp_path_factory.mktemp("release"))


@pytest.fixture(scope="session")
def operator(control_plane: ControlPlane, release: Release,
             tmp_path_factory: pytest.TempPathFactory) -> Iterator[Operator]:
    """One operator for the tier, so that the audit log shows everything it did."""
    running = start_operator(control_plane, release, tmp_path_factory.mktemp("operator"))
    try:
        wait_until(running.leading, "the operator holding the release's Lease", [running.process])
        yield running
    finally:
        running.stop()
