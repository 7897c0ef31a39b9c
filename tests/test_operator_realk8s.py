"""The operator on a real control plane (realk8s.py: etcd, kube-apiserver and
kube-controller-manager on loopback), installed from the chart as Helm would, running as the
chart's ServiceAccount (realk8s_operator.py), driven through the official ``kubernetes`` client.

No kubelet and no workload controller run. Where a scenario needs workloads ready, the
``workloads`` stand-in writes their status as the Deployment controller would; canary pods are
Pod objects the test creates and marks ready, their runtime a local HTTP server serving
``/metrics`` (operator_harness.RuntimeStandIn). The last tests read the API server's audit log for
what the operator did across the tier, so they stay last in this file.
"""
from __future__ import annotations

import copy
import json
import re
import threading
from collections.abc import Callable, Iterator
from typing import Any

import kubernetes
import pytest
from operator_harness import NS, Cluster, HttpStandIn, RuntimeStandIn, example, start_canary
from realk8s import ControlPlane, apiserver_minor, control_plane, wait_until  # noqa: F401 - control_plane: a fixture
from realk8s_operator import (  # noqa: F401 - release, operator: fixtures
    Operator,
    Release,
    denied,
    describe,
    granted,
    operator,
    permissions,
    release,
    unprovable,
)

from specdecode.operator import names
from specdecode.operator.resolve import resolve

# The control plane's start (and a cold build) have deadlines of their own.
pytestmark = [pytest.mark.realk8s, pytest.mark.timeout(180, func_only=True)]

WEBHOOK = "validate.specdecodedeployments.specdecode.io"
GARBAGE_COLLECTOR = "system:serviceaccount:kube-system:generic-garbage-collector"
Obj = dict[str, Any]


class Denied(AssertionError):
    """The API server refused a request of the operator (403)."""


class Unused(AssertionError):
    """The chart grants a verb the operator never used."""


class HandlerFailed(AssertionError):
    """One of the operator's kopf handlers raised (kopf retries it later)."""


HANDLER_FAILED = re.compile(r"^.*\[ERROR +\] .*Handler '\w+' failed.*$(?:\n^  .*$)?", re.MULTILINE)
# Before 1.23 a Service DELETE answers with a Status, not the Service.
SERVICE_DELETE_ANSWERS_A_STATUS = pytest.mark.xfail(
    apiserver_minor() < 23, strict=True, raises=HandlerFailed,
    reason="kube.Cluster.delete reads the Status a pre-1.23 API server answers to a Service DELETE as a "
           "V1Service (pydantic ValidationError: V1ServiceStatus, input_value='Success'): the reconciliation fails")


class RealCluster(Cluster):
    """operator_harness' view of a cluster (as the admin), plus what the operator did (audit log)."""

    def __init__(self, plane: ControlPlane, client: kubernetes.client.ApiClient, release: Release,
                 operator: Operator) -> None:
        super().__init__(client, plane.url, release.metrics_port, release.health_port)
        self.plane, self.release, self.operator = plane, release, operator
        self.log_from = 0  # where the running test's part of the operator's log starts

    def gone(self, name: str) -> bool:
        try:
            self.get(name)
        except kubernetes.client.ApiException as exc:
            if exc.status == 404:
                return True
            raise
        return False

    def children(self, name: str) -> list[Obj]:
        """The Deployments and Services labelled as ``name``'s."""
        selector, serialize = f"{names.LABEL_INSTANCE}={name}", self.apps.api_client.sanitize_for_serialization
        listed = {"Deployment": self.apps.list_namespaced_deployment(NS, label_selector=selector),
                  "Service": self.core.list_namespaced_service(NS, label_selector=selector)}
        # typed lists leave apiVersion and kind out of their items
        return [{**serialize(obj), "kind": kind} for kind, items in listed.items() for obj in items.items]

    def operator_requests(self) -> list[Obj]:
        return [e for e in self.plane.audit() if e["user"]["username"] == self.release.username]

    def operator_denials(self) -> list[str]:
        return [describe(e) for e in self.operator_requests() if denied(e)]

    def until(self, check: Callable[[], Any], what: str, timeout: float = 60) -> Any:
        """``wait_until``, failing at once with the API server's answer if the operator was denied,
        or with the error if one of its handlers failed during this test."""
        def checked() -> Any:
            denials = self.operator_denials()
            if denials:
                raise Denied("the API server refused the operator:\n" + "\n".join(denials))
            self.check_handlers()
            return check()

        return wait_until(checked, what, self.plane.processes, timeout=timeout)

    def check_handlers(self) -> None:
        """Fail with the error if one of the operator's handlers failed during this test."""
        failures = HANDLER_FAILED.findall(self.operator.log()[self.log_from:])
        if failures:
            raise HandlerFailed("\n".join(failures))

    def settled(self, name: str) -> None:
        """Once the operator has reconciled ``name``'s latest spec (it writes the status last): no
        handler failed on the way."""
        def reconciled() -> bool:
            body = self.get(name)
            return (body.get("status") or {}).get("observedGeneration") == body["metadata"]["generation"]

        self.until(reconciled, f"{name}'s latest spec reconciled")
        self.check_handlers()


class Workloads:
    """Stands in for the Deployment and StatefulSet controllers and the kubelet, for the resources
    named in ``ready``: each of their workloads reports every replica ready (status subresource)."""

    def __init__(self, apps: kubernetes.client.AppsV1Api) -> None:
        self.apps = apps
        self.ready: set[str] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        kinds = ((self.apps.list_namespaced_deployment, self.apps.patch_namespaced_deployment_status),
                 (self.apps.list_namespaced_stateful_set, self.apps.patch_namespaced_stateful_set_status))
        while not self._stop.wait(0.3):
            for listing, patch_status in kinds:
                for workload in listing(NS).items:
                    if (workload.metadata.labels or {}).get(names.LABEL_INSTANCE) in self.ready:
                        self._report_ready(workload, patch_status)

    @staticmethod
    def _report_ready(workload: Any, patch_status: Callable[..., Any]) -> None:
        want, status, generation = workload.spec.replicas or 0, workload.status, workload.metadata.generation
        if (status.ready_replicas or 0, status.observed_generation) == (want, generation):
            return
        try:
            patch_status(workload.metadata.name, NS, {"status": {
                "observedGeneration": generation, "replicas": want, "updatedReplicas": want, "readyReplicas": want,
                **({"availableReplicas": want} if hasattr(status, "available_replicas") else {})}})
        except kubernetes.client.ApiException as exc:
            if exc.status not in (404, 409):  # deleted or changed since listed: the next round sees it
                raise

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


@pytest.fixture(scope="module")
def cluster(control_plane: ControlPlane, release: Release, operator: Operator) -> Iterator[RealCluster]:  # noqa: F811
    """The namespace ``llm`` (its default ServiceAccount ready for pods) and the admin's view."""
    with control_plane.client() as client:
        core = kubernetes.client.CoreV1Api(client)
        core.create_namespace({"metadata": {"name": NS}})

        def pods_admitted() -> bool:  # the ServiceAccount admission plugin needs it (and, before 1.24, its token)
            accounts = {sa.metadata.name: sa for sa in core.list_namespaced_service_account(NS).items}
            return "default" in accounts and (control_plane.minor >= 24 or bool(accounts["default"].secrets))

        wait_until(pods_admitted, "the default ServiceAccount of the namespace", control_plane.processes)
        yield RealCluster(control_plane, client, release, operator)


@pytest.fixture(scope="module")
def workloads(cluster: RealCluster) -> Iterator[Workloads]:
    stand_in = Workloads(cluster.apps)
    yield stand_in
    stand_in.stop()


@pytest.fixture(autouse=True)
def operator_log(request: pytest.FixtureRequest) -> Iterator[None]:
    """The operator's log written during a test: checked for handler failures, shown if the test fails."""
    if "cluster" not in request.fixturenames:
        yield
        return
    cluster: RealCluster = request.getfixturevalue("cluster")
    cluster.log_from = len(cluster.operator.log())
    yield
    print(f"--- operator log:\n{cluster.operator.log()[cluster.log_from:][-20000:]}")


def owned_by(child: Obj, owner: Obj) -> bool:
    refs = child["metadata"].get("ownerReferences") or []
    return any(r["uid"] == owner["metadata"]["uid"] and r.get("controller") and r.get("blockOwnerDeletion")
               for r in refs)


def children_of(cluster: RealCluster, name: str) -> list[Obj]:
    """Once the operator made them: the Deployment and the Service of ``name``."""
    def made() -> list[Obj] | None:
        found = cluster.children(name)
        return found if {c["kind"] for c in found} == {"Deployment", "Service"} else None

    return cluster.until(made, f"{name}'s Deployment and Service")


# -- who the operator is --------------------------------------------------------------------------


def test_the_api_server_sees_the_operator_as_the_charts_service_account(cluster: RealCluster,
                                                                       release: Release) -> None:
    """Every request from the operator's clients (kopf's, and the ``kubernetes`` client's, which only
    the operator uses with its default user agent) is authenticated as the ServiceAccount."""
    def operator_events() -> list[Obj]:
        return [e for e in cluster.plane.audit()
                if e.get("userAgent", "").startswith(("kopf/", "OpenAPI-Generator/"))]

    events = wait_until(operator_events, "requests from the operator in the audit log", cluster.plane.processes)
    assert {e["user"]["username"] for e in events} == {release.username}
    groups = {g for e in events for g in e["user"].get("groups", [])}
    namespace = release.service_account["metadata"]["namespace"]
    assert "system:masters" not in groups and f"system:serviceaccounts:{namespace}" in groups


# -- admission ------------------------------------------------------------------------------------


def test_the_api_server_calls_the_webhook_which_refuses_an_invalid_spec(cluster: RealCluster) -> None:
    """Schema-valid but refused by admission (MTP under pipeline parallelism needs a gate): the API
    server asks the operator's webhook and answers with its message."""
    body = example("mtp-pp")
    body["spec"] |= {"parallelism": {"pipeline": 2}, "speculative": {"method": "mtp"}}
    expected = resolve(copy.deepcopy(body))
    assert not expected.allowed
    with pytest.raises(kubernetes.client.ApiException) as refused:
        cluster.create(body)
    assert refused.value.status == 422
    message = json.loads(refused.value.body)["message"]
    assert message == f'admission webhook "{WEBHOOK}" denied the request: {expected.message}'
    assert cluster.gone("mtp-pp")


# -- create, ready, roll out, delete --------------------------------------------------------------


def test_a_resource_gets_owned_children_and_a_status(cluster: RealCluster, workloads: Workloads) -> None:
    cluster.create(example("created"))
    created = cluster.get("created")
    children = children_of(cluster, "created")
    assert all(owned_by(child, created) for child in children)
    cluster.until(lambda: cluster.status("created").get("observedGeneration"), "a status")
    status = cluster.status("created")
    assert status["observedGeneration"] == 1 and status["stableRevision"]
    # policy/v1 PodDisruptionBudget is served from 1.21 on; before, the operator says so instead of failing
    assert any("PodDisruptionBudget" in w for w in status.get("warnings", [])) == (cluster.plane.minor < 21)
    assert cluster.condition("created", "Ready").get("status") == "False"  # no pod runs

    workloads.ready.add("created")
    cluster.until(lambda: cluster.condition("created", "Ready").get("status") == "True", "Ready=True")
    cluster.until(lambda: ("Normal", "Deployed") in {(t, r) for t, r, _ in cluster.events("created")},
                  "the Deployed Event")
    cluster.settled("created")


def test_a_good_canary_is_promoted_and_the_old_revision_deleted(cluster: RealCluster, workloads: Workloads,
                                                                 stand_ins: list[HttpStandIn]) -> None:
    workloads.ready.add("promoted")
    cluster.create(example("promoted"))
    cluster.until(lambda: cluster.condition("promoted", "Ready").get("status") == "True", "Ready=True")
    stable = cluster.status("promoted")["stableRevision"]
    canary = start_canary(cluster, "promoted")
    stand_ins.append(runtime := RuntimeStandIn(acceptance=0.8))
    cluster.stand_in_pod("promoted", canary, runtime.port)

    cluster.until(lambda: cluster.status("promoted").get("stableRevision") == canary, "the canary promoted")
    cluster.until(lambda: set(cluster.deployments("promoted")) == {names.workload_name("promoted", canary)},
                  "the old revision's Deployment deleted")
    status = cluster.status("promoted")
    assert "canaryRevision" not in status and status["acceptance"]["rate"] == pytest.approx(0.8)
    # Events are posted after the status is written
    cluster.until(lambda: {"RolloutStarted", "Promoted"} <= {r for _, r, _ in cluster.events("promoted")},
                  "the rollout's Events")
    deletes = [e for e in cluster.operator_requests() if e["verb"] == "delete"
               and e["objectRef"].get("name") == names.workload_name("promoted", stable)]
    assert deletes and all(e["responseStatus"]["code"] == 200 for e in deletes)
    cluster.settled("promoted")


@SERVICE_DELETE_ANSWERS_A_STATUS
def test_a_canary_behind_an_httproute_and_a_servicemonitor(cluster: RealCluster, workloads: Workloads,
                                                           stand_ins: list[HttpStandIn]) -> None:
    """The user's HTTPRoute gets the stable and canary Services weighted by step; switching the
    route and the ServiceMonitor off deletes the objects made for them."""
    workloads.ready.add("routed")
    routes = ("gateway.networking.k8s.io", "v1", NS, "httproutes")
    cluster.custom.create_namespaced_custom_object(*routes, {
        "apiVersion": "gateway.networking.k8s.io/v1", "kind": "HTTPRoute", "metadata": {"name": "gateway"},
        "spec": {"parentRefs": [{"name": "public"}], "rules": [{"backendRefs": [{"name": "routed", "port": 8000}]}]}})

    def weights() -> dict[str, int]:
        (rule,) = cluster.custom.get_namespaced_custom_object(*routes, "gateway")["spec"]["rules"]
        return {ref["name"]: ref["weight"] for ref in rule["backendRefs"] if "weight" in ref}

    def monitors() -> set[str]:
        listed = cluster.custom.list_namespaced_custom_object("monitoring.coreos.com", "v1", NS, "servicemonitors")
        return {m["metadata"]["name"] for m in listed["items"]}

    body = example("routed")
    body["spec"]["serviceMonitor"] = {"enabled": True}
    body["spec"]["rollout"]["trafficRouting"] = {"httpRoute": "gateway"}
    cluster.create(body)
    cluster.until(lambda: weights() == {"routed-stable": 100, "routed-canary": 0}, "all traffic to stable")
    assert monitors() == {names.service_monitor_name("routed")}
    canary = start_canary(cluster, "routed")
    stand_ins.append(runtime := RuntimeStandIn(acceptance=0.8))
    cluster.stand_in_pod("routed", canary, runtime.port)
    cluster.until(lambda: weights() == {"routed-stable": 50, "routed-canary": 50}, "half to the canary")
    cluster.until(lambda: cluster.status("routed").get("stableRevision") == canary, "the canary promoted")
    cluster.until(lambda: weights() == {"routed-stable": 100, "routed-canary": 0}, "all traffic to stable again")

    cluster.patch("routed", {"spec": {"serviceMonitor": {"enabled": False}, "rollout": {"trafficRouting": None}}})
    cluster.until(lambda: not monitors(), "the ServiceMonitor deleted")
    cluster.until(lambda: {c["metadata"]["name"] for c in cluster.children("routed") if c["kind"] == "Service"}
                  == {names.service_name("routed")}, "the route's Services deleted")
    cluster.settled("routed")


@SERVICE_DELETE_ANSWERS_A_STATUS
def test_a_pipeline_layout_runs_a_statefulset_group_per_replica(cluster: RealCluster, workloads: Workloads) -> None:
    """TP2×PP2 on CPU: a StatefulSet and a headless Service per replica; one replica fewer deletes
    the last group's."""
    workloads.ready.add("grouped")
    body = example("grouped")
    body["spec"] |= {"parallelism": {"tensor": 2, "pipeline": 2}}
    cluster.create(body)
    cluster.until(lambda: cluster.condition("grouped", "Ready").get("status") == "True", "Ready=True")
    stable = cluster.status("grouped")["stableRevision"]

    def groups() -> set[str]:
        listed = cluster.apps.list_namespaced_stateful_set(NS, label_selector=f"{names.LABEL_INSTANCE}=grouped")
        return {s.metadata.name for s in listed.items}

    def headless() -> set[str]:
        return {c["metadata"]["name"] for c in cluster.children("grouped")
                if c["kind"] == "Service" and c["metadata"]["name"] != names.service_name("grouped")}

    assert groups() == headless() == {names.group_name("grouped", stable, g) for g in (0, 1)}
    cluster.patch("grouped", {"spec": {"replicas": 1}})
    cluster.until(lambda: groups() == headless() == {names.group_name("grouped", stable, 0)}, "the second group deleted")
    cluster.settled("grouped")


def test_the_garbage_collector_deletes_the_children_of_a_deleted_resource(cluster: RealCluster) -> None:
    cluster.create(example("collected"))
    children = children_of(cluster, "collected")
    cluster.custom.delete_namespaced_custom_object(names.GROUP, names.VERSION, NS, names.PLURAL, "collected")
    cluster.until(lambda: cluster.gone("collected"), "the resource gone (kopf's finalizer removed)")
    cluster.until(lambda: not cluster.children("collected"), "the garbage collector to delete the children")
    deleted_by = {(e["objectRef"]["resource"], e["objectRef"]["name"]): e["user"]["username"]
                  for e in cluster.plane.audit() if e["verb"] == "delete" and e.get("objectRef", {}).get("name")}
    for child in children:
        resource = {"Deployment": "deployments", "Service": "services"}[child["kind"]]
        assert deleted_by[resource, child["metadata"]["name"]] == GARBAGE_COLLECTOR


# -- least privilege, from what the operator did in the tests above (keep these last) -------------


@pytest.fixture(scope="module")
def operator_requests(cluster: RealCluster, operator: Operator) -> list[Obj]:  # noqa: F811
    """Every request of the operator in the tier, once it stopped (the API server logs a watch
    only when it ends)."""
    operator.stop()
    return cluster.operator_requests()


def test_the_operator_was_never_denied(operator_requests: list[Obj]) -> None:
    assert operator_requests
    denials = [describe(e) for e in operator_requests if denied(e)]
    if denials:
        raise Denied("\n".join(denials))


@pytest.mark.xfail(strict=True, raises=Unused, reason=(
    "issue 19 items 2 and 4: LeaderWorkerSet's verbs wait for the scenario that registers its CRD mid-life "
    "(and before 1.23 the ServiceMonitor's delete, behind the failing Service delete)"))
def test_every_verb_the_chart_grants_was_used(cluster: RealCluster, operator_requests: list[Obj],
                                              release: Release) -> None:
    used = set().union(*map(permissions, operator_requests))
    grants = granted(release.only("ClusterRole"))
    unused = grants - used - unprovable(grants, cluster.plane.served())
    if unused:
        raise Unused("granted, never used: " + ", ".join("/".join(p) for p in sorted(unused)))
