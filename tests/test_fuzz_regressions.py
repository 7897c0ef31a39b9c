"""Defects the engine fuzzer found (issue 26), each pinned as the scenario that shows it; every test
here failed before its fix. The fuzzer (test_engine_fuzz.py) keeps looking for the next one.

1. Overlap: a look-ahead decode row preempted a decode row already scheduled in the same step,
   which then ran with an empty block table (IndexError in ``prepare``: every request failed).
2. Pipeline stages: a sequence preempted and then aborted before the next launch was sent to the
   verifier as both gone and preempted; the verifier died on the second (KeyError).
5. Overlap reserved K + 1 tokens per deciding sequence with the global K, where the request's cap
   or load control allowed fewer: the prompt chunks and admissions built ahead starved.
"""
from __future__ import annotations

import pytest

from specdecode.runtime.config import CacheConfig, EngineConfig, LoadConfig, ParallelConfig, SchedulerConfig, SpeculativeConfig
from specdecode.runtime.engine.sequence import SamplingParams

GREEDY = dict(temperature=0.0, ignore_eos=True)


def _first_token_steps(engine, arrivals: list[tuple[int, list[int], SamplingParams]]) -> tuple[dict[str, int], dict[str, list[int]]]:
    """Run requests arriving at the given steps: the step of each one's first token, and its tokens."""
    first, tokens = {}, {str(i): [] for i in range(len(arrivals))}
    step = 0
    while step < 500 and (engine.has_unfinished() or step <= max(a for a, _, _ in arrivals)):
        for i, (at, prompt, params) in enumerate(arrivals):
            if at == step:
                engine.add_request(str(i), prompt, params)
        for out in engine.step():
            new = [t for d in out.deltas for t in d.token_ids]
            if new and out.request_id not in first:
                first[out.request_id] = step
            tokens[out.request_id] += new
        step += 1
    return first, tokens


def test_a_look_ahead_decode_row_never_preempts_a_row_already_scheduled(sharp_target, make_engine, run_all):
    """Defect 1 (a workload the fuzzer's search found): block size 4, 10 blocks, budget 12, n-gram
    K = 3, overlap. A short prompt admitted late overtakes a long one still prefilling (the long
    one's next chunk found no free blocks), so the look-ahead's decode rows come in another order
    than their admission; when the long one then needs a block, the most recently admitted
    sequence — already scheduled — was preempted and ran with an empty block table (IndexError).
    Now every output equals the no-spec one, and a look-ahead decode row did preempt."""
    model, tok = sharp_target
    long = [65, 370, 332] * 6
    arrivals = [(0, [131, 325, 345, 297], 27), (0, [37, 60, 18, 37, 60], 19), (1, long, 13), (4, [207, 269, 207], 21)]
    arrivals = [(at, prompt, SamplingParams(max_tokens=n, **GREEDY)) for at, prompt, n in arrivals]
    engine = make_engine(model, tok, num_blocks=10, block_size=4, budget=12, max_seqs=4,
                         spec={"method": "ngram", "num_speculative_tokens": 3}, overlap=True)
    _, tokens = _first_token_steps(engine, arrivals)
    assert ("preempted by a look-ahead decode row" in {what for what, _ in engine.events})
    expected = run_all(make_engine(model, tok, block_size=4, overlap=False), [p for _, p, _ in arrivals],
                       arrivals[0][2])
    for i, (_, _, params) in enumerate(arrivals):
        assert tokens[str(i)] == expected[i][: params.max_tokens], i


@pytest.mark.parametrize("capped_by", ["request", "load control"])
def test_overlap_admits_a_prompt_ahead_when_the_decoding_sequences_draft_less_than_k(capped_by, sharp_target, make_engine):
    """Defect 5: three decoding sequences that may draft nothing (their request's cap is 0, or load
    control's batch-size table says K = 0 at three sequences) leave 9 of 12 tokens for the prompt
    that arrives meanwhile: with overlap it gets its first token one step after it would without
    (it arrived while a step ran, and is admitted by that step's look-ahead). The old reservation (3 × (K + 1) = 15 ≥ 12) kept it waiting until the three had finished."""
    model, tok = sharp_target
    table = {"load_control": {"batch_size_table": [{"max_batch_size": 1, "num_speculative_tokens": 4}]}}
    spec = {"method": "ngram", "num_speculative_tokens": 4, **(table if capped_by == "load control" else {})}
    cap = {"num_speculative_tokens": 0} if capped_by == "request" else {}
    decoding = SamplingParams(max_tokens=16, **GREEDY, **cap)
    arrivals = [(0, [5 + i, 6 + i, 7 + i], decoding) for i in range(3)]
    arrivals.append((3, list(range(40, 48)), SamplingParams(max_tokens=4, **GREEDY)))
    steps = {}
    for overlap in (False, True):
        engine = make_engine(model, tok, num_blocks=64, block_size=4, budget=12, spec=spec, overlap=overlap)
        steps[overlap], _ = _first_token_steps(engine, arrivals)
    # a prompt that arrives while a step runs is admitted by the look-ahead and runs in the next one
    assert steps[True]["3"] == steps[False]["3"] + 1, f"first token of the late prompt at step {steps[True]['3']} " \
                                                       f"with overlap, {steps[False]['3']} without"


def test_a_sequence_preempted_then_aborted_before_the_next_launch_leaves_the_pipeline_working(
        sharp_target_dir, sharp_target, sharp_draft_dir, make_engine):
    """Defect 2: in-process TP1×PP2 with overlap and a draft model (it lives on the verifier, which
    tells it of every preemption), a pool that makes the look-ahead preempt; the request preempted
    is aborted at once, before the step built after it launches. The verifier must hear only that
    it is gone, and the other requests finish with the no-spec outputs."""
    from pipeline_harness import in_process_pipeline_engine

    cfg = EngineConfig(
        load=LoadConfig(model=str(sharp_target_dir), weight_cache_dir=None, device="cpu", dtype="float32"),
        cache=CacheConfig(block_size=4, num_blocks=10),
        scheduler=SchedulerConfig(max_num_batched_tokens=16, overlap=True),
        speculative=SpeculativeConfig(method="draft", draft_model=sharp_draft_dir, num_speculative_tokens=2),
        parallel=ParallelConfig(pipeline_parallel_size=2),
    )
    engine, _ = in_process_pipeline_engine(cfg)
    prompts = [[10, 11, 12, 10, 11, 12], [20, 21, 22, 23], [30, 31, 30, 31, 30]]
    params = SamplingParams(max_tokens=20, **GREEDY)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    out = {str(i): [] for i in range(len(prompts))}
    aborted = None
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id] += [t for d in o.deltas for t in d.token_ids]
        if aborted is None and engine.scheduler.preempted:  # preempted by the step built ahead, not yet launched
            aborted = engine.scheduler.preempted[0].request_id
            engine.abort_request(aborted)
    assert aborted is not None, "the scenario no longer preempts: shrink the pool"
    reference = make_engine(*sharp_target, block_size=4, overlap=False)
    for i, prompt in enumerate(prompts):
        if str(i) != aborted:
            reference.add_request(str(i), prompt, params)
    expected = {str(i): [] for i in range(len(prompts))}
    while reference.has_unfinished():
        for o in reference.step():
            expected[o.request_id] += [t for d in o.deltas for t in d.token_ids]
    assert {k: v for k, v in out.items() if k != aborted} == {k: v for k, v in expected.items() if k != aborted}
