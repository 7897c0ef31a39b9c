"""Two operator replicas on the real control plane, as the chart's StatefulSet runs them: kopf
peering in the release's ClusterKopfPeering, each replica's priority from its ordinal (POD_ID).
The session's operator is ordinal 0; ordinal 1 joins as a standby, the active one is killed
without a word, and the standby takes over once the dead one's record outlives the chart's
``peering.lifetimeSeconds`` (realk8s_operator.PEERING_LIFETIME_SECONDS). The emulator tier's
counterpart is test_operator_ha.py.
"""
from __future__ import annotations

import random
import re
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import kubernetes
import pytest
from operator_harness import NS, example
from realk8s_cluster import HANDLER_FAILED, HandlerFailed, RealCluster, Workloads
from realk8s_operator import PEERING_LIFETIME_SECONDS, Operator, Ports, Release, start_operator

from specdecode.operator import names
from specdecode.operator.controller import peering_priority

pytestmark = [pytest.mark.realk8s, pytest.mark.timeout(420, func_only=True)]

Obj = dict[str, Any]
CONNECT_TIMEOUT_SECONDS = 2.0
NAME = "ha-failover"
# A handler of the operator ran for the resource or one of its workloads (the webhook's lines aside)
HANDLED = re.compile(rf"\[{NS}/{NAME}(-\w+)?\] Handler '\w+' succeeded")


class ServiceStandIn:
    """The chart's operator Service for the webhook, where no kube-proxy runs: a TCP forwarder on
    a port of its own sending each connection to one of the replicas' webhook ports, picked at
    random among those that accept one (the endpoints of a Service are its ready pods; the
    chart's readiness probe is a TCP connection to the webhook port)."""

    def __init__(self, ports: list[int]) -> None:
        self.ports = ports
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.connections = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:  # closed
                return
            backend = self._endpoint()
            if backend is None:
                client.close()
                continue
            self.connections += 1
            for source, sink in ((client, backend), (backend, client)):
                threading.Thread(target=self._pipe, args=(source, sink), daemon=True).start()

    def _endpoint(self) -> socket.socket | None:
        for port in random.sample(self.ports, len(self.ports)):
            try:
                backend = socket.create_connection(("127.0.0.1", port), timeout=CONNECT_TIMEOUT_SECONDS)
            except OSError:
                continue
            backend.settimeout(None)
            return backend
        return None

    @staticmethod
    def _pipe(source: socket.socket, sink: socket.socket) -> None:
        """Copy until either side ends, then end both (the other direction's copy stops too)."""
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        finally:
            source.close()
            sink.close()

    def close(self) -> None:
        self.listener.close()


def point_webhook(cluster: RealCluster, release: Release, port: int) -> None:
    """Send the API server's webhook calls to 127.0.0.1:``port`` (same path)."""
    api = kubernetes.client.AdmissionregistrationV1Api(cluster.apps.api_client)
    name = release.only("ValidatingWebhookConfiguration")["metadata"]["name"]
    configuration = api.read_validating_webhook_configuration(name)
    for hook in configuration.webhooks:
        path = hook.client_config.url.split("/", 3)[3]
        hook.client_config.url = f"https://127.0.0.1:{port}/{path}"
    api.replace_validating_webhook_configuration(name, configuration)


@contextmanager
def service_in_front_of(cluster: RealCluster, release: Release, replicas: list[Operator]) -> Iterator[ServiceStandIn]:
    """The webhook called through a ``ServiceStandIn`` for ``replicas`` (once the API server uses
    it: a dry-run create goes through admission and leaves nothing); by URL to ordinal 0 again after."""
    service = ServiceStandIn([replica.ports.webhook for replica in replicas])
    point_webhook(cluster, release, service.port)
    try:
        probe = example("ha-probe")

        def admitted_through_service() -> bool:
            cluster.custom.create_namespaced_custom_object(names.GROUP, names.VERSION, NS, names.PLURAL, probe,
                                                           dry_run="All")
            return service.connections > 0

        cluster.until(admitted_through_service, "the API server calling the webhook through the Service stand-in")
        yield service
    finally:
        point_webhook(cluster, release, release.webhook_port)
        service.close()


def peers(cluster: RealCluster, release: Release) -> dict[str, int]:
    """Identity → priority of the records in the release's ClusterKopfPeering."""
    name = release.only("ClusterKopfPeering")["metadata"]["name"]
    peering = cluster.custom.get_cluster_custom_object("kopf.dev", "v1", "clusterkopfpeerings", name)
    return {pod: record["priority"] for pod, record in (peering.get("status") or {}).items()}


def check_handlers(replica: Operator) -> None:
    """Fail with the error if one of ``replica``'s handlers failed since its latest start."""
    failures = HANDLER_FAILED.findall(replica.log()[replica.run_from:])
    if failures:
        raise HandlerFailed("\n".join(failures))


def replicas_of(cluster: RealCluster, name: str) -> list[int]:
    return [d.spec.replicas for d in cluster.deployments(name).values()]


def scale(cluster: RealCluster, name: str, replicas: int) -> bool:
    """Whether the API server took the change; not while no replica answers its webhook call
    (failurePolicy Fail), as while a Service has no ready endpoint."""
    try:
        cluster.patch(name, {"spec": {"replicas": replicas}})
    except kubernetes.client.ApiException as exc:
        if exc.status == 500 and "failed calling webhook" in exc.body:
            return False
        raise
    return True


@pytest.fixture
def standby(cluster: RealCluster, release: Release, operator: Operator, tmp_path: Path) -> Iterator[Operator]:
    """Ordinal 1 beside the session's operator (ordinal 0), with ports of its own: pods have a
    network namespace each, processes on this host share one (the only departure from the chart).
    Afterwards ordinal 0 runs again and is active, and ordinal 1 is stopped, as the tier found it."""
    replica = start_operator(cluster.plane, release, tmp_path, ordinal=1, ports=Ports.free())
    try:
        yield replica
    finally:
        if operator.process.popen.poll() is not None:
            operator.start()
        replica.stop()
        cluster.until(lambda: not operator.paused(), "ordinal 0 active again")


def test_the_standby_replica_takes_over_when_the_active_one_is_killed(
        cluster: RealCluster, release: Release, operator: Operator, standby: Operator, workloads: Workloads) -> None:
    """Only ordinal 0 reconciles while both run; SIGKILLed (its peering record stays until it
    expires), ordinal 1 resumes and reconciles a change, which the API server admits through the
    Service stand-in by calling the standby's webhook. Ordinal 0 started again takes over again.

    The Service: the API server calls a ``ServiceStandIn`` URL that forwards each connection to a
    replica accepting one, as a Service with its ready pods as endpoints does. Patching the
    webhook's URL to the standby's port when the active one dies would be a change no cluster
    makes; the forwarder keeps the webhook configuration as it was, calls every live replica
    (paused or not, each serves the webhook) and drops the dead one as its endpoint goes."""
    pods = [release.pod_name(ordinal) for ordinal in (0, 1)]
    cluster.until(lambda: peers(cluster, release) == {pod: peering_priority(pod) for pod in pods},
                  "both replicas peered")
    assert peers(cluster, release) == {pods[0]: 100, pods[1]: 99}
    cluster.until(lambda: standby.paused() and not operator.paused(), "ordinal 1 paused, ordinal 0 active")

    with service_in_front_of(cluster, release, [operator, standby]):
        workloads.ready.add(NAME)
        cluster.create(example(NAME))
        cluster.until(lambda: cluster.condition(NAME, "Ready").get("status") == "True", "Ready=True")
        cluster.settled(NAME)
        cluster.until(lambda: HANDLED.search(operator.log()), "ordinal 0's handlers done")
        assert not HANDLED.search(standby.log())  # the standby never touched it

        operator.kill()
        cluster.until(lambda: scale(cluster, NAME, 3), "the change admitted by the standby's webhook")
        cluster.until(lambda: check_handlers(standby) or replicas_of(cluster, NAME) == [3],
                      "the standby to reconcile the change", timeout=PEERING_LIFETIME_SECONDS + 120)
        cluster.until(lambda: cluster.status(NAME).get("replicas") == 3, "the standby's status")
        cluster.until(lambda: HANDLED.search(standby.log()), "the standby's handlers done")
        assert not standby.paused()

        operator.start()
        cluster.until(lambda: standby.paused() and not operator.paused(), "ordinal 0 active again, ordinal 1 paused")
        cluster.patch(NAME, {"spec": {"replicas": 2}})
        cluster.until(lambda: replicas_of(cluster, NAME) == [2], "ordinal 0 reconciling again")
        cluster.settled(NAME)
    check_handlers(standby)
