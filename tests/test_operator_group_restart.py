"""A StatefulSet group whose member started again is started again whole (group_restart.py):
the decision on pod shapes as the API server returns them; against the emulated API server, the
operator deleting the group's pods once on a bumped restartCount, with a GroupRestarted Event; and
on the real control plane, the same delete allowed by the chart's RBAC (the privilege test proves
the verb used).
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from operator_harness import NS, TEST_CLIENT, Cluster, emulated_cluster, example, running_stable, wait_for
from realk8s_cluster import RealCluster

from specdecode.operator import names
from specdecode.operator.group_restart import (
    GROUP_RESTARTED,
    Member,
    group_change,
    group_changes,
    pods_of,
    record_patch,
    recorded_members,
    restart_event,
)
from specdecode.operator.kube import kind_of
from specdecode.operator.render import build_workloads
from specdecode.operator.resolve import resolve

Obj = dict[str, Any]
NAME = "healed"
PIPELINE_2 = {"parallelism": {"pipeline": 2}, "resources": {"gpusPerPod": 0}}


def rendered(*, leader_worker_set: bool = False, **spec: Any) -> list[Obj]:
    """The workloads (and headless Services) of one replica of revision ``abc`` of ``spec``."""
    body = {"model": {"uri": "smollm2-135m"}, "image": "specdecode/runtime:test", **spec}
    answer = resolve({"apiVersion": names.API_VERSION, "kind": names.KIND,
                      "metadata": {"name": "demo", "namespace": "llm"}, "spec": body})
    assert answer.allowed, answer.message
    return build_workloads(answer.resolved, "abc", 1, leader_worker_set=leader_worker_set)


def statefulset() -> Obj:
    (sts,) = [o for o in rendered(**PIPELINE_2) if o["kind"] == "StatefulSet"]
    return sts


def pod(sts: Obj, ordinal: int, *, uid: str | None = None, restarts: int = 0, ready: bool = True,
        deleting: bool = False) -> Obj:
    """Pod ``ordinal`` of ``sts`` as the API server lists it: its runtime container running."""
    name = f"{sts['metadata']['name']}-{ordinal}"
    labels = {**sts["spec"]["template"]["metadata"]["labels"], names.LABEL_STS_POD_INDEX: str(ordinal)}
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": "llm", "uid": uid or f"uid-{name}", "labels": labels,
                         **({"deletionTimestamp": "2026-01-01T00:00:00Z"} if deleting else {})},
            "status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
                       "containerStatuses": [{"name": names.CONTAINER, "restartCount": restarts, "ready": ready,
                                              "state": {"running": {}}}]}}


def recorded(sts: Obj, pods: list[Obj]) -> Obj:
    """``sts`` with ``pods`` recorded, as the operator's patch leaves it."""
    patch = record_patch(sts, {p["metadata"]["name"]: Member(p["metadata"]["uid"], 0) for p in pods})
    return {**sts, "metadata": {**sts["metadata"], **patch["metadata"]}}


# -- the decision ---------------------------------------------------------------------------------


def test_a_group_whose_pods_are_all_ready_is_recorded_once() -> None:
    sts = statefulset()
    pods = [pod(sts, 0), pod(sts, 1)]
    change = group_change(sts, pods)
    assert change is not None and change.delete == ()
    assert change.record == {p["metadata"]["name"]: Member(p["metadata"]["uid"], 0) for p in pods}
    patch = record_patch(sts, change.record)
    assert kind_of(patch).kind == "StatefulSet" and patch["metadata"]["name"] == sts["metadata"]["name"]
    stored = {**sts, "metadata": {**sts["metadata"], **patch["metadata"]}}
    assert recorded_members(stored) == change.record
    assert group_change(stored, pods) is None  # recorded as it is: nothing to write


@pytest.mark.parametrize("pods", [
    pytest.param(lambda sts: [pod(sts, 0), pod(sts, 1, ready=False)], id="a pod not ready"),
    pytest.param(lambda sts: [pod(sts, 0)], id="a pod missing"),
    pytest.param(lambda sts: [pod(sts, 0), pod(sts, 1, deleting=True)], id="a pod being deleted"),
])
def test_a_group_not_whole_and_ready_is_not_recorded(pods: Callable[[Obj], list[Obj]]) -> None:
    sts = statefulset()
    assert group_change(sts, pods_of(sts, pods(sts))) is None


@pytest.mark.parametrize("started_again, how", [
    (lambda sts: pod(sts, 1, restarts=1), "restarted (restart 1)"),
    (lambda sts: pod(sts, 1, uid="new"), "was replaced"),
])
def test_a_member_that_started_again_beside_a_survivor_deletes_every_pod_once(
        started_again: Callable[[Obj], Obj], how: str) -> None:
    sts = statefulset()
    whole = [pod(sts, 0), pod(sts, 1)]
    sts = recorded(sts, whole)
    now = [whole[0], started_again(sts)]
    change = group_change(sts, now)
    assert change is not None and change.record is None and change.delete == tuple(now)
    name = sts["metadata"]["name"]
    event = restart_event(change)
    assert (event.type.value, event.reason) == ("Normal", GROUP_RESTARTED)
    assert event.message == (f"StatefulSet {name}: pod {name}-1 {how}; its 2 pods deleted so that the group "
                             "starts again whole")
    # once: then its pods are being deleted, then new, then recorded anew once all are Ready
    assert group_change(sts, pods_of(sts, [pod(sts, 0, deleting=True), pod(sts, 1, deleting=True)])) is None
    assert group_change(sts, [pod(sts, 0, uid="a", ready=False), pod(sts, 1, uid="b", restarts=2)]) is None
    change = group_change(sts, [pod(sts, 0, uid="a"), pod(sts, 1, uid="b")])
    assert change is not None and change.delete == () and set(change.record.values()) == {Member("a", 0),
                                                                                          Member("b", 0)}


def test_a_group_without_a_survivor_or_without_a_record_is_left_to_form() -> None:
    sts = statefulset()
    whole = [pod(sts, 0), pod(sts, 1)]
    every_one_restarted = [pod(sts, 0, restarts=1, ready=False), pod(sts, 1, uid="new", ready=False)]
    assert group_change(recorded(sts, whole), every_one_restarted) is None
    assert group_change(sts, [pod(sts, 0), pod(sts, 1, restarts=3, ready=False)]) is None  # forming at first
    unreadable = {**sts, "metadata": {**sts["metadata"], "annotations": {names.ANNOTATION_GROUP_MEMBERS: "[1]"}}}
    assert recorded_members(unreadable) == {}


def test_only_statefulset_groups_are_looked_at_each_with_its_own_pods() -> None:
    lws, deployment = rendered(leader_worker_set=True, **PIPELINE_2), rendered()
    sts = statefulset()
    other = {**sts, "metadata": {**sts["metadata"], "name": "demo-abc-1"},
             "spec": {**sts["spec"], "selector": {"matchLabels": {**sts["spec"]["selector"]["matchLabels"],
                                                                  names.LABEL_GROUP: "1"}}}}
    pods = [pod(sts, 0), pod(sts, 1)]
    assert pods_of(other, pods) == []
    changes = group_changes([*lws, *deployment, sts, other], pods)
    assert [(c.group["metadata"]["name"], c.delete) for c in changes] == [(sts["metadata"]["name"], ())]


# -- the operator, against the emulated API server ------------------------------------------------


@pytest.fixture
def emulated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Cluster]:
    with emulated_cluster(tmp_path, monkeypatch) as running:
        yield running


def group(cluster: Cluster, revision: str) -> Obj:
    """The StatefulSet of group 0 of ``revision``."""
    return cluster.custom.get_namespaced_custom_object("apps", "v1", NS, "statefulsets",
                                                       names.group_name(NAME, revision, 0))


def start_pods(cluster: Cluster, sts: Obj) -> list[str]:
    """Every pod of ``sts``, made as its controller makes them, and Ready; their names."""
    made = []
    for ordinal in range(sts["spec"]["replicas"]):
        shaped = pod(sts, ordinal)
        meta = {k: shaped["metadata"][k] for k in ("name", "labels")}
        cluster.core.create_namespaced_pod(NS, {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": {
            "containers": [{"name": names.CONTAINER, "image": "stand-in"}]}})
        report(cluster, meta["name"], restarts=0)
        made.append(meta["name"])
    return made


def report(cluster: Cluster, pod_name: str, restarts: int) -> None:
    """The kubelet's status of a pod whose runtime container runs, after ``restarts`` restarts."""
    running = {"name": names.CONTAINER, "image": "stand-in", "imageID": "", "ready": True, "restartCount": restarts,
               "state": {"running": {}}}
    cluster.core.patch_namespaced_pod_status(pod_name, NS, {"status": {
        "phase": "Running", "conditions": [{"type": "Ready", "status": "True"}], "containerStatuses": [running]}})


def uids(cluster: Cluster, pod_names: list[str]) -> dict[str, str]:
    return {n: cluster.core.read_namespaced_pod(n, NS).metadata.uid for n in pod_names}


def recorded_uids(cluster: Cluster, revision: str) -> dict[str, str]:
    return {n: m.uid for n, m in recorded_members(group(cluster, revision)).items()}


def gone(cluster: Cluster, pod_names: list[str]) -> bool:
    return not {p.metadata.name for p in cluster.core.list_namespaced_pod(NS).items} & set(pod_names)


def restarted_event(cluster: Cluster) -> list[str]:
    return [message for _, reason, message in cluster.events(NAME) if reason == GROUP_RESTARTED]


def pod_deletes(cluster: Cluster) -> list[str]:
    """The pods the operator deleted (not dry runs), in order."""
    assert cluster.server is not None
    return [r.name for r in cluster.server if r.method == "DELETE" and r.resource is not None
            and r.resource.plural == "pods" and r.params.get("dryRun") is None
            and not r.headers.get("User-Agent", "").startswith(TEST_CLIENT)]


@pytest.mark.timeout(120)
def test_a_statefulset_group_with_one_restarted_pod_has_all_its_pods_deleted_once(emulated: Cluster) -> None:
    stable = running_stable(emulated, NAME, replicas=1, **PIPELINE_2)
    pod_names = start_pods(emulated, group(emulated, stable))
    first = uids(emulated, pod_names)
    wait_for(lambda: recorded_uids(emulated, stable) == first, "the group's members recorded")

    report(emulated, pod_names[1], restarts=1)
    wait_for(lambda: gone(emulated, pod_names), "every pod of the group deleted")
    (message,) = wait_for(lambda: restarted_event(emulated), "the GroupRestarted Event")
    assert message.startswith(f"StatefulSet {names.group_name(NAME, stable, 0)}: pod {pod_names[1]} restarted")
    assert sorted(pod_deletes(emulated)) == pod_names

    start_pods(emulated, group(emulated, stable))  # the StatefulSet controller makes them again
    second = uids(emulated, pod_names)
    wait_for(lambda: recorded_uids(emulated, stable) == second, "the new members recorded")
    assert sorted(pod_deletes(emulated)) == pod_names and len(restarted_event(emulated)) == 1


# -- the operator on the real control plane -------------------------------------------------------


@pytest.mark.realk8s
@pytest.mark.timeout(180, func_only=True)
def test_the_operator_may_delete_the_pods_of_a_group_on_a_real_api_server(cluster: RealCluster) -> None:
    """No kubelet runs: the pods are made and reported Ready by the test, and the API server
    deletes a pod that no node runs at once."""
    body = example(NAME)
    body["metadata"]["annotations"] = {names.ANNOTATION_WORKLOAD_KIND: "StatefulSet"}
    body["spec"] |= {"replicas": 1, **PIPELINE_2}
    cluster.create(body)
    sts = cluster.until(lambda: next(iter(cluster.custom.list_namespaced_custom_object(
        "apps", "v1", NS, "statefulsets", label_selector=f"{names.LABEL_INSTANCE}={NAME}")["items"]), None),
        "the group's StatefulSet")
    revision = sts["metadata"]["labels"][names.LABEL_REVISION]
    pod_names = start_pods(cluster, sts)
    first = uids(cluster, pod_names)
    cluster.until(lambda: recorded_uids(cluster, revision) == first, "the group's members recorded")

    report(cluster, pod_names[0], restarts=1)
    cluster.until(lambda: gone(cluster, pod_names), "every pod of the group deleted")
    cluster.until(lambda: restarted_event(cluster), "the GroupRestarted Event")
    cluster.custom.delete_namespaced_custom_object(names.GROUP, names.VERSION, NS, names.PLURAL, NAME)
    cluster.until(lambda: cluster.gone(NAME), f"{NAME} deleted")
