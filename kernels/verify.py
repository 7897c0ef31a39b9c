"""Verify draft tokens against the target model: one launch computes the output tokens of a whole batch.

Terms (draft / accepted / recovered / bonus tokens, PLACEHOLDER_TOKEN_ID) are defined in
``specdecode.kernels``. Every strategy returns ``[B, K+1]`` int64: row b holds its accepted tokens,
then its recovered or bonus token, then PLACEHOLDER_TOKEN_ID. Inputs shared by all strategies:
``draft_token_ids [B, K]`` int64 (PLACEHOLDER-padded) and ``num_draft_tokens [B]`` int64 in 0..K
(values outside are clamped); a row with 0 drafts emits one token from position 0. Draft ids must
lie in [0, V) where they are drafts: kernels index the probabilities with them unchecked.

Strategies:
- ``greedy_verify``: accept while draft == target argmax; recovered / bonus = the argmax.
- ``target_match_verify``: sample the target at each position with that position's uniform and
  accept iff the draft equals the sample. With position-keyed uniforms this reproduces seeded
  sampling without speculation exactly (the same ``inverse_cdf_sample`` rule). Lossless.
- ``rejection_verify``: Leviathan et al. / Chen et al. speculative sampling. Lossless.
- ``topp_verify``: accept a draft inside the target's top-p candidate set. LOSSY.

Every emitted sample uses the one rule of ``specdecode.kernels.sampling`` (re-exported here as
``inverse_cdf_sample``), so sampling with and without speculation agree.

Kernel layout: one program per row, K+1 positions handled inside it; a position's vocabulary pass
runs only while the row is still accepting, so rejected tails cost nothing.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import PLACEHOLDER_TOKEN_ID, check_tensor, use_triton_for
from .sampling import Q_DENSE, Q_ONE_HOT, inverse_cdf_sample, inverse_cdf_sample_reference, sample_row, vocab_block

__all__ = [
    "PLACEHOLDER_TOKEN_ID",
    "greedy_verify",
    "target_match_verify",
    "rejection_verify",
    "topp_verify",
    "inverse_cdf_sample",
]

# ---------------------------------------------------------------- public API (dispatchers)


def greedy_verify(
    draft_token_ids: torch.Tensor,  # [B, K] int64
    num_draft_tokens: torch.Tensor,  # [B] int64
    target_argmax: torch.Tensor,  # [B, K+1] int64 (the caller's argmax: lowest index wins ties)
    *,
    use_triton: bool | None = None,
) -> torch.Tensor:  # [B, K+1] int64
    """Accept while draft == argmax; at the first mismatch emit the argmax (recovered), else the bonus argmax."""
    if use_triton_for(use_triton, draft_token_ids, num_draft_tokens, target_argmax):
        return greedy_verify_triton(draft_token_ids, num_draft_tokens, target_argmax)
    return greedy_verify_reference(draft_token_ids, num_draft_tokens, target_argmax)


def target_match_verify(
    draft_token_ids: torch.Tensor,  # [B, K] int64
    num_draft_tokens: torch.Tensor,  # [B] int64
    target_probs: torch.Tensor,  # [B, K+1, V] fp32
    uniforms: torch.Tensor,  # [B, K+1] fp32 in [0, 1)
    *,
    use_triton: bool | None = None,
) -> torch.Tensor:  # [B, K+1] int64
    """Sample the target at each position by inverse CDF; accept a draft iff equal; at the first mismatch emit the sample."""
    if use_triton_for(use_triton, draft_token_ids, num_draft_tokens, target_probs, uniforms):
        return target_match_verify_triton(draft_token_ids, num_draft_tokens, target_probs, uniforms)
    return target_match_verify_reference(draft_token_ids, num_draft_tokens, target_probs, uniforms)


def rejection_verify(
    draft_token_ids: torch.Tensor,  # [B, K] int64
    num_draft_tokens: torch.Tensor,  # [B] int64
    target_probs: torch.Tensor,  # [B, K+1, V] fp32, p
    draft_probs: torch.Tensor | None,  # [B, K, V] fp32, q; None: one-hot q (n-gram, suffix proposers)
    accept_uniforms: torch.Tensor,  # [B, K] fp32 in [0, 1)
    sample_uniforms: torch.Tensor,  # [B, K+1] fp32 in [0, 1)
    *,
    use_triton: bool | None = None,
) -> torch.Tensor:  # [B, K+1] int64
    """Speculative sampling (Leviathan/Chen): lossless for any draft distribution q.

    Draft x at position i is accepted iff ``p(x) > 0 and accept_uniforms[b, i] * q(x) <= p(x)``
    (u < min(1, p/q)); a draft the target gives probability 0 is rejected even at u == 0.
    At the first rejection the recovered token is an inverse-CDF sample of ``max(0, p - q)`` (with a
    one-hot q: p without x) using ``sample_uniforms[b, i]``; if that residual is all zero (p == q),
    of p. If all drafts are accepted, the bonus token samples p at position num_draft with
    ``sample_uniforms[b, num_draft]``. p and q are probability rows (each sums to 1).
    """
    tensors = (draft_token_ids, num_draft_tokens, target_probs, draft_probs, accept_uniforms, sample_uniforms)
    if use_triton_for(use_triton, *tensors):
        return rejection_verify_triton(*tensors)
    return rejection_verify_reference(*tensors)


def topp_verify(
    draft_token_ids: torch.Tensor,  # [B, K] int64
    num_draft_tokens: torch.Tensor,  # [B] int64
    target_probs: torch.Tensor,  # [B, K+1, V] fp32
    top_p: torch.Tensor,  # [B] fp32
    sample_uniforms: torch.Tensor,  # [B, K+1] fp32 in [0, 1)
    *,
    use_triton: bool | None = None,
) -> torch.Tensor:  # [B, K+1] int64
    """Accept a draft iff it lies in the target's top-p candidate set. LOSSY: output does not follow p.

    The candidate set is the smallest set of highest-probability tokens whose mass reaches
    ``top_p * sum(p)``, ties ordered by lower token id first; the best token is always in it. So
    token x is in iff it ranks first or the mass of the tokens ranked before it is < top_p * sum(p).
    Any such draft is accepted however unlikely the target finds it, which over-represents draft
    tokens: the emitted distribution is NOT the target's. At the first rejection, and for the bonus,
    the emitted token is an inverse-CDF sample of p with that position's sample uniform.
    """
    if use_triton_for(use_triton, draft_token_ids, num_draft_tokens, target_probs, top_p, sample_uniforms):
        return topp_verify_triton(draft_token_ids, num_draft_tokens, target_probs, top_p, sample_uniforms)
    return topp_verify_reference(draft_token_ids, num_draft_tokens, target_probs, top_p, sample_uniforms)


# ---------------------------------------------------------------- torch references


def greedy_verify_reference(
    draft_token_ids: torch.Tensor, num_draft_tokens: torch.Tensor, target_argmax: torch.Tensor
) -> torch.Tensor:  # [B, K+1] int64
    B, K = _check(draft_token_ids, num_draft_tokens)
    check_tensor(target_argmax, (B, K + 1), torch.long, "target_argmax")
    valid, num = _valid(draft_token_ids, num_draft_tokens)  # [B, K], [B]
    rejected = valid & (draft_token_ids != target_argmax[:, :K])  # [B, K]
    num_accepted = _first_true(rejected, num)  # [B]
    cols = torch.arange(K + 1, device=draft_token_ids.device)  # [K+1]
    return torch.where(cols[None, :] <= num_accepted[:, None], target_argmax, PLACEHOLDER_TOKEN_ID)


def target_match_verify_reference(
    draft_token_ids: torch.Tensor, num_draft_tokens: torch.Tensor, target_probs: torch.Tensor, uniforms: torch.Tensor
) -> torch.Tensor:  # [B, K+1] int64
    B, K = _check(draft_token_ids, num_draft_tokens)
    V = _expect_probs(target_probs, B, K + 1, "target_probs")
    check_tensor(uniforms, (B, K + 1), torch.float32, "uniforms")
    samples = inverse_cdf_sample_reference(target_probs.reshape(B * (K + 1), V), uniforms.reshape(-1)).view(B, K + 1)
    valid, num = _valid(draft_token_ids, num_draft_tokens)
    rejected = valid & (draft_token_ids != samples[:, :K])  # [B, K]
    num_accepted = _first_true(rejected, num)  # [B]
    cols = torch.arange(K + 1, device=draft_token_ids.device)
    return torch.where(cols[None, :] <= num_accepted[:, None], samples, PLACEHOLDER_TOKEN_ID)


def rejection_verify_reference(
    draft_token_ids: torch.Tensor,
    num_draft_tokens: torch.Tensor,
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor | None,
    accept_uniforms: torch.Tensor,
    sample_uniforms: torch.Tensor,
) -> torch.Tensor:  # [B, K+1] int64
    B, K = _check(draft_token_ids, num_draft_tokens)
    V = _expect_probs(target_probs, B, K + 1, "target_probs")
    if draft_probs is not None:
        check_tensor(draft_probs, (B, K, V), torch.float32, "draft_probs")
    check_tensor(accept_uniforms, (B, K), torch.float32, "accept_uniforms")
    check_tensor(sample_uniforms, (B, K + 1), torch.float32, "sample_uniforms")
    valid, num = _valid(draft_token_ids, num_draft_tokens)
    drafts = torch.where(valid, draft_token_ids, 0)  # [B, K]
    p_x = target_probs[:, :K].gather(2, drafts[..., None]).squeeze(-1)  # [B, K]
    q_x = torch.ones_like(p_x) if draft_probs is None else draft_probs.gather(2, drafts[..., None]).squeeze(-1)
    accepted = (p_x > 0) & (accept_uniforms * q_x <= p_x)  # [B, K]; p(x) == 0 is never accepted, even at u == 0
    rejected = valid & ~accepted  # [B, K]
    num_accepted = _first_true(rejected, num)  # [B]
    rows = torch.arange(B, device=drafts.device)
    p = target_probs[rows, num_accepted]  # [B, V]: the recovered or bonus position
    is_recovered = num_accepted < num  # [B]
    at = num_accepted.clamp(max=max(K - 1, 0))  # [B], a valid draft index where recovered
    if K == 0:
        residual = p
    elif draft_probs is None:
        residual = p.scatter(1, drafts[rows, at][:, None], 0.0)  # p without the rejected draft
    else:
        residual = (p - draft_probs[rows, at]).clamp(min=0)
    use_residual = is_recovered & (residual.sum(-1) > 0)  # [B]; p == q leaves nothing: sample p
    weights = torch.where(use_residual[:, None], residual, p)  # [B, V]
    token = inverse_cdf_sample_reference(weights, sample_uniforms[rows, num_accepted])  # [B]
    return _emit(drafts, num_accepted, token)


def topp_verify_reference(
    draft_token_ids: torch.Tensor,
    num_draft_tokens: torch.Tensor,
    target_probs: torch.Tensor,
    top_p: torch.Tensor,
    sample_uniforms: torch.Tensor,
) -> torch.Tensor:  # [B, K+1] int64
    B, K = _check(draft_token_ids, num_draft_tokens)
    V = _expect_probs(target_probs, B, K + 1, "target_probs")
    check_tensor(top_p, (B,), torch.float32, "top_p")
    check_tensor(sample_uniforms, (B, K + 1), torch.float32, "sample_uniforms")
    valid, num = _valid(draft_token_ids, num_draft_tokens)
    drafts = torch.where(valid, draft_token_ids, 0)  # [B, K]
    p = target_probs[:, :K]  # [B, K, V]
    p_x = p.gather(2, drafts[..., None])  # [B, K, 1]
    vocab = torch.arange(V, device=p.device)
    ahead = (p > p_x) | ((p == p_x) & (vocab < drafts[..., None]))  # [B, K, V]: ranked before the draft
    mass_ahead = torch.where(ahead, p, 0.0).sum(-1)  # [B, K]
    inside = (mass_ahead < top_p[:, None] * p.sum(-1)) | ~ahead.any(-1)  # [B, K]
    num_accepted = _first_true(valid & ~inside, num)  # [B]
    rows = torch.arange(B, device=drafts.device)
    token = inverse_cdf_sample_reference(target_probs[rows, num_accepted], sample_uniforms[rows, num_accepted])
    return _emit(drafts, num_accepted, token)


def _valid(draft_token_ids: torch.Tensor, num_draft_tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    K = draft_token_ids.shape[1]
    num = num_draft_tokens.clamp(0, K)  # [B]
    return torch.arange(K, device=num.device)[None, :] < num[:, None], num  # [B, K], [B]


def _first_true(mask: torch.Tensor, default: torch.Tensor) -> torch.Tensor:
    # mask: [B, K] bool, default: [B] -> [B] first True column, else default
    if mask.shape[1] == 0:
        return default
    cols = torch.arange(mask.shape[1], device=mask.device)
    return torch.where(mask, cols, default[:, None]).amin(1)


def _emit(drafts: torch.Tensor, num_accepted: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
    # drafts: [B, K], num_accepted: [B], token: [B] -> [B, K+1]: accepted drafts, token, placeholders
    B, K = drafts.shape
    cols = torch.arange(K + 1, device=drafts.device)[None, :]  # [1, K+1]
    padded = torch.cat([drafts, drafts.new_full((B, 1), PLACEHOLDER_TOKEN_ID)], 1)  # [B, K+1]
    out = torch.where(cols < num_accepted[:, None], padded, PLACEHOLDER_TOKEN_ID)
    return torch.where(cols == num_accepted[:, None], token[:, None], out)


def _check(draft_token_ids: torch.Tensor, num_draft_tokens: torch.Tensor) -> tuple[int, int]:
    if draft_token_ids.dim() != 2 or draft_token_ids.dtype != torch.long:
        got = f"{list(draft_token_ids.shape)} {draft_token_ids.dtype}"
        raise ValueError(f"draft_token_ids must be [B, K] int64, got {got}")
    B, K = draft_token_ids.shape
    check_tensor(num_draft_tokens, (B,), torch.long, "num_draft_tokens")
    return B, K


def _expect_probs(t: torch.Tensor, B: int, rows: int, name: str) -> int:
    if t.dim() != 3:
        raise ValueError(f"{name} must be [{B}, {rows}, V] float32, got {list(t.shape)}")
    check_tensor(t, (B, rows, t.shape[2]), torch.float32, name)
    return t.shape[2]


# ---------------------------------------------------------------- Triton paths


def greedy_verify_triton(
    draft_token_ids: torch.Tensor, num_draft_tokens: torch.Tensor, target_argmax: torch.Tensor
) -> torch.Tensor:  # [B, K+1] int64
    B, K = _check(draft_token_ids, num_draft_tokens)
    check_tensor(target_argmax, (B, K + 1), torch.long, "target_argmax")
    out = torch.empty((B, K + 1), dtype=torch.long, device=draft_token_ids.device)
    if B:
        _greedy_verify_kernel[(B,)](
            _rows(draft_token_ids), num_draft_tokens.contiguous(), target_argmax.contiguous(), out, K,
            PLACEHOLDER=PLACEHOLDER_TOKEN_ID, BLOCK_K1=triton.next_power_of_2(K + 1),
        )
    return out


def target_match_verify_triton(
    draft_token_ids: torch.Tensor,
    num_draft_tokens: torch.Tensor,
    target_probs: torch.Tensor,
    uniforms: torch.Tensor,
    *,
    block_v: int | None = None,
) -> torch.Tensor:  # [B, K+1] int64
    B, K = _check(draft_token_ids, num_draft_tokens)
    V = _expect_probs(target_probs, B, K + 1, "target_probs")
    check_tensor(uniforms, (B, K + 1), torch.float32, "uniforms")
    out = torch.empty((B, K + 1), dtype=torch.long, device=draft_token_ids.device)
    if B:
        _target_match_verify_kernel[(B,)](
            _rows(draft_token_ids), num_draft_tokens.contiguous(), target_probs.contiguous(), uniforms.contiguous(),
            out, K, V,
            PLACEHOLDER=PLACEHOLDER_TOKEN_ID, BLOCK_K1=triton.next_power_of_2(K + 1), BLOCK_V=vocab_block(V, block_v),
        )
    return out


def rejection_verify_triton(
    draft_token_ids: torch.Tensor,
    num_draft_tokens: torch.Tensor,
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor | None,
    accept_uniforms: torch.Tensor,
    sample_uniforms: torch.Tensor,
    *,
    block_v: int | None = None,
) -> torch.Tensor:  # [B, K+1] int64
    B, K = _check(draft_token_ids, num_draft_tokens)
    V = _expect_probs(target_probs, B, K + 1, "target_probs")
    if draft_probs is not None:
        check_tensor(draft_probs, (B, K, V), torch.float32, "draft_probs")
    check_tensor(accept_uniforms, (B, K), torch.float32, "accept_uniforms")
    check_tensor(sample_uniforms, (B, K + 1), torch.float32, "sample_uniforms")
    out = torch.empty((B, K + 1), dtype=torch.long, device=draft_token_ids.device)
    if B:
        target_probs = target_probs.contiguous()
        q_mode = Q_ONE_HOT if draft_probs is None else Q_DENSE
        q = target_probs if draft_probs is None or K == 0 else draft_probs.contiguous()  # unread when one-hot
        _rejection_verify_kernel[(B,)](
            _rows(draft_token_ids), num_draft_tokens.contiguous(), target_probs, q, _rows(accept_uniforms),
            sample_uniforms.contiguous(), out, K, V,
            Q_MODE=q_mode, PLACEHOLDER=PLACEHOLDER_TOKEN_ID,
            BLOCK_K1=triton.next_power_of_2(K + 1), BLOCK_V=vocab_block(V, block_v),
        )
    return out


def topp_verify_triton(
    draft_token_ids: torch.Tensor,
    num_draft_tokens: torch.Tensor,
    target_probs: torch.Tensor,
    top_p: torch.Tensor,
    sample_uniforms: torch.Tensor,
    *,
    block_v: int | None = None,
) -> torch.Tensor:  # [B, K+1] int64
    B, K = _check(draft_token_ids, num_draft_tokens)
    V = _expect_probs(target_probs, B, K + 1, "target_probs")
    check_tensor(top_p, (B,), torch.float32, "top_p")
    check_tensor(sample_uniforms, (B, K + 1), torch.float32, "sample_uniforms")
    out = torch.empty((B, K + 1), dtype=torch.long, device=draft_token_ids.device)
    if B:
        _topp_verify_kernel[(B,)](
            _rows(draft_token_ids), num_draft_tokens.contiguous(), target_probs.contiguous(), top_p.contiguous(),
            sample_uniforms.contiguous(), out, K, V,
            PLACEHOLDER=PLACEHOLDER_TOKEN_ID, BLOCK_K1=triton.next_power_of_2(K + 1), BLOCK_V=vocab_block(V, block_v),
        )
    return out


def _rows(t: torch.Tensor) -> torch.Tensor:
    # [B, K] with K possibly 0: the kernel masks every read of it, but it needs a real buffer
    return t.contiguous() if t.numel() else t.new_zeros(1)


@triton.jit
def _greedy_verify_kernel(
    draft_ptr,  # [B, K] int64
    num_draft_ptr,  # [B] int64
    argmax_ptr,  # [B, K+1] int64
    out_ptr,  # [B, K+1] int64
    K,
    PLACEHOLDER: tl.constexpr,
    BLOCK_K1: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    num = tl.minimum(tl.maximum(tl.load(num_draft_ptr + row), 0), K).to(tl.int32)
    offs = tl.arange(0, BLOCK_K1)  # [BLOCK_K1] positions
    drafts = tl.load(draft_ptr + row * K + offs, mask=offs < num, other=PLACEHOLDER)
    target = tl.load(argmax_ptr + row * (K + 1) + offs, mask=offs < K + 1, other=PLACEHOLDER)
    rejected = (offs < num) & (drafts != target)
    num_accepted = tl.min(tl.where(rejected, offs, num), axis=0)
    out = tl.where(offs <= num_accepted, target, PLACEHOLDER)  # accepted drafts equal the argmax
    tl.store(out_ptr + row * (K + 1) + offs, out, mask=offs < K + 1)


@triton.jit
def _target_match_verify_kernel(
    draft_ptr,  # [B, K] int64
    num_draft_ptr,  # [B] int64
    p_ptr,  # [B, K+1, V] fp32
    u_ptr,  # [B, K+1] fp32
    out_ptr,  # [B, K+1] int64
    K,
    V,
    PLACEHOLDER: tl.constexpr,
    BLOCK_K1: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    num = tl.minimum(tl.maximum(tl.load(num_draft_ptr + row), 0), K).to(tl.int32)
    offs = tl.arange(0, BLOCK_K1)
    drafts = tl.load(draft_ptr + row * K + offs, mask=offs < num, other=PLACEHOLDER)  # [BLOCK_K1]
    out = tl.full([BLOCK_K1], PLACEHOLDER, tl.int64)
    done = tl.full([], 0, tl.int32)
    for i in range(0, num + 1):
        if done == 0:
            pos = row * (K + 1) + i
            sampled = sample_row(p_ptr + pos * V, p_ptr, 0, tl.load(u_ptr + pos), V, 0, BLOCK_V)
            out = tl.where(offs == i, sampled.to(tl.int64), out)
            draft = tl.sum(tl.where(offs == i, drafts, 0), axis=0)  # PLACEHOLDER at i == num
            done = tl.where(sampled != draft, 1, 0)
    tl.store(out_ptr + row * (K + 1) + offs, out, mask=offs < K + 1)


@triton.jit
def _rejection_verify_kernel(
    draft_ptr,  # [B, K] int64
    num_draft_ptr,  # [B] int64
    p_ptr,  # [B, K+1, V] fp32
    q_ptr,  # [B, K, V] fp32 (Q_MODE 2 only)
    accept_u_ptr,  # [B, K] fp32
    sample_u_ptr,  # [B, K+1] fp32
    out_ptr,  # [B, K+1] int64
    K,
    V,
    Q_MODE: tl.constexpr,  # 1: one-hot q, 2: dense q
    PLACEHOLDER: tl.constexpr,
    BLOCK_K1: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    num = tl.minimum(tl.maximum(tl.load(num_draft_ptr + row), 0), K).to(tl.int32)
    offs = tl.arange(0, BLOCK_K1)  # [BLOCK_K1] positions
    drafted = offs < num
    drafts = tl.load(draft_ptr + row * K + offs, mask=drafted, other=0)  # [BLOCK_K1]
    p_x = tl.load(p_ptr + (row * (K + 1) + offs) * V + drafts, mask=drafted, other=0.0)
    q_x = tl.full([BLOCK_K1], 1.0, tl.float32)
    if Q_MODE == 2:
        q_x = tl.load(q_ptr + (row * K + offs) * V + drafts, mask=drafted, other=1.0)
    accept_u = tl.load(accept_u_ptr + row * K + offs, mask=drafted, other=0.0)
    rejected = drafted & ((p_x <= 0) | (accept_u * q_x > p_x))  # not (p(x) > 0 and u * q(x) <= p(x))
    num_accepted = tl.min(tl.where(rejected, offs, num), axis=0)
    pos = row * (K + 1) + num_accepted
    u = tl.load(sample_u_ptr + pos)
    if num_accepted < num:  # recovered token from the residual
        draft = tl.sum(tl.where(offs == num_accepted, drafts, 0), axis=0)
        token = sample_row(p_ptr + pos * V, q_ptr + (row * K + num_accepted) * V, draft, u, V, Q_MODE, BLOCK_V)
    else:  # bonus token from p: the same code as inverse_cdf_sample
        token = sample_row(p_ptr + pos * V, q_ptr, 0, u, V, 0, BLOCK_V)
    out = tl.where(offs < num_accepted, drafts, PLACEHOLDER)
    out = tl.where(offs == num_accepted, token.to(tl.int64), out)
    tl.store(out_ptr + row * (K + 1) + offs, out, mask=offs < K + 1)


@triton.jit
def _topp_verify_kernel(
    draft_ptr,  # [B, K] int64
    num_draft_ptr,  # [B] int64
    p_ptr,  # [B, K+1, V] fp32
    top_p_ptr,  # [B] fp32
    sample_u_ptr,  # [B, K+1] fp32
    out_ptr,  # [B, K+1] int64
    K,
    V,
    PLACEHOLDER: tl.constexpr,
    BLOCK_K1: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    num = tl.minimum(tl.maximum(tl.load(num_draft_ptr + row), 0), K).to(tl.int32)
    top_p = tl.load(top_p_ptr + row)
    offs = tl.arange(0, BLOCK_K1)
    drafts = tl.load(draft_ptr + row * K + offs, mask=offs < num, other=0)  # [BLOCK_K1]
    out = tl.full([BLOCK_K1], PLACEHOLDER, tl.int64)
    done = tl.full([], 0, tl.int32)
    for i in range(0, num + 1):
        if done == 0:
            pos = row * (K + 1) + i
            draft = tl.sum(tl.where(offs == i, drafts, 0), axis=0)
            inside = tl.full([], 0, tl.int32)
            if i < num:
                inside = _in_top_p(p_ptr + pos * V, draft, top_p, V, BLOCK_V)
            if inside != 0:  # accepted
                out = tl.where(offs == i, draft, out)
            else:  # recovered or bonus
                sampled = sample_row(p_ptr + pos * V, p_ptr, 0, tl.load(sample_u_ptr + pos), V, 0, BLOCK_V)
                out = tl.where(offs == i, sampled.to(tl.int64), out)
                done = tl.full([], 1, tl.int32)
    tl.store(out_ptr + row * (K + 1) + offs, out, mask=offs < K + 1)


@triton.jit
def _in_top_p(p_row, x, top_p, V, BLOCK_V: tl.constexpr):
    # p_row: [V] fp32 pointer, x: token -> 1 if x is in the top-p candidate set (topp_verify), else 0
    p_x = tl.load(p_row + x)
    offs = tl.arange(0, BLOCK_V)
    total = tl.full([], 0.0, tl.float32)
    mass_ahead = tl.full([], 0.0, tl.float32)
    count_ahead = tl.full([], 0, tl.int32)
    for v0 in range(0, V, BLOCK_V):
        idx = v0 + offs
        p = tl.load(p_row + idx, mask=idx < V, other=0.0)
        ahead = (p > p_x) | ((p == p_x) & (idx < x))  # ranked before x: more likely, or tied with a lower id
        mass_ahead += tl.sum(tl.where(ahead, p, 0.0), axis=0)
        count_ahead += tl.sum(ahead.to(tl.int32), axis=0)
        total += tl.sum(p, axis=0)
    return ((mass_ahead < top_p * total) | (count_ahead == 0)).to(tl.int32)
