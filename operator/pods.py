"""pods: why runtime pods do not serve, read from pods as the API server returns them.

- ``runtime_refusal``: why a runtime pod will not start at all (its termination message), as
  ``rollout.advance`` takes it.
- ``not_ready_reason``: why the pods of one revision are not Ready, one line for a condition
  message: a refusal as above, else a container waiting for something other than its start
  (``CrashLoopBackOff``, ``ImagePullBackOff``, ``CreateContainerConfigError``…), else the
  scheduler's verdict, else the phase (a running pod still loading its model).
- ``is_ready``: a pod's ``Ready`` condition.

The readers under them (``waiting``, ``unscheduled``, ``alive``, ``named``, ``first``…) are public for
``failures``, which picks the failures among what holds pods back.

Pods being deleted are ignored: they are on their way out and say nothing about what replaces them.

No I/O; ``controller`` lists the pods.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from specdecode.operator import names
from specdecode.operator.sources import SOURCES

Obj = dict[str, Any]
# Containers whose non-zero exit is a refusal to serve: the runtime, and the fetch of an hf:// source.
_OURS = (names.CONTAINER, *(source.fetch_container for source in SOURCES))
MAX_REFUSAL_CHARS = 400  # of the termination message (or any other message), in a condition message
_STARTING = frozenset({"ContainerCreating", "PodInitializing"})  # a container waiting on its way up
# A pod in a terminal phase (evicted, its node shut down) no longer runs: its controller has replaced it.
_TERMINAL = frozenset({"Succeeded", "Failed"})
UNSCHEDULABLE = "Unschedulable"  # the scheduler's reason for a pod no node can take (PodScheduled=False)


@dataclass(frozen=True)
class Holdup:
    """What holds a pod back, short of a refusal: the kubelet's or the scheduler's reason
    (``ImagePullBackOff``, ``Unschedulable``, ``SchedulingGated``…) and one line saying so."""

    reason: str
    text: str  # e.g. 'container runtime waiting: ErrImagePull: rpc error: …', 'unschedulable: 0/3 nodes…'


def runtime_refusal(pods: Sequence[Obj]) -> str | None:
    """Why runtime pods will not start, or None: the termination message of the first (by name) of
    our containers that exited non-zero and is not running again (terminated, or waiting to
    restart: CrashLoopBackOff). The runtime writes one line; a log tail (terminationMessagePolicy
    FallbackToLogsOnError) counts by its last line, where a traceback names the error."""
    refusals = [f"{named(pod)}: {refusal}" for pod in present(pods) if (refusal := _pod_refusal(pod))]
    return first(refusals, "pods")


def not_ready_reason(pods: Sequence[Obj], revision: str) -> str | None:
    """Why pods of ``revision`` are not Ready, one line for a condition message: the reason of the
    first not-ready pod by name, and how many more there are; None when every one is ready (or
    there are none). Pods in a terminal phase are left out, as their controller leaves them out."""
    reasons = [f"pod {pod['metadata']['name']}: {_not_ready(pod)}" for pod in alive(pods)
               if revision_of(pod) == revision and not is_ready(pod)]
    return first(reasons, "pods not ready")


def is_ready(pod: Obj) -> bool:
    """Whether ``pod`` is Ready: every container passed its readiness probe (the model is loaded)."""
    return condition(pod, "Ready").get("status") == "True"


def waiting(pod: Obj) -> list[Holdup]:
    """The containers (init containers first) waiting for more than their own start."""
    holdups = []
    for container in _containers(pod):
        state = (container.get("state") or {}).get("waiting") or {}
        reason, message = state.get("reason"), state.get("message")
        if reason and reason not in _STARTING:
            said = f": {line(message)}" if message else ""
            holdups.append(Holdup(reason, f"container {container.get('name')} waiting: {reason}{said}"))
    return holdups


def unscheduled(pod: Obj) -> Holdup | None:
    """The scheduler's verdict on a pod it could not place (e.g. "0/3 nodes are available: 3
    Insufficient nvidia.com/gpu."), or on one held back (SchedulingGated); None once placed."""
    scheduled = condition(pod, "PodScheduled")
    if scheduled.get("status") != "False":
        return None
    reason, message = scheduled.get("reason") or UNSCHEDULABLE, line(scheduled.get("message") or "no message")
    if reason == UNSCHEDULABLE:
        return Holdup(reason, f"unschedulable: {message}")
    return Holdup(reason, f"not scheduled: {reason}: {message}")


def alive(pods: Sequence[Obj]) -> list[Obj]:
    """The pods neither being deleted nor in a terminal phase, by name: those that may yet serve."""
    return [pod for pod in present(pods) if _status(pod).get("phase") not in _TERMINAL]


def present(objs: Sequence[Obj]) -> list[Obj]:
    """The objects (pods, workloads) not being deleted, by name."""
    return [obj for obj in sorted(objs, key=lambda o: o["metadata"]["name"])
            if not obj["metadata"].get("deletionTimestamp")]


def named(pod: Obj) -> str:
    """How a condition message names a pod: 'pod demo-3f2a-0 (revision 3f2a)'."""
    return f"pod {pod['metadata']['name']} (revision {revision_of(pod) or '?'})"


def first(lines: list[str], what: str) -> str | None:
    """The first line, and how many more there are; None for none."""
    if not lines:
        return None
    return lines[0] + (f" (and {len(lines) - 1} more {what})" if len(lines) > 1 else "")


def revision_of(obj: Obj) -> str | None:
    """The revision label of a pod or of a workload."""
    return (obj["metadata"].get("labels") or {}).get(names.LABEL_REVISION)


def condition(obj: Obj, type_: str) -> Obj:
    """The status condition of ``type_`` of a pod or a workload, or {}."""
    return next((c for c in _status(obj).get("conditions") or [] if c.get("type") == type_), {})


def line(message: str) -> str:
    """A kubelet's, a controller's or the scheduler's message on one line, cut to fit a condition."""
    return _cut(" ".join(message.split()))


def _not_ready(pod: Obj) -> str:
    """The first reason found: a refusal, a container waiting, the scheduler's verdict, the phase."""
    holdup = next(iter(waiting(pod)), None) or unscheduled(pod)
    return _pod_refusal(pod) or (holdup.text if holdup else _phase(pod))


def _pod_refusal(pod: Obj) -> str | None:
    for container in _containers(pod):
        exited = _failed_exit(container)
        if container.get("name") in _OURS and exited is not None:
            return f"{container['name']} exited with code {exited['exitCode']}: {_said(exited)}"
    return None


def _failed_exit(container: Obj) -> Obj | None:
    """A container status' last termination, if it failed and the container is not running again."""
    state = container.get("state") or {}
    before = (container.get("lastState") or {}).get("terminated") if "waiting" in state else None
    exited = state.get("terminated") or before
    return exited if exited and exited.get("exitCode", 0) != 0 else None


def _said(exited: Obj) -> str:
    """The last line of a termination message (or its reason, e.g. OOMKilled), cut to fit a condition."""
    lines = [text.strip() for text in (exited.get("message") or "").splitlines() if text.strip()]
    return _cut(lines[-1] if lines else exited.get("reason") or "no message")


def _phase(pod: Obj) -> str:
    status = _status(pod)
    phase = status.get("phase") or "Pending"
    if phase == "Running":
        return "running, not ready (model loading or readiness probe failing)"
    inits = status.get("initContainerStatuses") or []
    init = next((c.get("name") for c in inits if "running" in (c.get("state") or {})), None)
    if init is not None:
        return f"{phase.lower()}, not ready yet (init container {init} running)"
    return f"{phase.lower()}, not ready yet"


def _status(obj: Obj) -> Obj:
    return obj.get("status") or {}


def _containers(pod: Obj) -> list[Obj]:
    """Container statuses, init containers first (they run first)."""
    status = _status(pod)
    return [*(status.get("initContainerStatuses") or []), *(status.get("containerStatuses") or [])]


def _cut(text: str) -> str:
    return text if len(text) <= MAX_REFUSAL_CHARS else text[:MAX_REFUSAL_CHARS - 1] + "…"
