"""rollout: the canary state machine — steps, promotion, rollback, pause, commands, spec changes,
capacity kept through rollbacks, aborts and edits, the replica arithmetic (capacity.py), and a
rollout resumed from its serialized status after an operator restart."""
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from specdecode.operator import names
from specdecode.operator.analysis import History, Measurement, MetricSnapshot, Verdict, judge
from specdecode.operator.render import revision
from specdecode.operator.resolve import resolve
from specdecode.operator.equivalence import ProbeResult
from specdecode.operator.failures import Failure
from specdecode.operator.capacity import Replicas, max_surge, max_unavailable, next_move, step_replicas
from specdecode.operator.rollout import (
    Command,
    EventType,
    Transition,
    advance,
    read_commands,
    set_condition,
    route_canary,
    weight_in_effect,
)
from specdecode.operator.spec import (
    ConditionStatus,
    ConditionType,
    EquivalenceState,
    OutputDivergence,
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

    def tick(self, desired: str, verdict: Verdict | None = None, commands: dict[Command, str] | None = None,
             ready: dict[str, int] | None = None, failure: Failure | None = None, analysed: bool | None = None,
             not_ready: str | None = None, probe: ProbeResult | None = None) -> Transition:
        """One reconciliation: an analysis interval's when given a verdict (or ``analysed``); the
        route, if any, takes the weight asked for at once."""
        self.last = advance(self.status, desired, self.spec, now=self.now, ready=self.ready if ready is None else ready,
                            verdict=verdict, analysed=verdict is not None if analysed is None else analysed,
                            commands=commands, failure=failure, not_ready=not_ready, probe=probe)
        self.status = weight_in_effect(self.last.status, self.last.status.rollout.canary_weight, self.spec, self.now)
        self.ready = dict(self.last.replicas)
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
    t = op.tick("rev1", ready={}, failure=Failure("RuntimeRefused", refused))
    degraded = condition(t.status, ConditionType.DEGRADED)
    assert (degraded.status, degraded.reason, degraded.message) == (ConditionStatus.TRUE, "RuntimeRefused", refused)
    assert condition(t.status, ConditionType.READY).status == ConditionStatus.FALSE
    assert [(e.type, e.reason, e.message) for e in t.events if e.reason == "RuntimeRefused"] == [
        (EventType.WARNING, "RuntimeRefused", refused)]
    again = op.tick("rev1", ready={}, failure=Failure("RuntimeRefused", refused))  # still refusing: no second event, the condition holds
    assert again.events == () and condition(again.status, ConditionType.DEGRADED) == degraded
    fixed = op.tick("rev1", ready={"rev1": 1})
    assert condition(fixed.status, ConditionType.DEGRADED).reason == "AsExpected"
    assert condition(fixed.status, ConditionType.READY).status == ConditionStatus.TRUE


def test_pods_that_never_come_degrade_with_the_reason_and_a_first_deploy_has_a_progress_deadline():
    """A quota forbids the first deploy's pods (FailedCreate): Degraded says so at once, with an
    Event; the deadline passes with nothing ready: Progressing and (once the failure is gone but
    the pods still do not come) Degraded say ProgressDeadlineExceeded, one Event; a replica turning
    ready restarts the clock, and all ready clears it."""
    spec = make_spec(replicas=2, progressDeadline="10m")
    op = Operator(spec)
    quota = Failure("FailedCreate", 'Deployment demo-rev1 (revision rev1): pods "demo-rev1-x" is forbidden: '
                                    "exceeded quota: gpus")
    t = op.tick("rev1", ready={}, failure=quota)
    assert (condition(t.status, ConditionType.DEGRADED).reason, condition(t.status, ConditionType.DEGRADED).message
            ) == ("FailedCreate", quota.message)
    assert [(e.type, e.reason) for e in t.events if e.reason == "FailedCreate"] == [(EventType.WARNING, "FailedCreate")]
    op.now += timedelta(minutes=11)
    t = op.tick("rev1", ready={}, failure=quota)
    assert condition(t.status, ConditionType.DEGRADED).reason == "FailedCreate"  # the failure says more
    progressing = condition(t.status, ConditionType.PROGRESSING)
    assert (progressing.status, progressing.reason) == (ConditionStatus.FALSE, "ProgressDeadlineExceeded")
    assert progressing.message == "revision rev1: 0 of 2 replicas ready, none more within progressDeadline 10m"
    assert [e.reason for e in t.events] == ["ProgressDeadlineExceeded"]
    t = op.tick("rev1", ready={})
    assert condition(t.status, ConditionType.DEGRADED).reason == "ProgressDeadlineExceeded" and not t.events
    t = op.tick("rev1", ready={"rev1": 1})  # progress: the clock restarts
    assert condition(t.status, ConditionType.DEGRADED).reason == "AsExpected"
    assert condition(t.status, ConditionType.PROGRESSING).reason == "Stable"
    op.now += timedelta(minutes=11)
    assert condition(op.tick("rev1", ready={"rev1": 1}).status, ConditionType.DEGRADED).reason == (
        "ProgressDeadlineExceeded")
    t = op.tick("rev1", ready={"rev1": 2})
    assert condition(t.status, ConditionType.DEGRADED).reason == "AsExpected"
    assert t.status.rollout.progress_at is None and condition(t.status, ConditionType.READY).status == (
        ConditionStatus.TRUE)


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
    t = op.tick("rev2", commands={Command.PROMOTE: "t1"})
    assert t.status.rollout.phase == RolloutPhase.PROMOTING and t.status.rollout.canary_weight == 50
    assert op.tick("rev2").status.rollout.canary_weight == 50
    t = op.tick("rev2")
    assert kinds(t) == ["Promoted"] and t.status.rollout.canary_weight == 0


def test_a_rollback_keeps_the_route_on_the_retiring_canary_while_it_serves():
    op = Operator(make_spec(trafficRouting={"httpRoute": "gateway"}))
    op.reach_first_step()
    t = op.tick("rev2", commands={Command.ABORT: "t1"})
    assert t.status.rollout.phase == RolloutPhase.ROLLED_BACK and t.replicas == {"rev1": 3, "rev2": 1}
    assert route_canary(t.status) == "rev2" and t.status.rollout.canary_weight == 33  # 1 of 3 ready serving
    t = op.tick("rev2", ready={"rev1": 2, "rev2": 1})  # the stable's new replica still loading
    assert t.replicas == {"rev1": 3, "rev2": 1} and t.status.rollout.canary_weight == 33
    t = op.tick("rev2")
    assert t.replicas == {"rev1": 4} and t.status.rollout.canary_weight == 0 and route_canary(t.status) is None


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
    assert t.replicas == {"rev1": 3, "rev2": 1}  # one canary replica goes for each stable one ready
    s = t.status
    assert (s.stable_revision, s.canary_revision, s.rollout.phase, s.rollout.rolled_back_revision) == (
        "rev1", None, RolloutPhase.ROLLED_BACK, "rev2")
    rolled_back = condition(s, ConditionType.ROLLED_BACK)
    assert (rolled_back.status, rolled_back.reason) == (ConditionStatus.TRUE, "AnalysisFailed")
    assert rolled_back.message == "3 failed analyses in a row: acceptance rate 0.31 < minAcceptanceRate 0.5"
    assert condition(s, ConditionType.DEGRADED).status == ConditionStatus.TRUE
    assert condition(s, ConditionType.PROGRESSING).reason == "Restoring"
    assert op.tick("rev2").replicas == {"rev1": 4}  # the canary workload deleted once the stable is whole
    # the same spec again: not retried, the condition keeps its time
    again = op.tick("rev2")
    assert again.replicas == {"rev1": 4} and again.events == () and again.status.canary_revision is None
    assert condition(again.status, ConditionType.ROLLED_BACK) == rolled_back
    # a new spec is rolled out, and clears the rollback
    fresh = op.tick("rev3")
    assert kinds(fresh) == ["RolloutStarted"] and fresh.status.rollout.rolled_back_revision is None
    assert condition(fresh.status, ConditionType.ROLLED_BACK).status == ConditionStatus.FALSE


def test_outputs_that_diverged_roll_back_at_once_whatever_the_failure_limit():
    op = Operator(make_spec())
    reached = op.reach_first_step()
    where = OutputDivergence(prompt="What is 17 times 3?", position=2, stable_token="51", other_token="52",
                             logprob_gap=3.5)
    near = ProbeResult("rev2", EquivalenceState.PROBING, same=3, near_ties=1, divergence=where)
    assert op.tick("rev2", op.passing("rev2", reached), probe=near).status.canary_revision == "rev2"  # a near-tie
    stale = ProbeResult("rev0", EquivalenceState.DIVERGED, divergence=where, message="another revision's")
    assert op.tick("rev2", probe=stale, analysed=True).status.canary_revision == "rev2"
    diverged = ProbeResult("rev2", EquivalenceState.DIVERGED, divergence=where, message="canary rev2 diverged: 51 ≠ 52")
    t = op.tick("rev2", op.passing("rev2", reached), probe=diverged)  # its metrics pass: the probe decides
    assert kinds(t) == ["OutputDiverged", "RolledBack"] and t.status.rollout.phase == RolloutPhase.ROLLED_BACK
    rolled_back = condition(t.status, ConditionType.ROLLED_BACK)
    assert (rolled_back.reason, rolled_back.message) == ("OutputDiverged", "canary rev2 diverged: 51 ≠ 52")
    assert t.replicas == {"rev1": 3, "rev2": 1}  # retired, not dropped: capacity as any rollback


def test_the_stable_model_is_recorded_whenever_no_canary_runs():
    op = Operator(make_spec())
    assert op.tick("rev1").status.stable_model == "smollm2-135m"
    other = make_spec()
    op.spec = other.model_copy(update={"model": other.model.model_copy(update={"uri": "file:///models/other.gguf"})})
    assert op.tick("rev2").status.stable_model == "smollm2-135m"  # the canary's model is the spec's, not yet stable's
    op.spec = make_spec()
    assert op.tick("rev1").status.stable_model == "smollm2-135m"  # back to the stable: cancelled


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
    assert rolled_back.message == ("step 1 not reached within progressDeadline 10m without progress: "
                                   "0 of 2 canary replicas ready")


def test_the_progress_deadline_does_not_run_while_paused():
    op = Operator(make_spec(progressDeadline="1m"))
    op.tick("rev1")
    op.tick("rev2", ready={"rev1": 4, "rev2": 0})
    for _ in range(10):
        t = op.tick("rev2", commands={Command.PAUSE: "t1"}, ready={"rev1": 3, "rev2": 0})
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
    t = op.tick("rev2", commands={Command.RESUME: "t1"})
    assert kinds(t) == ["Resumed", "StepReached"] and t.status.rollout.step_started_at == resumed_at
    assert t.consumed_annotations == () and t.status.commands.resume == "t1"


# -- commands -----------------------------------------------------------------------------------


def test_resume_lifts_a_pause_whose_annotation_stays():
    op = Operator(make_spec())
    op.reach_first_step()
    op.tick("rev2", commands={Command.PAUSE: "p1"})
    t = op.tick("rev2", commands={Command.PAUSE: "p1", Command.RESUME: "r1"})
    assert kinds(t)[0] == "Resumed" and t.status.rollout.phase == RolloutPhase.PROGRESSING
    assert t.consumed_annotations == () and (t.status.commands.pause, t.status.commands.resume) == ("p1", "r1")
    again = op.tick("rev2", commands={Command.PAUSE: "p1", Command.RESUME: "r1"})  # GitOps applies both again
    assert again.events == () and again.status.rollout.phase == RolloutPhase.PROGRESSING
    t = op.tick("rev2", commands={Command.PAUSE: "p2", Command.RESUME: "r1"})  # a new value pauses again
    assert kinds(t) == ["ManualPause"] and t.status.rollout.phase == RolloutPhase.PAUSED


def test_the_legacy_true_value_acts_is_removed_and_warns():
    op = Operator(make_spec())
    op.reach_first_step()
    t = op.tick("rev2", commands={Command.PAUSE: "true"})
    assert kinds(t) == ["ManualPause", "DeprecatedCommand"] and t.consumed_annotations == ()  # held while present
    assert op.tick("rev2", commands={Command.PAUSE: "true"}).events == ()
    t = op.tick("rev2", commands={Command.PAUSE: "true", Command.RESUME: "true"})
    assert kinds(t) == ["DeprecatedCommand", "DeprecatedCommand", "Resumed", "StepReached"]
    assert t.consumed_annotations == (names.ANNOTATION_PAUSE, names.ANNOTATION_RESUME)
    assert t.status.commands.pause is None and t.status.commands.resume is None  # "true" is never recorded


def test_commands_are_read_from_annotations():
    annotations = {names.ANNOTATION_PROMOTE: " 4f2a9c1e7b ", names.ANNOTATION_PAUSE: "True",
                   names.ANNOTATION_ABORT: "", "example.com/other": "x"}
    assert read_commands(annotations) == {Command.PROMOTE: "4f2a9c1e7b", Command.PAUSE: "True"}
    assert read_commands(None) == {}


def test_manual_promote_skips_analysis_and_waits_for_replicas():
    op = Operator(make_spec())
    op.tick("rev1")
    op.tick("rev2")
    t = op.tick("rev2", commands={Command.PROMOTE: "t1"}, ready={"rev1": 3, "rev2": 0})
    assert kinds(t) == ["Promoting"] and t.consumed_annotations == () and t.status.commands.promote == "t1"
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
    t = op.tick("rev2", commands={Command.ABORT: "rev2", Command.PROMOTE: "rev2"})  # abort wins
    assert kinds(t) == ["RolledBack"] and t.replicas == {"rev1": 3, "rev2": 1}
    assert condition(t.status, ConditionType.ROLLED_BACK).reason == "ManualAbort"
    assert t.consumed_annotations == () and (t.status.commands.abort, t.status.commands.promote) == ("rev2", "rev2")
    assert op.tick("rev2", commands={Command.ABORT: "rev2", Command.PROMOTE: "rev2"}).events == ()  # re-applied
    ignored = op.tick("rev2", commands={Command.ABORT: "t2"})
    assert kinds(ignored) == ["CommandIgnored"] and "no rollout in progress" in ignored.events[0].message
    assert ignored.status.commands.abort == "t2"


def test_pause_holds_the_step_until_the_annotation_goes():
    op = Operator(make_spec())
    reached = op.reach_first_step()
    pause = {Command.PAUSE: "t1"}
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
    op.tick("rev2")  # rev1 0, rev2 4
    t = op.tick("rev3")
    assert kinds(t) == ["RolloutRestarted"]
    # rev2 retires: it gives up a replica for each one of rev1's that is ready, then rev3 starts
    assert t.replicas == {"rev1": 1, "rev3": 0, "rev2": 3}
    s = t.status
    assert (s.canary_revision, s.canary_step, s.rollout.step_started_at, s.rollout.consecutive_failures) == (
        "rev3", 0, None, 0)
    assert [(old.revision, old.replicas) for old in s.rollout.retiring] == [("rev2", 3)]
    assert op.tick("rev3").replicas == {"rev1": 2, "rev3": 0, "rev2": 2}
    assert op.tick("rev3").replicas == {"rev1": 2, "rev3": 1, "rev2": 1}
    t = op.tick("rev1")  # back to the stable spec: the canary is cancelled and retires too; the oldest goes first
    assert kinds(t) == ["RolloutCancelled"] and t.replicas == {"rev1": 3, "rev3": 1}
    assert [(old.revision, old.replicas) for old in t.status.rollout.retiring] == [("rev3", 1)]
    assert (t.status.canary_revision, t.status.rollout.phase) == (None, RolloutPhase.STABLE)
    assert op.tick("rev1").replicas == {"rev1": 4}


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


def _move(spec: SpecDecodeDeploymentSpec, current: tuple[int, ...], target: tuple[int, ...], ready: tuple[int, ...],
          *, retiring: bool = False) -> tuple[int, ...]:
    """next_move over revisions a (stable), b (canary), c (retired), as tuples."""
    revs = "abc"[:len(current)]
    move = next_move(spec, dict(zip(revs, current)), dict(zip(revs, target)), dict(zip(revs, ready)), retiring=retiring)
    return tuple(move[rev] for rev in revs)


def test_moves_with_and_without_surge():
    no_surge, surge = make_spec(4, maxSurge=0, maxUnavailable=1), make_spec(4, maxSurge=1, maxUnavailable=0)
    target = (2, 2)
    assert _move(no_surge, (4, 0), target, (4, 0)) == (3, 1)
    assert _move(no_surge, (3, 1), target, (3, 0)) == (3, 1)  # canary not ready yet
    assert _move(no_surge, (3, 1), target, (3, 1)) == (2, 2)
    assert _move(no_surge, (4, 0), target, (2, 0)) == (2, 2)  # unready stable may go
    target = (3, 2)
    assert _move(surge, (4, 0), target, (4, 0)) == (4, 1)  # total 5 = 4 + maxSurge
    assert _move(surge, (4, 1), target, (4, 1)) == (3, 2)
    assert _move(surge, (0, 0), target, (0, 0)) == (3, 2)  # restoring: all at once


def test_a_retired_revision_shrinks_only_as_its_replacements_turn_ready():
    no_surge, surge = make_spec(4, maxSurge=0, maxUnavailable=1), make_spec(4, maxSurge=1, maxUnavailable=1)
    # rolled back at 100 % without a surge: one replica at a time, replicas − maxUnavailable kept ready
    assert _move(no_surge, (0, 0, 4), (4, 0, 0), (0, 0, 4), retiring=True) == (1, 0, 3)
    assert _move(no_surge, (1, 0, 3), (4, 0, 0), (0, 0, 3), retiring=True) == (1, 0, 3)  # stable still loading
    assert _move(no_surge, (1, 0, 3), (4, 0, 0), (1, 0, 3), retiring=True) == (2, 0, 2)
    assert _move(no_surge, (1, 0, 3), (4, 0, 0), (0, 0, 1), retiring=True) == (3, 0, 1)  # unready ones go at once
    # with a surge the floor is every replica: the stable grows first, the retired goes once it is ready
    assert _move(surge, (1, 0, 4), (4, 0, 0), (1, 0, 4), retiring=True) == (2, 0, 3)
    assert _move(surge, (2, 0, 3), (4, 0, 0), (1, 0, 3), retiring=True) == (2, 0, 3)
    # an edit: the stable regains its share before the new canary grows
    assert _move(no_surge, (2, 0, 2), (2, 2, 0), (2, 0, 2), retiring=True) == (2, 1, 1)


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



# -- a canary not ready, the deadline, when windows count ---------------------------------------


def test_a_canary_not_ready_at_its_step_fails_its_windows():
    op = Operator(make_spec())
    op.reach_first_step()
    why = "pod demo-rev2-x: container runtime waiting: CrashLoopBackOff: back-off 5m0s restarting failed container"
    crashed = {"rev1": 2, "rev2": 1}
    t = op.tick("rev2", op.passing("rev2", T0), ready=crashed, not_ready=why)  # the ready pod's window passes
    assert kinds(t) == ["CanaryNotReady"] and t.events[0].type == EventType.WARNING
    assert t.events[0].message == f"1/3: 1 of 2 canary replicas ready at step 1: {why}"
    assert condition(t.status, ConditionType.DEGRADED).reason == "AnalysisFailing"
    assert op.tick("rev2", ready=crashed).events == ()  # between analyses nothing is judged
    op.tick("rev2", ready=crashed, analysed=True, not_ready=why)  # no verdict: no ready pod answered
    t = op.tick("rev2", ready=crashed, analysed=True, not_ready=why)
    assert kinds(t) == ["RolledBack"]
    rolled_back = condition(t.status, ConditionType.ROLLED_BACK)
    assert rolled_back.reason == "CanaryNotReady" and why in rolled_back.message


def test_the_progress_deadline_is_time_without_progress():
    """8 replicas, each canary replica loading for 9 minutes, one at a time (maxUnavailable 1):
    the step takes 36 minutes, past a 30-minute deadline, but never 30 minutes without a replica
    turning ready."""
    op = Operator(make_spec(8, progressDeadline="30m"))
    op.tick("rev1")
    added: list[datetime] = []  # when each canary replica was set
    for _ in range(120):
        loaded = sum(1 for at in added if op.now - at >= timedelta(minutes=9))
        t = op.tick("rev2", ready={"rev1": op.ready.get("rev1", 8), "rev2": loaded})
        assert "RolledBack" not in kinds(t)
        added += [op.now - INTERVAL] * (t.replicas["rev2"] - len(added))
        if "StepReached" in kinds(t):
            break
    assert t.status.rollout.step_started_at - T0 > timedelta(minutes=35)


def test_windows_count_only_once_the_route_holds_the_step_weight():
    op = Operator(make_spec(trafficRouting={"httpRoute": "gateway"}))
    op.tick("rev1")
    op.tick("rev2")
    op.tick("rev2")
    reached = op.now
    t = advance(op.status, "rev2", op.spec, now=reached, ready={"rev1": 2, "rev2": 2})  # the route patch conflicts
    assert kinds(t) == ["StepReached"] and t.status.rollout.canary_weight == 50
    assert t.status.rollout.analysis_since is None
    idle = verdict(op.spec, "rev2", MetricSnapshot(), reached, reached + WINDOW)  # weight 0: no requests yet
    for minute in range(1, 6):
        t = advance(t.status, "rev2", op.spec, now=reached + timedelta(minutes=minute), ready={"rev1": 2, "rev2": 2},
                    verdict=idle, analysed=True)
    assert t.status.rollout.phase == RolloutPhase.PROGRESSING and t.status.rollout.consecutive_inconclusive == 0
    carried = reached + timedelta(minutes=6)
    status = weight_in_effect(t.status, 50, op.spec, carried)  # the patch went through
    assert status.rollout.analysis_since == carried
    early = verdict(op.spec, "rev2", HEALTHY, reached, carried + WINDOW)  # began before the weight: no step
    t = advance(status, "rev2", op.spec, now=carried + WINDOW, ready={"rev1": 2, "rev2": 2}, verdict=early,
                analysed=True)
    assert t.status.canary_step == 0
    whole = verdict(op.spec, "rev2", HEALTHY, carried, carried + WINDOW)
    t = advance(t.status, "rev2", op.spec, now=carried + WINDOW, ready={"rev1": 2, "rev2": 2}, verdict=whole,
                analysed=True)
    assert kinds(t)[0] == "StepPassed"


# -- commands by value ---------------------------------------------------------------------------


def test_a_command_naming_another_revision_is_ignored():
    op = Operator(make_spec())
    op.tick("rev1")
    op.tick("4f2a9c1e7b")
    t = op.tick("4f2a9c1e7b", commands={Command.ABORT: "0123456789"})
    assert kinds(t) == ["CommandIgnored"] and "names revision 0123456789, the canary is 4f2a9c1e7b" in t.events[0].message
    assert t.status.rollout.phase == RolloutPhase.PROGRESSING and t.status.commands.abort == "0123456789"
    t = op.tick("4f2a9c1e7b", commands={Command.ABORT: "4f2a9c1e7b"})
    assert kinds(t) == ["RolledBack"]


def test_a_pause_set_before_an_edit_holds_the_new_rollout():
    op = Operator(make_spec())
    op.tick("rev1", commands={Command.PAUSE: "hold"})
    assert op.status.commands.pause is None  # nothing to hold yet: it waits
    t = op.tick("rev2", commands={Command.PAUSE: "hold"})
    assert kinds(t) == ["RolloutStarted", "ManualPause"] and t.status.commands.pause == "hold"
    t = op.tick("rev2", commands={Command.PAUSE: "hold", Command.RESUME: "go"})
    assert kinds(t)[0] == "Resumed"
    given = {Command.PAUSE: "hold", Command.RESUME: "go", Command.PROMOTE: "ship"}  # as GitOps keeps them
    while op.status.canary_revision is not None:
        op.tick("rev2", commands=given)
    t = op.tick("rev3", commands=given)  # the next rollout: every value was handled
    assert kinds(t) == ["RolloutStarted"] and t.status.rollout.phase == RolloutPhase.PROGRESSING


def test_retry_starts_the_rolled_back_canary_again_once_per_value():
    op = Operator(make_spec())
    op.reach_first_step()
    t = op.tick("rev2", commands={Command.RETRY: "r0"})
    assert kinds(t) == ["CommandIgnored"] and "no rolled-back revision" in t.events[0].message
    t = op.tick("rev2", commands={Command.ABORT: "a1"})
    assert t.replicas == {"rev1": 3, "rev2": 1}  # rev2 retiring
    t = op.tick("rev2", commands={Command.ABORT: "a1", Command.RETRY: "0123456789"}, ready={"rev1": 2, "rev2": 1})
    assert kinds(t) == ["CommandIgnored"] and "the rolled-back one is rev2" in t.events[0].message
    assert t.replicas == {"rev1": 3, "rev2": 1}  # the stable's third replica still loading: rev2 stays
    t = op.tick("rev2", commands={Command.ABORT: "a1", Command.RETRY: "r1"}, ready={"rev1": 2, "rev2": 1})
    assert kinds(t) == ["RolloutRetried"] and t.status.commands.retry == "r1"
    s = t.status
    assert (s.canary_revision, s.canary_step, s.rollout.phase, s.rollout.retiring) == ("rev2", 0, RolloutPhase.PROGRESSING, ())
    assert t.replicas == {"rev1": 2, "rev2": 2}  # its retiring replica is the canary's again, and one more
    t = op.tick("rev2", commands={Command.ABORT: "a1", Command.RETRY: "r1"})  # both re-applied: nothing happens
    assert t.status.rollout.phase == RolloutPhase.PROGRESSING and "RolledBack" not in kinds(t)
