"""N-gram proposer kernel: Triton (under TRITON_INTERPRET=1, set in conftest.py) equals the torch reference."""
import pytest
import torch

from specdecode.kernels import PLACEHOLDER_TOKEN_ID, use_triton_for
from specdecode.kernels.ngram import ngram_propose, ngram_propose_reference, ngram_propose_triton

P = PLACEHOLDER_TOKEN_ID


def _batch(rows: list[list[int]], pad: int = P) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(1, max(len(r) for r in rows))
    tokens = torch.tensor([r + [pad] * (width - len(r)) for r in rows], dtype=torch.long)  # [B, L]
    return tokens, torch.tensor([len(r) for r in rows], dtype=torch.long)  # [B]


def _both(tokens, lengths, min_n, max_n, k, block_l=128):
    ref = ngram_propose_reference(tokens, lengths, min_n, max_n, k)
    tri = ngram_propose_triton(tokens, lengths, min_n, max_n, k, block_l=block_l)
    assert torch.equal(tri[0], ref[0]) and torch.equal(tri[1], ref[1]), f"triton {tri} != reference {ref}"
    return ref


# (name, tokens, min_n, max_n, k, expected drafts)
EDGE_CASES = [
    ("no match", [1, 2, 3, 4, 5], 1, 3, 3, []),
    ("match at the very start", [7, 8, 9, 1, 7, 8], 1, 3, 3, [9, 1, 7]),
    ("k larger than what is left", [4, 5, 6, 4, 5], 1, 2, 5, [6, 4, 5]),
    ("longest n wins over a more recent shorter match", [1, 2, 3, 9, 5, 3, 1, 2, 3], 1, 3, 3, [9, 5, 3]),
    ("most recent occurrence wins", [1, 2, 7, 1, 2, 8, 1, 2], 2, 2, 3, [8, 1, 2]),
    ("occurrence overlapping the suffix", [5, 5, 5, 5], 1, 3, 3, [5]),
    ("shorter than min_n + 1", [4, 4], 2, 3, 3, []),
    ("single token", [4], 1, 3, 3, []),
    ("empty row", [], 1, 3, 3, []),
    ("match only below min_n", [1, 2, 3, 2], 2, 3, 3, []),
]


@pytest.mark.parametrize("case", EDGE_CASES, ids=[c[0] for c in EDGE_CASES])
def test_edge_cases_reference(case):
    _, row, min_n, max_n, k, expected = case
    drafts, num = ngram_propose_reference(*_batch([row]), min_n, max_n, k)
    assert num.tolist() == [len(expected)]
    assert drafts.tolist() == [expected + [P] * (k - len(expected))]


def test_edge_cases_triton_batched():
    """All edge cases with the same window in one batch and one launch, against hand-computed drafts."""
    cases = [c for c in EDGE_CASES if (c[2], c[3], c[4]) == (1, 3, 3)]
    tokens, lengths = _batch([c[1] for c in cases], pad=5)  # padding 5 would extend matches if it were read
    drafts, num = _both(tokens, lengths, 1, 3, 3)
    for (name, _, _, _, k, expected), row, n in zip(cases, drafts.tolist(), num.tolist()):
        assert (row, n) == (expected + [P] * (k - len(expected)), len(expected)), name


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_batches_match_reference(seed):
    torch.manual_seed(seed)
    B, L = 4, 40
    tokens = torch.randint(0, 4, (B, L))  # 4 symbols: plenty of matches of every length
    lengths = torch.randint(0, L + 1, (B,))
    lengths[0] = L
    tokens[torch.arange(L)[None, :] >= lengths[:, None]] = P
    drafts, num = _both(tokens, lengths, 1, 4, 3, block_l=16)  # several blocks of start positions
    assert (num > 0).any()


def test_random_long_rows_default_block():
    torch.manual_seed(3)
    tokens = torch.randint(0, 50, (2, 300))
    tokens[:, 250:260] = tokens[:, 100:110]  # a long repeat, then random tokens again
    lengths = torch.tensor([260, 300])
    drafts, num = _both(tokens, lengths, 2, 5, 4)
    assert drafts[0].tolist() == tokens[0, 110:114].tolist() and num[0] == 4


def test_k_zero_and_validation():
    tokens, lengths = _batch([[1, 2, 1]])
    drafts, num = ngram_propose(tokens, lengths, 1, 2, 0)
    assert drafts.shape == (1, 0) and num.tolist() == [0]
    with pytest.raises(ValueError):
        ngram_propose(tokens, lengths, 3, 2, 4)
    with pytest.raises(ValueError):
        ngram_propose(tokens.int(), lengths, 1, 2, 4)


def test_dispatch_picks_reference_on_cpu():
    tokens, lengths = _batch([[1, 2, 1]])
    assert not use_triton_for(None, tokens, lengths)
    assert use_triton_for(True, tokens, lengths)
    assert ngram_propose(tokens, lengths, 1, 2, 2)[0].tolist() == [[2, 1]]
    assert ngram_propose(tokens, lengths, 1, 2, 2, use_triton=True)[0].tolist() == [[2, 1]]
