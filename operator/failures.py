"""failures: why a resource's runtime pods never come, read from what the API server lists.

A runtime that refuses to start exits, and ``pods.runtime_refusal`` reads its termination
message. Other failures make no container exit; each shows in one place only:

- FailedCreate: pods never created, because an admission plugin (PodSecurity) or a ResourceQuota
  forbids them. A Deployment says so in its ``ReplicaFailure`` condition (copied from its
  ReplicaSet's); a StatefulSet only in core/v1 Events (reason ``FailedCreate``) about itself, those
  a LeaderWorkerSet makes included: its leaders' StatefulSet, named like it, and one StatefulSet of
  workers per group, ``<name>-<group>``.
- A container waiting on something that will not come by retrying: its image (``ImagePullBackOff``,
  ``ErrImagePull``, ``InvalidImageName``…) or what it is made of (``CreateContainerConfigError``:
  a Secret or ConfigMap it names is missing; ``CreateContainerError``).
- ``Unschedulable``: no node can take the pod (e.g. none has enough free nvidia.com/gpu).

``failure`` reports the first kind found, in that order after a refusal: pods that cannot be
created have nothing else to say, and a pod may wait for a node that an autoscaler is adding.

No I/O: ``controller`` lists the pods, the workloads and the Events.
"""
from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime

from specdecode.operator.pods import (
    UNSCHEDULABLE,
    Holdup,
    Obj,
    alive,
    condition,
    first,
    line,
    named,
    present,
    revision_of,
    runtime_refusal,
    unscheduled,
    waiting,
)

RUNTIME_REFUSED = "RuntimeRefused"
FAILED_CREATE = "FailedCreate"  # the ReplicaSet's and the StatefulSet controller's reason
# Waiting reasons that are failures (pkg/kubelet/images/types.go, pkg/kubelet/container/sync_result.go):
# the kubelet retries them, but they clear only once someone fixes the image or the config. A start
# (ContainerCreating, PodInitializing) is none; CrashLoopBackOff follows an exit: of our container it
# is a refusal already, of a sidecar not ours to report.
FAILED_WAITING = frozenset({
    "ErrImagePull", "ImagePullBackOff", "InvalidImageName", "ErrImageNeverPull", "ImageInspectError",
    "RegistryUnavailable", "SignatureValidationFailed", "CreateContainerConfigError", "CreateContainerError"})
_LONG_AGO = datetime.min.replace(tzinfo=UTC)


@dataclass(frozen=True)
class Failure:
    """Why a resource's runtime pods never come, for a status condition."""

    reason: str  # CamelCase: RuntimeRefused, FailedCreate, or the kubelet's or scheduler's (ImagePullBackOff…)
    message: str  # one line: what failed and the first one's message, "(and N more …)"


def failure(pods: Sequence[Obj], workloads: Sequence[Obj] = (), events: Sequence[Obj] = ()) -> Failure | None:
    """The first failure found among a resource's runtime ``pods``, its ``workloads`` (its children
    as listed: Deployments, StatefulSets, LeaderWorkerSets; other kinds are passed over) and the
    core/v1 ``events`` of its namespace (those about other objects are passed over): a refusal, a
    workload that cannot create pods, a container waiting on a failure, an unschedulable pod.
    None while pods are healthy or merely on their way."""
    if refusal := runtime_refusal(pods):
        return Failure(RUNTIME_REFUSED, refusal)
    if uncreated := first(_failed_creates(pods, workloads, events), "workloads"):
        return Failure(FAILED_CREATE, uncreated)
    return _held(pods, _failed_waiting) or _held(pods, _unschedulable)


def told_by_events(workloads: Sequence[Obj]) -> bool:
    """Whether ``failure`` may need the namespace's Events: a StatefulSet or a LeaderWorkerSet
    (whose StatefulSets tell their failures in Events only) has fewer ready replicas than it wants."""
    return any(w.get("kind") in ("StatefulSet", "LeaderWorkerSet")
               and ((w.get("status") or {}).get("readyReplicas") or 0) < (w.get("spec") or {}).get("replicas", 1)
               for w in present(workloads))


def _failed_creates(pods: Sequence[Obj], workloads: Sequence[Obj], events: Sequence[Obj]) -> list[str]:
    """One line per StatefulSet or Deployment that cannot create its pods, workloads by name."""
    listed = {w["metadata"]["name"] for w in workloads if w.get("kind") == "StatefulSet"}
    return [text for workload in present(workloads) for text in _workload_failures(workload, pods, listed, events)]


def _workload_failures(workload: Obj, pods: Sequence[Obj], listed: set[str], events: Sequence[Obj]) -> list[str]:
    kind = workload.get("kind")
    if kind == "Deployment":
        return _replica_failure(workload)
    if kind == "StatefulSet":
        return _statefulset_failure(workload, events)
    if kind == "LeaderWorkerSet":
        return _leader_worker_set_failures(workload, pods, listed, events)
    return []  # Services, PodDisruptionBudgets…: they create no pods


def _replica_failure(deployment: Obj) -> list[str]:
    """A Deployment's ReplicaFailure: its ReplicaSet could not create a pod, in the API server's
    words ('pods "…" is forbidden: exceeded quota: …'). The controller drops it once a create works."""
    failed = condition(deployment, "ReplicaFailure")
    if failed.get("status") != "True" or failed.get("reason") != FAILED_CREATE:
        return []
    return [f"{_named(deployment)}: {line(failed.get('message') or 'no message')}"]


def _statefulset_failure(statefulset: Obj, events: Sequence[Obj]) -> list[str]:
    """The latest FailedCreate event about a StatefulSet while it is short of pods (status.replicas
    < spec.replicas): Events outlive the failure (an hour, by default), a StatefulSet's status does not."""
    meta, want = statefulset["metadata"], (statefulset.get("spec") or {}).get("replicas", 1)
    if ((statefulset.get("status") or {}).get("replicas") or 0) >= want:
        return []
    event = _latest_failed_create(events, meta["name"], meta.get("uid"))
    return [f"{_named(statefulset)}: {line(event.get('message') or 'no message')}"] if event else []


def _leader_worker_set_failures(lws: Obj, pods: Sequence[Obj], listed: set[str], events: Sequence[Obj]) -> list[str]:
    """The latest FailedCreate event about each StatefulSet a LeaderWorkerSet makes, while it is
    short of pods: the leaders' (named like it; pods ``<name>-<group>``, one per group) and each
    group's workers' (``<name>-<group>``; pods ``<name>-<group>-<worker>``, size - 1 of them). Those
    the workloads list (LeaderWorkerSet releases that copy its labels onto them) are read as
    StatefulSets instead."""
    name, spec = lws["metadata"]["name"], lws.get("spec") or {}
    replicas, size = spec.get("replicas", 1), (spec.get("leaderWorkerTemplate") or {}).get("size", 1)
    wanted = {name: replicas, **{f"{name}-{group}": size - 1 for group in range(replicas)}}
    short = [sts for sts, want in wanted.items() if sts not in listed and _statefulset_pods(pods, sts) < want]
    return [f"StatefulSet {sts} of {_named(lws)}: {line(event.get('message') or 'no message')}"
            for sts in short if (event := _latest_failed_create(events, sts))]


def _statefulset_pods(pods: Sequence[Obj], statefulset: str) -> int:
    """How many pods StatefulSet ``statefulset`` has: they are named ``<statefulset>-<ordinal>``."""
    own = re.compile(re.escape(statefulset) + r"-\d+")
    return sum(1 for pod in pods if own.fullmatch(pod["metadata"]["name"]))


def _latest_failed_create(events: Sequence[Obj], statefulset: str, uid: str | None = None) -> Obj | None:
    """The latest FailedCreate Warning about StatefulSet ``statefulset``; when both know its ``uid``,
    only about this one (a StatefulSet of the same name before it leaves its Events behind)."""
    about = [event for event in events if event.get("reason") == FAILED_CREATE and event.get("type") == "Warning"
             and _about(event.get("involvedObject") or {}, statefulset, uid)]
    return max(about, key=_last_seen, default=None)


def _about(involved: Obj, statefulset: str, uid: str | None) -> bool:
    same_uid = not uid or not involved.get("uid") or involved["uid"] == uid
    return involved.get("kind") == "StatefulSet" and involved.get("name") == statefulset and same_uid


def _last_seen(event: Obj) -> datetime:
    """When an Event last happened. Those of the core/v1 recorder carry first/lastTimestamp (and a
    count), eventTime null; those written through events.k8s.io carry eventTime and, once repeated,
    series.lastObservedTime, first/lastTimestamp null. The latest of whichever are set."""
    stamps = ((event.get("series") or {}).get("lastObservedTime"), event.get("lastTimestamp"), event.get("eventTime"),
              event.get("firstTimestamp"), (event.get("metadata") or {}).get("creationTimestamp"))
    return max(map(_time, stamps))


def _time(stamp: object) -> datetime:
    """An RFC 3339 time as the API server writes it ("…T10:00:00Z", a MicroTime "…T10:00:00.123456Z");
    long ago for null or anything else."""
    if not isinstance(stamp, str):
        return _LONG_AGO
    try:
        parsed = datetime.fromisoformat(stamp)
    except ValueError:
        return _LONG_AGO
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)


def _named(workload: Obj) -> str:
    """How a condition message names a workload: 'StatefulSet demo-3f2a-0 (revision 3f2a)'."""
    return f"{workload.get('kind')} {workload['metadata']['name']} (revision {revision_of(workload) or '?'})"


def _held(pods: Sequence[Obj], holdup: Callable[[Obj], Holdup | None]) -> Failure | None:
    """The first pod (by name) that ``holdup`` finds held back, with its reason, and how many more are."""
    held = [(pod, found) for pod in alive(pods) if (found := holdup(pod))]
    message = first([f"{named(pod)}: {found.text}" for pod, found in held], "pods")
    return Failure(held[0][1].reason, message) if message else None


def _failed_waiting(pod: Obj) -> Holdup | None:
    return next((holdup for holdup in waiting(pod) if holdup.reason in FAILED_WAITING), None)


def _unschedulable(pod: Obj) -> Holdup | None:
    verdict = unscheduled(pod)
    return verdict if verdict is not None and verdict.reason == UNSCHEDULABLE else None
