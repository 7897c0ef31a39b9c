"""Speculative decoding end to end: greedy equivalence with the no-spec output for every
lossless strategy, seeded target_match == seeded no-spec sampling, the verifier's sampled
distribution, per-request override, logprobs, penalties and stops under speculation."""

import pytest
import torch

from specdecode.runtime.config import VerifyStrategy
from specdecode.runtime.engine.sampler import SamplerRow
from specdecode.runtime.engine.sequence import SamplingParams
from specdecode.runtime.engine.verifier import Verifier

LOSSLESS = ["greedy", "target_match", "rejection"]

@pytest.mark.parametrize("verify", LOSSLESS)
def test_ngram_greedy_equals_no_spec_batch_of_8(smollm2, smol_rep, smol_nospec, make_engine, run_all, assert_greedy_match, verify, rep_greedy):
    spec = {"method": "ngram", "num_speculative_tokens": 4, "verify": verify, "prompt_lookup_max": 3}
    engine = make_engine(smollm2.model, smollm2.tokenizer, spec=spec)
    got = run_all(engine, smol_rep, rep_greedy)
    for prompt, expected, actual in zip(smol_rep, smol_nospec, got):
        assert_greedy_match(smollm2.model, prompt, expected, actual)
    stats = engine.stats()
    assert stats.spec_decode_num_draft_tokens > 0 and stats.spec_decode_num_accepted_tokens > 0  # speculation really ran
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


@pytest.mark.parametrize("verify", LOSSLESS)
def test_ngram_greedy_equals_no_spec_alone(smollm2, smol_rep, smol_nospec, make_engine, run_all, assert_greedy_match, verify, rep_greedy):
    spec = {"method": "ngram", "num_speculative_tokens": 5, "verify": verify}
    for i in (0, 2):
        got = run_all(make_engine(smollm2.model, smollm2.tokenizer, spec=spec), [smol_rep[i]], rep_greedy)[0]
        assert_greedy_match(smollm2.model, smol_rep[i], smol_nospec[i], got)


def test_speculation_under_chunked_prefill_and_preemption(smollm2, smol_rep, smol_nospec, make_engine, run_all,
                                                         assert_greedy_match, rep_greedy, drafts_at_preemption):
    """Prompts in chunks, and preemption of sequences that had drafts verified before it."""
    spec = {"method": "ngram", "num_speculative_tokens": 4}
    # 24-token steps chunk the longer prompts; 22 blocks of 8 preempt one sequence after it had drafts
    engine = make_engine(smollm2.model, smollm2.tokenizer, spec=spec, budget=24, num_blocks=22, block_size=8)
    drafted_before_preemption = drafts_at_preemption(engine)
    got = run_all(engine, smol_rep, rep_greedy)
    for prompt, expected, actual in zip(smol_rep, smol_nospec, got):
        assert_greedy_match(smollm2.model, prompt, expected, actual)
    assert any(n > 0 for n in drafted_before_preemption) and engine.stats().spec_decode_num_accepted_tokens > 0


def test_stops_penalties_and_logprobs_inside_accepted_drafts(smollm2, smol_rep, make_engine, full_forward):
    """With a frequency penalty, n-gram drafts are accepted and the stop string completes on an
    accepted draft (the step's later accepted tokens are dropped): tokens, text, stop and logprobs
    equal the no-spec run's."""
    stop = "`add` function takes two"  # its second "function takes two numbers and" is drafted from the first
    params = SamplingParams(max_tokens=32, temperature=0.0, frequency_penalty=0.3, logprobs=3, stop=(stop,))
    results = {}
    for name, spec in (("plain", None), ("ngram", {"method": "ngram", "num_speculative_tokens": 4})):
        engine = make_engine(smollm2.model, smollm2.tokenizer, spec=spec)
        engine.add_request("r", smol_rep[0], params)
        tokens, text, logprobs, deltas, steps = [], "", [], [], []
        while engine.has_unfinished():
            for o in engine.step():
                steps.append((sum(len(d.token_ids) for d in o.deltas), o.spec.num_accepted_tokens))
                for d in o.deltas:
                    tokens += d.token_ids
                    text += d.text
                    logprobs += d.logprobs
                    deltas.append(d)
        results[name] = (tokens, text, logprobs, deltas[-1], steps)
    (t0, s0, l0, d0, _), (t1, s1, l1, d1, steps) = results["plain"], results["ngram"]
    assert d0.finish_reason == d1.finish_reason == "stop" and d0.stop_reason == d1.stop_reason == stop
    assert len(t0) < params.max_tokens and stop not in s0 and smollm2.tokenizer.decode(t0).startswith(s0 + stop)
    assert t0 == t1 and s0 == s1
    # The stop completed on an accepted draft: the last step accepted at least as many drafts as it
    # delivered tokens, so the stop token was one of them and what followed it was dropped.
    (last_tokens, accepted_total), (_, accepted_before) = steps[-1], steps[-2]
    assert last_tokens >= 2 and accepted_total - accepted_before >= last_tokens, steps
    # The penalty changed the greedy choice somewhere: no near-tie excuse is needed for t0 == t1.
    raw = full_forward(smollm2.model, smol_rep[0] + t0)[len(smol_rep[0]) - 1 : -1].argmax(-1)  # [len(t0)]
    assert raw.tolist() != t0
    assert len(l0) == len(l1) == len(t0)
    for a, b in zip(l0, l1):
        assert a.token_id == b.token_id and a.logprob == pytest.approx(b.logprob, abs=1e-4)
        assert [t for t, _ in a.top] == [t for t, _ in b.top]


def test_seeded_target_match_reproduces_seeded_sampling(sharp, make_engine, run_all):
    model, tok = sharp
    prompts = [tok.encode(t) for t in ("hello hello hello hello", "the cat the cat the cat", "a b a b a b")]
    params = SamplingParams(max_tokens=24, temperature=0.8, top_p=0.95, seed=7, ignore_eos=True)
    plain = run_all(make_engine(model, tok), prompts, params)
    engine = make_engine(model, tok, spec={"method": "ngram", "num_speculative_tokens": 3, "verify": "target_match"})
    spec = run_all(engine, prompts, params)
    assert spec == plain
    assert engine.stats().spec_decode_num_draft_tokens > 0


def test_per_request_override_turns_speculation_off(sharp, make_engine):
    model, tok = sharp
    engine = make_engine(model, tok, spec={"method": "ngram", "num_speculative_tokens": 4})
    prompt = tok.encode("hello hello hello hello hello")
    engine.add_request("off", prompt, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, num_speculative_tokens=0))
    engine.add_request("on", prompt, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    final = {}
    while engine.has_unfinished():
        for o in engine.step():
            final[o.request_id] = o
    assert final["off"].spec.num_draft_tokens == 0
    assert final["on"].spec.num_draft_tokens > 0


def emitted_at(verdicts, position: int, vocab: int) -> torch.Tensor:  # [V] counts
    """Counts of the token emitted at ``position`` by the verdicts that got that far (every draft
    before it accepted): the target's row ``position`` decided it."""
    tokens = [v.token_ids[position] for v in verdicts if v.num_accepted >= position]
    return torch.bincount(torch.tensor(tokens, dtype=torch.long), minlength=vocab).float()


@pytest.mark.parametrize("strategy", ["target_match", "rejection", "topp"])
def test_verifier_distribution_at_every_draft_position(strategy, chi_square_p_value, assert_follows):
    """Many independent seeds, one step each, drafts a fixed guess (the first row's runner-up, then
    each row's favourite; all often rejected): for lossless strategies the token emitted at every
    position (accepted, recovered or bonus), among the seeds that reached it, follows the target's
    sampling distribution there."""
    torch.manual_seed(0)
    vocab, k, n = 8, 3, 6000
    logits = torch.randn(k + 1, vocab) * 1.5
    draft = [int(logits[0].topk(2).indices[1])] + [int(logits[j].argmax()) for j in range(1, k)]  # all in topp's set
    params = SamplingParams(temperature=0.9, max_tokens=8)
    rows = [SamplerRow(params, seed, 10, [], list(draft)) for seed in range(n)]
    verifier = Verifier(VerifyStrategy(strategy), verify_top_p=0.9)
    verdicts = verifier(logits.repeat(n, 1), rows)
    target = (logits / 0.9).softmax(-1)  # [K+1, V]
    if strategy == "topp":  # lossy, as documented: it accepts the runner-up whenever it is drafted
        assert chi_square_p_value(emitted_at(verdicts, 0, vocab), target[0]) < 1e-6
        return
    for position in range(k + 1):
        counts = emitted_at(verdicts, position, vocab)
        assert counts.sum() >= 100, (position, counts.sum())
        assert_follows(counts, target[position])


def test_rejection_with_draft_model_distributions_keeps_the_target_distribution(assert_follows):
    """Drafts sampled from a dense q (as a draft model proposes), one q row per position: the token
    emitted at every position, among the seeds that reached it, follows p there; the first draft is
    accepted with probability Σ min(p, q)."""
    torch.manual_seed(1)
    vocab, n = 8, 6000
    logits = torch.randn(3, vocab) * 1.5
    q = (torch.randn(2, vocab) * 1.5).softmax(-1)  # [K, V] the draft model's distributions
    drafts = torch.stack([torch.multinomial(q[j], n, replacement=True) for j in range(2)], dim=1)  # [n, K], row j ~ q[j]
    params = SamplingParams(temperature=1.0, max_tokens=8)
    rows = [SamplerRow(params, seed, 10, [], drafts[seed].tolist(), q) for seed in range(n)]
    verdicts = Verifier(VerifyStrategy.REJECTION, verify_top_p=0.9)(logits.repeat(n, 1), rows)
    p = logits.softmax(-1)  # [K+1, V]
    for position in range(3):
        counts = emitted_at(verdicts, position, vocab)
        assert counts.sum() >= 300, (position, counts.sum())
        assert_follows(counts, p[position])
    accepted_first = sum(v.num_accepted > 0 for v in verdicts) / n
    expected = float(torch.minimum(q[0], p[0]).sum())  # P(accept) = Σ min(p, q)
    assert abs(accepted_first - expected) < 0.03


def test_logprobs_0_under_speculation_runs_no_top_k_and_returns_no_top_list(sharp, make_engine, full_forward, monkeypatch):
    """A request asking ``logprobs=0`` beside one asking none: every emitted token (accepted drafts
    included) carries its target logprob and no top list, and no top-k runs in any step."""
    model, tok = sharp
    prompt = tok.encode("a b a b a b")  # the model's greedy output repeats itself: n-gram drafts get accepted
    engine = make_engine(model, tok, spec={"method": "ngram", "num_speculative_tokens": 4})
    engine.add_request("lp", prompt, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=0))
    engine.add_request("none", prompt, SamplingParams(max_tokens=16, temperature=0.7, seed=1, ignore_eos=True))

    def no_top_k(*args, **kwargs):
        raise AssertionError("top-k ran although no request asked for top logprobs")

    monkeypatch.setattr(torch.Tensor, "topk", no_top_k)
    monkeypatch.setattr(torch, "topk", no_top_k)
    tokens, logprobs, final = [], [], {}
    while engine.has_unfinished():
        for o in engine.step():
            final[o.request_id] = o
            if o.request_id == "lp":
                for d in o.deltas:
                    tokens += d.token_ids
                    logprobs += d.logprobs
            else:
                assert all(d.logprobs == [] for d in o.deltas)
    monkeypatch.undo()
    assert final["lp"].spec.num_accepted_tokens > 0  # logprobs of accepted drafts were really produced
    assert [lp.token_id for lp in logprobs] == tokens and len(tokens) == 16
    assert all(lp.top == [] for lp in logprobs)
    expected = full_forward(model, prompt + tokens).log_softmax(-1)[len(prompt) - 1 : -1]  # [16, V]
    assert [lp.logprob for lp in logprobs] == pytest.approx(expected.gather(1, torch.tensor(tokens)[:, None])[:, 0].tolist(), abs=1e-4)


@pytest.mark.parametrize("verify", ["rejection", "target_match"])
def test_ngram_speculation_keeps_the_target_distribution_of_the_first_three_output_tokens(
    sharp, make_engine, full_forward, run_seeded, assert_next_token_follows_target, verify
):
    """Many seeded requests for one prompt through the engine, n-gram drafts (one-hot q) verified
    from the second output token on, some accepted and some not: the first, second and third
    output tokens, each given the most frequent preceding output, follow the target's conditional
    distribution under the request's temperature and top-k (chi-square, fixed seeds)."""
    model, tok = sharp
    prompt = tok.encode("a b a b a b")
    for _ in range(7):  # the model's own greedy continuation, which loops on one token: plausible drafts
        prompt.append(int(full_forward(model, prompt)[-1].argmax()))
    n = 3000
    params = SamplingParams(max_tokens=4, temperature=0.6, top_k=6, ignore_eos=True)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "verify": verify}
    engine = make_engine(model, tok, spec=spec, max_seqs=n, budget=8 * n, num_blocks=3 * n)
    outputs, counts = run_seeded(engine, prompt, params, n)
    assert 0 < counts.num_accepted_tokens < counts.num_draft_tokens, counts  # drafts accepted and rejected
    for position in (0, 1, 2):  # 0-based output positions
        prefix, samples = assert_next_token_follows_target(model, prompt, outputs, position, params)
        assert samples >= 400, (position, prefix, samples)
