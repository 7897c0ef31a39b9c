"""capacity: the replica arithmetic of a rollout. Pure.

A rollout moves replicas between revisions one move at a time, each move as far as the rollout's
``maxSurge`` and ``maxUnavailable`` allow given the replicas observed ready:

- The budget: all revisions together never set more than ``replicas + maxSurge`` replicas.
- The floor: ready replicas never fall below ``replicas − maxUnavailable`` through the move (a
  rollout), or below ``replicas`` when a spare replica exists (``maxSurge`` > 0) while a revision
  is *retired* — rolled back, aborted, or replaced by a newer edit: a retired revision keeps
  serving and shrinks only as the replicas replacing it turn ready. Without a surge the floor is
  ``replicas − maxUnavailable`` there too, and with ``replicas: 1`` that is 0: the retired
  replica goes before its replacement is ready (``cuts_over``).
- Unready replicas may always go (they serve nothing; a Deployment removes unready pods first).
  Ready ones go while the floor holds — retired revisions' first (oldest first), then the
  canary's, then the stable's. Then revisions grow, the stable first, into what the budget frees.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from specdecode.operator.spec import IntOrString, SpecDecodeDeploymentSpec


def _count(value: IntOrString, replicas: int, *, round_up: bool) -> int:
    if isinstance(value, int):
        return value
    share = int(value.rstrip("%")) * replicas
    return -(-share // 100) if round_up else share // 100


def max_surge(spec: SpecDecodeDeploymentSpec) -> int:
    """Extra replicas allowed during a rollout (a percentage rounds up, as in a Deployment)."""
    return _count(spec.rollout.max_surge, spec.replicas, round_up=True)


def max_unavailable(spec: SpecDecodeDeploymentSpec) -> int:
    """Replicas that may be unready during a rollout (a percentage rounds down; never 0 together
    with a surge of 0, or nothing could move)."""
    count = min(_count(spec.rollout.max_unavailable, spec.replicas, round_up=False), spec.replicas)
    return max(count, 1) if max_surge(spec) == 0 else count


def floor(spec: SpecDecodeDeploymentSpec, *, retiring: bool) -> int:
    """Ready replicas a move keeps (of those ready before it): see the module docstring."""
    if retiring and max_surge(spec) > 0:
        return spec.replicas
    return spec.replicas - max_unavailable(spec)


def cuts_over(spec: SpecDecodeDeploymentSpec) -> bool:
    """Whether retiring a revision takes its ready replicas down before their replacements are
    ready: no spare replica, and none that may be unavailable beyond the one (``replicas: 1``)."""
    return max_surge(spec) == 0 and floor(spec, retiring=True) <= 0 < spec.replicas


@dataclass(frozen=True)
class Replicas:
    """Replicas of the stable and of the canary revision."""

    stable: int
    canary: int


def step_replicas(spec: SpecDecodeDeploymentSpec, weight: int) -> Replicas:
    """The target of a step of ``weight`` percent: the canary's share rounded up, the stable what
    keeps the total within replicas + maxSurge."""
    total = spec.replicas
    canary = -(-weight * total // 100)
    return Replicas(stable=max(0, min(total, total + max_surge(spec) - canary)), canary=canary)


def next_move(spec: SpecDecodeDeploymentSpec, current: Mapping[str, int], target: Mapping[str, int],
              ready: Mapping[str, int], *, retiring: bool) -> dict[str, int]:
    """One move from ``current`` towards ``target`` replicas per revision. Both list the same
    revisions in the order they grow — the stable, the canary, then retired ones (target 0),
    newest first — and shrink in the reverse order. ``ready``: ready replicas per revision, as
    observed; ``retiring``: whether a retired revision is among them (the floor)."""
    serving = {rev: min(ready.get(rev, 0), n) for rev, n in current.items()}
    spare = sum(serving.values()) - floor(spec, retiring=retiring)  # ready replicas that may go
    move = dict(current)
    for rev in reversed(list(current)):
        if current[rev] <= target[rev]:
            continue
        keep = max(target[rev], serving[rev])  # the unready ones go
        ready_going = min(keep - target[rev], max(spare, 0))
        spare -= ready_going
        move[rev] = keep - ready_going
    free = spec.replicas + max_surge(spec) - sum(move.values())
    for rev in current:
        grow = min(max(target[rev] - move[rev], 0), max(free, 0))
        move[rev] += grow
        free -= grow
    return move
