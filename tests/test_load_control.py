"""Load control: the batch-size → K table and the acceptance floor that turns speculation off
and probes it again later — unit level and inside the engine."""
import pytest

from specdecode.runtime.config import BatchSizeRule, LoadControl
from specdecode.runtime.engine.load_control import MIN_STEPS, Budget, LoadController, StepCosts
from specdecode.runtime.engine.sequence import SamplingParams


def test_batch_size_table_picks_k_and_turns_off_past_the_last_rule():
    table = (BatchSizeRule(max_batch_size=4, num_speculative_tokens=5), BatchSizeRule(max_batch_size=16, num_speculative_tokens=2))
    lc = LoadController(LoadControl(batch_size_table=table), num_speculative_tokens=4)
    assert [lc.budget(b, b).k for b in (1, 4, 5, 16, 17)] == [4, 4, 2, 2, 0]
    assert LoadController(LoadControl(), 3).budget(1000, 1000).k == 3


def test_acceptance_floor_switches_off_then_reprobes():
    cfg = LoadControl(acceptance_floor=0.5, window_draft_tokens=8, reprobe_steps=3)
    lc = LoadController(cfg, num_speculative_tokens=4)
    lc.observe(4, 3)
    lc.observe(4, 3)  # 6/8 accepted: stays on
    assert lc.enabled and lc.budget(1, 1).k == 4
    lc.observe(4, 0)
    lc.observe(4, 0)  # window now 3/8 < 0.5: off
    assert not lc.enabled
    assert [lc.budget(1, 1).k for _ in range(3)] == [0, 0, 0]
    assert lc.enabled and lc.budget(1, 1).k == 4  # probed again with a fresh window


def test_engine_turns_speculation_off_under_a_floor_and_back_on(sharp, make_engine):
    model, tok = sharp
    spec = {
        "method": "ngram",
        "num_speculative_tokens": 4,
        "load_control": {"acceptance_floor": 0.99, "window_draft_tokens": 8, "reprobe_steps": 4},
    }
    engine = make_engine(model, tok, spec=spec)
    engine.add_request("r", tok.encode("hello hello hello"), SamplingParams(max_tokens=60, temperature=1.0, seed=3, ignore_eos=True))
    states = []
    while engine.has_unfinished():
        engine.step()
        states.append(engine.stats().spec_decode_enabled)
    assert engine.stats().spec_decode_num_draft_tokens > 0
    assert False in states  # sampled output rarely meets a 99% floor: switched off …
    off_then_on = any(a is False and b is True for a, b in zip(states, states[1:]))
    assert off_then_on  # … and probed again later


def test_batch_table_applies_inside_the_engine(sharp, make_engine, run_all):
    model, tok = sharp
    spec = {"method": "ngram", "num_speculative_tokens": 4,
            "load_control": {"batch_size_table": [{"max_batch_size": 1, "num_speculative_tokens": 4}]}}
    prompts = [tok.encode("hello hello hello")] * 3
    engine = make_engine(model, tok, spec=spec)
    run_all(engine, prompts, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    assert engine.stats().spec_decode_num_draft_tokens == 0  # 3 running > 1: speculation off
    single = make_engine(model, tok, spec=spec)
    run_all(single, prompts[:1], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    assert single.stats().spec_decode_num_draft_tokens > 0


# -- goodput: K from measured acceptance and this machine's step times ---------------------------


def learn_acceptance(lc: LoadController, accepted: list[int], k: int = 4) -> None:
    """Proposals of k drafts, all delivered, verified with ``accepted`` (a pattern repeated so that
    no order skews the decayed estimates) until the estimates are trusted."""
    for _ in range(200 // len(accepted)):
        for m in accepted:
            lc.observe_proposal([k], [k])
            lc.observe(k, m)


def goodput_controller(step_cost: list[float], accepted: list[int], reprobe_steps: int = 5, batch: int = 8):
    """A goodput controller (K ≤ 4) that has measured, at this batch size, decode steps costing
    ``step_cost[k]`` seconds per sequence at K = k and, for sequences asked for and given 4
    drafts, verifications accepting ``accepted`` (a pattern repeated so that no order skews the
    decayed estimates)."""
    lc = LoadController(LoadControl(goodput=True, reprobe_steps=reprobe_steps), num_speculative_tokens=4)
    learn_acceptance(lc, accepted)
    for _ in range(5):
        for k, cost in enumerate(step_cost):
            lc.costs.observe(batch, k, batch, cost * batch)
    return lc


def test_step_costs_price_k_per_drafting_sequence_over_the_draft_free_step():
    costs = StepCosts()
    costs.observe(16, 4, 2, 0.8)
    assert costs.weight == {}  # a step with drafts is not priced before the bucket's draft-free cost
    for _ in range(MIN_STEPS - 1):
        costs.observe(16, 0, 0, 0.8)
    assert costs.per_sequence(16, 0) is None  # too few steps yet
    costs.observe(12, 0, 0, 0.6)  # same bucket (9-16), same cost per sequence
    assert costs.per_sequence(9, 0) == pytest.approx(0.05)
    for _ in range(MIN_STEPS):
        costs.observe(16, 4, 2, 0.9)  # 2 of 16 sequences asked: 0.1 s over the draft-free 0.8 s, 0.05 s each
    assert costs.per_sequence(16, 4) == pytest.approx(0.1)  # every sequence asked: 0.05 + 0.05
    costs.observe(16, 4, 16, 1.6)  # a step asking all 16 at the same price agrees
    assert costs.per_sequence(16, 4) == pytest.approx(0.1)
    assert costs.per_sequence(16, 2) is None and costs.per_sequence(8, 4) is None and costs.per_sequence(17, 4) is None
    assert costs.nearest_measured(40, 4) == [pytest.approx(0.05), None, None, None, pytest.approx(0.1)]  # 9-16 is nearest
    assert costs.nearest_measured(40, 3) == [pytest.approx(0.05), None, None, None]
    assert StepCosts().nearest_measured(8, 2) == [None] * 3


def decode_steps(lc: LoadController, step_cost: list[float], n: int, batch: int = 8) -> list[int]:
    """``n`` decode-only steps at this batch size, K = k costing ``step_cost[k]`` s per sequence
    asked (over ``step_cost[0]`` for each); a step that explores asks its ``explorers``."""
    ks = []
    for _ in range(n):
        budget = lc.budget(batch, batch)
        asked = (budget.explorers or batch) if budget.k else 0
        lc.observe_proposal([budget.k] * asked, [budget.k] * asked)
        lc.observe_step(0, batch * step_cost[0] + asked * (step_cost[budget.k] - step_cost[0]))
        ks.append(budget.k)
    return ks


def test_goodput_measures_each_k_smallest_first_and_only_in_decode_steps():
    lc = LoadController(LoadControl(goodput=True), num_speculative_tokens=2)
    assert decode_steps(lc, [0.05], MIN_STEPS) == [0] * MIN_STEPS  # K = 0 first, acceptance unknown
    assert lc.budget(8, 8) == Budget(1, explorers=2)  # 2 tokens, if accepted, could beat 1 / 0.05
    lc.observe_step(512, 5.0)  # a step with a prefill chunk: not a decode step's cost
    assert lc.costs.per_sequence(8, 1) is None
    assert decode_steps(lc, [0.05, 0.075], MIN_STEPS) == [1] * MIN_STEPS
    assert lc.costs.per_sequence(8, 1) == pytest.approx(0.075)  # priced from the two sequences asked
    assert decode_steps(lc, [0.05, 0.075, 0.1], MIN_STEPS) == [2] * MIN_STEPS  # 3 tokens could beat 2 / 0.075
    assert lc.budget(8, 8) == Budget(2, explorers=2)  # wins if accepted: learnt on a few
    learn_acceptance(lc, [2], k=2)
    assert lc.budget(8, 8) == Budget(2)  # every draft accepted: 3 tokens for 0.1 s wins, asked of all


def test_goodput_explores_on_a_share_of_a_large_batch():
    """Measuring a K, learning its acceptance and probing ask max(2, batch / 16) sequences; a K
    measured to win is asked of all. A dear K = 1 rules out every K before any acceptance is seen."""
    lc = LoadController(LoadControl(goodput=True, reprobe_steps=2), num_speculative_tokens=4)
    dear = [0.05, 0.3, 0.3, 0.3, 0.3]  # even 5 tokens for 0.3 s lose to 1 for 0.05 s
    assert decode_steps(lc, dear, 2 * MIN_STEPS, batch=48) == [0] * MIN_STEPS + [1] * MIN_STEPS
    assert lc.costs.per_sequence(48, 1) == pytest.approx(0.3)
    assert decode_steps(lc, dear, 2, batch=48) == [0, 0]
    assert lc.budget(48, 48) == Budget(1, explorers=3)  # the probe explores too
    assert lc.positions.asked[0] < 16  # all that without acceptance known
    cheap = [0.05, 0.052, 0.2, 0.2, 0.2]
    lc = LoadController(LoadControl(goodput=True), num_speculative_tokens=4)
    assert decode_steps(lc, cheap, 3 * MIN_STEPS, batch=32) == [0] * MIN_STEPS + [1] * MIN_STEPS + [2] * MIN_STEPS
    assert lc.budget(32, 32) == Budget(1, explorers=2)
    learn_acceptance(lc, [0, 0, 0, 1])
    assert lc.budget(32, 32) == Budget(1)  # 1.25 tokens / 52 ms beats 1 / 50 ms: every sequence asked


def test_goodput_skips_measuring_a_k_that_cannot_win():
    """Acceptance 0.2 at the first position and none after: K = 1 could beat K = 0 (1.2 tokens if it
    cost no more), so it is measured; once it costs 0.075 s, no larger K can beat K = 0 (1.2 tokens
    for at least 0.075 s), so none is asked for."""
    lc = LoadController(LoadControl(goodput=True, reprobe_steps=1000), num_speculative_tokens=4)
    learn_acceptance(lc, [0, 0, 0, 0, 1])
    ks = decode_steps(lc, [0.05, 0.075, 0.08, 0.085, 0.09], 20)
    assert ks == [0] * MIN_STEPS + [1] * MIN_STEPS + [0] * (20 - 2 * MIN_STEPS)
    assert not lc.enabled


def test_goodput_never_explores_in_a_step_with_a_prefill_chunk():
    """A mixed step is not costed: it takes the best measured K of its bucket, else of the nearest
    bucket measured, else 0 (drafts there compete with the chunk); it counts toward no probe."""
    lc = LoadController(LoadControl(goodput=True, reprobe_steps=2), num_speculative_tokens=4)
    assert lc.budget(8, 8, prefill=True) == Budget(0)  # acceptance unknown
    learn_acceptance(lc, [4])
    assert lc.budget(8, 8, prefill=True) == Budget(0)  # nothing measured anywhere
    assert decode_steps(lc, [0.05, 0.06, 0.06, 0.06, 0.06], 2 * MIN_STEPS) == [0] * MIN_STEPS + [1] * MIN_STEPS
    assert lc.budget(8, 8, prefill=True) == Budget(1)  # K = 1 measured to win (2 tokens / 0.06 s): mixed steps take it
    lc = LoadController(LoadControl(goodput=True, reprobe_steps=2), num_speculative_tokens=4)
    learn_acceptance(lc, [4])
    costs = [0.05, 0.3, 0.3, 0.3, 0.3]  # scoring drafts so dear that even 5 tokens do not pay
    assert decode_steps(lc, costs, 2 * MIN_STEPS) == [0] * MIN_STEPS + [1] * MIN_STEPS
    assert [lc.budget(8, 8, prefill=True).k for _ in range(10)] == [0] * 10  # the bucket's best, no probe
    assert lc.budget(40, 40, prefill=True).k == 0  # bucket 32-63 unmeasured: the nearest, 8-15
    assert decode_steps(lc, costs, 3) == [0, 0, 1]  # the probe comes after 2 decode steps, not before
    assert lc.budget(40, 40).k == 0  # a decode step in the unmeasured bucket measures it


def test_goodput_turns_speculation_off_where_scoring_costs_and_acceptance_is_low():
    cpu_low = goodput_controller([0.05, 0.075, 0.085, 0.09, 0.1], [0, 0, 1, 0, 2])  # c = 0.4, 0.2, 0, 0
    assert cpu_low.budget(8, 8).k == 0 and not cpu_low.enabled
    gpu_low = goodput_controller([0.05, 0.0501, 0.0502, 0.0503, 0.0504], [0, 0, 1, 0, 2])  # scoring is ~free
    assert gpu_low.budget(8, 8).k >= 2 and gpu_low.enabled


def test_goodput_prices_each_k_from_its_own_steps_not_a_line():
    """On a CPU K = 1 costs most of what K = 4 does: with acceptance that pays at K = 4 but not
    at K = 1 a line through K = 0 and K = 4 would pick K = 1; the measured costs do not."""
    lc = goodput_controller([0.05, 0.075, 0.085, 0.09, 0.1], [0, 1, 2, 3, 4, 4, 4, 4])  # c = 0.88, 0.86, 0.83, 0.8
    assert lc.budget(8, 8).k == 4
    stops = goodput_controller([0.05, 0.06, 0.07, 0.08, 0.09], [0, 1, *[2] * 14, 3, 4])  # c = 0.9, 0.8, 0.1, 0.05
    assert stops.budget(8, 8).k == 2  # 2.7 tokens / 70 ms beats 2.85 / 80 ms and 1.9 / 60 ms


def test_goodput_probes_the_best_k_with_a_growing_interval_and_never_exceeds_the_table():
    lc = goodput_controller([0.05, 0.075, 0.085, 0.09, 0.1], [0], reprobe_steps=3)
    assert [lc.budget(8, 8).k for _ in range(3)] == [0, 0, 0] and not lc.enabled
    probe = lc.budget(8, 8).k
    assert probe > 0 and lc.enabled  # the best K > 0, so its cost and the acceptance stay current
    assert [lc.budget(8, 8).k for _ in range(7)] == [0] * 6 + [probe]  # K = 0 confirmed: the interval doubled
    table = (BatchSizeRule(max_batch_size=64, num_speculative_tokens=1),)
    capped = LoadController(LoadControl(goodput=True, batch_size_table=table), num_speculative_tokens=4)
    assert decode_steps(capped, [0.05, 0.06, 0.06, 0.06, 0.06], 10) == [0] * MIN_STEPS + [1] * (10 - MIN_STEPS)


def test_goodput_in_the_engine_keeps_greedy_output_and_measures(sharp, make_engine, run_all):
    model, tok = sharp
    prompts = [tok.encode("hello hello hello world"), tok.encode("one two one two one")]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    plain = run_all(make_engine(model, tok), prompts, params)
    engine = make_engine(model, tok, spec={"method": "ngram", "load_control": {"goodput": True}})
    assert run_all(engine, prompts, params) == plain
    lc = engine.load_control
    assert lc.costs.weight and lc.positions.asked[0] > 0  # steps and proposals were measured
    off = make_engine(model, tok, spec={"method": "ngram"})
    assert run_all(off, prompts, params) == plain
    assert not off.load_control.costs.weight and off.load_control.positions.asked[0] == 0  # goodput off: no bookkeeping
