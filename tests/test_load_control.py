"""Load control: the batch-size → K table and the acceptance floor that turns speculation off
and probes it again later — unit level and inside the engine."""
from specdecode.runtime.config import BatchSizeRule, LoadControl
from specdecode.runtime.engine.load_control import LoadController
from specdecode.runtime.engine.sequence import SamplingParams


def test_batch_size_table_picks_k_and_turns_off_past_the_last_rule():
    table = (BatchSizeRule(max_batch_size=4, num_speculative_tokens=5), BatchSizeRule(max_batch_size=16, num_speculative_tokens=2))
    lc = LoadController(LoadControl(batch_size_table=table), num_speculative_tokens=4)
    assert [lc.num_speculative_tokens(b) for b in (1, 4, 5, 16, 17)] == [4, 4, 2, 2, 0]
    assert LoadController(LoadControl(), 3).num_speculative_tokens(1000) == 3


def test_acceptance_floor_switches_off_then_reprobes():
    cfg = LoadControl(acceptance_floor=0.5, window_draft_tokens=8, reprobe_steps=3)
    lc = LoadController(cfg, num_speculative_tokens=4)
    lc.observe(4, 3)
    lc.observe(4, 3)  # 6/8 accepted: stays on
    assert lc.enabled and lc.num_speculative_tokens(1) == 4
    lc.observe(4, 0)
    lc.observe(4, 0)  # window now 3/8 < 0.5: off
    assert not lc.enabled
    assert [lc.num_speculative_tokens(1) for _ in range(3)] == [0, 0, 0]
    assert lc.enabled and lc.num_speculative_tokens(1) == 4  # probed again with a fresh window


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
