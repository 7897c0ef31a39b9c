"""rollout: the canary state machine over a SpecDecodeDeployment's status. Pure: time is ``now``,
the cluster is what the shell observed (ready replicas per revision, why runtime pods refuse to
start), the analysis is a ``Verdict``.

    advance(status, desired_revision, spec, now=…, ready={revision: n}, verdict=…, commands=…,
            refusal=…) → Transition

``Transition.status`` is the whole new status; ``Transition.replicas`` says which workloads exist
and with how many replicas (a revision left out = delete its workloads); ``Transition.events``
are Kubernetes Events to emit; ``Transition.consumed_annotations`` are one-shot command
annotations to remove from the resource. The shell calls ``advance`` on every change and every
``analysis.interval``, with ``verdict=None`` when it has none (no ready canary pod yet, no two
samples yet); it records samples and calls ``advance`` with the same ``now``.

Semantics:

- First creation, or ``replicas: 0``: the desired revision becomes stable at once (no canary).
- A new revision starts a canary at step 0; weight = replica ratio: the canary gets
  ceil(weight% × replicas) replicas, the stable what keeps the total within replicas + maxSurge.
  The move is gradual: stable replicas go only as far as keeps replicas − maxUnavailable ready,
  the canary grows into what the stable freed. A step is *reached* when both are at their
  targets and the canary's are ready; ``rollout.stepStartedAt`` is then set.
- Each verdict: FAIL counts (``failureLimit`` in a row rolls back: canary deleted, stable to all
  replicas, RolledBack condition with the verdict's reasons, Warning event); INCONCLUSIVE counts
  (``inconclusiveLimit`` in a row pauses); PASS resets both and, if its window started after the
  step was reached and spans a whole window, moves to the next step — past 100 % it promotes:
  the canary becomes stable and the old stable's workloads go.
- A step not reached within ``progressDeadline`` of its start (canary pods that never become
  ready: an image that does not pull, a model that does not fit) rolls back with reason
  ProgressDeadlineExceeded; the clock stops while paused and restarts on resume.
- A spec change mid-rollout replaces the canary (back to step 0); a change back to the stable
  revision cancels the canary; a rolled-back revision is not retried until the spec changes.
  ``spec.replicas`` is not part of the revision (render.revision hashes the pod template only):
  scaling never starts a rollout.
- With ``rollout.trafficRouting`` the canary's share of requests at the HTTPRoute is
  ``rollout.canaryWeight``: the weight of the step last reached (0 before the first), so the
  route never sends a step's share to replicas that are not ready yet; replicas still follow
  the step weights, so each revision has the capacity for its share.
- A runtime pod that refused to start (``refusal``: its termination message, see
  ``reconcile.runtime_refusal``) sets ``Degraded=True, reason=RuntimeRefused`` with that message,
  before any other reason to be degraded, and a Warning event when it begins; its replica is not
  ready, so ``Ready`` follows the replicas. It clears when no pod refuses any more.
- Commands (annotations in ``names``, value "true"): abort rolls back now (reason ManualAbort);
  promote skips the remaining steps and analysis (phase Promoting, then Promoted once every
  replica runs the canary); pause holds the step while the annotation is present (scaling to
  the current step continues); resume (or removing pause) resumes; a resumed step waits one
  whole window again. Abort beats promote beats pause.

Restart: all of this is in ``status`` (revisions, step, step start, counters, replica counts).
The analysis samples are in the shell's memory only: after a restart the step resumes and the
first passing window starts after the restart.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from enum import Enum

from specdecode.operator import names
from specdecode.operator.analysis import Result, Verdict, measured_acceptance
from specdecode.operator.resolve import duration_seconds
from specdecode.operator.spec import (
    Condition,
    ConditionStatus,
    ConditionType,
    IntOrString,
    MeasuredAcceptance,
    PauseCause,
    RolloutPhase,
    RolloutStatus,
    SpecDecodeDeploymentSpec,
    SpecDecodeDeploymentStatus,
)

TRUE, FALSE, UNKNOWN = ConditionStatus.TRUE, ConditionStatus.FALSE, ConditionStatus.UNKNOWN
RUNTIME_REFUSED = "RuntimeRefused"


class Command(str, Enum):
    PROMOTE = "promote"
    ABORT = "abort"
    PAUSE = "pause"
    RESUME = "resume"


COMMAND_ANNOTATIONS = {
    Command.PROMOTE: names.ANNOTATION_PROMOTE,
    Command.ABORT: names.ANNOTATION_ABORT,
    Command.PAUSE: names.ANNOTATION_PAUSE,
    Command.RESUME: names.ANNOTATION_RESUME,
}
ONE_SHOT = frozenset({Command.PROMOTE, Command.ABORT, Command.RESUME})


def read_commands(annotations: Mapping[str, str] | None) -> frozenset[Command]:
    """The commands set on a resource: its command annotations whose value is "true"."""
    given = annotations or {}
    return frozenset(c for c, key in COMMAND_ANNOTATIONS.items() if given.get(key, "").strip().lower() == "true")


class EventType(str, Enum):
    NORMAL = "Normal"
    WARNING = "Warning"


@dataclass(frozen=True)
class Event:
    type: EventType
    reason: str
    message: str


@dataclass(frozen=True)
class Transition:
    status: SpecDecodeDeploymentStatus
    replicas: dict[str, int]  # revision → replicas; a revision absent = delete its workloads
    events: tuple[Event, ...] = ()
    consumed_annotations: tuple[str, ...] = ()  # remove these from metadata.annotations


# -- replica arithmetic -------------------------------------------------------------------------


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


def next_move(spec: SpecDecodeDeploymentSpec, current: Replicas, target: Replicas, ready: Replicas) -> Replicas:
    """One move from ``current`` towards ``target`` replicas, given the ``ready`` ones: shrink the
    stable while replicas − maxUnavailable stay ready (unready stable replicas may always go),
    grow the canary into what the total replicas + maxSurge allows."""
    total, budget = spec.replicas, spec.replicas + max_surge(spec)
    canary = min(current.canary, target.canary)
    if current.stable > target.stable:
        keep_ready = total - max_unavailable(spec) - ready.canary
        stable = max(target.stable, min(current.stable, keep_ready, ready.stable))
    else:
        stable = min(target.stable, max(current.stable, budget - canary))
    canary = max(canary, min(target.canary, budget - stable))
    return Replicas(stable, canary)


# -- conditions ---------------------------------------------------------------------------------


def set_condition(conditions: Sequence[Condition], type_: ConditionType, status: ConditionStatus, reason: str,
                  message: str, now: datetime) -> tuple[Condition, ...]:
    """``conditions`` with ``type_`` set; its lastTransitionTime moves only when its status does."""
    old = next((c for c in conditions if c.type == type_), None)
    since = old.last_transition_time if old is not None and old.status == status else now
    new = Condition(type=type_, status=status, reason=reason, message=message, last_transition_time=since)
    order = list(ConditionType)
    return tuple(sorted([*(c for c in conditions if c.type != type_), new], key=lambda c: order.index(c.type)))


# -- the state machine --------------------------------------------------------------------------


@dataclass
class _State:
    """What ``advance`` changes, gathered from the status; local to one call."""

    stable: str | None
    canary: str | None
    step: int | None
    rollout: RolloutStatus
    acceptance: MeasuredAcceptance | None
    events: list[Event] = field(default_factory=list)
    rolled_back: tuple[str, str] | None = None  # (reason, message) when this call rolled back
    refusal: str | None = None  # why runtime pods refuse to start, as observed

    def update(self, **changes: object) -> None:
        self.rollout = self.rollout.model_copy(update=changes)

    def emit(self, type_: EventType, reason: str, message: str) -> None:
        self.events.append(Event(type_, reason, message))


def advance(status: SpecDecodeDeploymentStatus, desired_revision: str, spec: SpecDecodeDeploymentSpec, *,
            now: datetime, ready: Mapping[str, int], verdict: Verdict | None = None,
            commands: frozenset[Command] = frozenset(), refusal: str | None = None) -> Transition:
    """The next status, workloads and events (see the module docstring). ``ready``: ready
    replicas (whole parallel groups) per revision, as observed; ``commands``: ``read_commands``;
    ``refusal``: ``reconcile.runtime_refusal`` of the resource's pods."""
    state = _State(status.stable_revision, status.canary_revision, status.canary_step, status.rollout,
                   status.acceptance, refusal=refusal)
    if refusal is not None and not any(c.reason == RUNTIME_REFUSED for c in status.conditions):
        state.emit(EventType.WARNING, RUNTIME_REFUSED, refusal)
    _follow_spec(state, desired_revision, spec)
    _obey(state, commands, spec)
    if verdict is not None:
        _weigh(state, verdict, spec)
    replicas = _scale(state, spec, ready, now)
    state.update(canary_weight=_route_weight(state, spec))
    new_status = status.model_copy(update={
        "stable_revision": state.stable,
        "canary_revision": state.canary,
        "canary_step": state.step,
        "rollout": state.rollout,
        "acceptance": state.acceptance,
        "replicas": sum(replicas.values()),
        "ready_replicas": sum(min(ready.get(rev, 0), n) for rev, n in replicas.items()),
        "conditions": _conditions(status.conditions, state, spec, ready, replicas, now),
    })
    return Transition(new_status, replicas, tuple(state.events), _consumed(commands))


def _consumed(commands: frozenset[Command]) -> tuple[str, ...]:
    resumed_while_held = {Command.PAUSE, Command.RESUME} <= commands
    done = commands & ONE_SHOT | ({Command.PAUSE} if resumed_while_held else set())
    return tuple(COMMAND_ANNOTATIONS[c] for c in Command if c in done)


def _follow_spec(s: _State, desired: str, spec: SpecDecodeDeploymentSpec) -> None:
    if s.stable is None or (spec.replicas == 0 and desired not in (s.stable, s.rollout.rolled_back_revision)):
        if s.stable != desired:
            s.emit(EventType.NORMAL, "Deployed", f"revision {desired} serves {spec.replicas} replicas (no canary)")
        s.stable, s.canary, s.step, s.rollout = desired, None, None, RolloutStatus()
    elif desired == s.stable:
        if s.canary is not None:
            s.emit(EventType.NORMAL, "RolloutCancelled",
                   f"spec is back to the stable revision {s.stable}: canary {s.canary} removed")
        if s.canary is not None or s.rollout.phase == RolloutPhase.ROLLED_BACK:
            s.canary, s.step = None, None
            s.rollout = RolloutStatus(stable_replicas=s.rollout.stable_replicas)
    elif desired not in (s.canary, s.rollout.rolled_back_revision):
        weights = ", ".join(f"{step.weight}%" for step in spec.rollout.steps)
        if s.canary is None:
            s.emit(EventType.NORMAL, "RolloutStarted", f"canary {desired} beside stable {s.stable}: steps {weights}")
        else:
            s.emit(EventType.NORMAL, "RolloutRestarted",
                   f"spec changed during the rollout: canary {s.canary} replaced by {desired}, back to step 1")
        s.canary, s.step = desired, 0
        s.rollout = RolloutStatus(phase=RolloutPhase.PROGRESSING, stable_replicas=s.rollout.stable_replicas)


def _obey(s: _State, commands: frozenset[Command], spec: SpecDecodeDeploymentSpec) -> None:
    phase = s.rollout.phase
    if s.canary is None:
        for command in sorted(commands & ONE_SHOT):
            s.emit(EventType.NORMAL, "CommandIgnored", f"{COMMAND_ANNOTATIONS[command]}: no rollout in progress")
    elif Command.ABORT in commands:
        _roll_back(s, "ManualAbort", f"aborted by hand ({names.ANNOTATION_ABORT})")
    elif Command.PROMOTE in commands or phase == RolloutPhase.PROMOTING:
        if phase != RolloutPhase.PROMOTING:
            s.emit(EventType.NORMAL, "Promoting", f"canary {s.canary} promoted by hand ({names.ANNOTATION_PROMOTE}): "
                   "remaining steps and analysis skipped")
            s.update(step_requested_at=None, step_started_at=None)  # scaling to 100 % is a step of its own
        s.step = len(spec.rollout.steps) - 1
        s.update(phase=RolloutPhase.PROMOTING, paused_by=None, message="promoted by hand")
    elif phase == RolloutPhase.PAUSED and (Command.RESUME in commands or (
            Command.PAUSE not in commands and s.rollout.paused_by == PauseCause.MANUAL)):
        s.emit(EventType.NORMAL, "Resumed", f"rollout of {s.canary} resumed at step {s.step + 1}")
        s.update(phase=RolloutPhase.PROGRESSING, paused_by=None, step_requested_at=None, step_started_at=None,
                 consecutive_inconclusive=0)
    elif phase == RolloutPhase.PROGRESSING and Command.PAUSE in commands:
        _pause(s, PauseCause.MANUAL, f"paused by hand ({names.ANNOTATION_PAUSE}); remove the annotation to resume")


def _pause(s: _State, cause: PauseCause, message: str) -> None:
    kind = EventType.NORMAL if cause == PauseCause.MANUAL else EventType.WARNING
    s.emit(kind, cause.value, f"rollout of {s.canary} paused at step {s.step + 1}: {message}")
    s.update(phase=RolloutPhase.PAUSED, paused_by=cause, message=message)


def _roll_back(s: _State, reason: str, message: str) -> None:
    s.emit(EventType.WARNING, "RolledBack", f"canary {s.canary} rolled back to {s.stable}: {message}")
    s.rolled_back = (reason, message)
    s.rollout = RolloutStatus(phase=RolloutPhase.ROLLED_BACK, stable_replicas=s.rollout.stable_replicas,
                              rolled_back_revision=s.canary, message=message)
    s.canary, s.step = None, None


def _promote(s: _State, how: str) -> None:
    s.emit(EventType.NORMAL, "Promoted", f"revision {s.canary} promoted {how}; revision {s.stable} removed")
    s.stable, s.canary, s.step = s.canary, None, None
    s.rollout = RolloutStatus(stable_replicas=s.rollout.canary_replicas, message=f"promoted {how}")


def _weigh(s: _State, verdict: Verdict, spec: SpecDecodeDeploymentSpec) -> None:
    """Count one analysis verdict of the canary; a verdict on another revision is stale."""
    if s.canary is None or verdict.measurement.revision != s.canary:
        return
    s.acceptance = measured_acceptance(verdict.measurement)
    if s.rollout.phase != RolloutPhase.PROGRESSING:
        return
    analysis, reasons = spec.rollout.analysis, "; ".join(verdict.reasons)
    if verdict.result == Result.FAIL:
        failures = s.rollout.consecutive_failures + 1
        s.update(consecutive_failures=failures, consecutive_inconclusive=0, message=verdict.message)
        if failures >= analysis.failure_limit:
            _roll_back(s, "AnalysisFailed", f"{failures} failed analyses in a row: {reasons}")
        else:
            s.emit(EventType.WARNING, "AnalysisFailed", f"{failures}/{analysis.failure_limit}: {reasons}")
    elif verdict.result == Result.INCONCLUSIVE:
        inconclusive = s.rollout.consecutive_inconclusive + 1
        s.update(consecutive_failures=0, consecutive_inconclusive=inconclusive, message=verdict.message)
        if inconclusive >= analysis.inconclusive_limit:
            _pause(s, PauseCause.INCONCLUSIVE, f"{inconclusive} inconclusive analyses in a row ({reasons}); once the "
                   f"canary has traffic and its metrics can be read, annotate {names.ANNOTATION_RESUME}=true, "
                   "or promote or abort")
    else:
        s.update(consecutive_failures=0, consecutive_inconclusive=0, message=verdict.message)
        if _covers_step(verdict, s.rollout.step_started_at):
            _next_step(s, spec, reasons)


def _covers_step(verdict: Verdict, step_started_at: datetime | None) -> bool:
    """A whole window, all of it after the step was reached."""
    return step_started_at is not None and verdict.complete and verdict.measurement.start >= step_started_at


def _next_step(s: _State, spec: SpecDecodeDeploymentSpec, reasons: str) -> None:
    steps = spec.rollout.steps
    if s.step + 1 >= len(steps):
        _promote(s, f"after analysis passed at {steps[-1].weight}% ({reasons})")
        return
    s.emit(EventType.NORMAL, "StepPassed", f"canary {s.canary} passed step {s.step + 1} ({steps[s.step].weight}%): "
           f"{reasons}; moving to {steps[s.step + 1].weight}%")
    s.step += 1
    s.update(step_requested_at=None, step_started_at=None)


def _scale(s: _State, spec: SpecDecodeDeploymentSpec, ready: Mapping[str, int], now: datetime) -> dict[str, int]:
    """The replicas of each revision after one move, noting when the step is reached."""
    if s.canary is None:
        s.update(stable_replicas=spec.replicas, canary_replicas=0)
        return {s.stable: spec.replicas}
    weight = spec.rollout.steps[s.step].weight
    target = step_replicas(spec, weight)
    current = Replicas(s.rollout.stable_replicas, s.rollout.canary_replicas)
    seen = Replicas(ready.get(s.stable, 0), ready.get(s.canary, 0))
    move = next_move(spec, current, target, seen)
    s.update(stable_replicas=move.stable, canary_replicas=move.canary)
    reached = move == target and seen.canary >= target.canary
    if not reached and _past_deadline(s, spec, now):
        _roll_back(s, "ProgressDeadlineExceeded", f"step {s.step + 1} not reached within "
                   f"progressDeadline {spec.rollout.progress_deadline}: {seen.canary} of {target.canary} canary "
                   "replicas ready")
        s.update(stable_replicas=spec.replicas, canary_replicas=0)
        return {s.stable: spec.replicas}
    if reached and s.rollout.phase == RolloutPhase.PROMOTING:
        _promote(s, "by hand")
        return {s.stable: spec.replicas}
    if reached and s.rollout.step_started_at is None:
        s.update(step_started_at=now)
        s.emit(EventType.NORMAL, "StepReached", f"step {s.step + 1}/{len(spec.rollout.steps)}: canary {s.canary} "
               f"serves {weight}% ({move.canary} of {spec.replicas} replicas, stable {move.stable})")
    return {s.stable: move.stable, s.canary: move.canary}


def _route_weight(s: _State, spec: SpecDecodeDeploymentSpec) -> int | None:
    """The canary's percent of requests at the HTTPRoute (``trafficRouting`` only): the weight of
    the step it last reached, so traffic moves only onto replicas that are ready for it; 0 before
    the first step is reached and without a canary (promoted: the stable Service selects it)."""
    if spec.rollout.traffic_routing is None:
        return None
    if s.canary is None:
        return 0
    if s.rollout.step_started_at is not None:
        return spec.rollout.steps[s.step].weight
    return s.rollout.canary_weight or 0


def _past_deadline(s: _State, spec: SpecDecodeDeploymentSpec, now: datetime) -> bool:
    """Whether the current step has been scaling longer than progressDeadline (never while paused);
    the first call of a step starts its clock."""
    if s.rollout.phase == RolloutPhase.PAUSED or s.rollout.step_started_at is not None:
        return False
    if s.rollout.step_requested_at is None:
        s.update(step_requested_at=now)
        return False
    return (now - s.rollout.step_requested_at).total_seconds() > duration_seconds(spec.rollout.progress_deadline)


# -- conditions from the state ------------------------------------------------------------------


def _conditions(old: Sequence[Condition], s: _State, spec: SpecDecodeDeploymentSpec, ready: Mapping[str, int],
                replicas: Mapping[str, int], now: datetime) -> tuple[Condition, ...]:
    conditions = tuple(old)
    for type_, (status, reason, message) in _desired_conditions(old, s, spec, ready, replicas).items():
        conditions = set_condition(conditions, type_, status, reason, message, now)
    return conditions


def _desired_conditions(old: Sequence[Condition], s: _State, spec: SpecDecodeDeploymentSpec,
                        ready: Mapping[str, int], replicas: Mapping[str, int]
                        ) -> dict[ConditionType, tuple[ConditionStatus, str, str]]:
    r = s.rollout
    rolled_back = _rolled_back(old, s)
    if s.refusal is not None:
        degraded = (TRUE, RUNTIME_REFUSED, s.refusal)
    elif rolled_back:
        degraded = (TRUE, rolled_back[0], f"revision {r.rolled_back_revision} rolled back")
    elif r.consecutive_failures:
        degraded = (TRUE, "AnalysisFailing", r.message)
    else:
        degraded = (FALSE, "AsExpected", "")
    return {
        ConditionType.READY: _ready(spec, sum(min(ready.get(rev, 0), n) for rev, n in replicas.items())),
        ConditionType.PROGRESSING: _progressing(s, spec),
        ConditionType.DEGRADED: degraded,
        ConditionType.ROLLED_BACK: (TRUE, *rolled_back) if rolled_back else (FALSE, "NotRolledBack", ""),
        ConditionType.PAUSED: (TRUE, r.paused_by.value, r.message) if r.phase == RolloutPhase.PAUSED and r.paused_by
        else (FALSE, "NotPaused", ""),
    }


def _ready(spec: SpecDecodeDeploymentSpec, serving: int) -> tuple[ConditionStatus, str, str]:
    """Ready while at most maxUnavailable replicas (of any revision) are not serving."""
    needed = max(1, spec.replicas - max_unavailable(spec)) if spec.replicas else 0
    if serving >= needed:
        return TRUE, "ReplicasReady", f"{serving} of {spec.replicas} replicas ready"
    return FALSE, "ReplicasNotReady", f"{serving} of {spec.replicas} replicas ready, {needed} needed"


def _rolled_back(old: Sequence[Condition], s: _State) -> tuple[str, str] | None:
    """(reason, message) of the RolledBack condition while rolled back: new, or as it was."""
    if s.rollout.phase != RolloutPhase.ROLLED_BACK:
        return None
    if s.rolled_back is not None:
        return s.rolled_back
    before = next((c for c in old if c.type == ConditionType.ROLLED_BACK and c.status == TRUE), None)
    return (before.reason, before.message) if before is not None else ("RolledBack", s.rollout.message)


def _progressing(s: _State, spec: SpecDecodeDeploymentSpec) -> tuple[ConditionStatus, str, str]:
    r = s.rollout
    if s.canary is None:
        reason = "RolledBack" if r.phase == RolloutPhase.ROLLED_BACK else "Stable"
        return FALSE, reason, f"revision {s.stable} serves every replica"
    steps = spec.rollout.steps
    where = (f"step {s.step + 1}/{len(steps)} ({steps[s.step].weight}%): canary {s.canary} "
             f"{r.canary_replicas} replicas, stable {s.stable} {r.stable_replicas}")
    if r.phase == RolloutPhase.PAUSED:
        return UNKNOWN, "RolloutPaused", where
    if r.phase == RolloutPhase.PROMOTING:
        return TRUE, "Promoting", where
    waiting = "analysing" if r.step_started_at else "scaling"
    return TRUE, "CanaryStep", f"{where}; {waiting}"
