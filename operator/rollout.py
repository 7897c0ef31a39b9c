"""rollout: the canary state machine over a SpecDecodeDeployment's status. Pure: time is ``now``,
the cluster is what the shell observed (ready replicas per revision, why pods are not ready), the
analysis is a ``Verdict``.

    advance(status, desired_revision, spec, now=…, ready={revision: n}, verdict=…, analysed=…,
            commands={command: value}, failure=…, not_ready=…) → Transition
    weight_in_effect(status, weight, spec, now) → status

``Transition.status`` is the whole new status; ``Transition.replicas`` says which workloads exist
and with how many replicas (a revision left out = delete its workloads); ``Transition.events``
are Kubernetes Events to emit; ``Transition.consumed_annotations`` are deprecated ``"true"``
command annotations to remove. The shell calls ``advance`` on every change and, with
``analysed=True``, every ``analysis.interval`` (with the canary's ``verdict`` over the last
window, or None when it has none: no ready canary pod, no two samples yet). Once the backend
carries the weight ``status.rollout.canaryWeight`` asks for (the HTTPRoute patch was accepted;
``specdecode up``: the router acknowledged it) the shell calls ``weight_in_effect``.

Semantics:

- First creation, or ``replicas: 0``: the desired revision becomes stable at once (no canary).
- A new revision starts a canary at step 0; weight = replica ratio: the canary gets
  ceil(weight% × replicas) replicas, the stable what keeps the total within replicas + maxSurge.
  Replicas move as ``capacity.next_move`` allows. A step is *reached* when every revision is at
  its target (no retired one left) and the canary's replicas are ready; its weight is *in
  effect* then — with ``trafficRouting`` once the shell reports the route holds it
  (``weight_in_effect``). Analysis windows count only from then (``rollout.analysisSince``).
- Each analysis interval after the step was reached with fewer ready canary replicas than the
  step's target is a failed window (reason CanaryNotReady, with why the pods are not ready);
  otherwise each verdict counts: FAIL (``failureLimit`` in a row rolls back, RolledBack
  condition with the reasons, Warning event); INCONCLUSIVE (``inconclusiveLimit`` in a row
  pauses); PASS resets both and, if its window started once the weight was in effect and spans a
  whole window, moves to the next step — past 100 % it promotes: the canary becomes stable and
  the old stable's workloads (the surge's share, if any) go.
- An equivalence probe (``equivalence``) whose canary's greedy outputs diverged from the
  stable's rolls the canary back at once, whatever ``failureLimit`` (OutputDiverged, with the
  prompt, the position and both tokens); no step passes before a probe of the canary has ended
  (``outputs_checked``), unless none can run. ``status.stableModel`` records the stable's
  ``model.uri`` whenever no canary runs, so a canary is probed only on the same model.
- **Capacity**: a rollback, an abort, a new edit or a change back to the stable *retires* the
  canary (``rollout.retiring``): it keeps its replicas, serving, and shrinks only as the stable
  (and a new canary) regain them ready — ``capacity`` says how far each move goes. With
  ``replicas: 1`` and no surge there is no room for both: it cuts over, with a Warning.
- ``progressDeadline`` is time without progress: its clock restarts when a step begins, a canary
  replica turns ready, or the step is reached; a step not reached when it runs out rolls back
  (ProgressDeadlineExceeded). The clock stops while paused and restarts on resume.
- A spec change mid-rollout replaces the canary (back to step 0); a change back to the stable
  revision cancels the canary; a rolled-back revision is retried by the retry command or a spec
  change. ``spec.replicas`` is not part of the revision (render.revision hashes the pod template
  only): scaling never starts a rollout.
- With ``rollout.trafficRouting`` the canary Service's share of requests at the HTTPRoute is
  ``rollout.canaryWeight``: the weight of the step last reached (0 before the first); during a
  restore the canary Service selects the newest retired revision (``route_canary``) and its share
  follows the ready replicas, so requests never go to a revision with nothing ready.
- Pods that never come (``failure``, see ``failures``: a runtime that refused to start, pods a
  quota or PodSecurity forbids, one no node can take, an image that cannot be pulled) set
  ``Degraded=True`` with the failure's reason (``RuntimeRefused``, ``FailedCreate``,
  ``Unschedulable``, ``ImagePullBackOff``, …) and the first one's message, before any other
  reason to be degraded, and a Warning event when it begins; their replicas are not ready, so
  ``Ready`` follows the replicas. It clears when the failure does.
- Without a canary, a stable short of its replicas (a first deploy, a scale-up) has
  ``progressDeadline`` too: its clock restarts whenever a replica turns ready, and past it
  ``Degraded`` and ``Progressing`` say ``ProgressDeadlineExceeded`` (nothing to roll back to),
  with a Warning event; it clears once every replica is ready.
- Commands (``names`` annotations; ``read_commands``): each value acts once — the value names the
  revision meant (a revision's form: ``names.REVISION_LENGTH`` hex digits; another revision's
  name is ignored) or is any other token, and ``status.commands`` records the last value handled,
  so a re-applied annotation does nothing. abort rolls back now (ManualAbort); promote skips the
  remaining steps and analysis (phase Promoting, then Promoted once every replica runs the
  canary); pause holds the step (one set before an edit holds the new rollout from its start;
  scaling to the current step continues), and removing it resumes; resume resumes (a resumed
  step waits one whole window again); retry starts the rolled-back revision's canary again.
  Abort beats promote beats pause. The value ``"true"`` acts as before (the annotation is
  removed; pause held while present) with a Warning naming the new form.

Restart: all of this is in ``status`` (revisions, step, step start, counters, replica counts,
retired revisions, commands handled). The analysis samples are in the shell's memory only: after
a restart the step resumes and the first passing window starts after the restart.
"""
from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from enum import Enum

from specdecode.operator import names
from specdecode.operator.analysis import Result, Verdict, measured_acceptance
from specdecode.operator.capacity import cuts_over, max_unavailable, next_move, step_replicas
from specdecode.operator.equivalence import ProbeResult
from specdecode.operator.failures import Failure
from specdecode.operator.resolve import duration_seconds
from specdecode.operator.spec import (
    CommandRecord,
    Condition,
    ConditionStatus,
    ConditionType,
    EquivalenceState,
    MeasuredAcceptance,
    PauseCause,
    RetiringRevision,
    RolloutPhase,
    RolloutStatus,
    SpecDecodeDeploymentSpec,
    SpecDecodeDeploymentStatus,
)

TRUE, FALSE, UNKNOWN = ConditionStatus.TRUE, ConditionStatus.FALSE, ConditionStatus.UNKNOWN
CANARY_NOT_READY = "CanaryNotReady"
OUTPUT_DIVERGED = "OutputDiverged"
PROGRESS_DEADLINE_EXCEEDED = "ProgressDeadlineExceeded"
LEGACY_VALUE = "true"  # the command value before values named revisions: acts every time it is set
_REVISION = re.compile(f"[0-9a-f]{{{names.REVISION_LENGTH}}}")


class Command(str, Enum):
    PROMOTE = "promote"
    ABORT = "abort"
    PAUSE = "pause"
    RESUME = "resume"
    RETRY = "retry"


COMMAND_ANNOTATIONS = {
    Command.PROMOTE: names.ANNOTATION_PROMOTE,
    Command.ABORT: names.ANNOTATION_ABORT,
    Command.PAUSE: names.ANNOTATION_PAUSE,
    Command.RESUME: names.ANNOTATION_RESUME,
    Command.RETRY: names.ANNOTATION_RETRY,
}


def read_commands(annotations: Mapping[str, str] | None) -> dict[Command, str]:
    """The command annotations set on a resource, with their values (blank ones left out)."""
    given = annotations or {}
    return {c: value for c, key in COMMAND_ANNOTATIONS.items() if (value := given.get(key, "").strip())}


def _legacy(value: str) -> bool:
    return value.lower() == LEGACY_VALUE


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
    consumed_annotations: tuple[str, ...] = ()  # remove these from metadata.annotations ("true" values)


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
    commands: CommandRecord
    events: list[Event] = field(default_factory=list)
    rolled_back: tuple[str, str] | None = None  # (reason, message) when this call rolled back
    failure: Failure | None = None  # why pods never come, as observed
    ready_before: int = 0  # ready replicas, as the status said
    was_stalled: bool = False  # the status said the stable was past progressDeadline
    stalled: str | None = None  # a stable short of replicas past progressDeadline: why
    consumed: set[Command] = field(default_factory=set)  # "true" annotations to remove

    def update(self, **changes: object) -> None:
        self.rollout = self.rollout.model_copy(update=changes)

    def emit(self, type_: EventType, reason: str, message: str) -> None:
        self.events.append(Event(type_, reason, message))


def advance(status: SpecDecodeDeploymentStatus, desired_revision: str, spec: SpecDecodeDeploymentSpec, *,
            now: datetime, ready: Mapping[str, int], verdict: Verdict | None = None, analysed: bool = False,
            commands: Mapping[Command, str] | None = None, failure: Failure | None = None,
            not_ready: str | None = None, probe: ProbeResult | None = None, outputs_checked: bool = True) -> Transition:
    """The next status, workloads and events (see the module docstring). ``ready``: ready
    replicas (whole parallel groups) per revision, as observed; ``analysed``: this call is the
    analysis interval's; ``commands``: ``read_commands``; ``failure``: ``failures.failure`` of the
    resource's pods and workloads; ``not_ready``: ``pods.not_ready_reason`` of the canary's; ``probe``: the
    interval's equivalence probe of the canary; ``outputs_checked``: a probe of the canary has
    ended, or none can run (until then no step passes)."""
    state = _State(status.stable_revision, status.canary_revision, status.canary_step, status.rollout,
                   status.acceptance, status.commands, failure=failure, ready_before=status.ready_replicas or 0,
                   was_stalled=_says(status, ConditionType.PROGRESSING, FALSE, PROGRESS_DEADLINE_EXCEEDED))
    if failure is not None and not _says(status, ConditionType.DEGRADED, TRUE, failure.reason):
        state.emit(EventType.WARNING, failure.reason, failure.message)
    _follow_spec(state, desired_revision, spec)
    _obey(state, commands or {}, desired_revision, spec)
    _judge(state, spec, ready, verdict, analysed, not_ready, probe, outputs_checked)
    replicas = _scale(state, spec, ready, now)
    state.update(canary_weight=_route_weight(state, spec, ready, replicas, restored=bool(status.rollout.retiring)))
    new_status = status.model_copy(update={
        "stable_revision": state.stable,
        "canary_revision": state.canary,
        "canary_step": state.step,
        "rollout": state.rollout,
        "acceptance": state.acceptance,
        "stable_model": spec.model.uri if state.canary is None and state.stable == desired_revision
        else status.stable_model,
        "commands": state.commands,
        "replicas": sum(replicas.values()),
        "ready_replicas": sum(min(ready.get(rev, 0), n) for rev, n in replicas.items()),
        "conditions": _conditions(status.conditions, state, spec, ready, replicas, now),
    })
    consumed = tuple(COMMAND_ANNOTATIONS[c] for c in Command if c in state.consumed)
    return Transition(new_status, replicas, tuple(state.events), consumed)


def weight_in_effect(status: SpecDecodeDeploymentStatus, weight: int | None, spec: SpecDecodeDeploymentSpec,
                     now: datetime) -> SpecDecodeDeploymentStatus:
    """``status`` once the backend carries ``weight`` for the canary: if that is the weight of the
    step the canary reached, windows count from ``now`` on (``rollout.analysisSince``)."""
    r, step = status.rollout, status.canary_step
    if (status.canary_revision is None or step is None or r.step_started_at is None or r.analysis_since is not None
            or weight != spec.rollout.steps[step].weight):
        return status
    return status.model_copy(update={"rollout": r.model_copy(update={"analysis_since": now})})


def route_canary(status: SpecDecodeDeploymentStatus) -> str | None:
    """The revision the route's canary Service selects: the newest retired one while a restore
    runs (it still serves), else the canary."""
    retiring = status.rollout.retiring
    return retiring[0].revision if retiring else status.canary_revision


# -- following the spec -------------------------------------------------------------------------


def _follow_spec(s: _State, desired: str, spec: SpecDecodeDeploymentSpec) -> None:
    if s.stable is None or (spec.replicas == 0 and desired not in (s.stable, s.rollout.rolled_back_revision)):
        if s.stable != desired:
            s.emit(EventType.NORMAL, "Deployed", f"revision {desired} serves {spec.replicas} replicas (no canary)")
        s.stable, s.canary, s.step, s.rollout = desired, None, None, RolloutStatus()
    elif desired == s.stable:
        if s.canary is not None:
            s.emit(EventType.NORMAL, "RolloutCancelled",
                   f"spec is back to the stable revision {s.stable}: canary {s.canary} retired")
        if s.canary is not None or s.rollout.phase == RolloutPhase.ROLLED_BACK:
            _retire_canary(s, spec)
            s.rollout = _kept(s.rollout, RolloutPhase.STABLE)
    elif desired not in (s.canary, s.rollout.rolled_back_revision):
        weights = ", ".join(f"{step.weight}%" for step in spec.rollout.steps)
        if s.canary is None:
            s.emit(EventType.NORMAL, "RolloutStarted", f"canary {desired} beside stable {s.stable}: steps {weights}")
        else:
            s.emit(EventType.NORMAL, "RolloutRestarted",
                   f"spec changed during the rollout: canary {s.canary} replaced by {desired}, back to step 1")
            _retire_canary(s, spec)
        _start_canary(s, desired, spec)


def _kept(r: RolloutStatus, phase: RolloutPhase, **changes: object) -> RolloutStatus:
    """A fresh rollout status in ``phase`` that keeps what runs: the stable's replicas and the
    retired revisions."""
    return RolloutStatus(phase=phase, stable_replicas=r.stable_replicas, retiring=r.retiring, **changes)


def _start_canary(s: _State, revision: str, spec: SpecDecodeDeploymentSpec) -> None:
    """``revision`` as the canary at step 0, taking back its replicas if it was being retired."""
    if cuts_over(spec) and not s.rollout.retiring:
        s.emit(EventType.WARNING, "NoSpareReplica", _cut_over_message(s.stable, revision, spec))
    back = next((r.replicas for r in s.rollout.retiring if r.revision == revision), 0)
    s.rollout = _kept(s.rollout, RolloutPhase.PROGRESSING, canary_replicas=back)
    s.update(retiring=tuple(r for r in s.rollout.retiring if r.revision != revision))
    s.canary, s.step = revision, 0


def _retire_canary(s: _State, spec: SpecDecodeDeploymentSpec) -> None:
    """The canary leaves: its replicas stay, as the newest retired revision, until the ones
    replacing them are ready."""
    if s.canary is None:
        return
    if s.rollout.canary_replicas > 0:
        if cuts_over(spec):
            s.emit(EventType.WARNING, "NoSpareReplica", _cut_over_message(s.canary, s.stable, spec))
        s.update(retiring=(RetiringRevision(revision=s.canary, replicas=s.rollout.canary_replicas),
                           *s.rollout.retiring))
    s.update(canary_replicas=0)
    s.canary, s.step = None, None


def _cut_over_message(going: str | None, coming: str | None, spec: SpecDecodeDeploymentSpec) -> str:
    return (f"replicas {spec.replicas} and maxSurge 0 leave no room for both revisions: {going} stops before "
            f"{coming} is ready, and nothing serves in between; set rollout.maxSurge: 1 where a spare GPU exists")


# -- commands -----------------------------------------------------------------------------------


def _obey(s: _State, commands: Mapping[Command, str], desired: str, spec: SpecDecodeDeploymentSpec) -> None:
    fresh = {c: v for c, v in commands.items() if _legacy(v) or getattr(s.commands, c.value) != v}
    if Command.RETRY in fresh:
        _retry(s, fresh[Command.RETRY], desired, spec)
    if s.canary is None:
        for command in sorted(set(fresh) - {Command.PAUSE, Command.RETRY}):
            _ignore(s, command, fresh[command], "no rollout in progress")
        return  # a pause waits for the next rollout
    for command in sorted(set(fresh) - {Command.RETRY}):
        if _REVISION.fullmatch(fresh[command]) and fresh[command] != s.canary:
            value = fresh.pop(command)
            _ignore(s, command, value, f"names revision {value}, the canary is {s.canary}")
    phase = s.rollout.phase
    if Command.ABORT in fresh:
        _handled(s, Command.ABORT, fresh)
        _roll_back(s, spec, "ManualAbort", f"aborted by hand ({names.ANNOTATION_ABORT})")
        if Command.PROMOTE in fresh:
            _handled(s, Command.PROMOTE, fresh)
    elif Command.PROMOTE in fresh or phase == RolloutPhase.PROMOTING:
        if phase != RolloutPhase.PROMOTING:
            _handled(s, Command.PROMOTE, fresh)
            s.emit(EventType.NORMAL, "Promoting", f"canary {s.canary} promoted by hand ({names.ANNOTATION_PROMOTE}): "
                   "remaining steps and analysis skipped")
            s.update(progress_at=None, step_started_at=None, analysis_since=None)  # scaling to 100 % is a step
        s.step = len(spec.rollout.steps) - 1
        s.update(phase=RolloutPhase.PROMOTING, paused_by=None, message="promoted by hand")
    else:
        _pause_or_resume(s, commands, fresh)


def _pause_or_resume(s: _State, commands: Mapping[Command, str], fresh: dict[Command, str]) -> None:
    phase, manual = s.rollout.phase, s.rollout.paused_by == PauseCause.MANUAL
    if Command.RESUME in fresh or (phase == RolloutPhase.PAUSED and manual and Command.PAUSE not in commands):
        if Command.RESUME in fresh:
            _handled(s, Command.RESUME, fresh)
        if phase != RolloutPhase.PAUSED:
            s.emit(EventType.NORMAL, "CommandIgnored", f"{names.ANNOTATION_RESUME}: the rollout is not paused")
            return
        if Command.PAUSE in commands:  # the pause it lifts is done with
            _handled(s, Command.PAUSE, {Command.PAUSE: commands[Command.PAUSE]})
        s.emit(EventType.NORMAL, "Resumed", f"rollout of {s.canary} resumed at step {s.step + 1}")
        s.update(phase=RolloutPhase.PROGRESSING, paused_by=None, progress_at=None, step_started_at=None,
                 analysis_since=None, consecutive_inconclusive=0)
    elif Command.PAUSE in fresh:
        value = fresh[Command.PAUSE]
        if phase == RolloutPhase.PROGRESSING:
            _pause(s, PauseCause.MANUAL, f"paused by hand ({names.ANNOTATION_PAUSE}={value}); remove the annotation "
                   "or set " f"{names.ANNOTATION_RESUME} to a new value to resume")
        if not _legacy(value):  # "true" is held while present, as it always was
            s.commands = s.commands.model_copy(update={Command.PAUSE.value: value})
        elif phase == RolloutPhase.PROGRESSING:
            _deprecated(s, Command.PAUSE)


def _retry(s: _State, value: str, desired: str, spec: SpecDecodeDeploymentSpec) -> None:
    rolled_back = s.rollout.rolled_back_revision
    if s.rollout.phase != RolloutPhase.ROLLED_BACK or rolled_back is None:
        _ignore(s, Command.RETRY, value, "no rolled-back revision to retry")
    elif _REVISION.fullmatch(value) and value != rolled_back:
        _ignore(s, Command.RETRY, value, f"names revision {value}, the rolled-back one is {rolled_back}")
    elif desired != rolled_back:
        _ignore(s, Command.RETRY, value, f"the spec no longer asks for the rolled-back revision {rolled_back}")
    else:
        _handled(s, Command.RETRY, {Command.RETRY: value})
        s.emit(EventType.NORMAL, "RolloutRetried", f"canary {rolled_back} started again beside stable {s.stable} "
               f"({names.ANNOTATION_RETRY})")
        _start_canary(s, rolled_back, spec)


def _handled(s: _State, command: Command, values: Mapping[Command, str]) -> None:
    """Record ``command``'s value as handled: never again for the same value; "true" is removed."""
    value = values[command]
    if _legacy(value):
        s.consumed.add(command)
        _deprecated(s, command)
    else:
        s.commands = s.commands.model_copy(update={command.value: value})


def _ignore(s: _State, command: Command, value: str, why: str) -> None:
    s.emit(EventType.NORMAL, "CommandIgnored", f"{COMMAND_ANNOTATIONS[command]}={value}: {why}")
    _handled(s, command, {command: value})


def _deprecated(s: _State, command: Command) -> None:
    s.emit(EventType.WARNING, "DeprecatedCommand",
           f"{COMMAND_ANNOTATIONS[command]}=true is deprecated and goes in the next release: set it to the revision it "
           "means (or any new token); each value then acts once and the annotation may stay")


def _pause(s: _State, cause: PauseCause, message: str) -> None:
    kind = EventType.NORMAL if cause == PauseCause.MANUAL else EventType.WARNING
    s.emit(kind, cause.value, f"rollout of {s.canary} paused at step {s.step + 1}: {message}")
    s.update(phase=RolloutPhase.PAUSED, paused_by=cause, message=message)


def _roll_back(s: _State, spec: SpecDecodeDeploymentSpec, reason: str, message: str) -> None:
    s.emit(EventType.WARNING, "RolledBack", f"canary {s.canary} rolled back to {s.stable}: {message}")
    s.rolled_back = (reason, message)
    canary = s.canary
    _retire_canary(s, spec)
    s.rollout = _kept(s.rollout, RolloutPhase.ROLLED_BACK, rolled_back_revision=canary, message=message)


def _promote(s: _State, how: str) -> None:
    s.emit(EventType.NORMAL, "Promoted", f"revision {s.canary} promoted {how}; revision {s.stable} removed")
    s.stable, s.canary, s.step = s.canary, None, None
    s.rollout = RolloutStatus(stable_replicas=s.rollout.canary_replicas, retiring=s.rollout.retiring,
                              message=f"promoted {how}")


# -- judging ------------------------------------------------------------------------------------


def _judge(s: _State, spec: SpecDecodeDeploymentSpec, ready: Mapping[str, int], verdict: Verdict | None,
           analysed: bool, not_ready: str | None, probe: ProbeResult | None, outputs_checked: bool) -> None:
    """A canary whose outputs diverged from the stable's is rolled back at once; an analysis
    interval with a canary short of ready replicas at its reached step fails; otherwise the
    verdict, if any, counts."""
    if s.canary is None:
        return
    if (probe is not None and probe.revision == s.canary and probe.state is EquivalenceState.DIVERGED
            and s.rollout.phase == RolloutPhase.PROGRESSING):
        s.emit(EventType.WARNING, OUTPUT_DIVERGED, probe.message)
        _roll_back(s, spec, OUTPUT_DIVERGED, probe.message)
        return
    wanted = step_replicas(spec, spec.rollout.steps[s.step].weight).canary
    seen = ready.get(s.canary, 0)
    reached = s.rollout.phase == RolloutPhase.PROGRESSING and s.rollout.step_started_at is not None
    if analysed and reached and seen < wanted:
        why = f"{seen} of {wanted} canary replicas ready at step {s.step + 1}: {not_ready or 'no reason reported'}"
        _fail(s, spec, CANARY_NOT_READY, why, f"{Result.FAIL.value}: {why}")
    elif verdict is not None:
        _weigh(s, verdict, spec, outputs_checked)


def _weigh(s: _State, verdict: Verdict, spec: SpecDecodeDeploymentSpec, outputs_checked: bool) -> None:
    """Count one analysis verdict of the canary: a verdict on another revision is stale, one from
    before the step's weight took effect does not count yet; a failure counts once the window
    reaches past that moment, a window without data or a pass only when it began after it."""
    if verdict.measurement.revision != s.canary:
        return
    s.acceptance = measured_acceptance(verdict.measurement)
    since = s.rollout.analysis_since
    if s.rollout.phase != RolloutPhase.PROGRESSING or since is None or verdict.measurement.end <= since:
        return
    analysis, reasons = spec.rollout.analysis, "; ".join(verdict.reasons)
    if verdict.result == Result.FAIL:
        _fail(s, spec, "AnalysisFailed", reasons, verdict.message)
    elif verdict.result == Result.INCONCLUSIVE:
        if verdict.measurement.start < since:
            return  # a window without data that began before the weight: the weight may be why
        inconclusive = s.rollout.consecutive_inconclusive + 1
        s.update(consecutive_failures=0, consecutive_inconclusive=inconclusive, message=verdict.message)
        if inconclusive >= analysis.inconclusive_limit:
            _pause(s, PauseCause.INCONCLUSIVE, f"{inconclusive} inconclusive analyses in a row ({reasons}); once the "
                   f"canary has traffic and its metrics can be read, set {names.ANNOTATION_RESUME} to a new value, "
                   "or promote or abort")
    else:
        waiting = "" if outputs_checked else "; waiting for the equivalence probe's first result"
        s.update(consecutive_failures=0, consecutive_inconclusive=0, message=verdict.message + waiting)
        if verdict.complete and verdict.measurement.start >= since and outputs_checked:
            _next_step(s, spec, reasons)


def _fail(s: _State, spec: SpecDecodeDeploymentSpec, reason: str, reasons: str, message: str) -> None:
    """One failed window; ``failureLimit`` in a row roll back."""
    limit = spec.rollout.analysis.failure_limit
    failures = s.rollout.consecutive_failures + 1
    s.update(consecutive_failures=failures, consecutive_inconclusive=0, message=message)
    if failures >= limit:
        _roll_back(s, spec, reason, f"{failures} failed analyses in a row: {reasons}")
    else:
        s.emit(EventType.WARNING, reason, f"{failures}/{limit}: {reasons}")


def _next_step(s: _State, spec: SpecDecodeDeploymentSpec, reasons: str) -> None:
    steps = spec.rollout.steps
    if s.step + 1 >= len(steps):
        _promote(s, f"after analysis passed at {steps[-1].weight}% ({reasons})")
        return
    s.emit(EventType.NORMAL, "StepPassed", f"canary {s.canary} passed step {s.step + 1} ({steps[s.step].weight}%): "
           f"{reasons}; moving to {steps[s.step + 1].weight}%")
    s.step += 1
    s.update(progress_at=None, step_started_at=None, analysis_since=None)


# -- scaling ------------------------------------------------------------------------------------


def _scale(s: _State, spec: SpecDecodeDeploymentSpec, ready: Mapping[str, int], now: datetime) -> dict[str, int]:
    """The replicas of each revision after one move, noting progress, a reached step, a deadline
    passed and a promotion that is complete."""
    r = s.rollout
    if s.canary is None and not r.retiring:
        s.update(stable_replicas=spec.replicas, canary_replicas=0)
        _stable_progress(s, spec, ready, now)
        return {s.stable: spec.replicas}
    target = {s.stable: spec.replicas}
    current = {s.stable: r.stable_replicas}
    if s.canary is not None:
        step = step_replicas(spec, spec.rollout.steps[s.step].weight)
        target, current[s.canary] = {s.stable: step.stable, s.canary: step.canary}, r.canary_replicas
    target |= {old.revision: 0 for old in r.retiring}
    current |= {old.revision: old.replicas for old in r.retiring}
    move = next_move(spec, current, target, ready, retiring=bool(r.retiring))
    s.update(stable_replicas=move[s.stable], canary_replicas=move.get(s.canary, 0) if s.canary else 0,
             retiring=tuple(RetiringRevision(revision=old.revision, replicas=move[old.revision])
                            for old in r.retiring if move[old.revision] > 0))
    if s.canary is None:
        return _kept_workloads(s, move)
    return _step(s, spec, r, move, target, ready, now)


def _kept_workloads(s: _State, move: Mapping[str, int]) -> dict[str, int]:
    """``move`` less the revisions that leave: a retired one down to no replicas, and a stable
    gone by promotion; the stable and the canary stay, scaled to 0 if so."""
    kept = {s.stable, s.canary, *(old.revision for old in s.rollout.retiring)}
    return {rev: n for rev, n in move.items() if rev in kept}


def _step(s: _State, spec: SpecDecodeDeploymentSpec, before: RolloutStatus, move: dict[str, int],
          target: Mapping[str, int], ready: Mapping[str, int], now: datetime) -> dict[str, int]:
    """The canary's side of a move (``before`` it, the rollout was so)."""
    seen = ready.get(s.canary, 0)
    reached = move == target and seen >= target[s.canary]
    if seen > s.rollout.canary_ready_replicas or (reached and s.rollout.step_started_at is None):
        s.update(progress_at=now)
    s.update(canary_ready_replicas=seen)
    if not reached and _past_deadline(s, spec, now):
        s.update(stable_replicas=before.stable_replicas, canary_replicas=before.canary_replicas,
                 retiring=before.retiring)  # the move is undone: the restore moves instead
        _roll_back(s, spec, PROGRESS_DEADLINE_EXCEEDED, f"step {s.step + 1} not reached within progressDeadline "
                   f"{spec.rollout.progress_deadline} without progress: {seen} of {target[s.canary]} canary "
                   f"replicas ready")
        return _scale(s, spec, ready, now)
    if reached and s.rollout.phase == RolloutPhase.PROMOTING:
        _promote(s, "by hand")
        return _kept_workloads(s, {s.stable: spec.replicas, **move})
    if reached and s.rollout.step_started_at is None:
        routed = spec.rollout.traffic_routing is not None
        s.update(step_started_at=now, analysis_since=None if routed else now)
        weight = spec.rollout.steps[s.step].weight
        s.emit(EventType.NORMAL, "StepReached", f"step {s.step + 1}/{len(spec.rollout.steps)}: canary {s.canary} "
               f"serves {weight}% ({move[s.canary]} of {spec.replicas} replicas, stable {move[s.stable]})")
    return _kept_workloads(s, move)


def _stable_progress(s: _State, spec: SpecDecodeDeploymentSpec, ready: Mapping[str, int], now: datetime) -> None:
    """The stable's progress while it is short of replicas without a canary: the clock restarts
    whenever a replica turns ready; past ``progressDeadline``, ``s.stalled`` says so (and a
    Warning event, as it begins)."""
    seen = min(ready.get(s.stable, 0), spec.replicas)
    if seen >= spec.replicas:
        s.update(progress_at=None)
        return
    if s.rollout.progress_at is None or seen > s.ready_before:
        s.update(progress_at=now)
    if (now - s.rollout.progress_at).total_seconds() <= duration_seconds(spec.rollout.progress_deadline):
        return
    s.stalled = (f"revision {s.stable}: {seen} of {spec.replicas} replicas ready, none more within progressDeadline "
                 f"{spec.rollout.progress_deadline}")
    if not s.was_stalled:
        s.emit(EventType.WARNING, PROGRESS_DEADLINE_EXCEEDED, s.stalled)


def _past_deadline(s: _State, spec: SpecDecodeDeploymentSpec, now: datetime) -> bool:
    """Whether the step has gone ``progressDeadline`` without progress (never while paused or
    once reached); the first call of a step starts the clock."""
    if s.rollout.phase == RolloutPhase.PAUSED or s.rollout.step_started_at is not None:
        return False
    if s.rollout.progress_at is None:
        s.update(progress_at=now)
        return False
    return (now - s.rollout.progress_at).total_seconds() > duration_seconds(spec.rollout.progress_deadline)


def _route_weight(s: _State, spec: SpecDecodeDeploymentSpec, ready: Mapping[str, int], replicas: Mapping[str, int],
                  *, restored: bool) -> int | None:
    """The percent of requests the route's canary Service gets (``trafficRouting`` only): during a
    restore, the newest retired revision's share of what serves; else the weight of the step the
    canary last reached (0 before the first — and after a restore, whose share it was — and
    without a canary: promoted, the stable Service selects it)."""
    if spec.rollout.traffic_routing is None:
        return None
    if s.rollout.retiring:
        newest, stable = s.rollout.retiring[0].revision, s.stable
        serving = {rev: min(ready.get(rev, 0), replicas.get(rev, 0)) for rev in (newest, stable)}
        counts = serving if sum(serving.values()) else {rev: replicas.get(rev, 0) for rev in (newest, stable)}
        return round(100 * counts[newest] / sum(counts.values())) if sum(counts.values()) else 0
    if s.canary is None:
        return 0
    if s.rollout.step_started_at is not None:
        return spec.rollout.steps[s.step].weight
    return 0 if restored else s.rollout.canary_weight or 0


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
    if s.failure is not None:
        degraded = (TRUE, s.failure.reason, s.failure.message)
    elif rolled_back:
        degraded = (TRUE, rolled_back[0], f"revision {r.rolled_back_revision} rolled back")
    elif r.consecutive_failures:
        degraded = (TRUE, "AnalysisFailing", r.message)
    elif s.stalled is not None:
        degraded = (TRUE, PROGRESS_DEADLINE_EXCEEDED, s.stalled)
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


def _says(status: SpecDecodeDeploymentStatus, type_: ConditionType, value: ConditionStatus, reason: str) -> bool:
    """Whether ``status`` has condition ``type_`` at ``value`` for ``reason`` (an Event is due when it did not)."""
    return any(c.type == type_ and c.status == value and c.reason == reason for c in status.conditions)


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
    retiring = "".join(f", retiring {old.revision} {old.replicas}" for old in r.retiring)
    if s.stalled is not None:
        return FALSE, PROGRESS_DEADLINE_EXCEEDED, s.stalled
    if s.canary is None and retiring:
        return TRUE, "Restoring", (f"stable {s.stable} {r.stable_replicas} of {spec.replicas} replicas{retiring}: "
                                   "each retiring replica goes once one replacing it is ready")
    if s.canary is None:
        reason = "RolledBack" if r.phase == RolloutPhase.ROLLED_BACK else "Stable"
        return FALSE, reason, f"revision {s.stable} serves every replica"
    steps = spec.rollout.steps
    where = (f"step {s.step + 1}/{len(steps)} ({steps[s.step].weight}%): canary {s.canary} "
             f"{r.canary_replicas} replicas, stable {s.stable} {r.stable_replicas}{retiring}")
    if r.phase == RolloutPhase.PAUSED:
        return UNKNOWN, "RolloutPaused", where
    if r.phase == RolloutPhase.PROMOTING:
        return TRUE, "Promoting", where
    waiting = "analysing" if r.step_started_at else "scaling"
    return TRUE, "CanaryStep", f"{where}; {waiting}"
