"""Engine behaviour on the real default model (SmolLM2) and a tiny sharp random model.

Greedy batch invariance (alone vs batch of 8, chunked prefill, prefix-cache hits, forced
preemption), one forward per step, stops, seeds, penalties, n, logprobs, abort; a failure while a
step runs in the background (overlap) fails that step only once the step has finished.
"""
import threading
import time

import pytest
import torch

from specdecode.runtime.engine.sequence import FinishReason, SamplingParams
from specdecode.runtime.models.decoder import DecoderLM

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "1, 2, 3, 4,",
    "Photosynthesis is the process by which green plants and some other organisms use sunlight to synthesize foods from carbon dioxide and water. In plants it",
    "Q: What is 12 times 12?\nA:",
    "The quick brown fox",
    "import numpy as np\nimport torch\n\n# A function that normalises a tensor along its last axis\ndef",
]


GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="session")
def smol_prompts(smollm2):
    return [smollm2.tokenizer.encode(p) for p in PROMPTS]


@pytest.fixture(scope="session")
def smol_alone(smollm2, smol_prompts, make_engine, run_all):
    return [run_all(make_engine(smollm2.model, smollm2.tokenizer), [p], GREEDY)[0] for p in smol_prompts]


@pytest.mark.parametrize(
    "engine_kwargs",
    [
        pytest.param({}, id="batch-of-8"),
        pytest.param({"budget": 16}, id="chunked-prefill"),
        pytest.param({"num_blocks": 20, "block_size": 8}, id="forced-preemption"),
    ],
)
def test_greedy_batch_equals_alone(smollm2, smol_prompts, smol_alone, assert_greedy_match, engine_kwargs, make_engine, run_all):
    engine = make_engine(smollm2.model, smollm2.tokenizer, **engine_kwargs)
    batched = run_all(engine, smol_prompts, GREEDY)
    for prompt, alone, got in zip(smol_prompts, smol_alone, batched):
        assert_greedy_match(smollm2.model, prompt, alone, got)
    if "num_blocks" in engine_kwargs:
        assert engine.scheduler.num_preemptions > 0
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


def test_prefix_cache_hit_keeps_output(smollm2, smol_prompts, smol_alone, assert_greedy_match, make_engine, run_all):
    engine = make_engine(smollm2.model, smollm2.tokenizer)
    long_prompt = smol_prompts[4]
    run_all(engine, [long_prompt + smollm2.tokenizer.encode(" Also,")], GREEDY)
    assert engine.scheduler.prefix_cache_hit_tokens == 0
    again = run_all(engine, [long_prompt], GREEDY)[0]
    assert engine.scheduler.prefix_cache_hit_tokens >= 16 * ((len(long_prompt) - 1) // 16) > 0
    assert_greedy_match(smollm2.model, long_prompt, smol_alone[4], again)


def test_one_target_forward_per_step(sharp, make_engine):
    model, tok = sharp
    engine = make_engine(model, tok, budget=20)
    calls: list[int] = []
    handle = model.register_forward_hook(lambda m, args, out: calls.append(args[0].numel()))
    try:
        prompts = [[5 + i] * n for i, n in enumerate((3, 30, 7, 12))]
        for i, p in enumerate(prompts):
            engine.add_request(str(i), p, SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
        while engine.has_unfinished():
            scheduled_before = len(calls)
            engine.step()
            assert len(calls) == scheduled_before + 1  # exactly one target forward per step
            assert calls[-1] <= 20  # every scheduled token of the step, within the budget
    finally:
        handle.remove()
    assert sum(calls) == sum(len(p) for p in prompts) + 4 * 4  # prefills + decodes, each computed once


def test_stop_conditions(sharp, make_engine, run_all):
    model, tok = sharp
    prompt = tok.encode("hello world")
    free = run_all(make_engine(model, tok), [prompt], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[0]
    assert len(free) == 12
    # stop_token_ids: ends at (and includes) the first occurrence
    stop_id = free[5]
    first = free.index(stop_id)
    engine = make_engine(model, tok)
    engine.add_request("s", prompt, SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=(stop_id,)))
    deltas = []
    while engine.has_unfinished():
        deltas += [d for o in engine.step() for d in o.deltas]
    assert deltas[-1].finish_reason is FinishReason.STOP and deltas[-1].stop_reason == stop_id
    assert sum(len(d.token_ids) for d in deltas) == first + 1
    # stop strings: text ends right before the stop string, which is not returned
    full_text = tok.decode(free)
    stop = full_text[len(full_text) // 2 : len(full_text) // 2 + 3]
    engine = make_engine(model, tok)
    engine.add_request("t", prompt, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, stop=(stop,)))
    text, reasons = "", []
    while engine.has_unfinished():
        for o in engine.step():
            text += "".join(d.text for d in o.deltas)
            reasons += [d.stop_reason for d in o.deltas if d.finish_reason]
    assert text == full_text[: full_text.index(stop)] and reasons == [stop]


def test_eos_stops_unless_ignored(sharp, make_engine, run_all):
    model, tok = sharp
    prompt = tok.encode("hello")
    free = run_all(make_engine(model, tok), [prompt], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))[0]
    eos = next(iter(tok.eos_token_ids))
    # Make the model's 3rd greedy token the EOS by swapping its id with the EOS id in the output layer.
    swapped = DecoderLM(model.config)
    swapped.load_state_dict(model.state_dict())
    with torch.no_grad():
        w = swapped.model.embed_tokens.weight if swapped.lm_head is None else swapped.lm_head.weight
        if swapped.lm_head is None:
            pytest.skip("tied embeddings: swapping rows would change inputs too")
        w[[free[2], eos]] = w[[eos, free[2]]]
    got = run_all(make_engine(swapped.eval(), tok), [prompt], SamplingParams(max_tokens=8, temperature=0.0))[0]
    assert got[-1] == eos and len(got) <= 3


def test_seeded_sampling_is_batch_independent(sharp, make_engine, run_all):
    model, tok = sharp
    prompts = [tok.encode(t) for t in ("hello", "world peace", "a b c d e f")]
    params = SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, top_k=50, seed=1234)
    alone = run_all(make_engine(model, tok), [prompts[1]], params)[0]
    batch = run_all(make_engine(model, tok), prompts, params)
    assert batch[1] == alone
    other_seed = run_all(make_engine(model, tok), [prompts[1]], SamplingParams(max_tokens=10, temperature=1.0, seed=99))[0]
    assert other_seed != alone


def test_frequency_penalty_discourages_repeats(sharp, make_engine, run_all):
    model, tok = sharp
    prompt = tok.encode("again and again")
    plain = run_all(make_engine(model, tok), [prompt], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))[0]
    penal = run_all(
        make_engine(model, tok), [prompt], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, frequency_penalty=2.0, presence_penalty=2.0)
    )[0]
    assert len(set(penal)) >= len(set(plain)) and penal != plain


def test_n_completions_and_logprobs(sharp, full_forward, make_engine):
    model, tok = sharp
    prompt = tok.encode("hello world")
    engine = make_engine(model, tok)
    engine.add_request("r", prompt, SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, n=3, logprobs=4))
    per_index: dict[int, list] = {0: [], 1: [], 2: []}
    while engine.has_unfinished():
        for o in engine.step():
            for d in o.deltas:
                per_index[d.index] += d.logprobs
    greedy = [lp.token_id for lp in per_index[0]]
    assert all([lp.token_id for lp in v] == greedy for v in per_index.values())  # greedy n=3: identical
    reference = full_forward(model, prompt + greedy).log_softmax(-1)
    for i, lp in enumerate(per_index[0]):
        row = reference[len(prompt) - 1 + i]
        assert lp.logprob == pytest.approx(float(row[lp.token_id]), abs=1e-4)
        assert [t for t, _ in lp.top] == row.topk(4).indices.tolist()


def test_abort_frees_blocks(sharp, make_engine):
    model, tok = sharp
    engine = make_engine(model, tok)
    engine.add_request("a", tok.encode("hello world " * 8), SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True))
    engine.step()
    assert engine.blocks.num_free_blocks < engine.blocks.num_blocks
    engine.abort_request("a")
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks and not engine.has_unfinished()


def test_invalid_requests_are_refused_with_reason(sharp, make_engine):
    model, tok = sharp
    engine = make_engine(model, tok, num_blocks=4, block_size=4)
    with pytest.raises(ValueError, match="maximum context length"):
        engine.add_request("a", [5] * 2040, SamplingParams(max_tokens=20))
    with pytest.raises(ValueError, match="KV cache blocks"):
        engine.add_request("b", [5] * 10, SamplingParams(max_tokens=20))
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("c", [], SamplingParams())
    with pytest.raises(ValueError, match="token ids"):
        engine.add_request("d", [10**7], SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)


def test_a_failure_while_a_step_runs_ahead_waits_for_that_step_and_the_next_request_runs_clean(
        sharp, make_engine, run_all):
    model, tok = sharp
    prompt = tok.encode("hello world " * 4)
    engine = make_engine(model, tok)  # overlap on: the step runs in a background thread
    run, ran = engine.runner.run, threading.Event()

    def slow_run(step):
        time.sleep(0.3)  # still running when planning the next step ahead fails
        out = run(step)
        ran.set()
        return out

    def failing_plan_ahead(plan):
        raise RuntimeError("injected: planning ahead failed")

    engine.runner.run, engine._plan_ahead = slow_run, failing_plan_ahead
    engine.add_request("a", prompt, GREEDY)
    with pytest.raises(RuntimeError, match="planning ahead failed"):
        engine.step()
    assert ran.is_set(), "the failed step still runs: it would race the next step on the KV pools"
    engine.abort_request("a")  # what AsyncEngine does with a failed step's requests
    del engine.runner.run, engine._plan_ahead
    assert run_all(engine, [prompt], GREEDY) == run_all(make_engine(model, tok), [prompt], GREEDY)
