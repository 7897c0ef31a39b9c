"""The EAGLE-3 proposer in the engine, on a 4-layer tiny llama (three distinct aux layers fit): greedy
output equals no-spec for every lossless strategy, alone and in a batch, under chunked prefill,
preemption, prefix caching, batch buckets and n > 1; the aux states come from the verify forward (one
target forward per step); seeded sampling under target_match equals no-spec; logprobs equal; a
constrained request drafts under its grammar; drafts after rejections equal drafts recomputed from
scratch (the head's K/V at rejected slots rewritten); the same seed gives the same outputs; refusals.

Two heads: a random one (its drafts are mostly rejected) and an *echo* head built without training
that agrees with the target often. The target is nearly a bigram model (small layer weights over a
wide embedding whose column 0 is constant, tied LM head), so the next token is roughly the LM head
over the current token's own embedding. The echo head recovers that embedding through attention:
``fc`` reads the constant column of aux state 0 (the embedding) into coordinate 0 of g, whose norm is
then the same at every slot; q and k read only it, so after RoPE each slot's score is highest on
itself (a sum of cosines of position differences), and v passes the token's normed embedding
through; its final norm drops coordinate 0. Drafts then match the target's argmax often, not always:
chains are accepted in part and rejected in part.
"""
from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from safetensors.torch import save_file

from specdecode.runtime.config import EngineConfig, ParallelConfig, SpeculativeConfig, mtp_pipeline_gate_refusal
from specdecode.runtime.engine.grammar import StructuredKind, StructuredOutput
from specdecode.runtime.engine.model_runner import Span, build_attention_batch
from specdecode.runtime.engine.scheduler import ScheduledSeq
from specdecode.runtime.engine.sequence import SamplingParams, Sequence
from specdecode.runtime.models.attention import kv_pool
from specdecode.runtime.models.decoder import DecoderLM
from specdecode.runtime.models.eagle3 import Eagle3Config, Eagle3Head
from specdecode.runtime.models.model_config import ModelConfig
from specdecode.runtime.proposers.eagle3 import Eagle3Proposer

LOSSLESS = ["greedy", "target_match", "rejection"]
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
TEXTS = ["def add(a, b):\n    return a + b", "The quick brown fox", "Once upon a time", "1, 2, 3,",
         "hello hello hello hello", "import numpy as np\nx = np.arange(10)"]
HIDDEN = 64


@pytest.fixture(scope="module")
def target(tiny) -> tuple[DecoderLM, object]:
    """(a 4-layer nearly-bigram llama, the tiny tokenizer): module docstring."""
    tok = tiny[1]
    cfg = ModelConfig(architecture="llama", vocab_size=tiny[0].config.vocab_size, hidden_size=HIDDEN, intermediate_size=128,
                      num_layers=4, num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0,
                      max_position_embeddings=2048, tie_word_embeddings=True, attention_bias=False)
    gen = torch.Generator().manual_seed(0)
    model = DecoderLM(cfg)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if not name.endswith("norm.weight"):
                param.copy_(torch.randn(param.shape, generator=gen) * 0.08)
        embedding = model.model.embed_tokens.weight
        embedding.copy_(torch.randn(embedding.shape, generator=gen))
        embedding[:, 0] = 1.0
    return model.eval(), tok


def head_config(target: DecoderLM, aux_ids: tuple[int, int, int], draft_vocab: int, **extra) -> Eagle3Config:
    c = target.config
    return Eagle3Config(hidden_size=HIDDEN, target_hidden_size=c.hidden_size, intermediate_size=32, num_heads=4,
                        num_kv_heads=4, head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0,
                        max_position_embeddings=2048, vocab_size=c.vocab_size, draft_vocab_size=draft_vocab,
                        aux_layer_ids=aux_ids, **extra)


def draft_ids(vocab: int, size: int, seed: int) -> torch.Tensor:  # [size] sorted target ids
    return torch.randperm(vocab, generator=torch.Generator().manual_seed(seed))[:size].sort().values


def random_head(target: DecoderLM) -> Eagle3Head:
    """Random weights, aux layers (1, 2, 3), a 300-token draft vocabulary, chained on norm(out)."""
    vocab = target.config.vocab_size
    head = Eagle3Head(head_config(target, (1, 2, 3), 300, norm_output=True))
    gen = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for name, param in head.named_parameters():
            param.copy_(1 + 0.1 * torch.randn(param.shape, generator=gen) if name.endswith("norm.weight")
                        else 0.15 * torch.randn(param.shape, generator=gen))
        ids = draft_ids(vocab, 300, seed=5)
        head.d2t.copy_(ids - torch.arange(len(ids)))
    return head


def echo_head(target: DecoderLM) -> Eagle3Head:
    """The module docstring's head that agrees with the target often; aux layers (0, 2, 3), every
    token but 16 in its draft vocabulary."""
    vocab, h = target.config.vocab_size, HIDDEN
    head = Eagle3Head(head_config(target, (0, 2, 3), vocab - 16))
    ids = draft_ids(vocab, vocab - 16, seed=6)
    with torch.no_grad():
        for param in head.parameters():
            param.zero_()
        head.fc.weight[0, 0] = 100.0  # g = (100·a_0[0], 0, …): aux state 0 is the embedding, column 0 constant
        mid = head.layers[0]
        mid.input_layernorm.weight.fill_(1.0)
        mid.hidden_norm.weight[0] = 1.0
        mid.post_attention_layernorm.weight.fill_(1.0)
        qkv = mid.self_attn.qkv_proj.weight  # [3·64, 2H]: cat[normed embedding, normed g]
        qkv[: 2 * h, h] = 2.0  # q and k: constant vectors, from g's coordinate 0
        qkv[2 * h :, :h] = torch.eye(h)  # v: the normed embedding
        mid.self_attn.o_proj.weight.copy_(torch.eye(h))
        head.norm.weight.fill_(1.0)
        head.norm.weight[0] = 0.0
        head.lm_head.weight.copy_(target.model.embed_tokens.weight[ids])
        head.d2t.copy_(ids - torch.arange(len(ids)))
    return head


def write_head(folder, head: Eagle3Head) -> str:
    """``head`` in speculators' format: config.json and model.safetensors (q/k/v and gate/up split)."""
    c = head.config
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    tensors = {}
    for name, tensor in head.state_dict().items():
        if ".qkv_proj." in name:
            for part, t in zip(("q_proj", "k_proj", "v_proj"), tensor.split([q, kv, kv])):
                tensors[name.replace("qkv_proj", part)] = t
        elif ".gate_up_proj." in name:
            for part, t in zip(("gate_proj", "up_proj"), tensor.chunk(2)):
                tensors[name.replace("gate_up_proj", part)] = t
        elif name != "d2t" or c.draft_vocab_size < c.vocab_size:
            tensors[name] = tensor
    folder.mkdir(parents=True, exist_ok=True)
    save_file({n: t.contiguous() for n, t in tensors.items()}, str(folder / "model.safetensors"))
    block = {"model_type": "llama", "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
             "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim,
             "num_hidden_layers": c.num_layers, "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta,
             "max_position_embeddings": c.max_position_embeddings, "vocab_size": c.vocab_size}
    (folder / "config.json").write_text(json.dumps({
        "speculators_model_type": "eagle3", "transformer_layer_config": block, "draft_vocab_size": c.draft_vocab_size,
        "target_hidden_size": c.target_hidden_size, "eagle_aux_hidden_state_layer_ids": list(c.aux_layer_ids),
        "norm_before_residual": c.norm_before_residual, "norm_output": c.norm_output}))
    return str(folder)


@pytest.fixture(scope="module")
def heads(target, tmp_path_factory) -> dict[str, str]:
    folder = tmp_path_factory.mktemp("eagle3-heads")
    return {"random": write_head(folder / "random", random_head(target[0])),
            "echo": write_head(folder / "echo", echo_head(target[0]))}


@pytest.fixture(scope="module")
def prompts(target) -> list[list[int]]:
    return [target[1].encode(t) for t in TEXTS]


@pytest.fixture(scope="module")
def nospec(target, prompts, make_engine, run_all) -> list[list[int]]:
    return run_all(make_engine(*target), prompts, GREEDY)


def eagle3(head: str, k: int = 3, verify: str = "rejection", **extra) -> dict:
    return {"method": "eagle3", "num_speculative_tokens": k, "eagle3_path": head, "verify": verify, **extra}


def acceptance(engine) -> tuple[int, int]:
    stats = engine.stats()
    return stats.spec_decode_num_accepted_tokens, stats.spec_decode_num_draft_tokens


@pytest.mark.parametrize("verify", LOSSLESS)
@pytest.mark.parametrize("head", ["random", "echo"])
def test_greedy_equals_no_spec_for_every_lossless_strategy(verify, head, target, heads, prompts, nospec, make_engine,
                                                           run_all, assert_greedy_match):
    """The batch, and its first prompt alone; the echo head's drafts are accepted in part (chains
    after partial acceptance), the random head's rarely."""
    engine = make_engine(*target, spec=eagle3(heads[head], verify=verify))
    batched = run_all(engine, prompts, GREEDY)
    alone = run_all(make_engine(*target, spec=eagle3(heads[head], verify=verify)), prompts[:1], GREEDY)[0]
    for prompt, expected, actual in zip(prompts + prompts[:1], nospec + nospec[:1], batched + [alone]):
        assert_greedy_match(target[0], prompt, expected, actual)
    accepted, drafted = acceptance(engine)
    assert drafted > 0
    if head == "echo":
        assert 0.2 * drafted < accepted < drafted, (accepted, drafted)
    assert engine.proposer.states == {} and engine.blocks.num_free_blocks == engine.blocks.num_blocks


def test_greedy_equals_no_spec_under_chunked_prefill_preemption_prefix_caching_buckets_and_n(
    target, heads, prompts, nospec, make_engine, assert_greedy_match, drafts_at_preemption
):
    """A 6-token step budget (prompts in chunks), a pool too small for all (preemption of sequences
    with drafts verified), a shared prefix cached, verify steps and the head's drafting steps padded
    to batch buckets, n = 2."""
    engine = make_engine(*target, spec=eagle3(heads["echo"]), budget=6, num_blocks=14, block_size=4, buckets=True)
    shapes, padded_module = [], engine.proposer._padded_module
    engine.proposer._padded_module = lambda m, x, embeds, batch: shapes.append(
        (x.shape[0], embeds.shape[0], batch.uniform_query_len)) or padded_module(m, x, embeds, batch)
    drafted_before_preemption = drafts_at_preemption(engine)
    params = replace(GREEDY, n=2)
    shared = prompts + [prompts[0] + prompts[1]]
    for i, p in enumerate(shared):
        engine.add_request(str(i), p, params)
    out = {(str(i), j): [] for i in range(len(shared)) for j in range(2)}
    while engine.has_unfinished():
        for o in engine.step():
            for d in o.deltas:
                out[(o.request_id, d.index)] += d.token_ids
    for i, (prompt, expected) in enumerate(zip(prompts, nospec)):
        for j in range(2):
            assert_greedy_match(target[0], prompt, expected, out[(str(i), j)])
    assert engine.scheduler.num_preemptions > 0 and any(n > 0 for n in drafted_before_preemption)
    assert acceptance(engine)[0] > 0
    drafting = [(real, rows) for real, rows, q in shapes if q == 1]  # one row a sequence
    assert drafting and all(rows in engine.runner.buckets and rows >= real for real, rows in drafting)


def test_the_aux_states_come_from_the_verify_forward(target, heads, prompts, make_engine, run_all):
    """One target forward per step, and the proposer observes [T, 3·H] aux states: the residual
    streams entering its layers, equal to a layer-by-layer recomputation."""
    model = target[0]
    engine = make_engine(*target, spec=eagle3(heads["random"]), overlap=False)
    seen = []
    observe = engine.proposer.observe
    engine.proposer.observe = lambda scheduled, hidden: (seen.append(([i.seq.token_ids[i.start:i.start + i.num_tokens]
                                                                        for i in scheduled], hidden)),
                                                         observe(scheduled, hidden))[1]
    steps = 0
    engine.add_request("0", prompts[1], GREEDY)
    while engine.has_unfinished():
        engine.step()
        steps += 1
    assert engine.runner.num_forwards == steps
    (first_tokens,), aux = seen[0]  # the prompt's step: every row is a prompt token
    assert aux.shape == (len(prompts[1]), 3 * HIDDEN)
    torch.testing.assert_close(aux, entering(model, first_tokens, (1, 2, 3)), rtol=1e-5, atol=1e-5)


def entering(model: DecoderLM, tokens: list[int], ids: tuple[int, ...]) -> torch.Tensor:  # → [T, len(ids)·H]
    """The residual streams entering layers ``ids`` at every position, layer by layer over a fresh cache."""
    c, block = model.config, 16
    blocks = -(-len(tokens) // block)
    batch = build_attention_batch([Span(list(range(blocks)), 0, len(tokens))], block, blocks, torch.device("cpu"))
    x, states = model.model.embed_tokens(torch.tensor(tokens)), []
    with torch.inference_mode():
        for layer in model.model.layers:
            states.append(x)
            pool = kv_pool(blocks, block, c.num_kv_heads, c.head_dim, dtype=torch.float32, device=torch.device("cpu"))
            x = layer(x, model.rope, pool, batch)
    return torch.cat([states[i] for i in ids], dim=-1)


@pytest.mark.parametrize("head", ["random", "echo"])
def test_drafts_after_rejections_equal_drafts_recomputed_from_scratch(head, target, heads, prompts, make_engine):
    """Every proposal after a verify step (chains over slots written by earlier chains, rejected ones
    among them) equals the drafts of a fresh proposer that saw only the sequence's final tokens: the
    random head attends all its slots, the echo head's drafts are accepted in part."""
    model = target[0]
    engine = make_engine(*target, spec=eagle3(heads[head], k=4, verify="greedy"), overlap=False, block_size=4)
    proposer: Eagle3Proposer = engine.proposer
    propose = proposer.propose
    checked = []

    def checking(seqs, max_drafts, guides=None):
        proposal = propose(seqs, max_drafts, guides)
        for seq, k, drafts in zip(seqs, max_drafts, proposal.token_ids):
            if len(seq) > seq.num_prompt_tokens + 1:  # after a verify step
                checked.append(drafts == from_scratch(proposer, model, seq, k))
        return proposal

    proposer.propose = checking
    for i, p in enumerate(prompts[1:4]):
        engine.add_request(str(i), p, replace(GREEDY, max_tokens=10))
    while engine.has_unfinished():
        engine.step()
    accepted, drafted = acceptance(engine)
    assert checked and all(checked), checked
    assert accepted < drafted and (accepted > 0) == (head == "echo"), (accepted, drafted)
    if head == "echo":  # some verify steps accepted drafts and rejected the next: proposals followed them
        per_position = engine.stats().spec_decode_num_accepted_tokens_per_pos
        assert per_position[0] > per_position[-1], per_position


def from_scratch(proposer: Eagle3Proposer, model: DecoderLM, seq: Sequence, k: int) -> list[int]:
    """K greedy drafts for ``seq`` from a fresh proposer over fresh pools: its final slots from the
    aux states of the sequence's tokens but the last, then the chain."""
    n, block = len(seq), proposer.block_size
    fresh = Eagle3Proposer(proposer.head, model, num_blocks=-(-(n + k) // block), block_size=block)
    copy = Sequence(0, "", 0, list(seq.token_ids), seq.num_prompt_tokens, seq.params, 0.0,
                    block_table=list(range(-(-(n + k) // block))))
    item = ScheduledSeq(copy, n - 1)
    copy.num_computed_tokens = n - 1
    fresh.observe([item], entering(model, copy.token_ids[: n - 1], proposer.aux_layer_ids))
    return fresh.propose([copy], [k]).token_ids[0]


def test_seeded_target_match_and_logprobs_equal_no_spec(target, heads, prompts, make_engine, run_all):
    params = SamplingParams(max_tokens=16, temperature=0.8, top_p=0.95, seed=7, ignore_eos=True)
    plain = run_all(make_engine(*target), prompts[:4], params)
    engine = make_engine(*target, spec=eagle3(heads["echo"], verify="target_match"))
    assert run_all(engine, prompts[:4], params) == plain
    assert acceptance(engine)[0] > 0
    results = []
    for spec in (None, eagle3(heads["echo"])):
        engine = make_engine(*target, spec=spec)
        for i, n in enumerate((3, 0)):
            engine.add_request(str(i), prompts[i], replace(GREEDY, max_tokens=12, logprobs=n))
        got = {"0": [], "1": []}
        while engine.has_unfinished():
            for o in engine.step():
                for d in o.deltas:
                    got[o.request_id] += d.logprobs
        results.append(got)
    plain_lp, spec_lp = results
    for rid in ("0", "1"):
        assert [lp.token_id for lp in plain_lp[rid]] == [lp.token_id for lp in spec_lp[rid]]
        for a, b in zip(plain_lp[rid], spec_lp[rid]):
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
            assert [t for t, _ in a.top] == [t for t, _ in b.top]


def test_the_same_seed_gives_the_same_outputs_under_rejection(target, heads, prompts, make_engine, run_all):
    """Sampled drafts (the head's own distribution, q scattered through d2t) and rejection sampling:
    the same seeds give the same tokens in two engines, in a batch and alone."""
    params = SamplingParams(max_tokens=16, temperature=0.9, top_k=20, seed=11, ignore_eos=True)
    spec = eagle3(heads["echo"], verify="rejection")
    first = run_all(make_engine(*target, spec=spec), prompts[:3], params)
    engine = make_engine(*target, spec=spec)
    assert run_all(engine, prompts[:3], params) == first
    assert run_all(make_engine(*target, spec=spec), prompts[:1], params)[0] == first[0]
    assert acceptance(engine)[0] > 0


def test_a_constrained_request_drafts_under_its_grammar(target, heads, prompts, make_engine, run_all):
    """A regex request: its output equals no-spec's, the head drafted for it, and no draft it
    proposed is one the grammar forbids."""
    params = SamplingParams(max_tokens=24, temperature=0.0,
                            structured=StructuredOutput(StructuredKind.REGEX, r"(ab|cd|[a-z ]{1,3})+\."))
    want = run_all(make_engine(*target), prompts[:2], params)
    engine = make_engine(*target, spec=eagle3(heads["echo"], k=4, max_grammar_drafts=2))
    forbidden = []
    cut = engine._grammar_drafts

    def watched(seq, tokens, drawn):
        if seq.grammar is not None:
            forbidden.append(seq.grammar.valid_prefix(tokens) < len(tokens))
        return cut(seq, tokens, drawn)

    engine._grammar_drafts = watched
    assert run_all(engine, prompts[:2], params) == want
    assert forbidden and not any(forbidden)
    assert acceptance(engine)[1] > 0


def test_refusals(heads):
    with pytest.raises(ValueError, match="needs eagle3_path"):
        SpeculativeConfig(method="eagle3")
    with pytest.raises(ValueError, match="only used by method 'eagle3'"):
        SpeculativeConfig(method="mtp", eagle3_path=heads["echo"])
    spec = SpeculativeConfig(**eagle3(heads["echo"]))
    assert mtp_pipeline_gate_refusal("eagle3", 2, ["mtp-pipeline-parallel"]) is None  # PP behind MTP's gate
    with pytest.raises(ValueError, match="gate 'mtp-pipeline-parallel'"):
        EngineConfig(speculative=spec, parallel=ParallelConfig(pipeline_parallel_size=2))
