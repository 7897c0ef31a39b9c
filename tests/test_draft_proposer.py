"""Draft-model proposer: greedy equivalence with the no-spec output (same model as draft: every
draft accepted; a different draft: every lossless strategy), draft forward tokens per step (never
the prefix again; long prompts fed in budget-sized chunks), sampled drafts follow the draft
distribution and rejection keeps the target's, tokenizer checks, draft KV freed on finish/abort, a too-small draft pool and target preemption."""
import json

import pytest
import torch
from conftest import copy_hf_folder
from safetensors.torch import load_file

from specdecode.runtime.config import VerifyStrategy
from specdecode.runtime.engine.sampler import SamplerRow, sampling_probs
from specdecode.runtime.engine.sequence import SamplingParams, Sequence
from specdecode.runtime.engine.verifier import Verifier
from specdecode.runtime.models import weight_cache

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
LOSSLESS = ["greedy", "target_match", "rejection"]
TEXTS = ["def add(a, b):\n    return a + b\n\ndef sub(a, b):", "The quick brown fox", "Once upon a time", "1, 2, 3,"]


@pytest.fixture(scope="module")
def smol_dir(smollm2, smollm2_gguf, cache_dir):
    """SmolLM2 as the HF folder the weight cache holds (loading it as a draft skips dequantization)."""
    return str(weight_cache.lookup(cache_dir, smollm2_gguf, torch.float32))


@pytest.fixture(scope="module")
def noisy_draft_dir(tiny_hf_model_dir, tmp_path_factory):
    """The tiny target's weights plus more noise: a draft whose distributions differ enough from
    the target's that rejection and the recovered tokens matter."""
    gen = torch.Generator().manual_seed(2)
    weights = load_file(str(tiny_hf_model_dir / "model.safetensors"))
    noisy = {k: v + 0.3 * v.std() * torch.randn(v.shape, generator=gen) for k, v in weights.items()}
    return copy_hf_folder(tiny_hf_model_dir, tmp_path_factory.mktemp("noisy-draft"), noisy)


@pytest.fixture(scope="module")
def tiny_prompts(tiny):
    return [tiny[1].encode(t) for t in TEXTS]


@pytest.fixture(scope="module")
def tiny_nospec(tiny, tiny_prompts, make_engine, run_all):
    return run_all(make_engine(*tiny), tiny_prompts, GREEDY)


def count_forward_tokens(engine) -> list[int]:
    """Tokens in each forward of the engine's draft model, appended as they run."""
    counts: list[int] = []
    engine.proposer.model.register_forward_hook(lambda module, args, out: counts.append(args[0].numel()))
    return counts


def run_counting(engine, prompts, params) -> tuple[list[list[int]], list[list[int]]]:
    """Run to completion; (outputs, the tokens of each draft forward, per engine step). For engines
    with overlap off: with it on, a call proposes the next step's drafts too."""
    counts = count_forward_tokens(engine)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    out: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    per_step = []
    while engine.has_unfinished():
        before = len(counts)
        for o in engine.step():
            for d in o.deltas:
                out[o.request_id] += d.token_ids
        per_step.append(counts[before:])
    return [out[str(i)] for i in range(len(prompts))], per_step


def assert_forward_tokens_bounded(forwards: list[list[int]], prompts, k: int) -> None:
    """Step 1 prefills the target (no drafts yet); step 2 feeds each prompt once plus K−1 drafts;
    every later step at most (K+1)·B catch-up tokens plus (K−1)·B single-token draft steps."""
    b = len(prompts)
    per_step = [sum(f) for f in forwards]
    assert per_step[0] == 0
    assert per_step[1] == sum(len(p) + 1 for p in prompts) + (k - 1) * b  # the prompt + first token, once
    assert all(n <= (k + 1) * b + (k - 1) * b for n in per_step[2:]), per_step
    assert sum(per_step[2:]) > 0


def test_same_model_as_draft_is_always_accepted(smollm2, smol_dir, make_engine, run_all, assert_greedy_match):
    prompts = [smollm2.tokenizer.encode(t) for t in TEXTS[:2]]
    params = SamplingParams(max_tokens=11, temperature=0.0, ignore_eos=True)
    expected = run_all(make_engine(smollm2.model, smollm2.tokenizer, num_blocks=16), prompts, params)
    spec = {"method": "draft", "draft_model": smol_dir, "num_speculative_tokens": 4, "verify": "greedy", "draft_kv_cache_blocks": 16}
    engine = make_engine(smollm2.model, smollm2.tokenizer, spec=spec, num_blocks=16, overlap=False)
    got, per_step = run_counting(engine, prompts, params)
    for prompt, e, a in zip(prompts, expected, got):
        assert_greedy_match(smollm2.model, prompt, e, a)
    stats = engine.stats()
    assert stats.spec_decode_num_draft_tokens > 0
    assert stats.spec_decode_num_accepted_tokens == stats.spec_decode_num_draft_tokens  # acceptance 1.0
    assert_forward_tokens_bounded(per_step, prompts, 4)
    assert [sum(f) for f in per_step[2:]] == [2 * 2 + 3 * 2]  # all accepted: 2 unseen tokens each (the last draft, the bonus) + 3 draft steps


@pytest.mark.parametrize("verify", LOSSLESS)
def test_different_draft_greedy_equals_no_spec(tiny, tiny_draft_dir, tiny_prompts, tiny_nospec, make_engine, assert_greedy_match, verify):
    spec = {"method": "draft", "draft_model": tiny_draft_dir, "num_speculative_tokens": 3, "verify": verify}
    engine = make_engine(*tiny, spec=spec, overlap=False)
    got, per_step = run_counting(engine, tiny_prompts, GREEDY)
    for prompt, expected, actual in zip(tiny_prompts, tiny_nospec, got):
        assert_greedy_match(tiny[0], prompt, expected, actual)
    stats = engine.stats()
    assert 0 < stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens  # some drafts rejected
    assert_forward_tokens_bounded(per_step, tiny_prompts, 3)
    assert engine.proposer.states == {} and engine.proposer.blocks.num_free_blocks == engine.proposer.blocks.num_blocks


def test_prompt_catch_up_is_chunked_to_the_step_budget(tiny, tiny_draft_dir, tiny_prompts, tiny_nospec, make_engine, assert_greedy_match):
    """A step budget shorter than the prompts: the draft is fed each prompt in chunks over several
    steps (shortest catch-ups first, drafting nothing for a sequence until its prompt is in), its
    catch-up forward never exceeds the budget, and outputs stay the no-spec ones."""
    budget, k = 8, 3
    assert max(len(p) for p in tiny_prompts) > budget
    spec = {"method": "draft", "draft_model": tiny_draft_dir, "num_speculative_tokens": k}
    engine = make_engine(*tiny, spec=spec, budget=budget, overlap=False)
    got, per_step = run_counting(engine, tiny_prompts, GREEDY)
    for prompt, expected, actual in zip(tiny_prompts, tiny_nospec, got):
        assert_greedy_match(tiny[0], prompt, expected, actual)
    catch_ups = [forwards[0] for forwards in per_step if forwards]  # each step's first draft forward feeds the catch-ups
    assert max(catch_ups) <= budget
    assert sum(catch_ups) >= sum(len(p) for p in tiny_prompts)  # every prompt was fed, in budget-sized pieces
    assert budget in catch_ups  # a prompt cut at the budget, the rest fed in later steps
    assert engine.stats().spec_decode_num_accepted_tokens > 0


def test_goodput_explores_on_the_sequences_with_the_least_catch_up(tiny, tiny_draft_dir, tiny_prompts, tiny_nospec, make_engine, assert_greedy_match):
    """Goodput measures K > 0 by asking drafts of a few sequences (here 2 of 4): those whose prompts
    the draft has least to catch up on, so exploring does not feed it every prompt; outputs stay
    the no-spec ones."""
    spec = {"method": "draft", "draft_model": tiny_draft_dir, "num_speculative_tokens": 3, "load_control": {"goodput": True}}
    engine = make_engine(*tiny, spec=spec, overlap=False)
    asked: list[list[int]] = []
    propose = engine.proposer.propose
    engine.proposer.propose = lambda seqs, caps, guides=None: asked.append([s.seq_id for s in seqs]) or propose(seqs, caps, guides)
    got, per_step = run_counting(engine, tiny_prompts, GREEDY)
    for prompt, expected, actual in zip(tiny_prompts, tiny_nospec, got):
        assert_greedy_match(tiny[0], prompt, expected, actual)
    shortest = sorted(range(len(tiny_prompts)), key=lambda i: len(tiny_prompts[i]))[:2]
    assert sorted(asked[0]) == sorted(shortest)  # K = 0 measured first, then K = 1 asked of these two
    first_catch_up = next(forwards[0] for forwards in per_step if forwards)
    assert first_catch_up < sum(len(p) for p in tiny_prompts)  # not every prompt fed
    assert engine.stats().spec_decode_num_draft_tokens > 0


def test_sampled_drafts_follow_the_draft_and_rejection_keeps_the_target(tiny, tiny_draft_dir, make_engine, full_forward, assert_follows):
    """One proposal for many seeds: the first draft token follows the draft's distribution q (which the
    proposal returns), and rejection sampling of it emits a first token that follows the target's p
    (later output positions: the engine-level test below)."""
    model, tok = tiny
    n, k = 3000, 2
    prompt = tok.encode("The quick brown fox")
    params = SamplingParams(temperature=1.5, top_k=40, max_tokens=8)
    spec = {"method": "draft", "draft_model": tiny_draft_dir, "num_speculative_tokens": k, "draft_kv_cache_blocks": n}
    engine = make_engine(model, tok, spec=spec, budget=n * len(prompt))  # every prompt caught up in this one step
    proposer = engine.proposer
    seqs = [Sequence(i, str(i), 0, list(prompt), len(prompt), params, 0.0, seed=i) for i in range(n)]
    proposal = proposer.propose(seqs, [k] * n)
    assert proposal.probs.shape == (n, k, model.config.vocab_size) and proposal.probs.dtype == torch.float32
    q = sampling_probs(full_forward(proposer.model, prompt)[-1:], [params])[0]  # [V]
    torch.testing.assert_close(proposal.probs[:, 0], q.expand(n, -1), atol=1e-5, rtol=1e-4)
    first = torch.tensor([d[0] for d in proposal.token_ids])
    assert_follows(torch.bincount(first, minlength=len(q)).float(), q)

    p_logits = full_forward(model, prompt)[-1]  # [V]: the target's row for the first emitted token
    rows = [SamplerRow(params, i, len(prompt), [], proposal.token_ids[i], proposal.probs[i]) for i in range(n)]
    verdicts = Verifier(VerifyStrategy.REJECTION, verify_top_p=0.9)(p_logits.repeat(n * (k + 1), 1), rows)
    p = sampling_probs(p_logits[None], [params])[0]
    emitted = torch.bincount(torch.tensor([v.token_ids[0] for v in verdicts]), minlength=len(p)).float()
    assert_follows(emitted, p)
    assert 0.2 < sum(v.num_accepted > 0 for v in verdicts) / n < 0.98  # q ≠ p, yet many accepted


def test_rejection_with_a_draft_model_keeps_the_target_distribution_of_the_first_three_output_tokens(
    tiny, noisy_draft_dir, make_engine, run_seeded, assert_next_token_follows_target
):
    """Many seeded requests for one prompt through the engine, drafts sampled from the draft model
    (dense q) and verified by rejection from the second output token on, accepted and rejected
    alike: the first, second and third output tokens, each given the most frequent preceding output,
    follow the target's conditional distribution under the request's temperature and top-k
    (chi-square, fixed seeds)."""
    model, tok = tiny
    prompt = tok.encode("The quick brown fox")
    n = 2000
    params = SamplingParams(max_tokens=4, temperature=0.6, top_k=8, ignore_eos=True)
    spec = {"method": "draft", "draft_model": noisy_draft_dir, "num_speculative_tokens": 2, "verify": "rejection"}
    engine = make_engine(model, tok, spec=spec, max_seqs=n, budget=8 * n, num_blocks=2 * n)
    outputs, counts = run_seeded(engine, prompt, params, n)
    assert 0.2 * counts.num_draft_tokens < counts.num_accepted_tokens < 0.8 * counts.num_draft_tokens, counts
    assert len(counts.accepted_per_position) == 2  # second drafts accepted too
    for position in (0, 1, 2):  # 0-based output positions
        prefix, samples = assert_next_token_follows_target(model, prompt, outputs, position, params)
        assert samples >= 250, (position, prefix, samples)


def test_seeded_sampling_with_draft_is_reproducible_and_mixes_with_greedy(
    tiny, tiny_draft_dir, tiny_prompts, tiny_nospec, make_engine, assert_greedy_match
):
    """Sampled and greedy requests in one batch (dense and one-hot draft distributions together):
    seeded outputs repeat, greedy ones still equal no-spec."""
    sampled = SamplingParams(max_tokens=16, temperature=0.8, top_p=0.95, seed=3, ignore_eos=True)
    spec = {"method": "draft", "draft_model": tiny_draft_dir, "num_speculative_tokens": 3, "verify": "rejection"}
    runs = []
    for _ in range(2):
        engine = make_engine(*tiny, spec=spec)
        for i, prompt in enumerate(tiny_prompts):
            engine.add_request(f"s{i}", prompt, sampled)
            engine.add_request(f"g{i}", prompt, GREEDY)
        out: dict[str, list[int]] = {}
        while engine.has_unfinished():
            for o in engine.step():
                for d in o.deltas:
                    out.setdefault(o.request_id, []).extend(d.token_ids)
        runs.append(out)
        for i, (prompt, expected) in enumerate(zip(tiny_prompts, tiny_nospec)):
            assert_greedy_match(tiny[0], prompt, expected, out[f"g{i}"])
        assert engine.stats().spec_decode_num_accepted_tokens > 0
    assert runs[0] == runs[1]


def test_draft_with_another_vocabulary_is_refused(smollm2, tiny_hf_model_dir, make_engine):
    spec = {"method": "draft", "draft_model": str(tiny_hf_model_dir)}
    tiny_vocab = json.loads((tiny_hf_model_dir / "config.json").read_text())["vocab_size"]
    with pytest.raises(ValueError, match=rf"{tiny_vocab} tokens but the target's has 49152"):
        make_engine(smollm2.model, smollm2.tokenizer, spec=spec)


def test_draft_with_another_tokenizer_is_refused(tiny, tiny_hf_model_dir, tmp_path, make_engine):
    folder = copy_hf_folder(tiny_hf_model_dir, tmp_path / "draft", load_file(str(tiny_hf_model_dir / "model.safetensors")))
    tok_json = json.loads((tmp_path / "draft" / "tokenizer.json").read_text())
    vocab = tok_json["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[200:202]
    vocab[a], vocab[b] = vocab[b], vocab[a]  # same size, two tokens swapped
    (tmp_path / "draft" / "tokenizer.json").write_text(json.dumps(tok_json))
    with pytest.raises(ValueError, match="must share the target's tokenizer"):
        make_engine(*tiny, spec={"method": "draft", "draft_model": folder})


def test_finish_and_abort_free_the_draft_kv(tiny, tiny_draft_dir, tiny_prompts, make_engine):
    engine = make_engine(*tiny, spec={"method": "draft", "draft_model": tiny_draft_dir, "num_speculative_tokens": 3})
    proposer = engine.proposer
    for i, p in enumerate(tiny_prompts):
        engine.add_request(str(i), p, GREEDY)
    for _ in range(3):
        engine.step()
    assert len(proposer.states) == len(tiny_prompts)
    held = proposer.blocks.num_blocks - proposer.blocks.num_free_blocks
    seq = engine.requests["0"].completions[0].seq
    own = len(proposer.states[seq.seq_id].block_table)
    engine.abort_request("0")
    assert seq.seq_id not in proposer.states
    assert proposer.blocks.num_blocks - proposer.blocks.num_free_blocks == held - own
    while engine.has_unfinished():
        engine.step()
    assert proposer.states == {} and proposer.blocks.num_free_blocks == proposer.blocks.num_blocks


def test_small_draft_pool_and_target_preemption(tiny, tiny_draft_dir, tiny_prompts, tiny_nospec, make_engine, run_all,
                                                assert_greedy_match, drafts_at_preemption):
    """A draft pool with room for one sequence: the others get no drafts (the step never fails);
    a target pool small enough to preempt sequences that had drafts: recomputed sequences keep
    their draft state."""
    spec = {"method": "draft", "draft_model": tiny_draft_dir, "num_speculative_tokens": 3, "draft_kv_cache_blocks": 6}
    engine = make_engine(*tiny, spec=spec, budget=24, num_blocks=14, block_size=8)
    drafted_before_preemption = drafts_at_preemption(engine)
    got = run_all(engine, tiny_prompts, GREEDY)
    for prompt, expected, actual in zip(tiny_prompts, tiny_nospec, got):
        assert_greedy_match(tiny[0], prompt, expected, actual)
    assert any(n > 0 for n in drafted_before_preemption)
    assert engine.proposer.blocks.num_free_blocks == engine.proposer.blocks.num_blocks == 6
