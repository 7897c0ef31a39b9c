"""analysis: the runtime's own /metrics → snapshots → a window's measurement → a verdict; and the
Prometheus path to the same measurement."""
import math
from datetime import UTC, datetime, timedelta
from types import SimpleNamespace

import pytest

from specdecode.operator import names
from specdecode.operator.analysis import (
    METRIC_PREFIX,
    History,
    Measurement,
    MetricSnapshot,
    Result,
    delta,
    histogram_quantile,
    judge,
    measured_acceptance,
    measurement_from_prometheus,
    parse_metrics,
    prometheus_queries,
)
from specdecode.operator.spec import Analysis
from specdecode.runtime.server import metrics as runtime_metrics

T0 = datetime(2025, 3, 1, 12, 0, tzinfo=UTC)
WINDOW = timedelta(minutes=5)


def engine_stats(drafts=0, draft_tokens=0, accepted=0, per_pos=()):
    return SimpleNamespace(num_running=1, num_waiting=0, kv_cache_usage=0.25, num_preemptions=0,
                           prefix_cache_hit_tokens=0, spec_decode_num_drafts=drafts,
                           spec_decode_num_draft_tokens=draft_tokens, spec_decode_num_accepted_tokens=accepted,
                           spec_decode_num_accepted_tokens_per_pos=list(per_pos), spec_decode_enabled=True)


def exposition(stats, *, stops=0, lengths=0, errors=(), generated=0, itl_seconds=()) -> str:
    """What a runtime pod's /metrics answers, made by the runtime's own metrics module."""
    server = runtime_metrics.ServerMetrics(lambda: stats)
    server.success.labels("stop").inc(stops)
    server.success.labels("length").inc(lengths)
    for code in errors:
        server.record_error(code)
    server.generation_tokens.inc(generated)
    for seconds in itl_seconds:
        server.itl.observe(seconds)
    return server.render().decode()


def snapshot(drafts=0.0, draft_tokens=0.0, accepted=0.0, stops=0.0, errors=None, itl=None, **more) -> MetricSnapshot:
    return MetricSnapshot(drafts=drafts, draft_tokens=draft_tokens, accepted_tokens=accepted,
                          successes={"stop": stops}, errors=errors or {}, itl_buckets=itl or {}, **more)


def measurement(increase: MetricSnapshot, seconds: float = 300) -> Measurement:
    return Measurement("canary1", increase, T0, T0 + timedelta(seconds=seconds))


# -- parsing the runtime's exposition -----------------------------------------------------------


def test_prefix_is_the_runtimes():
    assert METRIC_PREFIX == runtime_metrics.PREFIX


def test_parse_reads_every_series_the_runtime_exports():
    text = exposition(engine_stats(drafts=10, draft_tokens=40, accepted=22, per_pos=(9, 7, 4, 2)),
                      stops=5, lengths=2, errors=(500, 400, 503), generated=123, itl_seconds=(0.004, 0.02, 0.02, 3.0))
    s = parse_metrics(text)
    assert (s.drafts, s.draft_tokens, s.accepted_tokens, s.generation_tokens) == (10, 40, 22, 123)
    assert s.accepted_per_position == {0: 9, 1: 7, 2: 4, 3: 2}
    assert s.successes == {"stop": 5, "length": 2, "abort": 0}
    assert s.errors == {"500": 1, "400": 1, "503": 1}
    assert (s.itl_count, round(s.itl_sum, 6)) == (4, 3.044)
    assert s.itl_buckets[0.0025] == 0 and s.itl_buckets[0.005] == 1 and s.itl_buckets[0.025] == 3
    assert s.itl_buckets[math.inf] == 4 and len(s.itl_buckets) == len(runtime_metrics.ITL_BUCKETS) + 1


def test_parse_of_an_empty_exposition_is_all_zero():
    assert parse_metrics("") == MetricSnapshot()


# -- deltas and windows -------------------------------------------------------------------------


def test_delta_subtracts_every_counter():
    earlier = snapshot(drafts=10, draft_tokens=40, accepted=20, stops=3, itl={0.1: 1, math.inf: 2})
    later = snapshot(drafts=15, draft_tokens=60, accepted=31, stops=7, errors={"500": 1}, itl={0.1: 4, math.inf: 6})
    d = delta(earlier, later)
    assert (d.drafts, d.draft_tokens, d.accepted_tokens) == (5, 20, 11)
    assert d.successes == {"stop": 4} and d.errors == {"500": 1} and d.itl_buckets == {0.1: 3, math.inf: 4}


def test_delta_after_a_counter_reset_is_the_later_snapshot():
    earlier = snapshot(drafts=100, draft_tokens=400, accepted=200, stops=50)
    restarted = snapshot(drafts=4, draft_tokens=16, accepted=9, stops=60)  # drafts went down: a new process
    assert delta(earlier, restarted) == restarted


def test_window_sums_pods_and_survives_a_restart_inside_it():
    history = History("canary1")
    pod_a = [(0, 100, 400), (30, 150, 600), (60, 20, 80), (90, 50, 200)]  # restart between 30 s and 60 s
    for seconds, drafts, tokens in pod_a:
        history = history.record("pod-a", T0 + timedelta(seconds=seconds),
                                 snapshot(drafts=drafts, draft_tokens=tokens, accepted=tokens / 2), keep=WINDOW)
    for seconds, drafts in ((30, 7), (90, 17)):
        history = history.record("pod-b", T0 + timedelta(seconds=seconds),
                                 snapshot(drafts=drafts, draft_tokens=drafts * 4, accepted=drafts), keep=WINDOW)
    m = history.measure(T0 + timedelta(seconds=90), WINDOW)
    assert m.increase.drafts == 50 + 20 + 30 + 10  # not 50 - 100: the restart costs only what came before it
    assert m.increase.draft_tokens == 200 + 80 + 120 + 40
    assert (m.start, m.end) == (T0, T0 + timedelta(seconds=90))
    assert m.acceptance_rate == pytest.approx((100 + 40 + 60 + 10) / 440)


def test_window_baseline_is_the_oldest_sample_inside_it():
    history = History("canary1")
    for minute in range(8):
        history = history.record("pod-a", T0 + timedelta(minutes=minute), snapshot(drafts=10 * minute), keep=WINDOW)
    assert min(s.at for s in history.samples["pod-a"]) == T0 + timedelta(minutes=2)  # older ones dropped
    m = history.measure(T0 + timedelta(minutes=7), WINDOW)
    assert m.start == T0 + timedelta(minutes=2) and m.increase.drafts == 50


def test_no_measurement_before_a_pod_has_two_samples():
    history = History("canary1").record("pod-a", T0, snapshot(drafts=5), keep=WINDOW)
    assert history.measure(T0, WINDOW) is None
    gone = history.record("pod-b", T0 + WINDOW * 2, snapshot(drafts=1), keep=WINDOW)
    assert set(gone.samples) == {"pod-b"}  # a pod without samples left in the window is forgotten


# -- the measured quantities --------------------------------------------------------------------


def test_p95_interpolates_linearly_inside_its_bucket():
    buckets = {0.01: 50.0, 0.025: 90.0, 0.05: 100.0, math.inf: 100.0}
    assert histogram_quantile(0.95, buckets) == pytest.approx(0.0375)  # 0.025 + 0.025 × (95 − 90) / 10
    assert histogram_quantile(0.5, buckets) == pytest.approx(0.01)
    assert histogram_quantile(0.25, buckets) == pytest.approx(0.005)  # the first bucket starts at 0
    assert histogram_quantile(0.95, {0.1: 1.0, math.inf: 10.0}) == 0.1  # past the last finite bound
    assert histogram_quantile(0.95, {0.1: 0.0, math.inf: 0.0}) is None


def test_p95_from_the_runtimes_histogram_deltas():
    before = parse_metrics(exposition(engine_stats(), itl_seconds=[0.5] * 10))
    after = parse_metrics(exposition(engine_stats(), itl_seconds=[0.5] * 10 + [0.04] * 90 + [0.09] * 10))
    m = measurement(delta(before, after))
    # 100 new observations: 90 in (0.025, 0.05], 10 in (0.075, 0.1]; rank 95 → 0.075 + 0.025 × 5/10
    assert m.p95_inter_token_latency_ms == pytest.approx(87.5)


def test_rates_lengths_and_errors():
    m = measurement(snapshot(drafts=10, draft_tokens=40, accepted=22, stops=18, errors={"500": 2, "400": 5},
                             accepted_per_position={0: 9, 1: 7, 2: 4, 3: 2}))
    assert m.acceptance_rate == pytest.approx(0.55)
    assert m.mean_acceptance_length == pytest.approx(3.2)
    assert m.per_position_acceptance == pytest.approx((0.9, 0.7, 0.4, 0.2))
    assert m.error_rate == pytest.approx(0.1)  # 2 server errors of 20 requests; a 400 is the client's
    empty = measurement(MetricSnapshot())
    assert (empty.acceptance_rate, empty.mean_acceptance_length, empty.error_rate) == (None, None, None)
    assert empty.p95_inter_token_latency_ms is None and empty.per_position_acceptance == ()


# -- judging ------------------------------------------------------------------------------------

SLO = Analysis(min_acceptance_rate=0.5, min_mean_acceptance_length=2.0, max_p95_inter_token_latency_ms=50,
               max_error_rate=0.05)
FAST = {0.025: 95.0, 0.05: 100.0, math.inf: 100.0}  # p95 = 25 ms
SLOW = {0.025: 10.0, 0.05: 20.0, 0.1: 100.0, math.inf: 100.0}  # p95 ≈ 96.9 ms


def test_a_healthy_canary_passes_with_every_check_named():
    verdict = judge(measurement(snapshot(drafts=100, draft_tokens=400, accepted=300, stops=50, itl=FAST)), SLO)
    assert verdict.result is Result.PASS and verdict.complete
    assert verdict.reasons == ("p95 inter-token latency 25 ms ≤ maxP95InterTokenLatencyMs 50",
                               "error rate 0 ≤ maxErrorRate 0.05", "acceptance rate 0.75 ≥ minAcceptanceRate 0.5",
                               "mean acceptance length 4 ≥ minMeanAcceptanceLength 2")


def test_low_acceptance_fails_naming_the_slo_field():
    verdict = judge(measurement(snapshot(drafts=100, draft_tokens=400, accepted=124, stops=50, itl=FAST)), SLO)
    assert verdict.result is Result.FAIL
    assert verdict.reasons == ("acceptance rate 0.31 < minAcceptanceRate 0.5",)
    assert verdict.message == "Fail: acceptance rate 0.31 < minAcceptanceRate 0.5"


def test_a_window_without_drafts_is_inconclusive_for_acceptance_only():
    no_drafts = judge(measurement(snapshot(stops=50, itl=FAST)), SLO)
    assert no_drafts.result is Result.INCONCLUSIVE
    assert no_drafts.reasons[0].startswith("acceptance rate unknown: no drafts in the window")
    slow = judge(measurement(snapshot(stops=50, itl=SLOW)), SLO)
    assert slow.result is Result.FAIL and slow.reasons == ("p95 inter-token latency 96.9 ms > "
                                                           "maxP95InterTokenLatencyMs 50",)
    failing = judge(measurement(snapshot(stops=50, errors={"503": 50}, itl=FAST)), SLO)
    assert failing.result is Result.FAIL and failing.reasons == ("error rate 0.5 > maxErrorRate 0.05",)
    method_none = judge(measurement(snapshot(stops=50, itl=FAST)), SLO, speculative=False)
    assert method_none.result is Result.PASS


def test_no_requests_at_all_is_inconclusive():
    verdict = judge(measurement(MetricSnapshot()), Analysis())
    assert verdict.result is Result.INCONCLUSIVE
    assert verdict.reasons == ("no requests reached revision canary1 in 300s",)


def test_a_short_measurement_is_not_a_complete_window():
    analysis = Analysis(interval="30s", window="5m")
    healthy = snapshot(drafts=10, draft_tokens=40, accepted=30, stops=5)
    assert judge(measurement(healthy, seconds=270), analysis).complete  # one interval of scrape jitter
    assert not judge(measurement(healthy, seconds=269), analysis).complete


def test_measured_acceptance_for_status():
    m = measurement(snapshot(drafts=10, draft_tokens=40, accepted=22, stops=3, itl=FAST))
    status = measured_acceptance(m)
    assert (status.revision, status.rate, status.draft_tokens, status.measured_at) == ("canary1", 0.55, 40, m.end)
    assert status.model_dump(mode="json", by_alias=True)["p95InterTokenLatencyMs"] == pytest.approx(25)


# -- Prometheus ---------------------------------------------------------------------------------


def test_prometheus_queries_select_one_revision_of_one_resource():
    queries = prometheus_queries("llm", "demo", "abc123", "5m")
    selector = f'{{namespace="llm",service="demo",{names.METRIC_LABEL_REVISION}="abc123"}}'
    assert queries["drafts"] == f"sum (increase(specdecode:spec_decode_num_drafts_total{selector}[5m]))"
    itl = f"sum by (le) (increase(specdecode:inter_token_latency_seconds_bucket{selector}[5m]))"
    assert queries["itl_buckets"] == itl
    assert queries["successes"].startswith("sum by (finished_reason) (increase(specdecode:request_success_total{")


def test_prometheus_results_make_the_same_measurement():
    def vector(label=None, **values):
        return [{"metric": {label: k} if label else {}, "value": [1700000000.0, str(v)]} for k, v in values.items()]

    results = {
        "drafts": vector(x=100), "draft_tokens": vector(x=400), "accepted_tokens": vector(x=124),
        "successes": vector("finished_reason", stop=40, length=10),
        "errors": vector("code", **{"500": 1}),
        "itl_buckets": [{"metric": {"le": le}, "value": [0, v]} for le, v in
                        (("0.025", "95"), ("0.05", "100"), ("+Inf", "100"))],
        "accepted_per_position": vector("position", **{"0": 80, "1": 44}),
    }
    m = measurement_from_prometheus(results, "abc123", T0, "5m")
    assert (m.start, m.end, m.seconds) == (T0 - WINDOW, T0, 300)
    assert m.acceptance_rate == pytest.approx(0.31) and m.error_rate == pytest.approx(1 / 51)
    assert m.p95_inter_token_latency_ms == pytest.approx(25) and m.per_position_acceptance == (0.8, 0.44)
    verdict = judge(m, SLO)
    assert verdict.result is Result.FAIL and verdict.complete
