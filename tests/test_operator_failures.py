"""failures: why a resource's runtime pods never come, read from pods, workloads and Events shaped as
the API server returns them (tests/fixtures/pending_failures.yaml, each case citing its source)."""
from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

from specdecode.operator import names
from specdecode.operator.failures import FAILED_WAITING, failure
from specdecode.operator.pods import MAX_REFUSAL_CHARS, runtime_refusal

Obj = dict[str, Any]
CASES: dict[str, Obj] = yaml.safe_load((Path(__file__).parent / "fixtures" / "pending_failures.yaml").read_text())
REVISION = "3f2a9c1d7e"


def case(name: str) -> Obj:
    """A fresh copy of fixture case ``name``: its pods, workloads and events."""
    return copy.deepcopy(CASES[name])


def failure_of(name: str) -> Any:
    found = case(name)
    return failure(found["pods"], found["workloads"], found["events"])


def waiting_message(pod: Obj, init: bool = False) -> str:
    statuses = pod["status"]["initContainerStatuses" if init else "containerStatuses"]
    return statuses[0]["state"]["waiting"]["message"]


def test_the_fixtures_carry_the_operators_revision_label() -> None:
    for name, found in CASES.items():
        for obj in [*found["pods"], *(w for w in found["workloads"] if w["kind"] != "Service")]:
            assert obj["metadata"]["labels"][names.LABEL_REVISION] == REVISION, name


def test_an_unschedulable_pod_says_what_the_scheduler_said() -> None:
    found = failure_of("unschedulable_gpu")
    said = case("unschedulable_gpu")["pods"][0]["status"]["conditions"][0]["message"]
    assert found.reason == "Unschedulable"
    assert found.message == f"pod demo-{REVISION}-5d8f7c9b6d-x7k2p (revision {REVISION}): unschedulable: {said}"
    assert "3 Insufficient nvidia.com/gpu." in found.message


def test_an_image_that_cannot_be_pulled_names_the_pod_and_its_container() -> None:
    backing_off = failure_of("image_pull_back_off")
    said = waiting_message(case("image_pull_back_off")["pods"][0])
    assert backing_off.reason == "ImagePullBackOff"
    assert backing_off.message == (f"pod demo-{REVISION}-5d8f7c9b6d-q4w9z (revision {REVISION}): "
                                   f"container runtime waiting: ImagePullBackOff: {said}")
    first_pull = failure_of("err_image_pull")  # the init container fetching the model
    said = waiting_message(case("err_image_pull")["pods"][0], init=True)
    assert first_pull.reason == "ErrImagePull"
    assert first_pull.message == (f"pod demo-{REVISION}-5d8f7c9b6d-m2n8r (revision {REVISION}): "
                                  f"container fetch-model waiting: ErrImagePull: {said}")
    assert "pull access denied" in first_pull.message


def test_a_deployment_that_cannot_create_pods_says_its_replica_failure() -> None:
    found = failure_of("deployment_quota")
    deployment = case("deployment_quota")["workloads"][0]
    said = next(c["message"] for c in deployment["status"]["conditions"] if c["type"] == "ReplicaFailure")
    assert found.reason == "FailedCreate"
    assert found.message == f"Deployment demo-{REVISION} (revision {REVISION}): {said}"
    assert "exceeded quota: gpu-quota" in found.message
    deleting = case("deployment_quota")  # a failure to scale down is no failure to come
    next(c for c in deleting["workloads"][0]["status"]["conditions"] if c["type"] == "ReplicaFailure")["reason"] = (
        "FailedDelete")
    assert failure(deleting["pods"], deleting["workloads"]) is None


def test_a_statefulset_short_of_pods_says_its_latest_failed_create_event() -> None:
    found = failure_of("statefulset_pod_security")
    prefix = f"StatefulSet demo-{REVISION}-0 (revision {REVISION}): "
    assert found.reason == "FailedCreate"
    assert found.message.startswith(
        f"{prefix}create Pod demo-{REVISION}-0-0 in StatefulSet demo-{REVISION}-0 failed error: "
        f'pods "demo-{REVISION}-0-0" is forbidden: violates PodSecurity "restricted:latest": allowPrivilegeEscalation')
    said = found.message.removeprefix(prefix)  # the Event's message, cut to fit a condition
    assert said.endswith("…") and len(said) == MAX_REFUSAL_CHARS
    assert case("statefulset_pod_security")["events"][0]["message"].startswith(said[:-1])


def test_a_stale_event_says_nothing_once_the_statefulset_has_its_pods() -> None:
    assert failure_of("statefulset_stale_event") is None  # its pods are being created: no failure
    short = case("statefulset_stale_event")
    short["workloads"][0]["status"]["replicas"] = 1
    assert failure(short["pods"], short["workloads"], short["events"]).reason == "FailedCreate"


def test_events_about_other_objects_are_passed_over() -> None:
    assert failure_of("unrelated_event") is None
    found = case("statefulset_pod_security")
    event = found["events"][0]
    others = [{**event, "involvedObject": {**event["involvedObject"], "kind": "Deployment"}},
              {**event, "involvedObject": {**event["involvedObject"], "name": f"demo-{REVISION}-1"}},
              {**event, "involvedObject": {**event["involvedObject"], "uid": "an-earlier-statefulset"}},
              {**event, "type": "Normal"}, {**event, "reason": "SuccessfulCreate"}]
    assert failure(found["pods"], found["workloads"], others) is None


def test_a_leader_worker_sets_statefulsets_are_read_by_their_names() -> None:
    found = failure_of("leader_worker_set_quota")
    said = case("leader_worker_set_quota")["events"][0]["message"]
    assert found.reason == "FailedCreate"
    assert found.message == (f"StatefulSet demo-{REVISION}-0 of LeaderWorkerSet demo-{REVISION} "
                             f"(revision {REVISION}): {said}")
    created = case("leader_worker_set_quota")  # the worker came after all: the event is stale
    worker = copy.deepcopy(created["pods"][0])
    worker["metadata"]["name"] = f"demo-{REVISION}-0-1"
    assert failure([*created["pods"], worker], created["workloads"], created["events"]) is None
    listed = case("leader_worker_set_quota")  # LWS v0.10 labels them: listed, read as StatefulSets
    statefulset = copy.deepcopy(case("statefulset_stale_event")["workloads"][0])  # all its pods
    statefulset["metadata"]["uid"] = listed["events"][0]["involvedObject"]["uid"]
    assert failure(listed["pods"], [*listed["workloads"], statefulset], listed["events"]) is None


def test_a_refusal_comes_first_then_failed_creates_then_waiting_then_unschedulable() -> None:
    unplaced = case("unschedulable_gpu")["pods"]
    pulling = case("image_pull_back_off")["pods"]
    refusing = copy.deepcopy(pulling[0])
    refusing["metadata"]["name"] = f"demo-{REVISION}-5d8f7c9b6d-a1b2c"
    refusing["status"]["containerStatuses"][0].update(
        state={"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 40s restarting failed container"}},
        lastState={"terminated": {"exitCode": 1, "reason": "Error", "message": "specdecode serve: cannot start: bad"}})
    quota = case("deployment_quota")["workloads"]
    everything = [*unplaced, *pulling, refusing]
    first = failure(everything, quota)
    assert (first.reason, first.message) == ("RuntimeRefused", runtime_refusal(everything))
    assert failure([*unplaced, *pulling], quota).reason == "FailedCreate"
    assert failure([*unplaced, *pulling], [q for q in quota if q["kind"] == "Service"]).reason == "ImagePullBackOff"
    assert failure(unplaced, quota[1:]).reason == "Unschedulable"


def test_the_first_pod_by_name_is_named_and_the_rest_counted() -> None:
    pods = [case("unschedulable_gpu")["pods"][0] for _ in range(3)]
    for pod, name in zip(pods, ("c", "a", "b")):
        pod["metadata"]["name"] = f"demo-{REVISION}-5d8f7c9b6d-{name}"
    found = failure(pods)
    assert found.message.startswith(f"pod demo-{REVISION}-5d8f7c9b6d-a (revision {REVISION}): unschedulable: 0/3")
    assert found.message.endswith(" (and 2 more pods)")


def test_healthy_or_starting_pods_give_none() -> None:
    template = case("image_pull_back_off")["pods"][0]

    def pod(name: str, state: Obj, **meta: Any) -> Obj:
        made = copy.deepcopy(template)
        made["metadata"].update(name=name, **meta)
        made["status"]["containerStatuses"][0]["state"] = state
        return made
    gated = copy.deepcopy(case("unschedulable_gpu")["pods"][0])  # held back on purpose, not unschedulable
    gated["status"]["conditions"][0].update(reason="SchedulingGated", message="Scheduling is blocked due to "
                                            "non-empty scheduling gates")
    evicted = copy.deepcopy(case("unschedulable_gpu")["pods"][0])
    evicted["status"]["phase"] = "Failed"
    sidecar = pod("f", {"running": {}})  # a sidecar crash-looping is not ours to report
    sidecar["status"]["containerStatuses"].append({"name": "istio-proxy", "state": {"waiting": {
        "reason": "CrashLoopBackOff"}}, "lastState": {"terminated": {"exitCode": 1}}})
    healthy = [pod("a", {"running": {"startedAt": "2026-03-02T09:21:00Z"}}),
               pod("b", {"waiting": {"reason": "ContainerCreating"}}),
               pod("c", {"waiting": {"reason": "PodInitializing"}}),
               pod("d", template["status"]["containerStatuses"][0]["state"], deletionTimestamp="2026-03-02T09:40:00Z"),
               gated, evicted, sidecar]
    assert failure(healthy, case("statefulset_stale_event")["workloads"]) is None
    assert failure([]) is None


def test_every_failed_waiting_reason_is_reported_as_the_kubelet_names_it() -> None:
    template = case("image_pull_back_off")["pods"][0]
    for reason in sorted(FAILED_WAITING):
        pod = copy.deepcopy(template)
        pod["status"]["containerStatuses"][0]["state"] = {"waiting": {"reason": reason, "message": "it says why"}}
        found = failure([pod])
        assert (found.reason, found.message.rsplit(": ", 2)[1:]) == (reason, [reason, "it says why"])
    assert {"ContainerCreating", "PodInitializing", "CrashLoopBackOff"}.isdisjoint(FAILED_WAITING)


def test_the_latest_event_counts_whichever_timestamps_it_carries() -> None:
    found = case("statefulset_pod_security")
    recorded = found["events"][0]  # core/v1 recorder: lastTimestamp 10:52:37Z
    series = {**recorded, "message": "the latest", "firstTimestamp": None, "lastTimestamp": None,
              "eventTime": "2026-03-02T10:30:00.000001Z",  # events.k8s.io: a series, last seen 10:55
              "series": {"count": 4, "lastObservedTime": "2026-03-02T10:55:00.123456Z"}}
    bare = {**recorded, "message": "no times", "firstTimestamp": None, "lastTimestamp": "yesterday",
            "metadata": {"name": "x", "creationTimestamp": "2026-03-02T10:00:00Z"}}
    for events in ([recorded, series, bare], [bare, series, recorded]):
        assert failure(found["pods"], found["workloads"], events).message.endswith(": the latest")
    assert failure(found["pods"], found["workloads"], [bare]).message.endswith(": no times")
