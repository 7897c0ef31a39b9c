"""pods: why runtime pods do not serve, read from pods as the API server returns them.

- ``runtime_refusal``: why a runtime pod will not start at all (its termination message), as
  ``rollout.advance`` takes it.
- ``not_ready_reason``: why the pods of one revision are not Ready, one line for a condition
  message: a refusal as above, else a container waiting for something other than its start
  (``CrashLoopBackOff``, ``ImagePullBackOff``, ``CreateContainerConfigError``…), else the
  scheduler's verdict, else the phase (a running pod still loading its model).
- ``is_ready``: a pod's ``Ready`` condition.

Pods being deleted are ignored: they are on their way out and say nothing about what replaces them.

No I/O; ``controller`` lists the pods.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from specdecode.operator import names

Obj = dict[str, Any]
# Containers whose non-zero exit is a refusal to serve: the runtime, and the fetch of an hf:// source.
_OURS = (names.CONTAINER, names.FETCH_CONTAINER, names.FETCH_MTP_CONTAINER)
MAX_REFUSAL_CHARS = 400  # of the termination message (or any other message), in a condition message
_STARTING = frozenset({"ContainerCreating", "PodInitializing"})  # a container waiting on its way up
# A pod in a terminal phase (evicted, its node shut down) no longer runs: its controller has replaced it.
_TERMINAL = frozenset({"Succeeded", "Failed"})


def runtime_refusal(pods: Sequence[Obj]) -> str | None:
    """Why runtime pods will not start, or None: the termination message of the first (by name) of
    our containers that exited non-zero and is not running again (terminated, or waiting to
    restart: CrashLoopBackOff). The runtime writes one line; a log tail (terminationMessagePolicy
    FallbackToLogsOnError) counts by its last line, where a traceback names the error."""
    refusals = [f"pod {pod['metadata']['name']} (revision {_revision(pod) or '?'}): {refusal}"
                for pod in _present(pods) if (refusal := _pod_refusal(pod))]
    return _first(refusals, "pods")


def not_ready_reason(pods: Sequence[Obj], revision: str) -> str | None:
    """Why pods of ``revision`` are not Ready, one line for a condition message: the reason of the
    first not-ready pod by name, and how many more there are; None when every one is ready (or
    there are none). Pods in a terminal phase are left out, as their controller leaves them out."""
    reasons = [f"pod {pod['metadata']['name']}: {_not_ready(pod)}" for pod in _present(pods)
               if _revision(pod) == revision and not is_ready(pod) and _status(pod).get("phase") not in _TERMINAL]
    return _first(reasons, "pods not ready")


def is_ready(pod: Obj) -> bool:
    """Whether ``pod`` is Ready: every container passed its readiness probe (the model is loaded)."""
    return _condition(pod, "Ready").get("status") == "True"


def _not_ready(pod: Obj) -> str:
    """The first reason found: a refusal, a container waiting, the scheduler's verdict, the phase."""
    return _pod_refusal(pod) or _waiting(pod) or _unscheduled(pod) or _phase(pod)


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
    lines = [line.strip() for line in (exited.get("message") or "").splitlines() if line.strip()]
    return _cut(lines[-1] if lines else exited.get("reason") or "no message")


def _waiting(pod: Obj) -> str | None:
    """The first container (init containers first) waiting for more than its own start."""
    for container in _containers(pod):
        waiting = (container.get("state") or {}).get("waiting") or {}
        reason, message = waiting.get("reason"), waiting.get("message")
        if reason and reason not in _STARTING:
            return f"container {container.get('name')} waiting: {reason}" + (f": {_line(message)}" if message else "")
    return None


def _unscheduled(pod: Obj) -> str | None:
    """The scheduler's verdict on a pod it could not place (e.g. "0/3 nodes are available: 3
    Insufficient nvidia.com/gpu."), or on one held back (SchedulingGated)."""
    scheduled = _condition(pod, "PodScheduled")
    if scheduled.get("status") != "False":
        return None
    reason, message = scheduled.get("reason") or "Unschedulable", _line(scheduled.get("message") or "no message")
    return f"unschedulable: {message}" if reason == "Unschedulable" else f"not scheduled: {reason}: {message}"


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


def _present(pods: Sequence[Obj]) -> list[Obj]:
    """The pods not being deleted, by name."""
    return [pod for pod in sorted(pods, key=lambda p: p["metadata"]["name"])
            if not pod["metadata"].get("deletionTimestamp")]


def _first(lines: list[str], what: str) -> str | None:
    """The first line, and how many more there are; None for none."""
    if not lines:
        return None
    return lines[0] + (f" (and {len(lines) - 1} more {what})" if len(lines) > 1 else "")


def _status(pod: Obj) -> Obj:
    return pod.get("status") or {}


def _revision(pod: Obj) -> str | None:
    return (pod["metadata"].get("labels") or {}).get(names.LABEL_REVISION)


def _containers(pod: Obj) -> list[Obj]:
    """Container statuses, init containers first (they run first)."""
    status = _status(pod)
    return [*(status.get("initContainerStatuses") or []), *(status.get("containerStatuses") or [])]


def _condition(pod: Obj, type_: str) -> Obj:
    return next((c for c in _status(pod).get("conditions") or [] if c.get("type") == type_), {})


def _line(message: str) -> str:
    """A kubelet's or the scheduler's message on one line, cut to fit a condition."""
    return _cut(" ".join(message.split()))


def _cut(text: str) -> str:
    return text if len(text) <= MAX_REFUSAL_CHARS else text[:MAX_REFUSAL_CHARS - 1] + "…"
