"""The Verifier on hand-made rows: one-hot and dense draft distributions in one batch, and logprobs
computed only for what was asked (no log-softmax over other rows, no top-k at ``logprobs=0``)."""
import pytest
import torch

from specdecode.runtime.config import VerifyStrategy
from specdecode.runtime.engine import rng
from specdecode.runtime.engine.sampler import SamplerRow
from specdecode.runtime.engine.sequence import SamplingParams
from specdecode.runtime.engine.verifier import Verifier


def test_one_hot_row_beside_dense_q_rows_is_accepted_with_the_target_probability(chi_square_p_value):
    """n-gram-like rows (no draft_probs: q one-hot on the draft) batched with draft-model rows (dense
    q): a one-hot draft x is accepted with probability p(x), and the emitted first token follows p.
    With q = 0 for the one-hot rows every draft would be accepted (p/q = inf)."""
    torch.manual_seed(2)
    vocab, n = 8, 4000
    logits = torch.randn(3, vocab) * 1.5  # K = 2: rows for positions 0, 1 and the bonus
    params = SamplingParams(temperature=1.0, max_tokens=8)
    p = logits[0].softmax(-1)
    unlikely = int(p.argsort()[-3])  # third most likely: p(x) ≈ 0.07
    assert 0.03 < float(p[unlikely]) < 0.2
    q = (torch.randn(2, vocab) * 1.5).softmax(-1)  # [K, V] the dense rows' draft distributions
    dense_drafts = torch.multinomial(q[0], n, replacement=True)
    rows = []
    for seed in range(n):
        rows.append(SamplerRow(params, seed, 10, [], [int(dense_drafts[seed]), 3], q))
        rows.append(SamplerRow(params, n + seed, 10, [], [unlikely, 4]))  # one-hot drafts
    verdicts = Verifier(VerifyStrategy.REJECTION, verify_top_p=0.9)(logits.repeat(2 * n, 1), rows)
    one_hot = verdicts[1::2]
    accepted = sum(v.num_accepted > 0 for v in one_hot) / n
    assert abs(accepted - float(p[unlikely])) < 0.03, (accepted, float(p[unlikely]))
    first = torch.bincount(torch.tensor([v.token_ids[0] for v in one_hot]), minlength=vocab).float()
    assert chi_square_p_value(first, p) > 1e-3
    dense_first = torch.bincount(torch.tensor([v.token_ids[0] for v in verdicts[0::2]]), minlength=vocab).float()
    assert chi_square_p_value(dense_first, p) > 1e-3


def mixed_rows(logprobs: dict[str, int | None]) -> list[SamplerRow]:
    """Three sequences: greedy with 2 drafts, sampled with 2 drafts, sampled without drafts;
    ``logprobs`` gives each one's request setting ("greedy", "sampled", "plain")."""
    greedy = SamplingParams(temperature=0.0, logprobs=logprobs["greedy"])
    sampled = SamplingParams(temperature=0.8, logprobs=logprobs["sampled"])
    plain = SamplingParams(temperature=0.8, logprobs=logprobs["plain"])
    return [
        SamplerRow(greedy, 0, 10, [], [3, 5]),
        SamplerRow(sampled, 1, 10, [], [3, 5]),
        SamplerRow(plain, 2, 10, []),
    ]


def batch_logits(rows: list[SamplerRow], seed: int = 0) -> torch.Tensor:  # [Σ num_rows, V]
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(sum(r.num_rows for r in rows), 16, generator=gen) * 2


def expected_logprobs(logits: torch.Tensor, start: int, tokens: list[int]) -> list[float]:
    full = logits.log_softmax(-1)
    return [float(full[start + j, t]) for j, t in enumerate(tokens)]


def test_logprobs_0_runs_no_top_k_and_returns_no_top_list(monkeypatch):
    rows = mixed_rows({"greedy": 0, "sampled": 0, "plain": 0})
    logits = batch_logits(rows)
    logits[0, 3] = logits[1, 5] = 50.0  # the greedy row accepts both drafts: three emitted tokens

    def no_top_k(*args, **kwargs):
        raise AssertionError("top-k ran although no request asked for top logprobs")

    monkeypatch.setattr(torch.Tensor, "topk", no_top_k)
    monkeypatch.setattr(torch, "topk", no_top_k)
    verdicts = Verifier(VerifyStrategy.REJECTION, verify_top_p=0.9)(logits, rows)
    monkeypatch.undo()
    assert verdicts[0].token_ids[:2] == [3, 5]
    for verdict, start in zip(verdicts, (0, 3, 6)):
        assert len(verdict.logprobs) == len(verdict.token_ids)
        assert [lp.token_id for lp in verdict.logprobs] == verdict.token_ids
        assert all(lp.top == [] for lp in verdict.logprobs)
        assert [lp.logprob for lp in verdict.logprobs] == pytest.approx(expected_logprobs(logits, start, verdict.token_ids), abs=1e-5)


@pytest.fixture
def log_softmax_rows(monkeypatch) -> list[int]:
    """Rows of every log-softmax run while the fixture is active (method and function spelled)."""
    seen: list[int] = []
    method, function = torch.Tensor.log_softmax, torch.log_softmax

    def spy_method(self, *args, **kwargs):
        seen.append(self.shape[0] if self.dim() > 1 else 1)
        return method(self, *args, **kwargs)

    def spy_function(x, *args, **kwargs):
        seen.append(x.shape[0] if x.dim() > 1 else 1)
        return function(x, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "log_softmax", spy_method)
    monkeypatch.setattr(torch, "log_softmax", spy_function)
    return seen


def test_log_softmax_runs_only_over_the_rows_of_requests_that_asked(log_softmax_rows):
    """Only the sampled sequence asks for logprobs (3 of the batch's 7 rows): log-softmax sees at
    most its rows, and its logprobs and top-2 are those of the full log-softmax."""
    rows = mixed_rows({"greedy": None, "sampled": 2, "plain": None})
    logits = batch_logits(rows, seed=1)
    verdicts = Verifier(VerifyStrategy.REJECTION, verify_top_p=0.9)(logits.clone(), rows)
    ran = list(log_softmax_rows)
    assert 0 < sum(ran) <= rows[1].num_rows, ran
    assert verdicts[0].logprobs == [] and verdicts[2].logprobs == []
    tokens = verdicts[1].token_ids
    full = logits.log_softmax(-1)
    for j, lp in enumerate(verdicts[1].logprobs):
        assert lp.token_id == tokens[j] and lp.logprob == pytest.approx(float(full[3 + j, tokens[j]]), abs=1e-5)
        values, ids = full[3 + j].topk(2)
        assert [t for t, _ in lp.top] == ids.tolist()
        assert [v for _, v in lp.top] == pytest.approx(values.tolist(), abs=1e-5)
    assert len(verdicts[1].logprobs) == len(tokens)


def test_no_log_softmax_when_no_request_asked_for_logprobs(log_softmax_rows):
    rows = mixed_rows({"greedy": None, "sampled": None, "plain": None})
    verdicts = Verifier(VerifyStrategy.TARGET_MATCH, verify_top_p=0.9)(batch_logits(rows), rows)
    assert log_softmax_rows == [] and all(v.logprobs == [] for v in verdicts)


ZERO_ACCEPT_SEED, ZERO_ACCEPT_POSITION = 6116899, 10  # the accept uniform there is exactly 0.0 (issue 26)


@pytest.mark.parametrize("dense_q", [False, True], ids=["one_hot_q", "dense_q"])
@pytest.mark.parametrize("zeroed_by", ["grammar", "top_k"])
def test_a_draft_of_target_probability_zero_is_rejected_at_accept_uniform_zero(zeroed_by, dense_q):
    """Seed 6116899 at position 10 draws an accept uniform of exactly 0, where ``u * q(x) <= p(x)``
    holds for p(x) = 0: the draft (the target's second best, forbidden by the grammar or cut by
    top_k = 1) must still be rejected, and the recovered token is one the target allows."""
    key = torch.tensor([ZERO_ACCEPT_SEED]), torch.tensor([ZERO_ACCEPT_POSITION])
    assert rng.device_uniforms(*key, 1, rng.Stream.ACCEPT).item() == 0.0
    vocab = 16
    logits = torch.randn(2, vocab, generator=torch.Generator().manual_seed(0))  # [K+1=2, V]
    best, draft = logits[0].argsort(descending=True)[:2].tolist()
    allowed = None
    params = SamplingParams(temperature=1.0, top_k=1, max_tokens=8)
    if zeroed_by == "grammar":
        allowed = torch.full((2, 1), -1, dtype=torch.int32)  # [K+1, ceil(V/32)]: all allowed
        allowed[0, 0] = ~(1 << draft)  # but the draft at position 0
        params = SamplingParams(temperature=1.0, max_tokens=8)
    q = torch.full((1, vocab), 0.5 / (vocab - 1)) if dense_q else None  # [K=1, V]
    if dense_q:
        q[0, draft] = 0.5
    row = SamplerRow(params, ZERO_ACCEPT_SEED, ZERO_ACCEPT_POSITION, [], [draft], q, allowed=allowed)
    (verdict,) = Verifier(VerifyStrategy.REJECTION, verify_top_p=0.9)(logits, [row])
    assert verdict.num_accepted == 0
    assert verdict.token_ids[0] != draft
    if zeroed_by == "top_k":
        assert verdict.token_ids == [best]
