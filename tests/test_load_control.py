"""Load control: the batch-size → K table and the acceptance floor that turns speculation off
and probes it again later — unit level and inside the engine."""
from specdecode.runtime.config import BatchSizeRule, LoadControl
from specdecode.runtime.engine.load_control import DraftBudget, LoadController, StepTimeModel
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


def goodput_controller(t0: float, per_token: float, accepted: list[int], reprobe_steps: int = 5):
    """A goodput controller (K ≤ 4) that has seen steps costing ``t0 + per_token · n`` and, for
    sequences asked for and given 4 drafts, verifications accepting ``accepted`` (a pattern
    repeated so that no order skews the decayed estimates)."""
    lc = LoadController(LoadControl(goodput=True, reprobe_steps=reprobe_steps), num_speculative_tokens=4)
    for n in range(1, 64):
        lc.observe_step(n, 0, t0 + per_token * n)
    for _ in range(200 // len(accepted)):
        for m in accepted:
            lc.observe_proposal([4], [4])
            lc.observe(4, m)
    return lc


def test_the_step_time_model_fits_a_line_once_sizes_vary():
    model = StepTimeModel()
    for _ in range(40):
        model.observe(8, 0, 0.066)
    assert model.decode_line() is None  # one size only: no slope
    for n in range(1, 40):
        model.observe(n, 0, 0.05 + 0.002 * n)
    t0, a = model.decode_line()
    assert abs(t0 - 0.05) < 0.002 and abs(a - 0.002) < 0.0002


def test_the_step_time_model_prices_decided_rows_apart_from_prefill_tokens():
    """Prefill tokens are cheap per token (big matmuls, no LM head): a single slope over all
    tokens would price a draft at that rate and over-rate speculation."""
    model = StepTimeModel()
    for n in range(1, 41):
        model.observe(n, 0, 0.05 + 0.004 * n)  # decode and verify steps
        model.observe(1, 511, 0.05 + 0.004 + 0.001 * 511)  # a prefill chunk of 512, its last row decided
    t0, a = model.decode_line()
    assert abs(t0 - 0.05) < 0.002 and abs(a - 0.004) < 0.0002


def test_goodput_turns_speculation_off_where_scoring_costs_and_acceptance_is_low():
    cpu_low = goodput_controller(0.05, 0.01, [0, 0, 1, 0, 2])  # c = 0.4, 0.2, 0, 0
    assert cpu_low.budget(8, 8).k == 0 and not cpu_low.enabled
    gpu_low = goodput_controller(0.05, 0.00001, [0, 0, 1, 0, 2])  # scoring is free: drafts cost nothing
    assert gpu_low.budget(8, 8).k >= 2 and gpu_low.enabled


def test_goodput_stops_where_later_positions_stop_paying():
    lc = goodput_controller(0.05, 0.005, [0, 1, *[2] * 14, 3, 4])  # c = 0.9, 0.8, 0.1, 0.05
    assert lc.budget(1, 1).k == 2  # 2.7 tokens / 65 ms beats 2.85 / 75 ms and 1.9 / 60 ms


def test_goodput_probes_again_after_reprobe_steps_and_never_exceeds_the_table():
    lc = goodput_controller(0.05, 0.01, [0], reprobe_steps=3)
    assert [lc.budget(8, 8) for _ in range(4)] == [DraftBudget(0)] * 3 + [DraftBudget(4, sequences=1)]
    assert lc.enabled  # the probe step: one sequence drafts, the batch's step barely grows
    table = (BatchSizeRule(max_batch_size=64, num_speculative_tokens=1),)
    capped = LoadController(LoadControl(goodput=True, batch_size_table=table), num_speculative_tokens=4)
    assert capped.budget(8, 8).k == 1  # unmeasured: the table's K


def test_goodput_in_the_engine_keeps_greedy_output_and_measures(sharp, make_engine, run_all):
    model, tok = sharp
    prompts = [tok.encode("hello hello hello world"), tok.encode("one two one two one")]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    plain = run_all(make_engine(model, tok), prompts, params)
    engine = make_engine(model, tok, spec={"method": "ngram", "load_control": {"goodput": True}})
    assert run_all(engine, prompts, params) == plain
    lc = engine.load_control
    assert lc.step_time.xx[0][0] > 0 and lc.positions.asked[0] > 0  # steps and proposals were measured
    off = make_engine(model, tok, spec={"method": "ngram"})
    assert run_all(off, prompts, params) == plain
    assert off.load_control.step_time.xx[0][0] == 0 and off.load_control.positions.asked[0] == 0  # goodput off: no bookkeeping
