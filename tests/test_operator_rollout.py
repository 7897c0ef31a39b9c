"""rollout: the canary state machine — steps, promotion, rollback, pause, commands, spec changes,
replica arithmetic, and a rollout resumed from its serialized status after an operator restart."""
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from specdecode.operator import names
from specdecode.operator.analysis import History, Measurement, MetricSnapshot, Verdict, judge
from specdecode.operator.render import revision
from specdecode.operator.resolve import resolve
from specdecode.operator.rollout import (
    Command,
    EventType,
    Replicas,
    Transition,
    advance,
    max_surge,
    max_unavailable,
    next_move,
    read_commands,
    set_condition,
    step_replicas,
)
from specdecode.operator.spec import (
    ConditionStatus,
    ConditionType,
    PauseCause,
    RolloutPhase,
    SpecDecodeDeploymentSpec,
    SpecDecodeDeploymentStatus,
)

T0 = datetime(2025, 3, 1, 12, 0, tzinfo=UTC)
INTERVAL = timedelta(seconds=30)
WINDOW = timedelta(minutes=5)
HEALTHY = MetricSnapshot(drafts=100, draft_tokens=400, accepted_tokens=300, successes={"stop": 20})
POOR = MetricSnapshot(drafts=100, draft_tokens=400, accepted_tokens=124, successes={"stop": 20})


def make_spec(replicas: int = 4, **rollout: Any) -> SpecDecodeDeploymentSpec:
    analysis = {"interval": "30s", "window": "5m", "minAcceptanceRate": 0.5, "failureLimit": 3, "inconclusiveLimit": 3}
    body = {"model": {"uri": "smollm2-135m"}, "image": "specdecode/runtime:test", "replicas": replicas,
            "speculative": {"method": "ngram"},
            "rollout": {"steps": [{"weight": 50}, {"weight": 100}], "analysis": analysis, **rollout}}
    return SpecDecodeDeploymentSpec.model_validate(body, by_alias=True)


def verdict(spec: SpecDecodeDeploymentSpec, rev: str, increase: MetricSnapshot, start: datetime,
            end: datetime) -> Verdict:
    return judge(Measurement(rev, increase, start, end), spec.rollout.analysis)


def kinds(t: Transition) -> list[str]:
    return [e.reason for e in t.events]


def condition(status: SpecDecodeDeploymentStatus, type_: ConditionType):
    return next(c for c in status.conditions if c.type == type_)


class Operator:
    """Drives ``advance`` as the shell does, one interval per call; whatever a transition asks for
    is ready by the next call unless the test says otherwise."""

    def __init__(self, spec: SpecDecodeDeploymentSpec, status: SpecDecodeDeploymentStatus | None = None,
                 now: datetime = T0):
        self.spec, self.status, self.now = spec, status or SpecDecodeDeploymentStatus(), now
        self.ready: dict[str, int] = {}
        self.last: Transition | None = None

    def tick(self, desired: str, verdict: Verdict | None = None, commands: frozenset[Command] = frozenset(),
             ready: dict[str, int] | None = None, refusal: str | None = None) -> Transition:
        self.last = advance(self.status, desired, self.spec, now=self.now, ready=self.ready if ready is None else ready,
                            verdict=verdict, commands=commands, refusal=refusal)
        self.status, self.ready = self.last.status, dict(self.last.replicas)
        self.now += INTERVAL
        return self.last

    def passing(self, rev: str, since: datetime) -> Verdict:
        return verdict(self.spec, rev, HEALTHY, since, self.now)

    def reach_first_step(self) -> datetime:
        """rev1 stable on 4 replicas, rev2 canary at 50 %: returns when the step was reached."""
        assert self.tick("rev1").replicas == {"rev1": 4}
        assert self.tick("rev2").replicas == {"rev1": 3, "rev2": 1}
        assert self.tick("rev2").replicas == {"rev1": 2, "rev2": 2}
        reached_at = self.now
        t = self.tick("rev2")
        assert "StepReached" in kinds(t) and self.status.rollout.step_started_at == reached_at
        return reached_at


# -- the happy path -----------------------------------------------------------------------------


def test_first_creation_is_stable_at_once():
    t = Operator(make_spec()).tick("rev1")
    assert t.replicas == {"rev1": 4} and kinds(t) == ["Deployed"]
    assert (t.status.stable_revision, t.status.canary_revision, t.status.rollout.phase) == ("rev1", None,
                                                                                          RolloutPhase.STABLE)
    assert condition(t.status, ConditionType.READY).reason == "ReplicasNotReady"  # nothing ready yet


def test_a_runtime_that_refuses_to_start_degrades_until_it_starts():
    refused = "pod demo-rev1-x (revision rev1): runtime exited with code 1: specdecode serve: cannot start: no MTP layers"
    op = Operator(make_spec(replicas=1))
    t = op.tick("rev1", ready={}, refusal=refused)
    degraded = condition(t.status, ConditionType.DEGRADED)
    assert (degraded.status, degraded.reason, degraded.message) == (ConditionStatus.TRUE, "RuntimeRefused", refused)
    assert condition(t.status, ConditionType.READY).status == ConditionStatus.FALSE
    assert [(e.type, e.reason, e.message) for e in t.events if e.reason == "RuntimeRefused"] == [
        (EventType.WARNING, "RuntimeRefused", refused)]
    again = op.tick("rev1", ready={}, refusal=refused)  # still refusing: no second event, the condition holds
    assert again.events == () and condition(again.status, ConditionType.DEGRADED) == degraded
    fixed = op.tick("rev1", ready={"rev1": 1})
    assert condition(fixed.status, ConditionType.DEGRADED).reason == "AsExpected"
    assert condition(fixed.status, ConditionType.READY).status == ConditionStatus.TRUE


def test_a_canary_is_promoted_step_by_step():
    op = Operator(make_spec())
    reached = op.reach_first_step()
    assert condition(op.status, ConditionType.PROGRESSING).status == ConditionStatus.TRUE
    early = op.tick("rev2", op.passing("rev2", reached - INTERVAL))  # a window that began before the step
    assert op.status.canary_step == 0 and early.replicas == {"rev1": 2, "rev2": 2}
    op.now = reached + WINDOW
    short = op.tick("rev2", verdict(op.spec, "rev2", HEALTHY, reached + 2 * INTERVAL, op.now))  # 4 min: not whole
    assert op.status.canary_step == 0 and short.events == ()
    op.now = reached + WINDOW
    t = op.tick("rev2", op.passing("rev2", reached))
    assert kinds(t) == ["StepPassed"] and op.status.canary_step == 1
    assert t.replicas == {"rev1": 1, "rev2": 3}  # maxUnavailable 1: one stable replica at a time
    assert op.tick("rev2").replicas == {"rev1": 0, "rev2": 4}
    second = op.now
    assert kinds(op.tick("rev2")) == ["StepReached"]
    op.now = second + WINDOW
    t = op.tick("rev2", op.passing("rev2", second))
    assert kinds(t) == ["Promoted"] and t.replicas == {"rev2": 4}  # rev1's workload goes
    s = t.status
    assert (s.stable_revision, s.canary_revision, s.canary_step, s.rollout.phase) == ("rev2", None, None,
                                                                                    RolloutPhase.STABLE)
    assert s.acceptance.revision == "rev2" and s.acceptance.rate == 0.75
    assert condition(s, ConditionType.PROGRESSING).reason == "Stable"
    assert condition(s, ConditionType.READY).status == ConditionStatus.TRUE


def test_the_route_weight_follows_the_step_last_reached():
    op = Operator(make_spec(trafficRouting={"httpRoute": "gateway"}))
    assert op.tick("rev1").status.rollout.canary_weight == 0
    weights = [op.tick("rev2").status.rollout.canary_weight for _ in range(2)]
    assert weights == [0, 0]  # canary replicas not all ready yet: no traffic
    reached = op.now
    assert op.tick("rev2").status.rollout.canary_weight == 50  # step 1 reached
    op.now = reached + WINDOW
    t = op.tick("rev2", op.passing("rev2", reached))
    assert kinds(t) == ["StepPassed"] and t.status.rollout.canary_weight == 50  # until step 2 is reached
    op.tick("rev2")
    second = op.now
    assert op.tick("rev2").status.rollout.canary_weight == 100
    op.now = second + WINDOW
    t = op.tick("rev2", op.passing("rev2", second))
    assert kinds(t) == ["Promoted"] and t.status.rollout.canary_weight == 0  # the stable Service selects rev2 now

    assert Operator(make_spec()).tick("rev1").status.rollout.canary_weight is None  # no route: replica ratio


def test_a_manual_promotion_keeps_the_route_weight_until_every_replica_is_ready():
    op = Operator(make_spec(trafficRouting={"httpRoute": "gateway"}))
    op.reach_first_step()
    t = op.tick("rev2", commands=frozenset({Command.PROMOTE}))
    assert t.status.rollout.phase == RolloutPhase.PROMOTING and t.status.rollout.canary_weight == 50
    assert op.tick("rev2").status.rollout.canary_weight == 50
    t = op.tick("rev2")
    assert kinds(t) == ["Promoted"] and t.status.rollout.canary_weight == 0


def test_a_rollback_takes_the_route_weight_back():
    op = Operator(make_spec(trafficRouting={"httpRoute": "gateway"}))
    op.reach_first_step()
    t = op.tick("rev2", commands=frozenset({Command.ABORT}))
    assert t.status.rollout.phase == RolloutPhase.ROLLED_BACK and t.status.rollout.canary_weight == 0


def test_scaling_alone_is_not_a_new_revision():
    def rendered_revision(replicas: int) -> str:
        body = {"apiVersion": names.API_VERSION, "kind": names.KIND, "metadata": {"name": "demo"},
                "spec": {"model": {"uri": "smollm2-135m"}, "image": "img", "replicas": replicas}}
        return revision(resolve(body).resolved)

    assert rendered_revision(2) == rendered_revision(5)
    op = Operator(make_spec(replicas=2))
    op.tick("rev1")
    op.spec = make_spec(replicas=5)
    t = op.tick("rev1")
    assert t.replicas == {"rev1": 5} and t.events == () and t.status.rollout.phase == RolloutPhase.STABLE


def test_scaled_to_zero_switches_revision_without_a_canary():
    op = Operator(make_spec(replicas=0))
    op.tick("rev1")
    t = op.tick("rev2")
    assert t.replicas == {"rev2": 0} and kinds(t) == ["Deployed"] and t.status.canary_revision is None


# -- failure, inconclusive windows --------------------------------------------------------------


def test_low_acceptance_rolls_back_after_failure_limit():
    op = Operator(make_spec())
    reached = op.reach_first_step()
    for n in (1, 2):
        t = op.tick("rev2", verdict(op.spec, "rev2", POOR, reached, op.now))
        assert kinds(t) == ["AnalysisFailed"] and t.events[0].type == EventType.WARNING
        assert t.events[0].message == f"{n}/3: acceptance rate 0.31 < minAcceptanceRate 0.5"
        assert t.replicas == {"rev1": 2, "rev2": 2}
    assert condition(op.status, ConditionType.DEGRADED).reason == "AnalysisFailing"
    t = op.tick("rev2", verdict(op.spec, "rev2", POOR, reached, op.now))
    assert kinds(t) == ["RolledBack"] and t.events[0].type == EventType.WARNING
    assert t.replicas == {"rev1": 4}  # canary workload deleted, stable back to every replica
    s = t.status
    assert (s.stable_revision, s.canary_revision, s.rollout.phase, s.rollout.rolled_back_revision) == (
        "rev1", None, RolloutPhase.ROLLED_BACK, "rev2")
    rolled_back = condition(s, ConditionType.ROLLED_BACK)
    assert (rolled_back.status, rolled_back.reason) == (ConditionStatus.TRUE, "AnalysisFailed")
    assert rolled_back.message == "3 failed analyses in a row: acceptance rate 0.31 < minAcceptanceRate 0.5"
    assert condition(s, ConditionType.DEGRADED).status == ConditionStatus.TRUE
    # the same spec again: not retried, the condition keeps its time
    again = op.tick("rev2")
    assert again.replicas == {"rev1": 4} and again.events == () and again.status.canary_revision is None
    assert condition(again.status, ConditionType.ROLLED_BACK) == rolled_back
    # a new spec is rolled out, and clears the rollback
    fresh = op.tick("rev3")
    assert kinds(fresh) == ["RolloutStarted"] and fresh.status.rollout.rolled_back_revision is None
    assert condition(fresh.status, ConditionType.ROLLED_BACK).status == ConditionStatus.FALSE


def test_a_canary_that_never_becomes_ready_rolls_back_at_the_progress_deadline():
    op = Operator(make_spec(progressDeadline="10m"))
    op.tick("rev1")
    started = op.now
    op.tick("rev2", ready={"rev1": 4, "rev2": 0})  # the step's clock starts
    while op.now - started <= timedelta(minutes=10):
        t = op.tick("rev2", ready={"rev1": 3, "rev2": 0})  # the canary pod never gets ready
        assert t.status.rollout.phase == RolloutPhase.PROGRESSING and t.replicas == {"rev1": 3, "rev2": 1}
    t = op.tick("rev2", ready={"rev1": 3, "rev2": 0})
    assert kinds(t) == ["RolledBack"] and t.replicas == {"rev1": 4}
    rolled_back = condition(t.status, ConditionType.ROLLED_BACK)
    assert rolled_back.reason == "ProgressDeadlineExceeded"
    assert rolled_back.message == "step 1 not reached within progressDeadline 10m: 0 of 2 canary replicas ready"


def test_the_progress_deadline_does_not_run_while_paused():
    op = Operator(make_spec(progressDeadline="1m"))
    op.tick("rev1")
    op.tick("rev2", ready={"rev1": 4, "rev2": 0})
    for _ in range(10):
        t = op.tick("rev2", commands=frozenset({Command.PAUSE}), ready={"rev1": 3, "rev2": 0})
        assert t.status.rollout.phase == RolloutPhase.PAUSED
    t = op.tick("rev2", ready={"rev1": 3, "rev2": 0})  # resumed: a fresh minute
    assert kinds(t) == ["Resumed"] and t.status.rollout.phase == RolloutPhase.PROGRESSING


def test_a_pass_breaks_a_run_of_failures():
    op = Operator(make_spec())
    reached = op.reach_first_step()
    for increase in (POOR, POOR, HEALTHY, POOR, POOR):
        op.tick("rev2", verdict(op.spec, "rev2", increase, reached, op.now))
    assert op.status.rollout.phase == RolloutPhase.PROGRESSING and op.status.rollout.consecutive_failures == 2


def test_windows_without_data_pause_the_rollout():
    op = Operator(make_spec())
    reached = op.reach_first_step()
    for _ in range(2):
        op.tick("rev2", verdict(op.spec, "rev2", MetricSnapshot(), reached, op.now))
    assert op.status.rollout.phase == RolloutPhase.PROGRESSING
    t = op.tick("rev2", verdict(op.spec, "rev2", MetricSnapshot(), reached, op.now))
    assert kinds(t) == ["InconclusiveAnalysis"] and t.events[0].type == EventType.WARNING
    paused = condition(t.status, ConditionType.PAUSED)
    assert (paused.status, paused.reason) == (ConditionStatus.TRUE, "InconclusiveAnalysis")
    assert "3 inconclusive analyses in a row" in paused.message and names.ANNOTATION_RESUME in paused.message
    assert condition(t.status, ConditionType.PROGRESSING).status == ConditionStatus.UNKNOWN
    op.now = reached + 2 * WINDOW
    held = op.tick("rev2", op.passing("rev2", reached))  # paused: a passing window does not promote
    assert held.status.canary_step == 0 and held.status.rollout.phase == RolloutPhase.PAUSED
    assert held.replicas == {"rev1": 2, "rev2": 2}
    resumed_at = op.now
    t = op.tick("rev2", commands=frozenset({Command.RESUME}))
    assert kinds(t) == ["Resumed", "StepReached"] and t.status.rollout.step_started_at == resumed_at
    assert t.consumed_annotations == (names.ANNOTATION_RESUME,)


# -- commands -----------------------------------------------------------------------------------


def test_resume_while_the_pause_annotation_is_set_removes_both():
    op = Operator(make_spec())
    op.reach_first_step()
    op.tick("rev2", commands=frozenset({Command.PAUSE}))
    t = op.tick("rev2", commands=frozenset({Command.PAUSE, Command.RESUME}))
    assert kinds(t)[0] == "Resumed" and t.status.rollout.phase == RolloutPhase.PROGRESSING
    assert t.consumed_annotations == (names.ANNOTATION_PAUSE, names.ANNOTATION_RESUME)


def test_commands_are_read_from_annotations():
    annotations = {names.ANNOTATION_PROMOTE: "true", names.ANNOTATION_PAUSE: "True", names.ANNOTATION_ABORT: "false"}
    assert read_commands(annotations) == {Command.PROMOTE, Command.PAUSE}
    assert read_commands(None) == frozenset()


def test_manual_promote_skips_analysis_and_waits_for_replicas():
    op = Operator(make_spec())
    op.tick("rev1")
    op.tick("rev2")
    t = op.tick("rev2", commands=frozenset({Command.PROMOTE}), ready={"rev1": 3, "rev2": 0})
    assert kinds(t) == ["Promoting"] and t.consumed_annotations == (names.ANNOTATION_PROMOTE,)
    assert (t.status.rollout.phase, t.status.canary_step) == (RolloutPhase.PROMOTING, 1)
    assert t.replicas == {"rev1": 3, "rev2": 1}
    assert op.tick("rev2", verdict(op.spec, "rev2", POOR, T0, op.now), ready={"rev1": 3, "rev2": 1}
                   ).replicas == {"rev1": 2, "rev2": 2}  # verdicts no longer count
    assert op.tick("rev2").replicas == {"rev1": 1, "rev2": 3}  # maxUnavailable 1: one at a time
    assert op.tick("rev2").replicas == {"rev1": 0, "rev2": 4}
    t = op.tick("rev2")
    assert kinds(t) == ["Promoted"] and t.replicas == {"rev2": 4} and t.status.stable_revision == "rev2"


def test_manual_abort_rolls_back_now():
    op = Operator(make_spec())
    op.reach_first_step()
    t = op.tick("rev2", commands=frozenset({Command.ABORT, Command.PROMOTE}))  # abort wins
    assert kinds(t) == ["RolledBack"] and t.replicas == {"rev1": 4}
    assert condition(t.status, ConditionType.ROLLED_BACK).reason == "ManualAbort"
    assert t.consumed_annotations == (names.ANNOTATION_PROMOTE, names.ANNOTATION_ABORT)
    ignored = op.tick("rev2", commands=frozenset({Command.ABORT}))
    assert kinds(ignored) == ["CommandIgnored"] and ignored.consumed_annotations == (names.ANNOTATION_ABORT,)


def test_pause_holds_the_step_until_the_annotation_goes():
    op = Operator(make_spec())
    reached = op.reach_first_step()
    pause = frozenset({Command.PAUSE})
    t = op.tick("rev2", commands=pause)
    assert kinds(t) == ["ManualPause"] and t.status.rollout.paused_by == PauseCause.MANUAL
    assert t.consumed_annotations == ()  # pause is held by its annotation
    op.now = reached + 2 * WINDOW
    t = op.tick("rev2", op.passing("rev2", reached), commands=pause)
    assert t.status.canary_step == 0 and t.status.rollout.phase == RolloutPhase.PAUSED
    resumed_at = op.now
    t = op.tick("rev2")
    assert kinds(t) == ["Resumed", "StepReached"] and t.status.rollout.phase == RolloutPhase.PROGRESSING
    assert t.consumed_annotations == ()
    assert condition(t.status, ConditionType.PAUSED).status == ConditionStatus.FALSE
    op.now = resumed_at + WINDOW
    early = op.tick("rev2", op.passing("rev2", reached))  # a window from before the resume does not count
    assert early.status.canary_step == 0
    op.tick("rev2", op.passing("rev2", resumed_at))
    assert op.status.canary_step == 1


# -- spec changes during a rollout --------------------------------------------------------------


def test_a_spec_change_mid_rollout_restarts_with_the_newer_revision():
    op = Operator(make_spec())
    reached = op.reach_first_step()
    op.now = reached + WINDOW
    op.tick("rev2", op.passing("rev2", reached))
    op.tick("rev2")  # rev1 1, rev2 3
    t = op.tick("rev3")
    assert kinds(t) == ["RolloutRestarted"]
    assert t.replicas == {"rev1": 2, "rev3": 2}  # rev2's workload goes; rev1 back to the step-1 share
    s = t.status
    assert (s.canary_revision, s.canary_step, s.rollout.step_started_at, s.rollout.consecutive_failures) == (
        "rev3", 0, None, 0)
    t = op.tick("rev1")  # back to the stable spec: the canary is cancelled
    assert kinds(t) == ["RolloutCancelled"] and t.replicas == {"rev1": 4}
    assert (t.status.canary_revision, t.status.rollout.phase) == (None, RolloutPhase.STABLE)


# -- an operator restart ------------------------------------------------------------------------


def test_a_rollout_resumes_the_same_step_after_an_operator_restart():
    op = Operator(make_spec())
    reached = op.reach_first_step()
    op.tick("rev2", op.passing("rev2", reached))
    stored = op.status.model_dump(mode="json", by_alias=True)  # what the CR's status holds
    assert stored["rollout"]["phase"] == "Progressing" and stored["canaryStep"] == 0

    restarted_at = op.now + timedelta(minutes=1)
    status = SpecDecodeDeploymentStatus.model_validate(stored, by_alias=True)
    assert status == op.status
    after = Operator(op.spec, status, now=restarted_at)
    after.ready = {"rev1": 2, "rev2": 2}
    history = History("rev2")  # the samples were in memory: a fresh window starts at the restart
    counters = MetricSnapshot()
    while True:
        counters = MetricSnapshot(drafts=counters.drafts + 10, draft_tokens=counters.draft_tokens + 40,
                                  accepted_tokens=counters.accepted_tokens + 30,
                                  successes={"stop": counters.successes.get("stop", 0) + 2})
        history = history.record("rev2-pod-0", after.now, counters, keep=WINDOW)
        measured = history.measure(after.now, WINDOW)
        current = judge(measured, after.spec.rollout.analysis) if measured else None
        t = after.tick("rev2", current)
        if t.status.canary_step == 1:
            break
        assert t.replicas == {"rev1": 2, "rev2": 2} and t.status.rollout.step_started_at == reached
    assert current.measurement.start == restarted_at
    assert after.now - INTERVAL - restarted_at == WINDOW - INTERVAL  # one whole window (less jitter) after it
    assert t.replicas == {"rev1": 1, "rev2": 3}


# -- replica arithmetic and conditions ----------------------------------------------------------


@pytest.mark.parametrize("surge, unavailable, replicas, weight, want", [
    (0, 1, 4, 50, Replicas(stable=2, canary=2)),
    (0, 1, 4, 10, Replicas(stable=3, canary=1)),  # the canary's share rounds up
    (0, 1, 3, 50, Replicas(stable=1, canary=2)),
    (0, 1, 1, 50, Replicas(stable=0, canary=1)),  # one replica, no surge: the canary takes it
    (1, 0, 4, 50, Replicas(stable=3, canary=2)),  # a surge keeps more of the stable
    (1, 0, 4, 100, Replicas(stable=1, canary=4)),
    ("25%", 0, 4, 50, Replicas(stable=3, canary=2)),
    ("10%", 0, 4, 50, Replicas(stable=3, canary=2)),  # a surge percentage rounds up
])
def test_step_replicas(surge, unavailable, replicas, weight, want):
    assert step_replicas(make_spec(replicas, maxSurge=surge, maxUnavailable=unavailable), weight) == want


def test_unavailable_percentages_round_down_but_never_freeze():
    assert max_unavailable(make_spec(10, maxSurge=0, maxUnavailable="25%")) == 2
    assert max_unavailable(make_spec(3, maxSurge=0, maxUnavailable="25%")) == 1  # 0 would block every move
    assert (max_surge(make_spec(10, maxSurge="25%", maxUnavailable=0)),
            max_unavailable(make_spec(10, maxSurge="25%", maxUnavailable="5%"))) == (3, 0)


def test_moves_with_and_without_surge():
    no_surge, surge = make_spec(4, maxSurge=0, maxUnavailable=1), make_spec(4, maxSurge=1, maxUnavailable=0)
    target = step_replicas(no_surge, 50)
    assert next_move(no_surge, Replicas(4, 0), target, Replicas(4, 0)) == Replicas(3, 1)
    assert next_move(no_surge, Replicas(3, 1), target, Replicas(3, 0)) == Replicas(3, 1)  # canary not ready yet
    assert next_move(no_surge, Replicas(3, 1), target, Replicas(3, 1)) == Replicas(2, 2)
    assert next_move(no_surge, Replicas(4, 0), target, Replicas(2, 0)) == Replicas(2, 2)  # unready stable may go
    target = step_replicas(surge, 50)
    assert next_move(surge, Replicas(4, 0), target, Replicas(4, 0)) == Replicas(4, 1)  # total 5 = 4 + maxSurge
    assert next_move(surge, Replicas(4, 1), target, Replicas(4, 1)) == Replicas(3, 2)
    assert next_move(surge, Replicas(0, 0), target, Replicas(0, 0)) == Replicas(3, 2)  # restoring: all at once


def test_set_condition_keeps_the_transition_time_while_the_status_holds():
    later = T0 + timedelta(hours=1)
    first = set_condition((), ConditionType.PAUSED, ConditionStatus.TRUE, "ManualPause", "a", T0)
    same = set_condition(first, ConditionType.PAUSED, ConditionStatus.TRUE, "InconclusiveAnalysis", "b", later)
    assert same[0].last_transition_time == T0 and (same[0].reason, same[0].message) == ("InconclusiveAnalysis", "b")
    flipped = set_condition(same, ConditionType.PAUSED, ConditionStatus.FALSE, "NotPaused", "", later)
    assert flipped[0].last_transition_time == later
    both = set_condition(flipped, ConditionType.READY, ConditionStatus.TRUE, "ReplicasReady", "", later)
    assert [c.type for c in both] == [ConditionType.READY, ConditionType.PAUSED]


def test_a_stale_verdict_of_another_revision_is_ignored():
    op = Operator(make_spec())
    reached = op.reach_first_step()
    for _ in range(3):
        t = op.tick("rev2", verdict(op.spec, "rev0", POOR, reached, op.now))
    assert t.status.rollout.phase == RolloutPhase.PROGRESSING and t.status.rollout.consecutive_failures == 0


def test_verdict_results_reach_status_message():
    op = Operator(make_spec())
    reached = op.reach_first_step()
    t = op.tick("rev2", verdict(op.spec, "rev2", POOR, reached, op.now))
    assert t.status.rollout.message == "Fail: acceptance rate 0.31 < minAcceptanceRate 0.5"
