"""loop: one reconciliation of a SpecDecodeDeployment, over whatever runs its revisions.

Two backends run revisions: Kubernetes (``controller.KubeBackend``: workloads, pods, an HTTPRoute)
and local processes (``specdecode up``: a process per pod, a router). Each implements ``Backend``;
``converge`` is the loop both share, so the rollout's shell exists once:

    observe (revision, ready replicas, pods) → analyse the canary (its pods' /metrics, or
    Prometheus) and probe its outputs against the stable's (``equivalence``) → rollout.advance →
    the backend carries the transition out (replicas, route weight) → weight_in_effect → status,
    Events, consumed annotations

Pods are plain dicts shaped as the Kubernetes API shows them (``status.containerStatuses``,
``conditions``, …), so ``failures.failure`` and ``pods.not_ready_reason`` read both backends.
The analysis samples (``History``) are the caller's to keep between calls: ``converge`` takes the
last one and returns the next.
"""
from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, Protocol, TypeVar

from specdecode.operator import equivalence, scrape
from specdecode.operator.analysis import (
    History,
    Measurement,
    Verdict,
    already_counted,
    counting,
    judge,
    measurement_from_prometheus,
    parse_metrics,
    prometheus_queries,
    without_data,
)
from specdecode.operator.failures import failure
from specdecode.operator.pods import not_ready_reason
from specdecode.operator.reconcile import is_not_ready, not_ready
from specdecode.operator.resolve import Resolved, duration_seconds
from specdecode.operator.rollout import Event, EventType, Transition, advance, read_commands, weight_in_effect
from specdecode.operator.spec import EquivalenceState, EquivalenceStatus, RolloutPhase, SpecDecodeDeploymentStatus
from specdecode.runtime.config import SpeculativeMethod

Obj = dict[str, Any]
SCRAPE_TIMEOUT_SECONDS = 5.0


@dataclass(frozen=True)
class Observed:
    """What runs, as one backend sees it."""

    revision: str  # the revision the current spec asks for, as this backend runs it
    ready: Mapping[str, int]  # ready replicas (whole parallel groups) per revision
    pods: Sequence[Obj]  # the runtime pods (or processes, shaped as pods)
    children: Sequence[Obj] = ()  # the workloads (and other children) as listed, if the backend has any
    events: Sequence[Obj] = ()  # Events of the namespace that may say why pods are not created


@dataclass(frozen=True)
class Unwritten:
    """Writes the backend could not make, and why: ``reconcile.CHILD_REFUSED`` (refused: invalid,
    a policy, a quota), ``APPLY_FAILED`` (failed otherwise) or ``ROUTE_REFUSED``; with the
    server's message, naming what was written to."""

    reason: str
    message: str


@dataclass(frozen=True)
class Outcome:
    """What carrying a transition out did."""

    warnings: tuple[str, ...] = ()
    unwritten: Unwritten | None = None  # Ready=False with its reason, until the writes are made
    weight_carried: bool = True  # the route holds the canary weight asked for, or none decides traffic
    status: Mapping[str, Any] = field(default_factory=dict)  # the backend's own status fields
    events: tuple[Event, ...] = ()  # what the backend saw happen (a replica restarted)


O = TypeVar("O", bound=Observed)


class Backend(Protocol[O]):
    def observe(self, r: Resolved, status: SpecDecodeDeploymentStatus) -> O: ...

    def carry_out(self, r: Resolved, observed: O, t: Transition) -> Outcome:
        """Run ``t.replicas`` of each revision and set ``t.status.rollout.canaryWeight``."""

    def serving_endpoints(self, r: Resolved, observed: O, revision: str) -> list[tuple[str, str]]:
        """(pod, base URL) of each ready pod of ``revision`` that serves requests."""

    def write_status(self, r: Resolved, status: SpecDecodeDeploymentStatus) -> None: ...

    def post_events(self, r: Resolved, events: Sequence[Event]) -> None: ...

    def remove_annotations(self, r: Resolved, keys: Sequence[str]) -> None: ...


@dataclass(frozen=True)
class Carried:
    """What one pass hands the next (the caller keeps it; lost on restart): the canary's samples
    and the equivalence probe in flight."""

    history: History | None = None
    probing: equivalence.Probing | None = None


@dataclass(frozen=True)
class Converged:
    status: SpecDecodeDeploymentStatus
    verdict: Verdict | None
    carried: Carried  # to pass to the next call
    unwritten: Unwritten | None = None  # what the backend could not write (the caller retries)


def converge(backend: Backend[O], r: Resolved, status: SpecDecodeDeploymentStatus, *,
             annotations: Mapping[str, str] | None, generation: int | None, now: datetime,
             carried: Carried, logger: logging.Logger, analyze: bool) -> Converged:
    """One pass of the loop (the module docstring); ``analyze``: this is the analysis interval's."""
    observed = backend.observe(r, status)
    history, probing = carried.history, carried.probing
    verdict, history = analyse(backend, r, observed, status, now, history, logger) if analyze else (None, history)
    verdict = _uncounted(verdict, r, status, logger)
    probed, probing = probe_outputs(backend, r, observed, status, probing) if analyze else (None, probing)
    canary = status.canary_revision
    seen = equivalence.recorded(status.equivalence, probed) if probed is not None else status.equivalence
    t = advance(status, observed.revision, r.spec, now=now, ready=observed.ready, verdict=verdict, analysed=analyze,
                commands=read_commands(annotations), failure=failure(observed.pods, observed.children, observed.events),
                not_ready=not_ready_reason(observed.pods, canary) if canary and analyze else None, probe=probed,
                outputs_checked=_outputs_checked(r, status, seen))
    outcome = backend.carry_out(r, observed, t)
    weight = t.status.rollout.canary_weight
    settled = weight_in_effect(t.status, weight, r.spec, now) if outcome.weight_carried else t.status
    new = settled.model_copy(update={"observed_generation": generation, "warnings": (*r.warnings, *outcome.warnings),
                                     **outcome.status})
    if verdict is not None and verdict.measurement.revision == new.canary_revision:
        new = new.model_copy(update={"rollout": new.rollout.model_copy(
            update={"verdicts": counting(new.rollout.verdicts, verdict)})})
    events = [*t.events, *outcome.events]
    if probed is not None:
        new = new.model_copy(update={"equivalence": seen})
        events += _probe_events(status.equivalence, probed)
    if (unwritten := outcome.unwritten) is not None:
        if not is_not_ready(status, unwritten.reason, unwritten.message):
            events.append(Event(EventType.WARNING, unwritten.reason, unwritten.message))
        new = not_ready(new, unwritten.reason, unwritten.message, now, before=status)
    if new != status:
        backend.write_status(r, new)
    backend.remove_annotations(r, t.consumed_annotations)
    backend.post_events(r, events)
    return Converged(new, verdict, Carried(history, probing), unwritten)


# -- analysis -----------------------------------------------------------------------------------


def _uncounted(verdict: Verdict | None, r: Resolved, status: SpecDecodeDeploymentStatus,
               logger: logging.Logger) -> Verdict | None:
    """``verdict``, unless status shows its interval counted already (``analysis.already_counted``)."""
    interval = timedelta(seconds=duration_seconds(r.spec.rollout.analysis.interval))
    if verdict is None or not already_counted(verdict, status.rollout.verdicts, interval):
        return verdict
    m = verdict.measurement
    logger.info("verdict on %s over %s to %s not counted: its interval was counted already", m.revision,
                m.start.isoformat(), m.end.isoformat())
    return None


def analyse(backend: Backend[O], r: Resolved, observed: O, status: SpecDecodeDeploymentStatus, now: datetime,
            history: History | None, logger: logging.Logger) -> tuple[Verdict | None, History | None]:
    """The canary's verdict over the last window (None without a canary or without data yet), and
    its samples so far."""
    canary, analysis = status.canary_revision, r.spec.rollout.analysis
    if canary is None:
        return None, None
    history = history if history is not None and history.revision == canary else History(canary)
    try:
        if analysis.prometheus is not None:
            queries = prometheus_queries(r.namespace, r.name, canary, analysis.window)
            results = scrape.query_prometheus(analysis.prometheus.url, queries, SCRAPE_TIMEOUT_SECONDS)
            measurement: Measurement | None = measurement_from_prometheus(results, canary, now, analysis.window)
        else:
            targets = [(pod, f"{url}/metrics") for pod, url in backend.serving_endpoints(r, observed, canary)]
            history = _sample(targets, history, now, r, logger)
            measurement = history.measure(now, timedelta(seconds=duration_seconds(analysis.window)))
    except scrape.ScrapeError as exc:  # a window without data counts towards inconclusiveLimit, as one without traffic
        logger.warning("analysis of %s without data: %s", canary, exc)
        return without_data(canary, str(exc), now), history
    if measurement is None:
        return None, history
    return judge(measurement, analysis, speculative=r.spec.speculative.method is not SpeculativeMethod.NONE), history


def probe_outputs(backend: Backend[O], r: Resolved, observed: O, status: SpecDecodeDeploymentStatus,
                  probing: equivalence.Probing | None
                  ) -> tuple[equivalence.ProbeResult | None, equivalence.Probing | None]:
    """The result of the canary's equivalence probe that has ended (None: none has), and the probe
    in flight after this call: a new one, on the canary's first ready replica against the stable's
    first, when none runs and a progressing canary can be probed."""
    canary, config = status.canary_revision, r.spec.rollout.analysis.equivalence
    ended = probing.result() if probing is not None else None
    if probing is not None and ended is None:
        return None, probing
    ended = ended if ended is not None and ended.revision == canary else None
    if (canary is None or canary != observed.revision or status.stable_revision is None or config.enabled is False
            or status.rollout.phase is not RolloutPhase.PROGRESSING
            or (ended is not None and ended.state is EquivalenceState.DIVERGED)):
        return ended, None
    if status.stable_model != r.spec.model.uri:
        return equivalence.skipped(canary, "the stable revision's model is not known yet" if status.stable_model is None
                                   else f"the canary serves model {r.spec.model.uri}, the stable {status.stable_model}: "
                                        "outputs of two models are not compared"), None
    stable, new = (backend.serving_endpoints(r, observed, rev) for rev in (status.stable_revision, canary))
    if not stable or not new:  # one side starting, or (at a reached step) none to reach, e.g. no stable at 100 %
        reached = status.rollout.step_started_at is not None
        missing = "stable replica to compare with" if not stable else "canary replica to probe"
        return ended or (equivalence.skipped(canary, f"no ready {missing}") if reached else None), None
    so_far = equivalence.recorded(status.equivalence, ended) if ended is not None else status.equivalence
    done = so_far.prompts_same + so_far.near_ties if so_far is not None and so_far.revision == canary else 0
    prompts, model = equivalence.prompts_for(config, done), r.spec.model.served_name or r.name
    return ended, equivalence.Probing(canary, lambda: equivalence.probe(
        stable[0][1], new[0][1], revision=canary, model=model, prompts=prompts, config=config))


def _outputs_checked(r: Resolved, status: SpecDecodeDeploymentStatus, seen: EquivalenceStatus | None) -> bool:
    """Whether the canary may pass a step as far as its outputs go: the probe is off, or a probe of
    it has ended or was skipped (another model, no stable replica to compare with)."""
    return r.spec.rollout.analysis.equivalence.enabled is False or (
        seen is not None and seen.revision == status.canary_revision)


def _probe_events(before: EquivalenceStatus | None, result: equivalence.ProbeResult) -> list[Event]:
    """An Event when the probe of a revision turns inconclusive because the stable disagreed with
    itself, or is skipped (a divergence is the rollback's own Event). A probe whose requests
    failed (a replica the rollout itself is stopping, a runtime that wants an API key) says so in
    status only: the next interval probes again."""
    kinds = {EquivalenceState.INCONCLUSIVE: (EventType.WARNING, "EquivalenceInconclusive"),
             EquivalenceState.SKIPPED: (EventType.NORMAL, "EquivalenceSkipped")}
    unchanged = before is not None and before.revision == result.revision and before.state is result.state
    failed = result.state is EquivalenceState.INCONCLUSIVE and result.divergence is None
    if result.state not in kinds or unchanged or failed:
        return []
    kind, reason = kinds[result.state]
    return [Event(kind, reason, f"canary {result.revision}: {result.message}")]


def _sample(targets: Sequence[tuple[str, str]], history: History, now: datetime, r: Resolved,
            logger: logging.Logger) -> History:
    """``history`` with a sample of every target's ``/metrics``, scraped all at once within
    ``SCRAPE_TIMEOUT_SECONDS`` (``scrape.fetch_all``). Raises ``scrape.ScrapeError`` when targets
    exist but none could be sampled (the history with what was kept rides along)."""
    window = timedelta(seconds=duration_seconds(r.spec.rollout.analysis.window))
    failures = []
    for (pod, _), answer in zip(targets, scrape.fetch_all([url for _, url in targets], SCRAPE_TIMEOUT_SECONDS)):
        try:
            snapshot = parse_metrics(_text(answer))
        except (scrape.ScrapeError, ValueError) as exc:  # unreachable, or not a Prometheus exposition
            logger.warning("canary pod %s not sampled: %s", pod, exc)
            failures.append(f"pod {pod}: {exc}")
            continue
        history = history.record(pod, now, snapshot, keep=window)
    if targets and len(failures) == len(targets):
        raise scrape.ScrapeError("no canary pod answered /metrics: " + "; ".join(failures))
    return history


def _text(answer: str | scrape.ScrapeError) -> str:
    if isinstance(answer, scrape.ScrapeError):
        raise answer
    return answer
