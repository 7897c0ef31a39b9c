"""Prometheus metrics: the names and labels of DESIGN.md §3, in one registry per server.

Two sources:
- *request-side* series (success by finished_reason, errors by HTTP code, prompt/generation
  tokens, TTFT, inter-token latency, end-to-end latency) are observed by the server as each
  request ends;
- *engine-side* series (running/waiting, KV usage, preemptions, prefix-cache hits, the
  spec-decode counters and ``spec_decode_enabled``) are read from ``engine.stats()`` at scrape
  time by a custom collector, so they can never drift from the engine's own bookkeeping.

Inter-token latency is observed once per request with ≥ 2 output tokens, as its mean time per
output token after the first: with speculation several tokens land in one step, so per-token
gaps would be mostly zero and tell less than the per-request mean.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from specdecode.runtime.engine.sequence import FinishReason, RequestOutput

PREFIX = "specdecode:"
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
               2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


class EngineStatsCollector(Collector):
    """Engine-side gauges and cumulative counters, read from ``stats()`` at each scrape."""

    def __init__(self, stats: Callable[[], object]):
        self.stats = stats

    def describe(self) -> Iterable[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        s = self.stats()

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            return GaugeMetricFamily(PREFIX + name, doc, value=value)

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            return CounterMetricFamily(PREFIX + name, doc, value=value)

        yield gauge("num_requests_running", "Requests scheduled on the model.", s.num_running)
        yield gauge("num_requests_waiting", "Requests waiting to be scheduled.", s.num_waiting)
        yield gauge("kv_cache_usage_perc", "Fraction of KV cache blocks in use (0..1).", s.kv_cache_usage)
        yield counter("num_preemptions", "Sequences preempted (to be recomputed).", s.num_preemptions)
        yield counter("prefix_cache_hits", "Prompt tokens served from the prefix cache.", s.prefix_cache_hit_tokens)
        yield counter("spec_decode_num_drafts", "Draft proposals verified.", s.spec_decode_num_drafts)
        yield counter("spec_decode_num_draft_tokens", "Draft tokens proposed.", s.spec_decode_num_draft_tokens)
        yield counter(
            "spec_decode_num_accepted_tokens", "Draft tokens accepted.", s.spec_decode_num_accepted_tokens
        )
        per_pos = CounterMetricFamily(
            PREFIX + "spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted, by position in the draft.",
            labels=["position"],
        )
        for position, count in enumerate(s.spec_decode_num_accepted_tokens_per_pos):
            per_pos.add_metric([str(position)], count)
        yield per_pos
        yield gauge("spec_decode_enabled", "1 while speculation is on (load control), else 0.",
                    float(s.spec_decode_enabled))


@dataclass
class RequestTimer:
    """One request's timeline, fed with each engine output."""

    arrival: float = field(default_factory=time.monotonic)
    first_token: float | None = None
    last_token: float | None = None
    tokens_by_index: dict[int, int] = field(default_factory=dict)
    prompt_tokens: int = 0
    generation_tokens: int = 0

    def on_output(self, out: RequestOutput) -> None:
        now = time.monotonic()
        self.prompt_tokens = out.num_prompt_tokens
        self.generation_tokens = out.num_output_tokens
        new = [d for d in out.deltas if d.token_ids]
        if not new:
            return
        self.first_token = self.first_token or now
        self.last_token = now
        for d in new:
            self.tokens_by_index[d.index] = self.tokens_by_index.get(d.index, 0) + len(d.token_ids)

    @property
    def mean_inter_token_latency(self) -> float | None:
        longest = max(self.tokens_by_index.values(), default=0)
        if longest < 2 or self.first_token is None or self.last_token is None:
            return None
        return (self.last_token - self.first_token) / (longest - 1)


class ServerMetrics:
    def __init__(self, engine_stats: Callable[[], object]):
        self.registry = CollectorRegistry()
        r = self.registry
        self.success = Counter(
            PREFIX + "request_success_total", "Completions that ended, by finish reason.", ["finished_reason"],
            registry=r,
        )
        for reason in FinishReason:
            self.success.labels(reason.value)
        self.errors = Counter(PREFIX + "request_errors_total", "Error responses, by HTTP status.", ["code"],
                              registry=r)
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens_total", "Prompt tokens processed.", registry=r)
        self.generation_tokens = Counter(PREFIX + "generation_tokens_total", "Tokens generated.", registry=r)
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "Arrival to first output token.",
                              buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram(PREFIX + "inter_token_latency_seconds",
                             "Mean time per output token after the first, one observation per request.",
                             buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds", "Arrival to last output.",
                             buckets=E2E_BUCKETS, registry=r)
        r.register(EngineStatsCollector(engine_stats))

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def record_error(self, status: int) -> None:
        self.errors.labels(str(status)).inc()

    def record_finished(self, timer: RequestTimer, finish_reasons: Iterable[str]) -> None:
        """A request that reached the engine ended (finished or aborted)."""
        for reason in finish_reasons:
            self.success.labels(reason).inc()
        self.prompt_tokens.inc(timer.prompt_tokens)
        self.generation_tokens.inc(timer.generation_tokens)
        self.e2e.observe(time.monotonic() - timer.arrival)
        if timer.first_token is not None:
            self.ttft.observe(timer.first_token - timer.arrival)
        itl = timer.mean_inter_token_latency
        if itl is not None:
            self.itl.observe(itl)
