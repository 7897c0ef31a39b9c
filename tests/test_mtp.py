"""The MTP proposer in the engine, with a randomly initialised head (drafts mostly rejected) on the
tiny models: greedy output equals no-spec for every lossless strategy, alone and in a batch of mixed
lengths, under chunked prefill, preemption (drafts in flight) and n > 1; one target forward per step
and a bounded head; rejection keeps the target distribution at several output positions with the
head's dense q; logprobs, seeds, stops, per-request overrides and load control; the reduced draft
vocabulary; refusals at start."""
from __future__ import annotations

import pytest
import torch

from specdecode.runtime.config import LoadControl
from specdecode.runtime.engine.sequence import SamplingParams
from specdecode.runtime.models.mtp import MtpConfig, MtpHead, TargetFingerprint
from specdecode.runtime.models.mtp_checkpoint import save_mtp_head
from specdecode.runtime.proposers.mtp import MtpProposer

LOSSLESS = ["greedy", "target_match", "rejection"]
GREEDY = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
TEXTS = ["def add(a, b):\n    return a + b\n\ndef sub(a, b):", "The quick brown fox", "Once upon a time",
         "1, 2, 3,", "hello hello hello hello", "User: what is 12 times 12?\nAssistant:",
         "import numpy as np\nx = np.arange(10)", "The capital of France is Paris. The capital of Italy is"]


@pytest.fixture(scope="module")
def sharp_head(sharp, tmp_path_factory, write_random_mtp_head) -> str:
    return write_random_mtp_head(sharp[0], tmp_path_factory.mktemp("sharp-head"))


@pytest.fixture(scope="module")
def prompts(sharp) -> list[list[int]]:
    return [sharp[1].encode(t) for t in TEXTS]


@pytest.fixture(scope="module")
def nospec(sharp, prompts, make_engine, run_all) -> list[list[int]]:
    return run_all(make_engine(*sharp), prompts, GREEDY)


def mtp(head: str, k: int = 3, verify: str = "rejection", **extra) -> dict:
    return {"method": "mtp", "num_speculative_tokens": k, "mtp_path": head, "verify": verify, **extra}


@pytest.mark.parametrize("verify", LOSSLESS)
def test_greedy_equals_no_spec_alone_and_in_a_batch_of_mixed_lengths(
    verify, sharp, sharp_head, prompts, nospec, make_engine, run_all, assert_greedy_match
):
    engine = make_engine(*sharp, spec=mtp(sharp_head, verify=verify))
    batched = run_all(engine, prompts, GREEDY)
    alone = run_all(make_engine(*sharp, spec=mtp(sharp_head, verify=verify)), [prompts[0]], GREEDY)[0]
    for prompt, expected, actual in zip(prompts + prompts[:1], nospec + nospec[:1], batched + [alone]):
        assert_greedy_match(sharp[0], prompt, expected, actual)
    assert engine.stats().spec_decode_num_draft_tokens > 0
    assert engine.proposer.states == {} and engine.blocks.num_free_blocks == engine.blocks.num_blocks


def test_greedy_equals_no_spec_under_chunked_prefill_preemption_and_n(
    sharp, sharp_head, prompts, nospec, make_engine, assert_greedy_match, drafts_at_preemption
):
    """A 6-token step budget (prompts in chunks), a pool too small for all (preemption of sequences
    that had drafts verified), and n = 2 completions per request."""
    engine = make_engine(*sharp, spec=mtp(sharp_head), budget=6, num_blocks=12, block_size=4)
    drafted_before_preemption = drafts_at_preemption(engine)
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, n=2)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    out = {(str(i), j): [] for i in range(len(prompts)) for j in range(2)}
    while engine.has_unfinished():
        for o in engine.step():
            for d in o.deltas:
                out[(o.request_id, d.index)] += d.token_ids
    for i, (prompt, expected) in enumerate(zip(prompts, nospec)):
        for j in range(2):
            assert_greedy_match(sharp[0], prompt, expected, out[(str(i), j)])
    assert engine.scheduler.num_preemptions > 0 and any(n > 0 for n in drafted_before_preemption)


def test_one_target_forward_per_step_and_the_head_catches_up_at_most_k_plus_1_rows(sharp, sharp_head, prompts, make_engine):
    """Per step: one target forward; per decoding sequence the head's catch-up runs its accepted
    slots and its pending slot (≤ K + 1 rows; a prompt once, when it is prefilled) and each further
    draft one chained row. Overlap off: with it on, step N+1's drafts are proposed inside the call
    that runs step N, so the rows would not line up with the calls."""
    k = 3
    engine = make_engine(*sharp, spec=mtp(sharp_head, k=k), overlap=False)
    proposer: MtpProposer = engine.proposer
    rows: list[tuple[str, int]] = []
    run, chain, schedule = proposer._run, proposer._chain, engine.scheduler.schedule
    proposer._run = lambda jobs, tapped: (rows.append(("catch-up", sum(j.end - j.start for j in jobs))), run(jobs, tapped))[1]
    proposer._chain = lambda j, seqs, *a: (rows.append(("chain", len(seqs))), chain(j, seqs, *a))[1]
    scheduled: list[int] = []
    engine.scheduler.schedule = lambda *a: (scheduled.append(len(items := schedule(*a))), items)[1]
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, GREEDY)
    assert sum(map(len, prompts)) <= 512  # one step prefills every prompt
    steps = 0
    while engine.has_unfinished():
        before = len(rows)
        engine.step()
        steps += 1
        step_rows = rows[before:]
        if steps == 1:
            assert step_rows == [("catch-up", sum(map(len, prompts)))]  # each prompt fed to the head once
            continue
        assert sum(n for kind, n in step_rows if kind == "catch-up") <= (k + 1) * scheduled[-1]
        chained = [n for kind, n in step_rows if kind == "chain"]
        assert len(chained) <= k - 1 and all(n <= scheduled[-1] for n in chained)
    assert engine.runner.num_forwards == steps


def echo_head_dir(model, folder) -> str:
    """A head that drafts from the LM head over the token's own embedding: its block adds nothing and
    its projection passes the normed embedding through. The tiny model's two small random layers
    barely move its residual stream off the embedding, so q is close to p, not equal: rejection
    accepts some drafts (~9%, the second ones too) and rejects the others."""
    head = MtpHead(model.config, MtpConfig(num_modules=1, target=TargetFingerprint.of(model, "echo")))
    h = model.config.hidden_size
    with torch.no_grad():
        for param in head.parameters():
            param.zero_()
        module = head.layers[0]
        module.enorm.weight.fill_(1.0)
        module.eh_proj.weight[:, :h] = torch.eye(h)
        module.final_norm.weight.copy_(model.model.norm.weight)
        for block in module.blocks:
            block.input_layernorm.weight.fill_(1.0)
            block.post_attention_layernorm.weight.fill_(1.0)
    save_mtp_head(folder, head, model)
    return str(folder)


@pytest.mark.parametrize("verify", ["rejection", "target_match"])
def test_sampled_mtp_drafts_keep_the_target_distribution_of_the_first_three_output_tokens(
    verify, tiny, tmp_path, make_engine, run_seeded, assert_next_token_follows_target
):
    """Seeded requests through the engine, drafts sampled from the head's own softmax under the
    request's temperature and top-k (dense q), accepted and rejected alike, verified from the second
    output token on: the first three output tokens, each given the most frequent preceding output,
    follow the target's conditional distribution (chi-square)."""
    model, tok = tiny
    head = echo_head_dir(model, tmp_path / "head")
    prompt = tok.encode("The quick brown fox")
    n = 2000
    params = SamplingParams(max_tokens=4, temperature=0.6, top_k=8, ignore_eos=True)
    engine = make_engine(model, tok, spec=mtp(head, k=2, verify=verify), max_seqs=n, budget=8 * n, num_blocks=2 * n)
    outputs, counts = run_seeded(engine, prompt, params, n)
    assert 0.05 * counts.num_draft_tokens < counts.num_accepted_tokens < 0.95 * counts.num_draft_tokens, counts
    assert len(counts.accepted_per_position) == 2  # second drafts accepted too
    for position in (0, 1, 2):
        prefix, samples = assert_next_token_follows_target(model, prompt, outputs, position, params)
        assert samples >= 250, (position, prefix, samples)


def test_logprobs_with_mtp_equal_no_spec_and_top_logprobs_0_has_no_top_list(sharp, sharp_head, prompts, make_engine):
    results = []
    for spec in (None, mtp(sharp_head)):
        engine = make_engine(*sharp, spec=spec)
        for i, n in enumerate((3, 0)):
            engine.add_request(str(i), prompts[i], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=n))
        got = {"0": [], "1": []}
        while engine.has_unfinished():
            for o in engine.step():
                for d in o.deltas:
                    got[o.request_id] += d.logprobs
        results.append(got)
    plain, spec = results
    for rid in ("0", "1"):
        assert [lp.token_id for lp in plain[rid]] == [lp.token_id for lp in spec[rid]]
        for a, b in zip(plain[rid], spec[rid]):
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
            assert [t for t, _ in a.top] == [t for t, _ in b.top]
    assert all(len(lp.top) == 3 for lp in spec["0"]) and all(lp.top == [] for lp in spec["1"])


def test_seeded_target_match_with_mtp_reproduces_seeded_sampling(sharp, sharp_head, prompts, make_engine, run_all):
    params = SamplingParams(max_tokens=20, temperature=0.8, top_p=0.95, seed=7, ignore_eos=True)
    plain = run_all(make_engine(*sharp), prompts[:4], params)
    engine = make_engine(*sharp, spec=mtp(sharp_head, verify="target_match"))
    assert run_all(engine, prompts[:4], params) == plain
    assert engine.stats().spec_decode_num_draft_tokens > 0


def test_stops_overrides_and_goodput_with_mtp(sharp, sharp_head, prompts, make_engine, run_all, assert_greedy_match):
    """A stop string ends the output where no-spec ends it; a request with num_speculative_tokens 0
    gets no drafts beside one that does; goodput load control keeps greedy output."""
    plain_engine = make_engine(*sharp)
    plain = run_all(plain_engine, prompts[:2], GREEDY)
    stop = sharp[1].decode(plain[0][5:8])
    stopped = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, stop=(stop,))
    outs = []
    for spec in (None, mtp(sharp_head)):
        engine = make_engine(*sharp, spec=spec)
        engine.add_request("stop", prompts[0], stopped)
        engine.add_request("off", prompts[1], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, num_speculative_tokens=0))
        engine.add_request("on", prompts[2], GREEDY)
        final, tokens = {}, {"stop": [], "off": [], "on": []}
        while engine.has_unfinished():
            for o in engine.step():
                final[o.request_id] = o
                for d in o.deltas:
                    tokens[o.request_id] += d.token_ids
        outs.append((tokens, final))
    (t0, f0), (t1, f1) = outs
    assert t0 == t1 and f1["stop"].deltas[-1].finish_reason == "stop" and f1["stop"].deltas[-1].stop_reason == stop
    assert f1["off"].spec.num_draft_tokens == 0 and f1["on"].spec.num_draft_tokens > 0
    goodput = make_engine(*sharp, spec=mtp(sharp_head, load_control=LoadControl(goodput=True).model_dump()))
    for prompt, expected, actual in zip(prompts, run_all(make_engine(*sharp), prompts, GREEDY), run_all(goodput, prompts, GREEDY)):
        assert_greedy_match(sharp[0], prompt, expected, actual)


def test_reduced_draft_vocabulary_drafts_only_its_tokens(sharp, sharp_head, prompts, nospec, make_engine, run_all, assert_greedy_match):
    """With draft_vocab_size N the drafts are among the head's first N draft-vocabulary ids, and
    sampled drafts' q is zero elsewhere; greedy output is unchanged."""
    n = 50
    engine = make_engine(*sharp, spec=mtp(sharp_head, draft_vocab_size=n))
    allowed = set(engine.proposer.head.draft_vocab_ids[:n].tolist())
    proposals = []
    propose = engine.proposer.propose
    engine.proposer.propose = lambda seqs, caps, guides=None: (proposals.append(p := propose(seqs, caps, guides)), p)[1]
    for prompt, expected, actual in zip(prompts, nospec, run_all(engine, prompts, GREEDY)):
        assert_greedy_match(sharp[0], prompt, expected, actual)
    sampled = SamplingParams(max_tokens=12, temperature=1.0, seed=1, ignore_eos=True)
    run_all(engine, prompts[:3], sampled)
    drafted = {t for p in proposals for tokens in p.token_ids for t in tokens}
    assert drafted and drafted <= allowed
    dense = [p.probs for p in proposals if p.probs is not None]
    outside = torch.ones(sharp[0].config.vocab_size, dtype=torch.bool)
    outside[list(allowed)] = False
    assert dense and all(float(q[..., outside].abs().sum()) == 0.0 for q in dense)


def test_bad_heads_are_refused_at_start_with_what_to_do(sharp, tiny, sharp_head, tmp_path, make_engine, write_random_mtp_head):
    with pytest.raises(ValueError, match=r"carries no MTP layers.*train-mtp --model smollm2-135m"):
        make_engine(*sharp, spec={"method": "mtp"})  # the default model is a GGUF alias: no MTP layers
    with pytest.raises(ValueError, match=r"was trained for 'test' \(llama.*not for the target"):
        make_engine(*tiny, spec=mtp(sharp_head))  # same shapes, another embedding
    with pytest.raises(ValueError, match="draft_vocab_size 100000 exceeds"):
        make_engine(*sharp, spec=mtp(sharp_head, draft_vocab_size=100_000))
    bare = write_random_mtp_head(sharp[0], tmp_path / "no-vocab", draft_vocab=False)
    with pytest.raises(ValueError, match="draft_vocab_size needs a head trained by"):
        make_engine(*sharp, spec=mtp(bare, draft_vocab_size=8))
