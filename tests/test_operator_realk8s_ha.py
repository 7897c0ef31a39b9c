"""Two operator replicas on the real control plane, as the chart's StatefulSet runs them, taking
turns through the release's Lease (operator/leadership.py). The session's operator is ordinal 0
and leads; ordinal 1 joins as a standby. Mid-rollout the leader is killed without a word; ordinal
1 takes the Lease over once the dead one's last renewal is older than the lease duration
(realk8s_operator.LEASE), finishes the rollout, and the resource's status history (every version
the API server stored, from a watch) shows no verdict counted twice and none lost.
"""
from __future__ import annotations

import random
import re
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import kubernetes
import pytest
from operator_harness import NS, HttpStandIn, RuntimeStandIn, example
from realk8s_cluster import HANDLER_FAILED, HandlerFailed, RealCluster, Workloads
from realk8s_operator import LEASE, Operator, Ports, Release, lease, start_operator

from specdecode.operator import names

pytestmark = [pytest.mark.realk8s, pytest.mark.timeout(420, func_only=True)]

Obj = dict[str, Any]
CONNECT_TIMEOUT_SECONDS = 2.0
NAME = "ha-failover"
# A handler of the operator ran for the resource or one of its workloads (the webhook's lines aside)
HANDLED = re.compile(rf"\[{NS}/{NAME}(-\w+)?\] Handler '\w+' succeeded")
# Four steps judged every second over two-second windows: the rollout takes several windows, so
# the leader is killed with it under way.
ANALYSIS = {"interval": "1s", "window": "2s"}
STEPS = [{"weight": 25}, {"weight": 50}, {"weight": 75}, {"weight": 100}]


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


def holder(cluster: RealCluster, release: Release) -> str | None:
    return lease(cluster.apps.api_client, release)["spec"].get("holderIdentity")


def moment(stamp: str) -> datetime:
    return datetime.fromisoformat(stamp.replace("Z", "+00:00"))


@contextmanager
def status_history(cluster: RealCluster, name: str) -> Iterator[list[Obj]]:
    """Every status of ``name`` the API server stores while inside, in order: a watch, resumed
    from the last resourceVersion seen each time the server ends it (every second, so that the
    recording stops soon after leaving), sees each version once."""
    seen: list[Obj] = []
    stopped = threading.Event()

    def record() -> None:
        version = None
        while not stopped.is_set():
            for event in kubernetes.watch.Watch().stream(
                    cluster.custom.list_namespaced_custom_object, names.GROUP, names.VERSION, NS, names.PLURAL,
                    field_selector=f"metadata.name={name}", resource_version=version, timeout_seconds=1):
                seen.append(event["object"].get("status") or {})
                version = event["object"]["metadata"]["resourceVersion"]

    thread = threading.Thread(target=record, daemon=True)
    thread.start()
    try:
        yield seen
    finally:
        stopped.set()
        thread.join()


def windows(status: Obj) -> list[tuple[str, str, str]]:
    return [(v["revision"], v["start"], v["end"]) for v in status.get("rollout", {}).get("verdicts", [])]


def assert_counted_once_and_none_lost(history: list[Obj], interval: timedelta) -> None:
    """No verdict counted twice: every counted window is distinct, and those of one revision end
    at least half an interval apart (one per interval). None lost: each stored status keeps every
    window the one before it held, but for the oldest beyond the ten kept."""
    counted = sorted({w for status in history for w in windows(status)})
    assert counted, "no verdict was counted"
    for (rev_a, _, end_a), (rev_b, _, end_b) in zip(counted, counted[1:]):
        assert rev_a != rev_b or moment(end_b) - moment(end_a) >= interval / 2, (end_a, end_b)
    for before, after in zip(history, history[1:]):
        dropped = [w for w in windows(before) if w not in windows(after)]
        same_canary = before.get("canaryRevision") == after.get("canaryRevision")
        assert not same_canary or dropped == windows(before)[:len(dropped)], (before, after)


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
    Afterwards ordinal 0 runs again, ordinal 1 is stopped (releasing the Lease) and ordinal 0
    leads, as the tier found it."""
    replica = start_operator(cluster.plane, release, tmp_path, ordinal=1, ports=Ports.free())
    try:
        yield replica
    finally:
        if operator.process.popen.poll() is not None:
            operator.start()
        replica.stop()
        cluster.until(operator.leading, "ordinal 0 leading again")


def test_the_standby_takes_a_rollout_over_when_the_leader_is_killed(
        cluster: RealCluster, release: Release, operator: Operator, standby: Operator, workloads: Workloads,
        stand_ins: list[HttpStandIn]) -> None:
    """Only the Lease's holder (ordinal 0) reconciles while both run. SIGKILLed mid-rollout (its
    Lease stays its own), ordinal 1 acquires it no sooner than a lease duration after the dead
    one's last renewal, and finishes the rollout on windows of its own; then it reconciles a
    change, which the API server admits through the Service stand-in by calling the standby's
    webhook.

    The Service: the API server calls a ``ServiceStandIn`` URL that forwards each connection to a
    replica accepting one, as a Service with its ready pods as endpoints does; every replica,
    leading or not, serves the webhook."""
    pods = [release.pod_name(ordinal) for ordinal in (0, 1)]
    cluster.until(lambda: holder(cluster, release) == pods[0] and operator.leading(), "ordinal 0 holding the Lease")
    assert not standby.leading()
    body = example(NAME)
    body["spec"]["rollout"].update(steps=STEPS, analysis={**body["spec"]["rollout"]["analysis"], **ANALYSIS})

    with service_in_front_of(cluster, release, [operator, standby]), status_history(cluster, NAME) as history:
        workloads.ready.add(NAME)
        cluster.create(body)
        cluster.until(lambda: cluster.condition(NAME, "Ready").get("status") == "True", "Ready=True")
        cluster.patch(NAME, {"spec": {"speculative": {"numSpeculativeTokens": 3}}})
        canary = cluster.until(lambda: cluster.status(NAME).get("canaryRevision"), "a canary")
        stand_ins.append(runtime := RuntimeStandIn(acceptance=0.9))
        cluster.stand_in_pod(NAME, canary, runtime.port)
        cluster.until(lambda: windows(cluster.status(NAME)), "a verdict on the canary counted")
        assert not HANDLED.search(standby.log())  # the standby never touched it

        operator.kill()
        dead = lease(cluster.apps.api_client, release)["spec"]  # the killed leader's last renewal
        assert dead["holderIdentity"] == pods[0] and cluster.status(NAME).get("canaryRevision") == canary
        taken = cluster.until(lambda: (spec := lease(cluster.apps.api_client, release)["spec"])[
            "holderIdentity"] == pods[1] and spec, "ordinal 1 taking the Lease over",
            timeout=LEASE["leaseDurationSeconds"] + 60)
        assert moment(taken["acquireTime"]) >= moment(dead["renewTime"]) + timedelta(
            seconds=LEASE["leaseDurationSeconds"])
        assert taken["leaseTransitions"] == dead["leaseTransitions"] + 1
        cluster.until(lambda: check_handlers(standby) or cluster.status(NAME).get("stableRevision") == canary,
                      "ordinal 1 finishing the rollout", timeout=120)
        assert standby.leading() and "canaryRevision" not in cluster.status(NAME)

        cluster.until(lambda: scale(cluster, NAME, 3), "the change admitted by the standby's webhook")
        cluster.until(lambda: replicas_of(cluster, NAME) == [3], "ordinal 1 reconciling the change")
        cluster.settled(NAME)
    assert_counted_once_and_none_lost(history, timedelta(seconds=1))
    judged_after = [w for status in history for w in windows(status) if moment(w[1]) > moment(taken["acquireTime"])]
    assert judged_after  # the new leader judged the canary on its own windows
    check_handlers(standby)
