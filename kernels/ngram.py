"""N-gram (prompt lookup) proposer over a batch: draft tokens copied from earlier in each sequence.

For each row (its prompt + generated tokens), the *suffix* is its last n tokens. For n from
``max_n`` down to ``min_n`` we look for an earlier occurrence of that n-gram (any occurrence that
starts before the suffix itself; occurrences may overlap it). The longest n that matches wins:
a longer match is stronger evidence that the text is repeating. Among the occurrences of the
winning n-gram we take the MOST RECENT one: recent context predicts the continuation best (a loop
in generated code, the paragraph being quoted right now), and it is what the suffix is most likely
repeating. The up-to-k tokens that followed it become the draft tokens; fewer when the row ends
first. No match, or a row shorter than ``min_n + 1``, gives 0 draft tokens.

Terms (draft tokens, PLACEHOLDER_TOKEN_ID) are defined in ``specdecode.kernels``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import PLACEHOLDER_TOKEN_ID, use_triton_for

__all__ = ["PLACEHOLDER_TOKEN_ID", "ngram_propose", "ngram_propose_reference", "ngram_propose_triton"]

_BLOCK_L = 128  # candidate start positions compared per step inside the kernel


def ngram_propose(
    tokens: torch.Tensor,  # [B, L] int64, row b valid up to lengths[b], padding after
    lengths: torch.Tensor,  # [B] int64
    min_n: int,
    max_n: int,
    k: int,
    *,
    use_triton: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # draft_token_ids [B, k] int64 (PLACEHOLDER-padded), num_draft_tokens [B] int64
    """Propose up to k draft tokens per row by prompt lookup (see the module docstring)."""
    _check(tokens, lengths, min_n, max_n, k)
    if use_triton_for(use_triton, tokens, lengths):
        return ngram_propose_triton(tokens, lengths, min_n, max_n, k)
    return ngram_propose_reference(tokens, lengths, min_n, max_n, k)


def ngram_propose_reference(
    tokens: torch.Tensor,  # [B, L] int64
    lengths: torch.Tensor,  # [B] int64
    min_n: int,
    max_n: int,
    k: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # [B, k] int64, [B] int64
    """Plain-torch reference: every candidate start compared at once, one n at a time."""
    _check(tokens, lengths, min_n, max_n, k)
    B, L = tokens.shape
    dev = tokens.device
    lengths = lengths.clamp(0, L)
    best_start = torch.full((B,), -1, dtype=torch.long, device=dev)  # start of the chosen occurrence
    best_n = torch.zeros(B, dtype=torch.long, device=dev)
    for n in range(max_n, min_n - 1, -1):  # longest first: a row keeps its first (longest) match
        if L < n + 1:
            continue
        windows = tokens.unfold(1, n, 1)  # [B, L-n+1, n]: windows[b, s] = tokens[b, s:s+n]
        suffix_start = lengths - n  # [B]; an occurrence must start before it
        suffix_idx = (suffix_start[:, None] + torch.arange(n, device=dev)).clamp(0, L - 1)  # [B, n]
        suffix = tokens.gather(1, suffix_idx)  # [B, n]
        starts = torch.arange(L - n + 1, device=dev)  # [L-n+1]
        hit = (windows == suffix[:, None, :]).all(-1) & (starts[None, :] < suffix_start[:, None])  # [B, L-n+1]
        most_recent = torch.where(hit, starts, -1).amax(1)  # [B], -1: no occurrence
        take = (best_start < 0) & (most_recent >= 0)
        best_start = torch.where(take, most_recent, best_start)
        best_n = torch.where(take, torch.full_like(best_n, n), best_n)
    follow = best_start + best_n  # [B] position of the first token after the occurrence
    num = torch.where(best_start >= 0, (lengths - follow).clamp(max=k), 0)  # [B]
    cols = torch.arange(k, device=dev)  # [k]
    idx = (follow[:, None] + cols).clamp(0, max(L - 1, 0))  # [B, k]
    gathered = tokens.gather(1, idx) if L > 0 else torch.zeros_like(idx)
    drafts = torch.where(cols[None, :] < num[:, None], gathered, PLACEHOLDER_TOKEN_ID)  # [B, k]
    return drafts, num


def ngram_propose_triton(
    tokens: torch.Tensor,  # [B, L] int64
    lengths: torch.Tensor,  # [B] int64
    min_n: int,
    max_n: int,
    k: int,
    *,
    block_l: int = _BLOCK_L,
) -> tuple[torch.Tensor, torch.Tensor]:  # [B, k] int64, [B] int64
    """Triton path: one program per row; ``block_l`` (a power of two) is exposed for tests."""
    _check(tokens, lengths, min_n, max_n, k)
    B, L = tokens.shape
    drafts = torch.empty((B, k), dtype=torch.long, device=tokens.device)
    num = torch.empty((B,), dtype=torch.long, device=tokens.device)
    if B == 0 or k == 0:
        return drafts, num.zero_()
    _ngram_propose_kernel[(B,)](
        tokens.contiguous(), lengths.contiguous(), drafts, num,
        L, min_n, max_n, k,
        PLACEHOLDER=PLACEHOLDER_TOKEN_ID,
        BLOCK_L=block_l,
        BLOCK_K=triton.next_power_of_2(k),
    )
    return drafts, num


@triton.jit
def _ngram_propose_kernel(
    tokens_ptr,  # [B, L] int64
    lengths_ptr,  # [B] int64
    drafts_ptr,  # [B, k] int64, out
    num_ptr,  # [B] int64, out
    L,
    min_n,
    max_n,
    k,
    PLACEHOLDER: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    row_tokens = tokens_ptr + row * L
    length = tl.minimum(tl.maximum(tl.load(lengths_ptr + row), 0), L).to(tl.int32)
    offs = tl.arange(0, BLOCK_L)
    best_start = tl.full([], -1, tl.int32)  # start of the chosen occurrence, -1: none
    best_n = tl.full([], 0, tl.int32)
    # Shortest n first, a longer match overrides: no early exit in Triton, same result as longest-first.
    for n in range(min_n, max_n + 1):
        suffix_start = length - n  # an occurrence must start before it
        most_recent = tl.full([], -1, tl.int32)
        for s0 in range(0, suffix_start, BLOCK_L):
            starts = s0 + offs  # [BLOCK_L]
            hit = starts < suffix_start  # [BLOCK_L]
            for j in range(0, n):
                suffix_tok = tl.load(row_tokens + suffix_start + j)
                tok = tl.load(row_tokens + starts + j, mask=hit, other=PLACEHOLDER)
                hit = hit & (tok == suffix_tok)
            most_recent = tl.maximum(most_recent, tl.max(tl.where(hit, starts, -1), axis=0))
        found = most_recent >= 0
        best_start = tl.where(found, most_recent, best_start)
        best_n = tl.where(found, n, best_n)
    follow = tl.maximum(best_start + best_n, 0)  # first token after the occurrence
    num = tl.where(best_start >= 0, tl.minimum(length - follow, k), 0)
    offs_k = tl.arange(0, BLOCK_K)  # [BLOCK_K]
    drafts = tl.load(row_tokens + follow + offs_k, mask=offs_k < num, other=PLACEHOLDER)
    tl.store(drafts_ptr + row * k + offs_k, drafts, mask=offs_k < k)
    tl.store(num_ptr + row, num.to(tl.int64))


def _check(tokens: torch.Tensor, lengths: torch.Tensor, min_n: int, max_n: int, k: int) -> None:
    if tokens.dim() != 2 or tokens.dtype != torch.long:
        raise ValueError(f"tokens must be [B, L] int64, got {tuple(tokens.shape)} {tokens.dtype}")
    if lengths.shape != tokens.shape[:1] or lengths.dtype != torch.long:
        raise ValueError(f"lengths must be [B] int64, got {tuple(lengths.shape)} {lengths.dtype}")
    if not 1 <= min_n <= max_n or k < 0:
        raise ValueError(f"need 1 <= min_n <= max_n and k >= 0, got min_n={min_n} max_n={max_n} k={k}")
