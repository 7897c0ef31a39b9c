"""The capacity invariant of the rollout core, against a simulated cluster (``Fleet``): a replica
turns ready some time after it is set, a scale-down removes unready replicas first (as a
Deployment does), replicas crash and come back. Rollbacks, aborts and edits at the full step keep
the capacity; one replica without a surge cuts over with a Warning; and random sequences of edits,
commands, verdicts, crashes, operator restarts and time passing keep, at every move, ready
replicas ≥ min(ready before, replicas − maxUnavailable) — ≥ min(ready before, replicas) while a
retired revision shrinks with a surge — and every count within 0 … replicas + maxSurge."""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from specdecode.operator.analysis import Measurement, MetricSnapshot, judge
from specdecode.operator.capacity import max_surge, max_unavailable
from specdecode.operator.rollout import Command, Transition, advance, weight_in_effect
from specdecode.operator.spec import RolloutPhase, SpecDecodeDeploymentSpec, SpecDecodeDeploymentStatus

T0 = datetime(2025, 3, 1, 12, 0, tzinfo=UTC)
INTERVAL = timedelta(seconds=30)
LOAD = timedelta(seconds=30)  # a new replica is ready one interval after it is set
VERDICTS = {"pass": MetricSnapshot(drafts=100, draft_tokens=400, accepted_tokens=300, successes={"stop": 20}),
            "fail": MetricSnapshot(drafts=100, draft_tokens=400, accepted_tokens=40, successes={"stop": 20}),
            "idle": MetricSnapshot()}


def make_spec(replicas: int, **rollout: Any) -> SpecDecodeDeploymentSpec:
    analysis = {"interval": "30s", "window": "1m", "minAcceptanceRate": 0.5, "failureLimit": 2, "inconclusiveLimit": 2}
    body = {"model": {"uri": "smollm2-135m"}, "image": "specdecode/runtime:test", "replicas": replicas,
            "speculative": {"method": "ngram"}, "rollout": {"analysis": analysis, **rollout}}
    return SpecDecodeDeploymentSpec.model_validate(body, by_alias=True)


@dataclass
class Fleet:
    """Each revision's replicas as when each turns ready (None: crashed, restarting)."""

    pods: dict[str, list[datetime | None]] = field(default_factory=dict)

    def ready(self, now: datetime) -> dict[str, int]:
        return {rev: sum(1 for at in pods if at is not None and at <= now) for rev, pods in self.pods.items()}

    def apply(self, replicas: dict[str, int], now: datetime) -> None:
        """Scale every revision to ``replicas`` (absent: deleted), unready replicas going first."""
        for rev in set(self.pods) | set(replicas):
            want, pods = replicas.get(rev, 0), self.pods.get(rev, [])
            ready_first = sorted(pods, key=lambda at: (at is None or at > now, at or now))
            self.pods[rev] = ready_first[:want] + [now + LOAD] * (want - len(pods))
        self.pods = {rev: pods for rev, pods in self.pods.items() if rev in replicas}

    def crash(self, rng: random.Random, now: datetime) -> None:
        ready = [(rev, i) for rev, pods in self.pods.items() for i, at in enumerate(pods) if at is not None and at <= now]
        if ready:
            rev, i = rng.choice(ready)
            self.pods[rev][i] = None

    def restart_crashed(self, now: datetime) -> None:
        for pods in self.pods.values():
            pods[:] = [now + LOAD if at is None else at for at in pods]


def serving(fleet: Fleet, now: datetime) -> int:
    return sum(fleet.ready(now).values())


@dataclass
class Shell:
    """Drives ``advance`` as the operator does, against a ``Fleet``."""

    spec: SpecDecodeDeploymentSpec
    fleet: Fleet = field(default_factory=Fleet)
    status: SpecDecodeDeploymentStatus = field(default_factory=SpecDecodeDeploymentStatus)
    now: datetime = T0

    def tick(self, desired: str, **given: Any) -> Transition:
        t = advance(self.status, desired, self.spec, now=self.now, ready=self.fleet.ready(self.now), **given)
        self.fleet.apply(t.replicas, self.now)
        self.status = weight_in_effect(t.status, t.status.rollout.canary_weight, self.spec, self.now)
        self.now += INTERVAL
        return t


def kinds(t: Transition) -> list[str]:
    return [e.reason for e in t.events]


def at_full_step(shell: Shell) -> None:
    """rev1 stable, rev2 canary at its (only) 100 % step, reached."""
    while shell.status.stable_revision is None or serving(shell.fleet, shell.now) < shell.spec.replicas:
        shell.tick("rev1")
    while shell.status.rollout.step_started_at is None:
        shell.tick("rev2")


@pytest.mark.parametrize("surge, kept", [(0, 3), (1, 4)])
@pytest.mark.parametrize("event", ["abort", "edit", "cancel"])
def test_leaving_the_full_step_keeps_the_capacity(event: str, surge: int, kept: int) -> None:
    """At 100 % the canary holds every replica (the stable none without a surge). Rolled back,
    replaced or cancelled, it gives them up only as the stable's turn ready."""
    shell = Shell(make_spec(4, maxSurge=surge, steps=[{"weight": 100}]))
    at_full_step(shell)
    before = serving(shell.fleet, shell.now)
    desired, given = {"abort": ("rev2", {"commands": {Command.ABORT: "a1"}}), "edit": ("rev3", {}),
                      "cancel": ("rev1", {})}[event]
    t = shell.tick(desired, **given)
    assert t.status.rollout.retiring[0].revision == "rev2"
    while t.status.rollout.retiring:
        assert serving(shell.fleet, shell.now - INTERVAL) >= min(before, kept)
        t = shell.tick(desired)
    assert t.replicas.get("rev1") == 4 or event == "edit"
    assert "rev2" not in t.replicas and "NoSpareReplica" not in kinds(t)


def test_one_replica_without_a_surge_cuts_over_with_a_warning() -> None:
    shell = Shell(make_spec(1, steps=[{"weight": 100}]))
    at_full_step(shell)
    t = shell.tick("rev2", commands={Command.ABORT: "a1"})
    (warning,) = [e for e in t.events if e.reason == "NoSpareReplica"]
    assert warning.type.value == "Warning" and "set rollout.maxSurge: 1" in warning.message
    assert t.replicas == {"rev1": 1} and serving(shell.fleet, shell.now - INTERVAL) == 0
    one_spare = Shell(make_spec(1, maxSurge=1, steps=[{"weight": 100}]))
    at_full_step(one_spare)  # the stable kept its replica beside the canary's
    t = one_spare.tick("rev2", commands={Command.ABORT: "a1"})
    assert t.replicas == {"rev1": 1} and serving(one_spare.fleet, one_spare.now - INTERVAL) == 1
    assert "NoSpareReplica" not in kinds(t)


# -- random sequences ---------------------------------------------------------------------------

SEQUENCES, EVENTS = 12, 60


def _retired_at_move(before: SpecDecodeDeploymentStatus, after: SpecDecodeDeploymentStatus) -> set[str]:
    """The revisions the move of ``before`` → ``after`` was retiring."""
    retired = {old.revision for old in before.rollout.retiring}
    canary = before.canary_revision
    if canary and canary not in (after.canary_revision, after.stable_revision) and before.rollout.canary_replicas:
        retired.add(canary)
    return retired - {after.canary_revision}


class Sequence:
    """One random run: picks events, drives a ``Shell``, checks the invariants after every move."""

    def __init__(self, rng: random.Random, replicas: int, surge: int) -> None:
        steps = rng.choice([[{"weight": 50}, {"weight": 100}], [{"weight": 100}], [{"weight": 25}, {"weight": 100}]])
        routing = {"trafficRouting": {"httpRoute": "gateway"}} if rng.random() < 0.5 else {}
        self.rng, self.revisions = rng, 1
        self.shell = Shell(make_spec(replicas, maxSurge=surge, steps=steps, progressDeadline="3m", **routing))
        self.desired = self.revision(0)
        self.commands: dict[Command, str] = {}

    @staticmethod
    def revision(n: int) -> str:
        return f"{n:010x}"  # a revision's form: commands naming one act on it only

    def event(self) -> dict[str, Any]:
        rng, shell, status = self.rng, self.shell, self.shell.status
        roll = rng.random()
        if roll < 0.12:
            choices = [self.revision(self.revisions), status.stable_revision, status.rollout.rolled_back_revision,
                       *(old.revision for old in status.rollout.retiring)]
            self.desired = rng.choice([c for c in choices if c])
            self.revisions += 1
        elif roll < 0.27:
            command = rng.choice(list(Command))
            self.commands[command] = rng.choice([f"v{rng.randrange(3)}", status.canary_revision or "x", "true"])
        elif roll < 0.33:
            self.commands.pop(rng.choice(list(Command)), None)
        elif roll < 0.43:
            shell.fleet.crash(rng, shell.now)
        elif roll < 0.50:
            shell.fleet.restart_crashed(shell.now)
        elif roll < 0.55:
            shell.status = SpecDecodeDeploymentStatus.model_validate(
                status.model_dump(mode="json", by_alias=True), by_alias=True)  # an operator restart
            assert shell.status == status
        elif roll < 0.62:
            shell.now += timedelta(minutes=rng.choice([2, 4]))  # deadlines run out
        if rng.random() < 0.4 and status.canary_revision:
            since = status.rollout.analysis_since or shell.now - timedelta(minutes=1)
            measured = Measurement(status.canary_revision, VERDICTS[rng.choice(list(VERDICTS))], since,
                                   shell.now)
            return {"verdict": judge(measured, shell.spec.rollout.analysis), "analysed": True}
        return {"analysed": rng.random() < 0.3}

    def step(self) -> None:
        shell, spec = self.shell, self.shell.spec
        given = self.event()
        before, served_before = shell.status, serving(shell.fleet, shell.now)
        legacy = {c for c, v in self.commands.items() if v == "true"}
        t = shell.tick(self.desired, commands=dict(self.commands), **given)
        for annotation in t.consumed_annotations:  # the shell removes "true" ones
            self.commands = {c: v for c, v in self.commands.items() if not (c in legacy and annotation.endswith(c.value))}
        served_after = serving(shell.fleet, shell.now - INTERVAL)
        budget = spec.replicas + max_surge(spec)
        assert all(n >= 0 for n in t.replicas.values()) and sum(t.replicas.values()) <= budget, t.replicas
        assert t.status.stable_revision in t.replicas
        assert t.status.canary_revision is None or t.status.canary_revision in t.replicas
        assert served_after >= min(served_before, spec.replicas - max_unavailable(spec)), (served_before, t)
        if max_surge(spec) > 0 and _retired_at_move(before, t.status):
            assert served_after >= min(served_before, spec.replicas), (served_before, t)
        if t.status.rollout.phase == RolloutPhase.ROLLED_BACK:
            assert t.status.canary_revision is None


@pytest.mark.parametrize("surge", [0, 1])
@pytest.mark.parametrize("replicas", [1, 2, 4, 8])
def test_random_events_never_drop_capacity(replicas: int, surge: int) -> None:
    for seed in range(SEQUENCES):
        sequence = Sequence(random.Random(f"{replicas}-{surge}-{seed}"), replicas, surge)
        for _ in range(EVENTS):
            sequence.step()
