"""analysis: a canary revision's runtime metrics → a ``Measurement`` over a window → a ``Verdict``.

Pure (no I/O). Two sources, one ``Measurement``:

- **Scraping** (default). Every ``analysis.interval`` the shell fetches each canary pod's
  ``/metrics``, parses it (``parse_metrics``) and records it: ``history = history.record(pod, now,
  snapshot, keep=window)``. ``history.measure(now, window)`` sums, per pod, the increase between
  consecutive samples inside the window (the baseline is the pod's oldest sample not older than
  the window), so a pod restart inside the window (counters back to zero) costs only the
  increase before the restart, as Prometheus' ``increase()`` does. It is None until some pod has
  two samples in the window: the shell then has no verdict to give. When ready canary pods run
  but none answers, the window is inconclusive (``without_data``), as one without traffic is.
- **Prometheus** (``analysis.prometheus.url``): the shell sends ``prometheus_queries(...)`` to
  ``/api/v1/query`` and hands the ``data.result`` lists to ``measurement_from_prometheus``; a
  Prometheus that does not answer gives an inconclusive window too.

``judge(measurement, analysis)`` compares it with the SLO: FAIL on any breach, INCONCLUSIVE when
a configured SLO had no data (no drafts for the acceptance SLOs, no requests at all), else PASS;
its reasons name the SLO fields as the CRD spells them.

Where state lives: the ``History`` is the shell's, in memory, one per resource and canary
revision (``History(revision)`` when the canary changes). An operator restart loses it; the
rollout's step and counters are in status (``rollout.py``), so the step resumes and waits for one
fresh window, measured from the restart.

Terms: *drafts* are proposals verified (one per running sequence and step), *draft tokens* the
tokens they proposed, *accepted tokens* those the target kept. Acceptance rate = accepted / draft
tokens; mean acceptance length = 1 + accepted / drafts (the bonus token counts). Error rate counts
server errors (HTTP 5xx) only: a 4xx is the client's request, not the revision's fault.
"""
from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from enum import Enum
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from specdecode.operator import names
from specdecode.operator.resolve import duration_seconds
from specdecode.operator.spec import Analysis, CountedVerdict, MeasuredAcceptance

METRIC_PREFIX = "specdecode:"  # the runtime's (runtime/server/metrics.py PREFIX); a test ties the two
P95 = 0.95
# Labels Prometheus Operator puts on every series a ServiceMonitor scrapes.
PROMETHEUS_NAMESPACE_LABEL = "namespace"
PROMETHEUS_SERVICE_LABEL = "service"


# -- one scrape ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class MetricSnapshot:
    """The counters analysis reads from one scrape (or their increase over a window)."""

    drafts: float = 0.0
    draft_tokens: float = 0.0
    accepted_tokens: float = 0.0
    accepted_per_position: Mapping[int, float] = field(default_factory=dict)
    successes: Mapping[str, float] = field(default_factory=dict)  # by finished_reason
    errors: Mapping[str, float] = field(default_factory=dict)  # by HTTP status code
    generation_tokens: float = 0.0
    itl_buckets: Mapping[float, float] = field(default_factory=dict)  # le (seconds, +Inf = inf) → cumulative count
    itl_count: float = 0.0
    itl_sum: float = 0.0

    def values(self) -> list[float]:
        out: list[float] = []
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            out += list(value.values()) if isinstance(value, Mapping) else [value]
        return out


_SCALARS = {
    "spec_decode_num_drafts": "drafts",
    "spec_decode_num_draft_tokens": "draft_tokens",
    "spec_decode_num_accepted_tokens": "accepted_tokens",
    "generation_tokens": "generation_tokens",
    "inter_token_latency_seconds_count": "itl_count",
    "inter_token_latency_seconds_sum": "itl_sum",
}
# series with a label → (snapshot field, label, how the label value becomes the key)
_LABELLED: dict[str, tuple[str, str, Callable[[str], Any]]] = {
    "spec_decode_num_accepted_tokens_per_pos": ("accepted_per_position", "position", int),
    "request_success": ("successes", "finished_reason", str),
    "request_errors": ("errors", "code", str),
    "inter_token_latency_seconds_bucket": ("itl_buckets", "le", float),
}
_LABEL_VALUE = {label: convert for _, label, convert in _LABELLED.values()}


def _series_key(sample_name: str) -> str:
    """``specdecode:request_success_total`` → ``request_success``: the parser strips ``_total``
    from counter *family* names but not from sample names, so match samples without it."""
    return sample_name.removeprefix(METRIC_PREFIX).removesuffix("_total")


def parse_metrics(text: str) -> MetricSnapshot:
    """The analysis counters in one ``/metrics`` exposition of the runtime; absent series are 0."""
    scalars: dict[str, float] = {}
    labelled: dict[str, dict[Any, float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = _series_key(sample.name)
            if key in _SCALARS:
                scalars[_SCALARS[key]] = scalars.get(_SCALARS[key], 0.0) + sample.value
            elif key in _LABELLED and _LABELLED[key][1] in sample.labels:
                target, label, convert = _LABELLED[key]
                by = labelled.setdefault(target, {})
                value_key = convert(sample.labels[label])
                by[value_key] = by.get(value_key, 0.0) + sample.value
    return MetricSnapshot(**scalars, **labelled)


# -- arithmetic over snapshots ------------------------------------------------------------------


def _combine(a: MetricSnapshot, b: MetricSnapshot, op: Callable[[float, float], float]) -> MetricSnapshot:
    values: dict[str, Any] = {}
    for f in dataclasses.fields(MetricSnapshot):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, Mapping):
            values[f.name] = {k: op(x.get(k, 0.0), y.get(k, 0.0)) for k in sorted({*x, *y})}
        else:
            values[f.name] = op(x, y)
    return MetricSnapshot(**values)


def total(snapshots: Sequence[MetricSnapshot]) -> MetricSnapshot:
    out = MetricSnapshot()
    for snapshot in snapshots:
        out = _combine(out, snapshot, lambda x, y: x + y)
    return out


def delta(earlier: MetricSnapshot, later: MetricSnapshot) -> MetricSnapshot:
    """The increase from ``earlier`` to ``later`` of one pod. If any counter went down the
    process restarted in between and started from zero: the increase is ``later`` itself."""
    difference = _combine(later, earlier, lambda x, y: x - y)
    if any(value < 0 for value in difference.values()):
        return later
    return difference


# -- a window -----------------------------------------------------------------------------------


def histogram_quantile(q: float, buckets: Mapping[float, float]) -> float | None:
    """The ``q`` quantile of cumulative ``buckets`` (le → count), interpolated linearly inside
    its bucket as Prometheus' ``histogram_quantile`` does; None without observations."""
    bounds = sorted(buckets)
    if not bounds or bounds[-1] != math.inf or buckets[math.inf] <= 0:
        return None
    rank = q * buckets[math.inf]
    lower, below = 0.0, 0.0
    for le in bounds:
        count = buckets[le]
        if count >= rank and count > below:
            if le == math.inf:
                return lower  # past the last finite bound: the best Prometheus can say
            return lower + (le - lower) * (rank - below) / (count - below)
        lower, below = le, count
    return lower


@dataclass(frozen=True)
class Measurement:
    """What one revision's pods did between ``start`` and ``end`` (``increase`` summed over pods)."""

    revision: str
    increase: MetricSnapshot
    start: datetime
    end: datetime

    @property
    def seconds(self) -> float:
        return (self.end - self.start).total_seconds()

    @property
    def server_errors(self) -> float:
        return sum(count for code, count in self.increase.errors.items() if code.startswith("5"))

    @property
    def requests(self) -> float:
        """Requests that ended: finished (any reason) or answered with a server error."""
        return sum(self.increase.successes.values()) + self.server_errors

    @property
    def acceptance_rate(self) -> float | None:
        s = self.increase
        return s.accepted_tokens / s.draft_tokens if s.draft_tokens > 0 else None

    @property
    def mean_acceptance_length(self) -> float | None:
        s = self.increase
        return 1.0 + s.accepted_tokens / s.drafts if s.drafts > 0 else None

    @property
    def per_position_acceptance(self) -> tuple[float, ...]:
        """Fraction of drafts whose token at each position was accepted; empty without drafts."""
        s = self.increase
        if s.drafts <= 0 or not s.accepted_per_position:
            return ()
        return tuple(s.accepted_per_position.get(i, 0.0) / s.drafts for i in range(max(s.accepted_per_position) + 1))

    @property
    def p95_inter_token_latency_ms(self) -> float | None:
        seconds = histogram_quantile(P95, self.increase.itl_buckets)
        return None if seconds is None else seconds * 1000.0

    @property
    def error_rate(self) -> float | None:
        return self.server_errors / self.requests if self.requests > 0 else None


@dataclass(frozen=True)
class Sample:
    at: datetime
    snapshot: MetricSnapshot


@dataclass(frozen=True)
class History:
    """Per-pod samples of one revision (pod → samples, oldest first); immutable, ``record``
    returns the next one. Held in memory by the shell (see the module docstring)."""

    revision: str
    samples: Mapping[str, tuple[Sample, ...]] = field(default_factory=dict)

    def record(self, pod: str, at: datetime, snapshot: MetricSnapshot, keep: timedelta) -> History:
        """With ``snapshot`` of ``pod`` (its name) added and samples older than ``keep`` before
        ``at`` dropped, pods left without samples included."""
        horizon = at - keep
        updated = {**self.samples, pod: (*self.samples.get(pod, ()), Sample(at, snapshot))}
        kept = {p: tuple(s for s in samples if s.at >= horizon) for p, samples in updated.items()}
        return History(self.revision, {p: samples for p, samples in kept.items() if samples})

    def measure(self, now: datetime, window: timedelta) -> Measurement | None:
        """The increase over the last ``window``; None until a pod has two samples in it."""
        horizon = now - window
        increases, starts, ends = [], [], []
        for samples in self.samples.values():
            inside = [s for s in samples if horizon <= s.at <= now]
            if len(inside) < 2:
                continue
            increases.append(total([delta(a.snapshot, b.snapshot) for a, b in zip(inside, inside[1:])]))
            starts.append(inside[0].at)
            ends.append(inside[-1].at)
        if not increases:
            return None
        return Measurement(self.revision, total(increases), min(starts), max(ends))


# -- the verdict --------------------------------------------------------------------------------


class Result(str, Enum):
    PASS = "Pass"
    FAIL = "Fail"
    INCONCLUSIVE = "Inconclusive"


@dataclass(frozen=True)
class Verdict:
    result: Result
    reasons: tuple[str, ...]
    measurement: Measurement
    complete: bool  # the measurement spans a whole window (less one interval of scrape jitter)

    @property
    def message(self) -> str:
        return f"{self.result.value}: " + "; ".join(self.reasons)


KEPT_VERDICTS = 10  # counted verdicts kept in status


def already_counted(verdict: Verdict, counted: Sequence[CountedVerdict], interval: timedelta) -> bool:
    """Whether ``verdict`` judges an interval a counted verdict judged: its window ends within half
    an interval of the last counted window on the same revision (or before it). Verdicts are one
    per interval; a second one so soon comes from a second writer, a pass planned again after a
    conflict, or a new leader judging what the last one did."""
    last = next((c for c in reversed(counted) if c.revision == verdict.measurement.revision), None)
    return last is not None and verdict.measurement.end - last.end < interval / 2


def counting(counted: Sequence[CountedVerdict], verdict: Verdict) -> tuple[CountedVerdict, ...]:
    """``counted`` with ``verdict`` (its window) added: the last ``KEPT_VERDICTS`` on its revision."""
    m = verdict.measurement
    new = CountedVerdict(revision=m.revision, result=verdict.result.value, start=m.start, end=m.end)
    return (*(c for c in counted if c.revision == m.revision), new)[-KEPT_VERDICTS:]


def _spelling(field_name: str) -> str:
    return Analysis.model_fields[field_name].alias or field_name


def _check(what: str, value: float | None, limit: float | None, field_name: str, unit: str = "",
           missing: str = "") -> tuple[Result, str] | None:
    """One SLO: None when not configured; the limit is a minimum for ``min_*`` fields."""
    if limit is None:
        return None
    spelled = f"{_spelling(field_name)} {limit:g}"
    if value is None:
        return Result.INCONCLUSIVE, f"{what} unknown: {missing} ({spelled})"
    minimum = field_name.startswith("min_")
    breached = value < limit if minimum else value > limit
    sign = ("<" if breached else "≥") if minimum else (">" if breached else "≤")
    return (Result.FAIL if breached else Result.PASS), f"{what} {value:.3g}{unit} {sign} {spelled}"


def judge(measurement: Measurement, analysis: Analysis, *, speculative: bool = True) -> Verdict:
    """``measurement`` against the SLO in ``analysis``. ``speculative`` is False for method
    ``none``: no drafts are made, so the acceptance SLOs do not apply (resolve warns about it)."""
    m, no_drafts = measurement, "no drafts in the window (method none or speculation off by load control)"
    checks = [
        _check("p95 inter-token latency", m.p95_inter_token_latency_ms, analysis.max_p95_inter_token_latency_ms,
               "max_p95_inter_token_latency_ms", " ms", "no request produced two tokens"),
        _check("error rate", m.error_rate, analysis.max_error_rate, "max_error_rate", missing="no requests"),
    ]
    if speculative:
        checks += [
            _check("acceptance rate", m.acceptance_rate, analysis.min_acceptance_rate, "min_acceptance_rate",
                   missing=no_drafts),
            _check("mean acceptance length", m.mean_acceptance_length, analysis.min_mean_acceptance_length,
                   "min_mean_acceptance_length", missing=no_drafts),
        ]
    done = [c for c in checks if c is not None]
    if m.requests == 0 and m.increase.generation_tokens == 0:
        done.append((Result.INCONCLUSIVE, f"no requests reached revision {m.revision} in {m.seconds:.0f}s"))
    results = {result for result, _ in done}
    result = next((r for r in (Result.FAIL, Result.INCONCLUSIVE) if r in results), Result.PASS)
    reasons = tuple(text for r, text in done if r is result) or (f"{m.requests:.0f} requests, no SLO set",)
    window, interval = duration_seconds(analysis.window), duration_seconds(analysis.interval)
    return Verdict(result, reasons, m, complete=m.seconds >= window - interval)


def without_data(revision: str, reason: str, now: datetime) -> Verdict:
    """The verdict on a window in which the source gave nothing (no canary pod answered, or
    Prometheus did not): inconclusive, as a window without traffic is."""
    return Verdict(Result.INCONCLUSIVE, (reason,), Measurement(revision, MetricSnapshot(), now, now), complete=False)


def measured_acceptance(measurement: Measurement) -> MeasuredAcceptance:
    """The status' ``acceptance`` block for a measurement."""
    m = measurement
    return MeasuredAcceptance(revision=m.revision, rate=m.acceptance_rate, mean_length=m.mean_acceptance_length,
                              p95_inter_token_latency_ms=m.p95_inter_token_latency_ms, error_rate=m.error_rate,
                              draft_tokens=int(m.increase.draft_tokens), measured_at=m.end)


# -- Prometheus ---------------------------------------------------------------------------------

# query key → (series, label to sum by or None); the keys are also snapshot fields
_PROMETHEUS_SERIES: dict[str, tuple[str, str | None]] = {
    "drafts": ("spec_decode_num_drafts_total", None),
    "draft_tokens": ("spec_decode_num_draft_tokens_total", None),
    "accepted_tokens": ("spec_decode_num_accepted_tokens_total", None),
    "accepted_per_position": ("spec_decode_num_accepted_tokens_per_pos_total", "position"),
    "successes": ("request_success_total", "finished_reason"),
    "errors": ("request_errors_total", "code"),
    "generation_tokens": ("generation_tokens_total", None),
    "itl_buckets": ("inter_token_latency_seconds_bucket", "le"),
    "itl_count": ("inter_token_latency_seconds_count", None),
    "itl_sum": ("inter_token_latency_seconds_sum", None),
}


def prometheus_selector(namespace: str, name: str, revision: str) -> str:
    """The series of one revision of one resource as its ServiceMonitor labels them."""
    labels = {PROMETHEUS_NAMESPACE_LABEL: namespace, PROMETHEUS_SERVICE_LABEL: names.service_name(name),
              names.METRIC_LABEL_REVISION: revision}
    return "{" + ",".join(f"{k}={json.dumps(v)}" for k, v in labels.items()) + "}"


def prometheus_queries(namespace: str, name: str, revision: str, window: str) -> dict[str, str]:
    """Instant queries (key → PromQL) for the increase of every analysis series over ``window``
    (a duration such as 5m). The ITL buckets are fetched ``by (le)``, what
    ``histogram_quantile`` reads: the p95 is computed here the same way for both sources."""
    selector = prometheus_selector(namespace, name, revision)
    queries = {}
    for key, (series, by) in _PROMETHEUS_SERIES.items():
        grouping = f" by ({by})" if by else ""
        queries[key] = f"sum{grouping} (increase({METRIC_PREFIX}{series}{selector}[{window}]))"
    return queries


def measurement_from_prometheus(results: Mapping[str, Sequence[Mapping[str, Any]]], revision: str,
                                now: datetime, window: str) -> Measurement:
    """A measurement from the ``data.result`` vector of each query in ``prometheus_queries``
    (same keys); a missing or empty result reads as 0."""
    values: dict[str, Any] = {}
    for key, (_, by) in _PROMETHEUS_SERIES.items():
        vector = results.get(key) or ()
        if by is None:
            values[key] = sum(float(item["value"][1]) for item in vector)
        else:
            convert = _LABEL_VALUE[by]
            labelled = [item for item in vector if by in item["metric"]]
            values[key] = {convert(item["metric"][by]): float(item["value"][1]) for item in labelled}
    return Measurement(revision, MetricSnapshot(**values), now - timedelta(seconds=duration_seconds(window)), now)
