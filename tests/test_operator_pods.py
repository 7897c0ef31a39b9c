"""pods: why runtime pods will not start (``runtime_refusal``) or are not ready (``not_ready_reason``),
read from pod objects as the API server returns them."""
from __future__ import annotations

from typing import Any

from specdecode.operator import names
from specdecode.operator.pods import MAX_REFUSAL_CHARS, not_ready_reason, runtime_refusal

Obj = dict[str, Any]


def runtime_pod(name: str, *containers: Obj, init: tuple[Obj, ...] = (), revision: str = "rev1",
                phase: str = "Running", conditions: tuple[Obj, ...] = (), **meta: Any) -> Obj:
    """A pod of ``revision`` with these container statuses and pod conditions."""
    labels = {**names.runtime_pod_labels("demo"), names.LABEL_REVISION: revision}
    status = {"phase": phase, "conditions": list(conditions), "containerStatuses": list(containers),
              "initContainerStatuses": list(init)}
    return {"metadata": {"name": name, "labels": labels, **meta}, "status": status}


def crash_looping(message: str = "", name: str = names.CONTAINER, **terminated: Any) -> Obj:
    return {"name": name, "state": {"waiting": {"reason": "CrashLoopBackOff"}}, "restartCount": 3,
            "lastState": {"terminated": {"exitCode": 1, "reason": "Error", "message": message, **terminated}}}


REFUSED = "specdecode serve: cannot start: /mnt/models/qwen has no MTP layers (looked for mtp.*); set mtpPath"
RUNNING = {"name": names.CONTAINER, "state": {"running": {}}, "ready": True}


def test_a_runtime_refusal_is_its_termination_message() -> None:
    assert runtime_refusal([runtime_pod("demo-rev1-a", crash_looping(REFUSED + "\n"))]) == (
        f"pod demo-rev1-a (revision rev1): runtime exited with code 1: {REFUSED}")
    stopped = {"name": names.CONTAINER, "state": {"terminated": {"exitCode": 2, "message": "invalid configuration"}}}
    assert runtime_refusal([runtime_pod("p", stopped)]).endswith("runtime exited with code 2: invalid configuration")


def test_healthy_starting_or_drained_pods_refuse_nothing() -> None:
    recovered = {**RUNNING, "lastState": crash_looping(REFUSED)["lastState"]}  # crashed once, running now
    creating = {"name": names.CONTAINER, "state": {"waiting": {"reason": "ContainerCreating"}}}
    drained = {"name": names.CONTAINER, "state": {"terminated": {"exitCode": 0, "message": "drained"}}}
    sidecar = crash_looping("proxy down", name="istio-proxy")
    leaving = runtime_pod("old", crash_looping(REFUSED), deletionTimestamp="2026-01-01T00:00:00Z")
    pods = [runtime_pod(n, c) for n, c in (("a", RUNNING), ("b", recovered), ("c", creating), ("d", drained))]
    assert runtime_refusal([*pods, runtime_pod("e", RUNNING, sidecar), leaving, runtime_pod("f")]) is None
    assert runtime_refusal([]) is None


def test_a_log_tail_counts_by_its_last_line_and_long_messages_are_cut() -> None:
    traceback = "Traceback (most recent call last):\n  File \"x.py\", line 1\nRuntimeError: CUDA out of memory\n\n"
    assert runtime_refusal([runtime_pod("p", crash_looping(traceback))]).endswith(": RuntimeError: CUDA out of memory")
    oom = crash_looping(exitCode=137, reason="OOMKilled")
    assert runtime_refusal([runtime_pod("p", oom)]).endswith("runtime exited with code 137: OOMKilled")
    cut = runtime_refusal([runtime_pod("p", crash_looping("x" * 5000))])
    assert cut.endswith("x…") and len(cut.split(": ", 1)[1]) < MAX_REFUSAL_CHARS + 40


def test_a_failed_fetch_counts_and_the_first_pod_by_name_is_named() -> None:
    fetch = crash_looping("huggingface_hub.errors.RepositoryNotFoundError: 404 org/heads", name=names.FETCH_MTP_CONTAINER)
    waiting = {"name": names.CONTAINER, "state": {"waiting": {"reason": "PodInitializing"}}}
    pods = [runtime_pod("demo-rev1-b", crash_looping(REFUSED)), runtime_pod("demo-rev1-a", waiting, init=(fetch,))]
    assert runtime_refusal(pods) == ("pod demo-rev1-a (revision rev1): fetch-mtp exited with code 1: "
                                     "huggingface_hub.errors.RepositoryNotFoundError: 404 org/heads (and 1 more pods)")
    for source in ("fetch-model", "fetch-eagle3"):  # every hf:// source's fetch, each its own container
        pod = runtime_pod("p", waiting, init=(crash_looping("404", name=source),))
        assert runtime_refusal([pod]) == f"pod p (revision rev1): {source} exited with code 1: 404"


# -- not_ready_reason ---------------------------------------------------------------------------


def waiting(reason: str, message: str | None = None, name: str = names.CONTAINER) -> Obj:
    said = {"message": message} if message else {}
    return {"name": name, "ready": False, "state": {"waiting": {"reason": reason, **said}}}


def condition(type_: str, status: str, **more: str) -> Obj:
    return {"type": type_, "status": status, **more}


READY = condition("Ready", "True")
NOT_READY = condition("Ready", "False", reason="ContainersNotReady")
GPU_SHORT = ("0/3 nodes are available: 3 Insufficient nvidia.com/gpu. "
             "preemption: 0/3 nodes are available: 3 No preemption victims found for incoming pod.")
UNSCHEDULABLE = condition("PodScheduled", "False", reason="Unschedulable", message=GPU_SHORT)


def reason(*containers: Obj, **pod: Any) -> str | None:
    """``not_ready_reason`` of one not-ready pod "p" of rev1."""
    return not_ready_reason([runtime_pod("p", *containers, **{"conditions": (NOT_READY,), **pod})], "rev1")


def test_a_refusal_is_the_reason_before_anything_else() -> None:
    sidecar = waiting("ImagePullBackOff", "Back-off pulling image", name="istio-proxy")
    assert reason(sidecar, crash_looping(REFUSED), conditions=(NOT_READY, UNSCHEDULABLE)) == (
        f"pod p: runtime exited with code 1: {REFUSED}")


def test_a_container_waiting_for_more_than_its_start_is_the_reason() -> None:
    pull = waiting("ImagePullBackOff", 'Back-off pulling image "ghcr.io/x/specdecode:v9"')
    assert reason(pull, phase="Pending") == (
        'pod p: container runtime waiting: ImagePullBackOff: Back-off pulling image "ghcr.io/x/specdecode:v9"')
    assert reason(waiting("CreateContainerConfigError", 'secret "hf-token" not found')) == (
        'pod p: container runtime waiting: CreateContainerConfigError: secret "hf-token" not found')
    assert reason(waiting("ErrImagePull")) == "pod p: container runtime waiting: ErrImagePull"
    sidecar = {**waiting("CrashLoopBackOff", "back-off 10s restarting failed container", name="istio-proxy"),
               "lastState": {"terminated": {"exitCode": 1}}}  # not ours: its exit is no refusal, its waiting is
    assert reason(RUNNING, sidecar) == ("pod p: container istio-proxy waiting: CrashLoopBackOff: "
                                        "back-off 10s restarting failed container")


def test_init_containers_are_read_first_and_a_waiting_container_before_the_scheduler() -> None:
    fetch = waiting("ErrImagePull", "rpc error: not found", name=names.FETCH_CONTAINER)
    pods = [runtime_pod("p", waiting("PodInitializing"), waiting("ImagePullBackOff", name="sidecar"), init=(fetch,),
                        phase="Pending", conditions=(UNSCHEDULABLE,))]
    assert not_ready_reason(pods, "rev1") == "pod p: container fetch-model waiting: ErrImagePull: rpc error: not found"


def test_an_unschedulable_pod_says_what_the_scheduler_said() -> None:
    assert reason(phase="Pending", conditions=(UNSCHEDULABLE,)) == f"pod p: unschedulable: {GPU_SHORT}"
    gated = condition("PodScheduled", "False", reason="SchedulingGated",
                      message="Scheduling is blocked due to non-empty scheduling gates")
    assert reason(phase="Pending", conditions=(gated,)) == (
        "pod p: not scheduled: SchedulingGated: Scheduling is blocked due to non-empty scheduling gates")


def test_otherwise_the_phase_says_how_far_the_pod_got() -> None:
    assert reason(RUNNING) == "pod p: running, not ready (model loading or readiness probe failing)"
    assert reason(waiting("ContainerCreating"), phase="Pending") == "pod p: pending, not ready yet"
    fetching = {"name": names.FETCH_CONTAINER, "state": {"running": {}}}
    assert reason(waiting("PodInitializing"), init=(fetching,), phase="Pending") == (
        "pod p: pending, not ready yet (init container fetch-model running)")
    bare = {"metadata": {"name": "p", "labels": {names.LABEL_REVISION: "rev1"}}}  # just created: no status yet
    assert not_ready_reason([bare], "rev1") == "pod p: pending, not ready yet"


def test_ready_leaving_finished_and_other_revisions_pods_are_not_reasons() -> None:
    ready = runtime_pod("a", RUNNING, conditions=(READY,))
    leaving = runtime_pod("b", crash_looping(REFUSED), deletionTimestamp="2026-01-01T00:00:00Z")
    evicted = runtime_pod("c", phase="Failed", conditions=(NOT_READY,))  # replaced by its controller
    other = runtime_pod("d", crash_looping(REFUSED), revision="rev2")
    assert not_ready_reason([ready, leaving, evicted, other], "rev1") is None
    assert not_ready_reason([], "rev1") is None
    assert not_ready_reason([other], "rev2") == f"pod d: runtime exited with code 1: {REFUSED}"


def test_the_first_not_ready_pod_by_name_is_named_and_the_rest_counted() -> None:
    pods = [runtime_pod("c", RUNNING), runtime_pod("a", RUNNING, conditions=(READY,)),
            runtime_pod("b", waiting("ErrImagePull")), runtime_pod("d", phase="Pending", conditions=(UNSCHEDULABLE,))]
    assert not_ready_reason(pods, "rev1") == (
        "pod b: container runtime waiting: ErrImagePull (and 2 more pods not ready)")


def test_long_or_multi_line_messages_are_cut_to_one_line() -> None:
    long = reason(waiting("CreateContainerConfigError", "y" * 5000))
    assert long.endswith("y…") and len(long.rsplit(": ", 1)[1]) == MAX_REFUSAL_CHARS
    assert reason(waiting("RunContainerError", "exec failed:\n  no such file\n")) == (
        "pod p: container runtime waiting: RunContainerError: exec failed: no such file")
    crowded = condition("PodScheduled", "False", reason="Unschedulable", message="z" * 5000)
    assert len(reason(phase="Pending", conditions=(crowded,))) == len("pod p: unschedulable: ") + MAX_REFUSAL_CHARS
