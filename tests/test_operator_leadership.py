"""Leadership through a Lease (operator/leadership.py) and what guards the status when two writers
meet: the Lease's decisions (who acquires, renews, waits; expiry on the candidate's own clock),
two electors against one Lease (one leads; a 409 makes none believe it holds it; a release hands
it over), kopf's storages writing nothing on a standby, a status write beaten by a second writer
read again and planned again, and a verdict's window counted once. The failover of two operator
processes on the real control plane is test_operator_realk8s_ha.py."""
from __future__ import annotations

import json
import logging
import threading
from datetime import datetime, timedelta, timezone
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import kopf
import kubernetes
import pytest
from kube_emulator import ApiServer, serve
from operator_harness import NS, TEST_CLIENT, example, wait_for, write_kubeconfig

from specdecode.operator import controller, kube, names
from specdecode.operator.analysis import Measurement, MetricSnapshot, Result, Verdict, already_counted, counting
from specdecode.operator.crd import build_crd
from specdecode.operator.settings import KOPF_PREFIX
from specdecode.operator.leadership import (
    Elector,
    LeaderDiffBaseStorage,
    LeaderProgressStorage,
    LeaseRecord,
    LeaseTiming,
    Move,
    Sighting,
    lease_spec,
    next_move,
    sighted,
)
from specdecode.operator.metrics import OperatorMetrics

Obj = dict[str, Any]
TIMING = LeaseTiming(duration=15, renew_deadline=10, retry_period=2)
FAST = LeaseTiming(duration=0.6, renew_deadline=0.4, retry_period=0.05)  # the electors' tests
NOW = datetime(2026, 11, 28, 8, 0, tzinfo=timezone.utc)


def record(holder: str | None, version: str = "1", transitions: int = 0) -> LeaseRecord:
    return LeaseRecord(holder=holder, duration=15, acquire_time="2026-11-28T07:00:00.000000Z",
                       transitions=transitions, resource_version=version)


# -- the decisions ---------------------------------------------------------------------------------


def test_timing_needs_the_renew_deadline_inside_the_lease_duration() -> None:
    for duration, deadline, retry in [(10, 10, 2), (15, 10, 10), (15, 20, 2), (15, 10, 0)]:
        with pytest.raises(ValueError, match="renew deadline"):
            LeaseTiming(duration, deadline, retry)


def test_a_free_lease_is_acquired_ours_renewed_anothers_waited_for() -> None:
    assert next_move(Sighting(record(None), 0.0), "me", 0.0, TIMING) is Move.ACQUIRE
    assert next_move(Sighting(record("me"), 0.0), "me", 100.0, TIMING) is Move.RENEW
    assert next_move(Sighting(record("other"), 0.0), "me", 14.9, TIMING) is Move.WAIT


def test_anothers_lease_expires_a_lease_duration_after_its_last_write_was_seen_here() -> None:
    """The candidate's own clock: a renewal (a new resourceVersion) starts it again, reading the
    same version again does not."""
    first = sighted(None, record("other", "1"), now=0.0)
    again = sighted(first, record("other", "1"), now=10.0)
    assert again.seen_at == 0.0 and next_move(again, "me", 15.0, TIMING) is Move.ACQUIRE
    renewed = sighted(again, record("other", "2"), now=10.0)
    assert renewed.seen_at == 10.0 and next_move(renewed, "me", 15.0, TIMING) is Move.WAIT
    assert next_move(renewed, "me", 25.0, TIMING) is Move.ACQUIRE


def test_acquiring_counts_a_transition_and_renewing_keeps_the_acquire_time() -> None:
    taken = lease_spec(record("other", transitions=3), "me", Move.ACQUIRE, NOW, TIMING)
    assert taken == {"holderIdentity": "me", "leaseDurationSeconds": 15, "acquireTime": "2026-11-28T08:00:00.000000Z",
                     "renewTime": "2026-11-28T08:00:00.000000Z", "leaseTransitions": 4}
    renewed = lease_spec(record("me", transitions=4), "me", Move.RENEW, NOW, TIMING)
    assert (renewed["acquireTime"], renewed["renewTime"], renewed["leaseTransitions"]) == (
        "2026-11-28T07:00:00.000000Z", "2026-11-28T08:00:00.000000Z", 4)


# -- two electors against one Lease -----------------------------------------------------------------


class LeaseApi:
    """The two calls an ``Elector`` makes, on one Lease, as the API server answers them: a replace
    whose resourceVersion is not the stored one is a 409 Conflict. ``conflicts`` replaces (any
    version) answer 409 as if another writer had come first."""

    def __init__(self) -> None:
        self.lease: Obj = {"metadata": {"name": "ops", "namespace": NS, "resourceVersion": "1"}, "spec": {}}
        self.conflicts = 0
        self.holders: list[str | None] = []  # every holder written, in order
        self._lock = threading.Lock()

    def read_namespaced_lease(self, name: str, namespace: str, **_: Any) -> SimpleNamespace:
        with self._lock:
            return SimpleNamespace(data=json.dumps(self.lease).encode())

    def replace_namespaced_lease(self, name: str, namespace: str, body: Obj, **_: Any) -> SimpleNamespace:
        with self._lock:
            stale = body["metadata"]["resourceVersion"] != self.lease["metadata"]["resourceVersion"]
            if stale or self.conflicts:
                self.conflicts = max(0, self.conflicts - 1)
                raise kubernetes.client.ApiException(status=409, reason="Conflict")
            version = str(int(self.lease["metadata"]["resourceVersion"]) + 1)
            self.lease = {"metadata": {**body["metadata"], "resourceVersion": version}, "spec": body["spec"]}
            self.holders.append(body["spec"]["holderIdentity"])
            return SimpleNamespace(data=json.dumps(self.lease).encode())


def electors(api: LeaseApi, *identities: str) -> list[Elector]:
    return [Elector(api, NS, "ops", identity, FAST, logging.getLogger(identity)) for identity in identities]


def test_of_two_electors_one_leads_and_its_release_hands_the_lease_to_the_other() -> None:
    api = LeaseApi()
    elected: list[str] = []
    first, second = electors(api, "operator-0", "operator-1")
    for elector in (first, second):
        elector.start(lambda e=elector: elected.append(e.identity))
    try:
        leader = wait_for(lambda: next((e for e in (first, second) if e.leading()), None), "a leader")
        other = second if leader is first else first
        wait_for(lambda: len(api.holders) >= 5, "a few renewals")
        assert not other.leading() and set(api.holders) == {leader.identity}
        leader.stop()
        assert api.lease["spec"]["holderIdentity"] is None and not leader.leading()
        wait_for(other.leading, "the other replica acquiring the released Lease")
        assert elected == [leader.identity, other.identity]  # each took over once
        assert api.lease["spec"]["leaseTransitions"] == 2
    finally:
        first.stop()
        second.stop()


def test_a_lease_write_answered_409_leaves_the_elector_a_candidate() -> None:
    api = LeaseApi()
    api.conflicts = 3
    (elector,) = electors(api, "operator-0")
    elector.start(lambda: None)
    try:
        wait_for(lambda: api.conflicts == 0, "three writes refused")
        wait_for(elector.leading, "the fourth acquiring it")
        assert api.holders == ["operator-0", *api.holders[1:]] and len(set(api.holders)) == 1
    finally:
        elector.stop()


def test_kopfs_storages_write_nothing_while_standing_by() -> None:
    """A standby whose change handlers are filtered out must not store the change as handled
    (kopf's diff-base), nor progress."""
    leading = SimpleNamespace(now=False)
    leadership = SimpleNamespace(leading=lambda: leading.now)
    progress = LeaderProgressStorage(leadership, prefix="kopf.specdecode.io")
    diffbase = LeaderDiffBaseStorage(leadership, prefix="kopf.specdecode.io")
    body = kopf.Body({"metadata": {"name": "demo", "namespace": NS, "annotations": {}}, "spec": {"replicas": 2}})

    def writes() -> Obj:
        patch = kopf.Patch()
        diffbase.store(body=body, patch=patch, essence={"spec": {"replicas": 2}})
        progress.store(key="reconcile", record={"success": True}, body=body, patch=patch)
        progress.touch(body=body, patch=patch, value="x")
        return dict(patch)

    assert writes() == {}
    leading.now = True
    annotations = writes()["metadata"]["annotations"]
    assert {"kopf.specdecode.io/last-handled-configuration", "kopf.specdecode.io/reconcile"} <= annotations.keys()


# -- a second writer ---------------------------------------------------------------------------------


class SecondWriter(kube.Cluster):
    """The API server as the operator sees it, where another writer sets the resource's status
    right after the operator's first read (as a second replica during a failover overlap would)."""

    def __init__(self, kubeconfig: str, client: kubernetes.client.ApiClient) -> None:
        super().__init__(kubeconfig)
        self.client, self.reads = client, 0

    def get(self, namespace: str, name: str) -> Obj | None:
        body = super().get(namespace, name)
        self.reads += 1
        if self.reads == 1:
            kubernetes.client.CustomObjectsApi(self.client).patch_namespaced_custom_object_status(
                names.GROUP, names.VERSION, namespace, names.PLURAL, name,
                {"status": {"acceptance": {"revision": "other-writer", "draftTokens": 7}}})
        return body


def test_a_status_write_beaten_by_a_second_writer_reads_again_and_plans_again(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The first pass planned from a status another writer changed before its write: the write
    carries the resourceVersion read, the server refuses it (409), and the second pass plans from
    the other writer's status, which the result keeps (no update lost)."""
    server = ApiServer()
    server.install_crd(build_crd())
    events: list[Any] = []
    with serve(server) as url:
        kubeconfig = write_kubeconfig(url, tmp_path / "kubeconfig")
        with kubernetes.config.new_client_from_config(str(kubeconfig)) as client:
            client.user_agent = TEST_CLIENT
            custom = kubernetes.client.CustomObjectsApi(client)
            custom.create_namespaced_custom_object(names.GROUP, names.VERSION, NS, names.PLURAL, example("conflict"))
            cluster = SecondWriter(str(kubeconfig), client)
            ctx = controller.Context(cluster, OperatorMetrics())
            with caplog.at_level(logging.INFO):
                assert controller.reconcile(ctx, NS, "conflict", logging.getLogger("test"),
                                            post=lambda owner, posted: events.extend(posted))
            status = custom.get_namespaced_custom_object(names.GROUP, names.VERSION, NS, names.PLURAL,
                                                         "conflict")["status"]
    assert cluster.reads == 2 and "changed since it was read" in caplog.text
    assert status["acceptance"]["revision"] == "other-writer"  # the other writer's update, kept
    assert status["observedGeneration"] == 1 and status["stableRevision"]  # and the operator's pass


def test_a_new_leader_takes_every_resource_over_from_its_own_thread(tmp_path: Path) -> None:
    """The takeover reconciles what kopf will not fire again (here a spec admission let by with a
    GPU count the layout cannot hold), from the elector's thread, outside kopf's context: the
    status says why and the Event reaches the API server all the same."""
    server = ApiServer()
    server.install_crd(build_crd())
    with serve(server) as url:
        kubeconfig = write_kubeconfig(url, tmp_path / "kubeconfig")
        with kubernetes.config.new_client_from_config(str(kubeconfig)) as client:
            client.user_agent = TEST_CLIENT
            body = example("taken-over")
            body["spec"]["resources"] = {"gpusPerPod": 2}  # more than parallelism.tensor (1)
            kubernetes.client.CustomObjectsApi(client).create_namespaced_custom_object(
                names.GROUP, names.VERSION, NS, names.PLURAL, body)
            ctx = controller.Context(kube.Cluster(str(kubeconfig)), OperatorMetrics())
            taking_over = threading.Thread(target=controller.take_over, args=(
                ctx, kopf.AnnotationsDiffBaseStorage(prefix=KOPF_PREFIX), logging.getLogger("test")))
            taking_over.start()
            taking_over.join()
            status = kubernetes.client.CustomObjectsApi(client).get_namespaced_custom_object(
                names.GROUP, names.VERSION, NS, names.PLURAL, "taken-over")["status"]
            events = kubernetes.client.CoreV1Api(client).list_namespaced_event(NS).items
    (ready,) = [c for c in status["conditions"] if c["type"] == "Ready"]
    assert (ready["status"], ready["reason"]) == ("False", "InvalidSpec")
    assert [(e.type, e.reason, e.involved_object.name) for e in events] == [("Warning", "InvalidSpec", "taken-over")]


# -- a verdict counted once ---------------------------------------------------------------------------


def verdict(end: datetime, revision: str = "canary", result: Result = Result.FAIL) -> Verdict:
    measurement = Measurement(revision, MetricSnapshot(), end - timedelta(minutes=5), end)
    return Verdict(result, ("acceptance low",), measurement, complete=True)


def test_a_verdict_on_an_interval_already_counted_is_not_counted_again() -> None:
    """One verdict per analysis interval: another one ending within half an interval of the last
    counted window (a second writer, a pass planned again, a new leader judging the same
    interval) is not counted; the next interval's is, and each counted one keeps its window."""
    interval = timedelta(seconds=30)
    counted = counting((), verdict(NOW))
    assert [(c.start, c.end, c.result) for c in counted] == [(NOW - timedelta(minutes=5), NOW, "Fail")]
    assert already_counted(verdict(NOW), counted, interval)
    assert already_counted(verdict(NOW + timedelta(seconds=14)), counted, interval)
    assert not already_counted(verdict(NOW + timedelta(seconds=30)), counted, interval)
    assert not already_counted(verdict(NOW, revision="another"), counted, interval)
    for i in range(1, 15):
        counted = counting(counted, verdict(NOW + i * interval))
    assert len(counted) == 10 and counted[-1].end == NOW + 14 * interval
