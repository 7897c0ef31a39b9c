"""The real control plane tier's view of the cluster (tests/README.md): ``RealCluster``, the
admin's client with what the operator did (its audit events, its log), and ``Workloads``, a
stand-in for the workload controllers and the kubelet. Test modules import the fixtures by name.

No kubelet and no workload controller run. Where a scenario needs workloads ready, the
``workloads`` stand-in writes their status as the Deployment controller would; canary pods are
Pod objects the test creates and marks ready, their runtime a local HTTP server serving
``/metrics`` (operator_harness.RuntimeStandIn).
"""
from __future__ import annotations

import re
import threading
from collections.abc import Callable, Iterator
from typing import Any

import kubernetes
import pytest
from operator_harness import NS, Cluster
from realk8s import ControlPlane, wait_until
from realk8s_operator import Operator, Release, denied, describe

from specdecode.operator import names

Obj = dict[str, Any]


class Denied(AssertionError):
    """The API server refused a request of the operator (403)."""


class HandlerFailed(AssertionError):
    """One of the operator's kopf handlers raised (kopf retries it later)."""


# kopf's log of a handler that raised; not the retries of writes the API server did not take, which
# the resource's status reports (controller.WritesFailed)
HANDLER_FAILED = re.compile(r"^.*\[ERROR +\] .*Handler '\w+' failed(?! temporarily: (?:ChildRefused|ApplyFailed|"
                            r"RouteRefused): ).*$(?:\n^  .*$)?", re.MULTILINE)


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


@pytest.fixture(scope="session")
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


@pytest.fixture(scope="session")
def workloads(cluster: RealCluster) -> Iterator[Workloads]:
    stand_in = Workloads(cluster.apps)
    yield stand_in
    stand_in.stop()


@pytest.fixture(autouse=True)
def operator_log(request: pytest.FixtureRequest) -> Iterator[None]:
    """The operator's log written during a test: checked for handler failures, shown if the test fails."""
    cluster = request.getfixturevalue("cluster") if "cluster" in request.fixturenames else None
    if not isinstance(cluster, RealCluster):  # another tier's test, or an emulator's ``cluster``
        yield
        return
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


