"""The Verifier on hand-made rows: one-hot and dense draft distributions in one batch, and logprobs
computed only for what was asked (no log-softmax over other rows, no top-k at ``logprobs=0``)."""
import pytest
import torch

from specdecode.runtime.config import VerifyStrategy
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
