"""group_restart: a StatefulSet group whose member started again is started again whole.

A multi-pod replica is one torch.distributed group. A rank that starts again (its container
restarted, or its pod replaced) cannot rejoin the group the other ranks still hold, and they cannot
take it in: the group forms again only when all its ranks start together. A LeaderWorkerSet does
that itself (``RecreateGroupOnPodRestart``); for a StatefulSet group the operator does it:

- whenever every pod of the group is Ready (as many as the StatefulSet's ``spec.replicas``), its
  *members* (pod name → uid and the runtime container's ``restartCount``) are recorded in the
  StatefulSet's ``names.ANNOTATION_GROUP_MEMBERS`` annotation;
- a recorded pod that *started again* (a higher restartCount, or a new uid under its name) while
  another still runs as recorded (a *survivor*) restarts the group: every pod of the StatefulSet
  is deleted, and the StatefulSet controller makes them all again.

A group with no survivor needs nothing: every rank in it is new and the group forms as it first
did. So a group without a record (forming at its first start) is never restarted, and a restart
deletes each pod once: its pods are then being deleted or new. Pods being deleted or in a terminal
phase are not members. LeaderWorkerSets restart their own groups, Deployments run single-pod
replicas: neither is looked at.

No I/O; ``controller`` writes the record and deletes the pods.
"""
from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from specdecode.operator import names
from specdecode.operator.pods import alive, is_ready, present
from specdecode.operator.rollout import Event, EventType

Obj = dict[str, Any]
GROUP_RESTARTED = "GroupRestarted"  # the Event's reason


@dataclass(frozen=True)
class Member:
    uid: str
    restarts: int  # the runtime container's restartCount


@dataclass(frozen=True)
class GroupChange:
    """What one StatefulSet group needs: its members recorded, or a restart (``delete``)."""

    group: Obj  # the StatefulSet, as listed
    record: Mapping[str, Member] | None = None  # to store in the annotation
    delete: tuple[Obj, ...] = ()  # every pod of the group, for a restart
    started_again: str = ""  # which member started again, and how


def group_changes(children: Sequence[Obj], pods: Sequence[Obj]) -> list[GroupChange]:
    """The change each StatefulSet among ``children`` needs, given the runtime ``pods``."""
    changes = (group_change(sts, pods_of(sts, pods)) for sts in present(children) if sts["kind"] == "StatefulSet")
    return [change for change in changes if change is not None]


def group_change(group: Obj, pods: Sequence[Obj]) -> GroupChange | None:
    """The change ``group`` needs (None: none), given its pods (``pods_of``)."""
    recorded, current = recorded_members(group), members(pods)
    started_again = _started_again(recorded, current)
    if started_again is not None and any(current.get(name) == member for name, member in recorded.items()):
        return GroupChange(group, delete=tuple(pods), started_again=started_again)
    if _whole(group, pods) and current != recorded:
        return GroupChange(group, record=current)
    return None


def pods_of(group: Obj, pods: Sequence[Obj]) -> list[Obj]:
    """The pods of ``pods`` that the StatefulSet ``group`` selects, neither deleted nor terminated, by name."""
    selector = group["spec"]["selector"]["matchLabels"].items()
    return [pod for pod in alive(pods) if selector <= (pod["metadata"].get("labels") or {}).items()]


def members(pods: Sequence[Obj]) -> dict[str, Member]:
    return {pod["metadata"]["name"]: Member(pod["metadata"]["uid"], _restarts(pod)) for pod in pods}


def recorded_members(group: Obj) -> dict[str, Member]:
    """The members recorded on ``group``; none if there is no record, or one no longer readable
    (edited by hand): the next time all its pods are Ready records them anew."""
    text = (group["metadata"].get("annotations") or {}).get(names.ANNOTATION_GROUP_MEMBERS)
    try:
        return {name: Member(m["uid"], m["restartCount"]) for name, m in json.loads(text or "{}").items()}
    except (ValueError, TypeError, KeyError, AttributeError):
        return {}


def record_patch(group: Obj, record: Mapping[str, Member]) -> Obj:
    """The merge patch storing ``record`` on the StatefulSet ``group``."""
    meta = group["metadata"]
    value = {name: {"uid": m.uid, "restartCount": m.restarts} for name, m in sorted(record.items())}
    annotations = {names.ANNOTATION_GROUP_MEMBERS: json.dumps(value, separators=(",", ":"))}
    return {"apiVersion": group["apiVersion"], "kind": group["kind"],
            "metadata": {"name": meta["name"], "namespace": meta["namespace"], "annotations": annotations}}


def restart_event(change: GroupChange) -> Event:
    return Event(EventType.NORMAL, GROUP_RESTARTED,
                 f"StatefulSet {change.group['metadata']['name']}: {change.started_again}; its {len(change.delete)} "
                 "pods deleted so that the group starts again whole")


def _started_again(recorded: Mapping[str, Member], current: Mapping[str, Member]) -> str | None:
    """How the first recorded member (by name) that started again did so; None if none did (a
    member not listed now is on its way out or back: its replacement tells)."""
    for name, was in sorted(recorded.items()):
        now = current.get(name)
        if now is not None and now.uid != was.uid:
            return f"pod {name} was replaced"
        if now is not None and now.restarts > was.restarts:
            return f"pod {name} restarted (restart {now.restarts})"
    return None


def _whole(group: Obj, pods: Sequence[Obj]) -> bool:
    """Whether every pod of ``group`` exists and is Ready."""
    want = group["spec"].get("replicas", 1)
    return want > 0 and len(pods) == want and all(map(is_ready, pods))


def _restarts(pod: Obj) -> int:
    statuses = (pod.get("status") or {}).get("containerStatuses") or []
    return next((c.get("restartCount", 0) for c in statuses if c.get("name") == names.CONTAINER), 0)
