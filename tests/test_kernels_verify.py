"""Verify kernels: Triton (under TRITON_INTERPRET=1, set in conftest.py) equals the torch reference,
hand-computed semantics, and sampling-distribution tests (lossless strategies follow p; top-p does not)."""
import pytest
import torch

from specdecode.kernels import PLACEHOLDER_TOKEN_ID
from specdecode.kernels import sampling as ks
from specdecode.kernels import verify as kv

P = PLACEHOLDER_TOKEN_ID
NEAR_ONE = 1.0 - 2.0**-24  # the largest float32 below 1


# ---------------------------------------------------------------- helpers


def _probs(*shape: int, gen: torch.Generator | None = None, sharpness: float = 3.0) -> torch.Tensor:
    x = torch.rand(*shape, generator=gen).pow(sharpness)
    return x / x.sum(-1, keepdim=True)  # [..., V] fp32 rows summing to 1


def _all_paths(name: str, *args, block_vs=(None, 16)) -> torch.Tensor:
    """Run the reference and the Triton path (default and small vocabulary blocks); all must be equal."""
    module = ks if name == "inverse_cdf_sample" else kv
    ref = getattr(module, f"{name}_reference")(*args)
    triton_fn = getattr(module, f"{name}_triton")
    for block_v in block_vs if name != "greedy_verify" else (None,):
        kwargs = {"block_v": block_v} if block_v else {}
        tri = triton_fn(*args, **kwargs)
        assert torch.equal(tri, ref), f"{name} block_v={block_v}:\ntriton {tri}\nreference {ref}"
    return ref


def _random_case(seed: int, B: int = 4, K: int = 4, V: int = 48):
    """Probabilities, uniforms and drafts that are often but not always accepted, num_draft covering 0..K."""
    gen = torch.Generator().manual_seed(seed)
    p = (3 * torch.randn(B, K + 1, V, generator=gen)).softmax(-1)  # [B, K+1, V], peaked: drafts get accepted
    q = (3 * torch.randn(B, K, V, generator=gen)).softmax(-1)  # [B, K, V]
    sample_u = torch.rand(B, K + 1, generator=gen)
    accept_u = torch.rand(B, K, generator=gen)
    sampled = ks.inverse_cdf_sample_reference(p[:, :K].reshape(-1, V), sample_u[:, :K].reshape(-1)).view(B, K)
    keep = torch.rand(B, K, generator=gen) < 0.8
    noise = torch.randint(0, V, (B, K), generator=gen)
    num = torch.tensor([0, K, 1, K - 1])[:B]
    padding = torch.arange(K)[None, :] >= num[:, None]
    drafts = torch.where(keep, sampled, noise).masked_fill(padding, P)  # [B, K]
    argmax_drafts = torch.where(keep, p[:, :K].argmax(-1), noise).masked_fill(padding, P)  # [B, K], for greedy
    return drafts, argmax_drafts, num, p, q, accept_u, sample_u


def _chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square goodness of fit; p-value = regularised upper incomplete gamma (no scipy needed)."""
    counts, probs = counts.double(), probs.double()
    expected = probs * counts.sum()
    keep = expected > 0
    assert counts[~keep].sum() == 0, "a zero-probability token was sampled"
    stat = ((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum()
    dof = torch.tensor(keep.sum().item() - 1.0, dtype=torch.float64)
    return float(torch.special.gammaincc(dof / 2, stat / 2))


# ---------------------------------------------------------------- Triton == reference on random inputs


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_inputs_all_strategies(seed):
    drafts, argmax_drafts, num, p, q, accept_u, sample_u = _random_case(seed)
    B, K = drafts.shape
    outs = {
        "greedy": _all_paths("greedy_verify", argmax_drafts, num, p.argmax(-1)),
        "target_match": _all_paths("target_match_verify", drafts, num, p, sample_u),
        "rejection": _all_paths("rejection_verify", drafts, num, p, q, accept_u, sample_u),
        "rejection_one_hot": _all_paths("rejection_verify", drafts, num, p, None, accept_u, sample_u),
        "topp": _all_paths("topp_verify", drafts, num, p, torch.tensor([0.9, 0.5, 0.99, 0.2])[:B], sample_u),
    }
    for name, out in outs.items():
        emitted = (out != P).sum(1)  # [B] = num_accepted + 1
        assert ((emitted >= 1) & (emitted <= num + 1)).all(), name
        assert (out[torch.arange(K + 1)[None, :] >= emitted[:, None]] == P).all(), name
        if name != "rejection_one_hot":  # accepts only when u <= p(x): covered by the hand-computed cases
            assert (emitted > 1).any(), f"{name}: the case should accept some drafts"


@pytest.mark.parametrize("seed", [0, 1])
def test_inverse_cdf_sample_random(seed):
    gen = torch.Generator().manual_seed(seed)
    probs = _probs(6, 100, gen=gen)
    probs[:2, 60:] = 0.0  # trailing zeros
    u = torch.rand(6, generator=gen)
    u[:2] = torch.tensor([0.0, NEAR_ONE])
    _all_paths("inverse_cdf_sample", probs, u, block_vs=(None, 16, 32))


def test_zero_drafts_k_zero():
    """K = 0 (no speculation): every strategy is plain sampling at position 0."""
    gen = torch.Generator().manual_seed(5)
    p = _probs(3, 1, 20, gen=gen)
    u = torch.rand(3, 1, generator=gen)
    drafts, num = torch.empty(3, 0, dtype=torch.long), torch.zeros(3, dtype=torch.long)
    plain = ks.inverse_cdf_sample_reference(p[:, 0], u[:, 0])[:, None]  # [3, 1]
    assert torch.equal(_all_paths("greedy_verify", drafts, num, p.argmax(-1)), p.argmax(-1))
    assert torch.equal(_all_paths("target_match_verify", drafts, num, p, u), plain)
    assert torch.equal(_all_paths("rejection_verify", drafts, num, p, None, torch.empty(3, 0), u), plain)
    assert torch.equal(_all_paths("topp_verify", drafts, num, p, torch.full((3,), 0.9), u), plain)


# ---------------------------------------------------------------- edge cases, both paths


def test_inverse_cdf_edges():
    probs = torch.tensor([[0.0, 0.25, 0.25, 0.5, 0.0, 0.0]] * 5 + [[0.0] * 6])  # [6, 6]
    u = torch.tensor([0.0, 0.25, 0.5, NEAR_ONE, 1.0, 0.3])
    # u = 0: the first token with mass; u = 0.25 lands on an edge: strictly greater wins; u >= 1 clamps
    # to the last token with mass, never the zero tail; an all-zero row gives token 0.
    assert _all_paths("inverse_cdf_sample", probs, u, block_vs=(None, 2, 4)).tolist() == [1, 2, 3, 3, 3, 0]


def test_inverse_cdf_never_picks_a_zero_weight_token_after_a_block_edge():
    """Blocked kernels carry ``sum(block)`` into the next block but compare ``cumsum(block)``, which may
    round lower (pairwise vs sequential, or tree vs scan): a threshold between the two used to pick
    the zero-weight token opening the next block (a grammar-forbidden token)."""
    probs = torch.zeros(1, 32)
    probs[0, 0], probs[0, 1:16], probs[0, 17] = 1.0, 2.0**-24, 1.0  # token 16 (first of block 2): weight 0
    u = torch.tensor([0.5])  # threshold ~1 + 2^-21: above the sequential cumsum of block 1, below its sum
    for use_triton, kwargs in ((False, {}), (True, {"block_v": 16}), (True, {})):
        fn = ks.inverse_cdf_sample_triton if use_triton else ks.inverse_cdf_sample_reference
        token = int(fn(probs, u, **kwargs))
        assert probs[0, token] > 0, (use_triton, kwargs, token)


def test_greedy_hand_computed():
    drafts = torch.tensor([[5, 6, 7], [5, 6, 7], [5, 6, 7], [9, P, P], [5, P, P]])
    num = torch.tensor([3, 3, 3, 0, 1])
    argmax = torch.tensor([[5, 6, 7, 9], [4, 6, 7, 9], [5, 6, 8, 9], [3, 1, 1, 1], [5, 2, 0, 0]])
    assert _all_paths("greedy_verify", drafts, num, argmax).tolist() == [
        [5, 6, 7, 9],  # all accepted: bonus
        [4, P, P, P],  # first rejected: recovered
        [5, 6, 8, P],  # rejected in the middle
        [3, P, P, P],  # no drafts: one token from position 0 (the draft column is ignored)
        [5, 2, P, P],  # one draft accepted, bonus from position 1
    ]


def test_greedy_argmax_ties_lowest_index():
    logits = torch.tensor([[[1.0, 3.0, 3.0, 0.0], [2.0, 2.0, 0.0, 0.0]]])  # [1, K+1=2, V]
    argmax = logits.argmax(-1)  # the engine's argmax: lowest index wins a tie
    assert argmax.tolist() == [[1, 0]]
    drafts, num = torch.tensor([[2]]), torch.tensor([1])
    assert _all_paths("greedy_verify", drafts, num, argmax).tolist() == [[1, P]]  # the tied 2 is rejected


def _peaked(V: int, tokens: list[int]) -> torch.Tensor:
    """[len(tokens), V] rows putting 0.9 on one token and the rest spread evenly."""
    p = torch.full((len(tokens), V), 0.1 / (V - 1))
    p[torch.arange(len(tokens)), torch.tensor(tokens)] = 0.9
    return p


def test_target_match_all_accepted_and_first_rejected():
    V, K = 8, 3
    p = torch.stack([_peaked(V, [3, 4, 5, 6])] * 2)  # [2, K+1, V]
    u = torch.full((2, K + 1), 0.5)  # inverse CDF at 0.5 lands on the 0.9 token
    drafts = torch.tensor([[3, 4, 5], [1, 4, 5]])
    out = _all_paths("target_match_verify", drafts, torch.tensor([K, K]), p, u, block_vs=(None, 4))
    assert out.tolist() == [[3, 4, 5, 6], [3, P, P, P]]


def test_target_match_reproduces_plain_sampling():
    """Each emitted token is exactly inverse_cdf_sample at its position: what seeded no-spec sampling draws."""
    drafts, _, num, p, _, _, u = _random_case(7)
    B, K = drafts.shape
    for use_triton in (False, True):
        out = kv.target_match_verify(drafts, num, p, u, use_triton=use_triton)
        plain = ks.inverse_cdf_sample(p.reshape(-1, p.shape[-1]), u.reshape(-1), use_triton=use_triton).view(B, K + 1)
        emitted = out != P
        assert torch.equal(out[emitted], plain[emitted])


def test_rejection_hand_computed_one_hot():
    V, K = 8, 2
    p = torch.stack([_peaked(V, [3, 4, 5])] * 5)  # [5, K+1, V]: 0.9 on the peak, 0.1/7 elsewhere
    drafts = torch.tensor([[3, 4], [3, 0], [0, 4], [9, 9], [3, 4]])
    num = torch.tensor([2, 2, 2, 0, 2])
    accept_u = torch.tensor([[0.0, 0.5], [0.5, 0.5], [0.5, 0.0], [0.9, 0.9], [NEAR_ONE, 0.0]])
    sample_u = torch.tensor([[0.5, 0.5, NEAR_ONE], [0.0, 0.5, 0.0], [0.0, 0.5, 0.5], [0.0, 0.5, 0.5], [0.0, 0.0, 0.0]])
    out = _all_paths("rejection_verify", drafts, num, p, None, accept_u, sample_u, block_vs=(None, 4))
    assert out.tolist() == [
        [3, 4, 7],  # u = 0 accepts; bonus at position 2 with u near 1: the last token, no overrun
        [3, 4, P],  # draft 0 (p = 0.014 < u = 0.5) rejected; recovered from p without 0 at u = 0.5: 4
        [1, P, P],  # first draft rejected; recovered from p without 0 at u = 0: the first token left, 1
        [0, P, P],  # no drafts: one token from position 0 (u = 0: token 0)
        [0, P, P],  # u near 1 rejects even p(x) = 0.9; recovered from p without 3 at u = 0: token 0
    ]


def test_rejection_hand_computed_dense_q():
    V = 8
    p = torch.stack([_peaked(V, [3, 5])] * 4)  # [4, K+1=2, V]
    q_off = _peaked(V, [2])[None].expand(2, 1, V)  # the draft model is confident in 2, the target is not
    q = torch.cat([q_off, 2 * p[2:, :1]])  # rows 2-3: q = 2p, so max(0, p - q) is all zero
    drafts, num = torch.tensor([[2], [2], [3], [3]]), torch.ones(4, dtype=torch.long)
    accept_u = torch.tensor([[0.01], [0.5], [0.9], [0.4]])
    sample_u = torch.tensor([[0.0, 0.5], [0.0, 0.5], [0.5, 0.5], [0.5, 0.5]])
    out = _all_paths("rejection_verify", drafts, num, p, q, accept_u, sample_u, block_vs=(None, 4))
    assert out.tolist() == [
        [2, 5],  # 0.01 * q(2) = 0.009 <= p(2) = 0.014: accepted; bonus from position 1
        [3, P],  # rejected; the residual max(0, p - q) is one-hot on 3 (the other tokens cancel exactly)
        [3, P],  # rejected (0.9 * 1.8 > 0.9) with an all-zero residual: recovered from p itself
        [3, 5],  # 0.4 * 1.8 <= 0.9: accepted
    ]


@pytest.mark.parametrize("one_hot", [True, False], ids=["one_hot_q", "dense_q"])
def test_rejection_rejects_a_zero_probability_draft_at_accept_uniform_zero(one_hot):
    """A draft x with p(x) = 0 (grammar-masked, outside top-k/top-p) is rejected even when the accept
    uniform is exactly 0, where ``u * q(x) <= p(x)`` holds (issue 26), and when q(x) = 0 too; the
    recovered token has p > 0."""
    V, x = 8, 2
    p = torch.tensor([0.0, 0.25, 0.0, 0.75, 0.0, 0.0, 0.0, 0.0]).expand(2, 2, V).contiguous()  # [2, K+1=2, V]
    q = None if one_hot else torch.tensor([[[0.1, 0.0, 0.6, 0.3, 0.0, 0.0, 0.0, 0.0]],
                                           [[0.5, 0.5, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]]])  # [2, K=1, V]; row 1: q(x) = 0
    drafts, num = torch.full((2, 1), x), torch.ones(2, dtype=torch.long)
    accept_u = torch.tensor([[0.0], [0.5]])
    sample_u = torch.tensor([[0.0, 0.0], [NEAR_ONE, 0.0]])
    out = _all_paths("rejection_verify", drafts, num, p, q, accept_u, sample_u, block_vs=(None, 4))
    assert out.tolist() == [[1, P], [3, P]]  # recovered from p (one-hot q) or max(0, p - q): tokens with mass
    assert (p[0, 0, out[:, 0]] > 0).all()


def test_topp_ties_and_candidate_set():
    probs = torch.tensor([0.25, 0.25, 0.25, 0.125, 0.125])  # exact in binary: sums are exact
    p = probs.expand(7, 2, 5).contiguous()  # [7, K+1=2, V=5]
    drafts = torch.tensor([[1], [1], [2], [0], [4], [4], [3]])
    top_p = torch.tensor([0.25, 0.5, 0.5, 0.0, 1.0, 0.875, 0.875])
    sample_u = torch.tensor([[0.0, 0.0], [0.0, NEAR_ONE], [0.6, 0.0], [0.0, 0.0], [0.0, 0.5], [0.0, 0.0], [0.0, 0.0]])
    out = _all_paths("topp_verify", drafts, torch.ones(7, dtype=torch.long), p, top_p, sample_u, block_vs=(None, 2))
    assert out.tolist() == [
        [0, P],  # top_p 0.25 -> {0}: the tie 0/1/2 is broken by the lower id; 1 rejected, recovered at u = 0
        [1, 4],  # top_p 0.5 -> {0, 1}: accepted; bonus with u near 1: the last token
        [2, P],  # 2 is outside {0, 1}: rejected; recovered at u = 0.6 happens to be 2 (0.75 > 0.6)
        [0, 0],  # top_p 0: the best token is always in
        [4, 2],  # top_p 1: everything with mass is in; bonus at u = 0.5: cumsum 0.5 is not > 0.5, so 2
        [0, P],  # top_p 0.875: 3 and 4 tie at 0.125; 3 is in (0.75 ahead), 4 is out (0.875 ahead)
        [3, 0],
    ]


def test_validation_errors():
    drafts, num = torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, dtype=torch.long)
    with pytest.raises(ValueError, match="target_argmax"):
        kv.greedy_verify(drafts, num, torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="target_probs"):
        kv.target_match_verify(drafts, num, torch.zeros(2, 4, 5, dtype=torch.float64), torch.zeros(2, 4))
    with pytest.raises(ValueError, match="draft_probs"):
        probs = torch.zeros(2, 4, 5)
        kv.rejection_verify(drafts, num, probs, probs, torch.zeros(2, 3), torch.zeros(2, 4))


# ---------------------------------------------------------------- distributions (references, vectorised)

N_SAMPLES, V_SMALL, K_DIST = 20_000, 6, 2


def _distribution_case(seed: int):
    """N rows sharing per-position target rows p [K+1, V] and draft rows q [K, V]; drafts sampled from q."""
    gen = torch.Generator().manual_seed(seed)
    p_rows = _probs(K_DIST + 1, V_SMALL, gen=gen, sharpness=1.5)  # [K+1, V]
    q_rows = _probs(K_DIST, V_SMALL, gen=gen, sharpness=1.5)  # [K, V]
    drafts = torch.multinomial(q_rows, N_SAMPLES, replacement=True, generator=gen).T.contiguous()  # [N, K]
    p = p_rows.expand(N_SAMPLES, -1, -1).contiguous()  # [N, K+1, V]
    q = q_rows.expand(N_SAMPLES, -1, -1).contiguous()  # [N, K, V]
    accept_u = torch.rand(N_SAMPLES, K_DIST, generator=gen)
    sample_u = torch.rand(N_SAMPLES, K_DIST + 1, generator=gen)
    num = torch.full((N_SAMPLES,), K_DIST, dtype=torch.long)
    assert _chi2_pvalue(torch.bincount(drafts[:, 0], minlength=V_SMALL), p_rows[0]) < 1e-6, "q must differ from p"
    return drafts, num, p, q, p_rows, accept_u, sample_u


def _assert_follows_p(out: torch.Tensor, p_rows: torch.Tensor) -> None:
    # out: [N, K+1]; position 0 always holds a token, position 1 whenever the first draft was accepted
    for pos in (0, 1):
        tokens = out[:, pos][out[:, pos] != P]
        assert tokens.numel() > N_SAMPLES // 10
        pvalue = _chi2_pvalue(torch.bincount(tokens, minlength=V_SMALL), p_rows[pos])
        assert pvalue > 1e-3, f"position {pos}: tokens do not follow p (chi-square p-value {pvalue:.2e})"


@pytest.mark.parametrize("seed", [11, 12])
def test_rejection_follows_p_with_dense_q(seed):
    drafts, num, p, q, p_rows, accept_u, sample_u = _distribution_case(seed)
    _assert_follows_p(kv.rejection_verify_reference(drafts, num, p, q, accept_u, sample_u), p_rows)


@pytest.mark.parametrize("seed", [13, 14])
def test_rejection_follows_p_with_one_hot_q(seed):
    drafts, num, p, _, p_rows, accept_u, sample_u = _distribution_case(seed)
    _assert_follows_p(kv.rejection_verify_reference(drafts, num, p, None, accept_u, sample_u), p_rows)


@pytest.mark.parametrize("seed", [15, 16])
def test_target_match_follows_p(seed):
    drafts, num, p, _, p_rows, _, sample_u = _distribution_case(seed)
    _assert_follows_p(kv.target_match_verify_reference(drafts, num, p, sample_u), p_rows)


def test_topp_is_lossy():
    drafts, num, p, _, p_rows, _, sample_u = _distribution_case(17)
    top_p = torch.full((N_SAMPLES,), 0.8)
    out = kv.topp_verify_reference(drafts, num, p, top_p, sample_u)
    pvalue = _chi2_pvalue(torch.bincount(out[:, 0], minlength=V_SMALL), p_rows[0])
    assert pvalue < 1e-6, f"top-p verification should visibly distort p (p-value {pvalue:.2e})"
