"""Batch buckets (runtime/engine/buckets.py): the bucket sizes; a bucketed engine gives the unpadded
engine's greedy and seeded outputs token for token, a draft model's single-token steps and an MTP
head's drafting steps bucketed too;
and a 1-layer bucketed verify step's forward
compiles with ``torch.compile(fullgraph=True)`` — static shapes, no host sync, no data-dependent
Python (a graph break fails it) — to what eager computes. The CUDA capture of the same forward is
checked in the gpu tier (tests/test_cuda.py)."""
import dataclasses

import pytest
import torch

from specdecode.bench.step import counting
from specdecode.runtime.engine.buckets import batch_buckets, bucket_for
from specdecode.runtime.engine.sequence import SamplingParams
from specdecode.runtime.models.decoder import DecoderLM

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}


def test_buckets_are_powers_of_two_to_8_then_every_16():
    assert batch_buckets(1) == [1]
    assert batch_buckets(3) == [1, 2, 4]
    assert batch_buckets(32) == [1, 2, 4, 8, 16, 32]
    assert batch_buckets(33) == [1, 2, 4, 8, 16, 32, 48]
    assert [bucket_for(n, batch_buckets(32)) for n in (1, 3, 5, 9, 17, 32)] == [1, 4, 8, 16, 32, 32]
    with pytest.raises(ValueError, match="largest batch bucket"):
        bucket_for(33, batch_buckets(32))


def repeating_prompts(vocab: int, count: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    return [(torch.randint(3, vocab, (3 + i,), generator=gen).tolist() * 6)[: 9 + 2 * i] for i in range(count)]


@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlap"])
def test_a_bucketed_engine_gives_the_unpadded_outputs(sharp, make_engine, run_all, overlap):
    """Greedy and seeded sampled requests, with and without n-gram drafts: padding rows and padding
    sequences change nothing (11 prompts: buckets 16, 8 … as they finish)."""
    model, tok = sharp
    prompts = repeating_prompts(model.config.vocab_size, 11)
    for params in (SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True),
                   SamplingParams(max_tokens=20, temperature=0.9, top_p=0.9, seed=5, ignore_eos=True)):
        for spec in (None, NGRAM):
            want = run_all(make_engine(model, tok, spec=spec, overlap=overlap), prompts, params)
            engine = make_engine(model, tok, spec=spec, overlap=overlap, buckets=True)
            padded = []
            run = engine.runner.run
            engine.runner.run = lambda step: padded.append(step.bucket) or run(step)
            assert run_all(engine, prompts, params) == want
            shapes = [bucket for bucket in padded if bucket is not None]
            assert any(b == 16 for b, _ in shapes)  # 11 sequences: 5 padding ones
            assert any(q > 1 for _, q in shapes) == (spec is not None)


def drafting_shapes(sharp_target, make_engine, run_all, spec: dict, watch) -> tuple[list, object]:
    """5 repeating greedy prompts with and without batch buckets, their outputs asserted equal: what
    ``watch(engine, shapes)`` recorded of the bucketed engine's drafting steps, and that engine."""
    model, tok = sharp_target
    prompts = repeating_prompts(model.config.vocab_size, 5)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    want = run_all(make_engine(model, tok, spec=spec), prompts, params)
    engine, shapes = make_engine(model, tok, spec=spec, buckets=True), []
    watch(engine.proposer, shapes)
    assert run_all(engine, prompts, params) == want
    return shapes, engine


def test_a_draft_models_single_token_steps_are_bucketed_and_change_nothing(sharp_target, sharp_draft_dir,
                                                                           make_engine, run_all):
    def watch(proposer, shapes):
        run = proposer.runner.run
        proposer.runner.run = lambda step: shapes.append(step.bucket) or run(step)

    spec = {"method": "draft", "draft_model": sharp_draft_dir, "num_speculative_tokens": 3}
    shapes, engine = drafting_shapes(sharp_target, make_engine, run_all, spec, watch)
    assert (8, 1) in shapes  # 5 sequences' single-token draft steps, padded to bucket 8
    assert engine.stats().spec_decode_num_accepted_tokens > 0


def test_an_mtp_heads_drafting_steps_are_bucketed_and_change_nothing(sharp_target, sharp_mtp_dir, make_engine,
                                                                     run_all):
    """The head's first draft step and its chain steps (one row a sequence) padded to the target's
    buckets: 5 drafting sequences run as 8."""
    def watch(heads, shapes):
        padded_module = heads._padded_module
        heads._padded_module = lambda m, x, embeds, batch: shapes.append(
            (x.shape[0], embeds.shape[0], batch.uniform_query_len)) or padded_module(m, x, embeds, batch)

    spec = {"method": "mtp", "mtp_path": sharp_mtp_dir, "num_speculative_tokens": 3}
    shapes, _ = drafting_shapes(sharp_target, make_engine, run_all, spec, watch)
    assert (5, 8, 1) in shapes  # 5 sequences' drafting steps, padded to bucket 8, one row each
    assert all(padded in (1, 2, 4, 8) for real, padded, q in shapes if q == 1)


def test_a_bucketed_verify_step_compiles_as_one_graph_to_what_eager_computes(sharp, make_engine):
    """One decoder layer, three sequences with drafts (bucket 4, rows padded to the step's K_max + 1).
    ``torch.compile(fullgraph=True)`` raises on a graph break (Python that branches on a tensor, a
    shape that depends on data); a value read back to the host is a sync, and dynamo specializes on
    it, so the second step of the same shape, other data, must run the first step's graph
    (``error_on_recompile``); the eager forward reads nothing back either. The control: the same rows
    grouped by metadata read back from the device fail."""
    sharp_model, tok = sharp
    model = DecoderLM(dataclasses.replace(sharp_model.config, num_layers=1)).eval()
    model.load_state_dict({k: v for k, v in sharp_model.state_dict().items() if not k.startswith("model.layers.1.")})
    engine = make_engine(model, tok, spec=NGRAM, overlap=False, buckets=True)
    for i, prompt in enumerate(repeating_prompts(model.config.vocab_size, 3)):
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    steps = []
    run = engine.runner.run
    engine.runner.run = lambda step: steps.append(step) or run(step)
    while len(twins := same_shape_verify_steps(steps)) < 2:
        engine.step()
    first, second = twins[:2]
    assert first.bucket[0] == 4 and first.batch.uniform_query_len == first.bucket[1] > 1
    assert not torch.equal(first.batch.seq_lens, second.batch.seq_lens)

    def forward(input_ids: torch.Tensor, batch) -> torch.Tensor:  # → [B_pad · Q, hidden]
        return model(input_ids, engine.runner.kv_pools, batch)

    def forward_grouped(input_ids: torch.Tensor, batch) -> torch.Tensor:  # its own code object: its own cache
        return model(input_ids, engine.runner.kv_pools, batch)

    torch._dynamo.reset()
    compiled = torch.compile(forward, fullgraph=True, dynamic=False, backend="aot_eager")
    control = torch.compile(forward_grouped, fullgraph=True, dynamic=False, backend="aot_eager")
    with torch.inference_mode(), torch._dynamo.config.patch(error_on_recompile=True):
        for step in (first, second):  # each call a fresh batch: the groups it caches are built in the graph
            with counting() as counted:
                eager = forward(step.input_ids, dataclasses.replace(step.batch))
            assert counted["syncs"] == 0
            assert torch.equal(compiled(step.input_ids, dataclasses.replace(step.batch)), eager)
        grouped = [dataclasses.replace(s.batch, uniform_query_len=None, query_start_list=None, seq_lens_list=None)
                   for s in (first, second)]
        with pytest.raises(torch._dynamo.exc.TorchDynamoException):  # data-dependent, or a recompile
            for step, batch in zip((first, second), grouped):
                control(step.input_ids, batch)
    torch._dynamo.reset()


def same_shape_verify_steps(steps) -> list:
    """The bucketed verify steps (Q > 1) of the most common shape so far."""
    verify = [s for s in steps if s.bucket is not None and s.bucket[1] > 1]
    shapes = [s.bucket for s in verify]
    return [s for s in verify if shapes and s.bucket == max(shapes, key=shapes.count)]


def test_cuda_graphs_are_refused_where_they_cannot_run(sharp, make_engine):
    from specdecode.runtime.config import EngineConfig, GraphConfig, ParallelConfig

    with pytest.raises(ValueError, match="one process only"):
        EngineConfig(graphs=GraphConfig(cuda_graphs=True), parallel=ParallelConfig(tensor_parallel_size=2))
    with pytest.raises(ValueError, match="needs batch_buckets"):
        EngineConfig(graphs=GraphConfig(cuda_graphs=True, batch_buckets=False))
    with pytest.raises(ValueError, match="needs a CUDA device"):
        make_engine(*sharp, cuda_graphs=True)
