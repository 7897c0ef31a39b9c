"""The one sampling rule: inverse CDF in vocabulary order (torch reference + Triton).

Every verify strategy that samples, and the engine's sampler without speculation, draw tokens with
this rule, so seeded sampling with and without speculation picks the same token from the same
probabilities and uniform. Given weights w >= 0 (not necessarily normalised) and u in [0, 1), the
token is the smallest t with ``w[t] > 0`` and ``cumsum(w)[t] > u * sum(w)``, clamped to the last
token with w > 0 (so rounding with u near 1 can never pick a zero-weight token past the end); a row
of all zeros gives token 0. ``w[t] > 0`` changes nothing in exact arithmetic; it keeps a cumulative
sum that rounds up across a zero (a block's ``sum`` carried past its ``cumsum``) from picking a
zero-weight token.

Kernels scan the vocabulary in blocks (vocabularies of 150k+ tokens), so their cumulative sums may
round differently from ``torch.cumsum`` in the last bit: Triton and reference agree except when
``u * sum(w)`` lands within rounding of a bucket edge. Within one path the rule is one function:
the verify kernels call ``sample_row`` with the same block size as ``inverse_cdf_sample``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import check_tensor, use_triton_for

__all__ = ["inverse_cdf_sample", "inverse_cdf_sample_reference", "inverse_cdf_sample_triton"]

MAX_BLOCK_V = 4096  # vocabulary entries per block inside a kernel

Q_NONE, Q_ONE_HOT, Q_DENSE = 0, 1, 2  # sample_row's Q_MODE: what is subtracted from p (nothing, a one-hot, q)


def inverse_cdf_sample(
    probs: torch.Tensor,  # [N, V] fp32, weights >= 0 (normalisation not needed)
    uniforms: torch.Tensor,  # [N] fp32 in [0, 1)
    *,
    use_triton: bool | None = None,
) -> torch.Tensor:  # [N] int64
    """The shared sampling rule (module docstring): smallest t with p[t] > 0, cumsum(p)[t] > u * sum(p), clamped."""
    if use_triton_for(use_triton, probs, uniforms):
        return inverse_cdf_sample_triton(probs, uniforms)
    return inverse_cdf_sample_reference(probs, uniforms)


def inverse_cdf_sample_reference(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    # probs: [N, V] fp32, uniforms: [N] fp32 -> [N] int64
    N, V = _check(probs, uniforms)
    vocab = torch.arange(V, device=probs.device)  # [V]
    if V == 0:
        return vocab.new_zeros(N)
    threshold = uniforms * probs.sum(-1)  # [N]
    cdf = probs.cumsum(-1)  # [N, V]
    first = torch.where((cdf > threshold[:, None]) & (probs > 0), vocab, V).amin(-1)  # [N]
    last_nonzero = torch.where(probs > 0, vocab, -1).amax(-1)  # [N]
    return torch.minimum(first, last_nonzero).clamp(min=0)


def inverse_cdf_sample_triton(
    probs: torch.Tensor, uniforms: torch.Tensor, *, block_v: int | None = None
) -> torch.Tensor:
    # probs: [N, V] fp32, uniforms: [N] fp32 -> [N] int64; block_v (a power of two) is exposed for tests
    N, V = _check(probs, uniforms)
    out = torch.empty(N, dtype=torch.long, device=probs.device)
    if N:
        _inverse_cdf_kernel[(N,)](probs.contiguous(), uniforms.contiguous(), out, V, BLOCK_V=vocab_block(V, block_v))
    return out


def vocab_block(V: int, override: int | None = None) -> int:
    """The vocabulary block size every sampling kernel uses for a vocabulary of V (tests may override)."""
    return override or min(triton.next_power_of_2(max(V, 1)), MAX_BLOCK_V)


def _check(probs: torch.Tensor, uniforms: torch.Tensor) -> tuple[int, int]:
    if probs.dim() != 2 or probs.dtype != torch.float32:
        raise ValueError(f"probs must be [N, V] float32, got {list(probs.shape)} {probs.dtype}")
    check_tensor(uniforms, (probs.shape[0],), torch.float32, "uniforms")
    return probs.shape[0], probs.shape[1]


@triton.jit
def _inverse_cdf_kernel(probs_ptr, uniforms_ptr, out_ptr, V, BLOCK_V: tl.constexpr):
    # probs: [N, V] fp32, uniforms: [N] fp32, out: [N] int64
    row = tl.program_id(0).to(tl.int64)
    token = sample_row(probs_ptr + row * V, probs_ptr, 0, tl.load(uniforms_ptr + row), V, 0, BLOCK_V)
    tl.store(out_ptr + row, token.to(tl.int64))


@triton.jit
def sample_row(
    p_row,  # [V] fp32 pointer: target probabilities at one position
    q_row,  # [V] fp32 pointer: draft probabilities there (read only when Q_MODE == 2)
    draft_tok,  # the rejected draft token (used only when Q_MODE == 1)
    u,  # fp32 scalar uniform
    V,
    Q_MODE: tl.constexpr,  # 0: sample p; 1: sample p without draft_tok; 2: sample max(0, p - q)
    BLOCK_V: tl.constexpr,
):
    """Inverse-CDF sample (module docstring) of p or of the residual; a residual of zero mass falls back to p."""
    offs = tl.arange(0, BLOCK_V)
    p_total = tl.full([], 0.0, tl.float32)
    r_total = tl.full([], 0.0, tl.float32)
    for v0 in range(0, V, BLOCK_V):
        idx = v0 + offs
        p = tl.load(p_row + idx, mask=idx < V, other=0.0)
        p_total += tl.sum(p, axis=0)
        if Q_MODE != 0:
            r_total += tl.sum(_residual(p, q_row, idx, V, draft_tok, Q_MODE), axis=0)
    use_residual = r_total > 0
    total = p_total
    if Q_MODE != 0:
        total = tl.where(use_residual, r_total, p_total)
    threshold = u * total
    carry = tl.full([], 0.0, tl.float32)
    first = tl.zeros([], tl.int32) + V  # smallest index with w > 0 whose cumulative weight passes the threshold
    last_nonzero = tl.full([], -1, tl.int32)
    for v0 in range(0, V, BLOCK_V):
        idx = v0 + offs
        w = tl.load(p_row + idx, mask=idx < V, other=0.0)
        if Q_MODE != 0:
            w = tl.where(use_residual, _residual(w, q_row, idx, V, draft_tok, Q_MODE), w)
        cdf = carry + tl.cumsum(w, axis=0)
        first = tl.minimum(first, tl.min(tl.where((cdf > threshold) & (w > 0), idx, V), axis=0))
        last_nonzero = tl.maximum(last_nonzero, tl.max(tl.where(w > 0, idx, -1), axis=0))
        carry += tl.sum(w, axis=0)
    return tl.maximum(tl.minimum(first, last_nonzero), 0)


@triton.jit
def _residual(p, q_row, idx, V, draft_tok, Q_MODE: tl.constexpr):
    # p: [BLOCK_V] target probabilities at vocabulary indices idx -> max(0, p - q) for that block
    if Q_MODE == 1:
        return tl.where(idx == draft_tok, 0.0, p)
    q = tl.load(q_row + idx, mask=idx < V, other=0.0)
    return tl.maximum(p - q, 0.0)
