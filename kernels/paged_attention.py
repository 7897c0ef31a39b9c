"""Paged attention: query rows attend their sequence's keys in place in the KV pool, through block tables.

Terms, used with these meanings here and by the callers:

- *pool*: one layer's K (and V) cache ``[num_blocks, block_size, kv_heads, head_dim]``. A token at
  position p of sequence b lives at *slot* ``block_tables[b, p // block_size] * block_size +
  p % block_size``. The step's new tokens are written into their slots before attention runs.
- *null block*: table entries past a sequence's last block are padding; they point at a reserved
  block whose contents are garbage. No path reads a slot at a position ``>= seq_lens[b]``, nor
  depends on what a padding entry holds.
- *query rows*: the step's queries are flat ``q [T, num_heads, head_dim]``; sequence b owns rows
  ``query_start[b] : query_start[b+1]`` (n_b >= 1 of them), at consecutive positions ending at
  ``seq_lens[b] - 1``: row i has position ``seq_lens[b] - n_b + i`` and attends the keys at
  positions ``0..p`` (causal), ``max_query_len >= max(n_b)``.
- *hidden keys*: ``hidden_keys [B, H]`` int64 (-1 padded, or None) lists key positions sequence b's
  rows must not see (MTP draft chains: slots another module wrote). They are never read either.
  A row that sees no key at all outputs zeros.
- GQA: query head h reads kv head ``h // (num_heads // kv_heads)``.

Softmax and accumulation are in fp32; the output has q's dtype. The pools must have q's dtype.

Kernels (one program per sequence x kv head x query tile; a tile packs query rows x the kv head's
GQA group of query heads, so each K/V tile loaded serves every query head that reads it):

- ``paged_decode_attention``: decode rows and K+1 verify chains (``max_query_len <= 16``): one tile
  holds all of a sequence's rows, ``BLOCK_M = next_power_of_2(max_query_len * group)`` (at least 16).
- ``paged_prefill_attention``: varlen chunked prefill over a cached prefix: tiles of ``BLOCK_M = 64``
  packed rows; a tile loops only over the keys up to its last row's position. Short sequences may
  share the batch (their rows past n_b are masked; their later tiles exit at once).

Both loop over the keys ``BLOCK_N`` at a time (decode 128, prefill 64; at least block_size), looking
up each key's block in the table, with an online softmax (exp2, running max and sum in fp32). Launch
settings, from a sweep on an H100 (SmolLM2-135M shapes, bf16): decode 2 warps x 3 stages, prefill 4
warps x 2 stages. fp32 dots run in IEEE fp32 (no TF32): fp32 outputs match the reference within 1e-5.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from . import check_tensor, use_triton_for

__all__ = [
    "MAX_DECODE_QUERY_LEN",
    "paged_decode_attention",
    "paged_prefill_attention",
    "paged_decode_attention_triton",
    "paged_prefill_attention_triton",
    "paged_attention_reference",
]

MAX_DECODE_QUERY_LEN = 16  # the decode kernel packs all of a sequence's rows in one tile
DECODE_BLOCK_N = 128  # keys per inner-loop step of the decode kernel (rounded up to block_size)
PREFILL_BLOCK_M = 64  # packed (query row, group head) pairs per prefill tile
PREFILL_BLOCK_N = 64  # keys per inner-loop step of the prefill kernel (rounded up to block_size)
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_INDEX_DTYPES = (torch.int32, torch.int64)

# ---------------------------------------------------------------- public API (dispatchers)


def paged_decode_attention(
    q: torch.Tensor,  # [T, num_heads, head_dim] fp32/bf16/fp16
    k_pool: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim], q's dtype
    v_pool: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim], q's dtype
    block_tables: torch.Tensor,  # [B, max_blocks] int32/int64
    seq_lens: torch.Tensor,  # [B] int32/int64: keys of sequence b (its last row's position + 1)
    query_start: torch.Tensor,  # [B+1] int32/int64: cumulative query rows
    hidden_keys: torch.Tensor | None,  # [B, H] int64, -1 padded
    *,
    scale: float,
    max_query_len: int,
    use_triton: bool | None = None,
) -> torch.Tensor:  # [T, num_heads, head_dim], q's dtype
    """Attention for decode rows and short verify chains (``max_query_len <= MAX_DECODE_QUERY_LEN``)."""
    _check_decode_len(max_query_len)
    args = (q, k_pool, v_pool, block_tables, seq_lens, query_start, hidden_keys)
    if use_triton_for(use_triton, *args):
        return paged_decode_attention_triton(*args, scale=scale, max_query_len=max_query_len)
    return paged_attention_reference(*args, scale=scale, max_query_len=max_query_len)


def paged_prefill_attention(
    q: torch.Tensor,  # [T, num_heads, head_dim] fp32/bf16/fp16
    k_pool: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim], q's dtype
    v_pool: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim], q's dtype
    block_tables: torch.Tensor,  # [B, max_blocks] int32/int64
    seq_lens: torch.Tensor,  # [B] int32/int64
    query_start: torch.Tensor,  # [B+1] int32/int64
    hidden_keys: torch.Tensor | None,  # [B, H] int64, -1 padded
    *,
    scale: float,
    max_query_len: int,
    use_triton: bool | None = None,
) -> torch.Tensor:  # [T, num_heads, head_dim], q's dtype
    """Attention for prefill chunks of any length over a cached prefix (short sequences may be mixed in)."""
    args = (q, k_pool, v_pool, block_tables, seq_lens, query_start, hidden_keys)
    if use_triton_for(use_triton, *args):
        return paged_prefill_attention_triton(*args, scale=scale, max_query_len=max_query_len)
    return paged_attention_reference(*args, scale=scale, max_query_len=max_query_len)


# ---------------------------------------------------------------- torch reference


def paged_attention_reference(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start: torch.Tensor,
    hidden_keys: torch.Tensor | None,
    *,
    scale: float,
    max_query_len: int,
) -> torch.Tensor:  # [T, num_heads, head_dim], q's dtype
    """Per sequence: gather the slots of its visible key positions, causal mask, fp32 softmax."""
    _check_args(q, k_pool, v_pool, block_tables, seq_lens, query_start, hidden_keys, max_query_len)
    block_size, kv_heads = k_pool.shape[1], k_pool.shape[2]
    group = q.shape[1] // kv_heads
    out = torch.zeros_like(q)
    starts, lens = query_start.tolist(), seq_lens.tolist()
    if any(b - a > max_query_len for a, b in zip(starts, starts[1:])):
        raise ValueError(f"a sequence has more query rows than max_query_len={max_query_len}")
    for b, seq_len in enumerate(lens):
        start, end = starts[b], starts[b + 1]
        keys = torch.arange(seq_len, device=q.device)  # [S] key positions
        if hidden_keys is not None:
            keys = keys[~torch.isin(keys, hidden_keys[b])]  # [S'] the visible ones: hidden slots are not read
        blocks = block_tables[b].long()[keys // block_size]  # [S']
        k = k_pool[blocks, keys % block_size].float().repeat_interleave(group, dim=1)  # [S', num_heads, head_dim]
        v = v_pool[blocks, keys % block_size].float().repeat_interleave(group, dim=1)
        positions = torch.arange(seq_len - (end - start), seq_len, device=q.device)  # [n]
        causal = keys[None, :] <= positions[:, None]  # [n, S']
        scores = torch.einsum("nhd,shd->hns", q[start:end].float(), k) * scale  # [num_heads, n, S']
        weights = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        weights = torch.where(causal.any(-1)[:, None], weights, 0.0)  # a row that sees no key: zeros
        out[start:end] = torch.einsum("hns,shd->nhd", weights, v).to(q.dtype)
    return out


def _check_args(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start: torch.Tensor,
    hidden_keys: torch.Tensor | None,
    max_query_len: int,
) -> None:
    if q.dim() != 3 or q.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"q must be [T, num_heads, head_dim] fp32/bf16/fp16, got {list(q.shape)} {q.dtype}")
    num_heads, head_dim = q.shape[1:]
    if k_pool.dim() != 4 or k_pool.shape[3] != head_dim or k_pool.dtype != q.dtype:
        raise ValueError(
            f"k_pool must be [num_blocks, block_size, kv_heads, {head_dim}] {q.dtype}, "
            f"got {list(k_pool.shape)} {k_pool.dtype}"
        )
    check_tensor(v_pool, tuple(k_pool.shape), k_pool.dtype, "v_pool")
    if num_heads % k_pool.shape[2]:
        raise ValueError(f"num_heads={num_heads} must be a multiple of kv_heads={k_pool.shape[2]}")
    if block_tables.dim() != 2 or block_tables.dtype not in _INDEX_DTYPES:
        got = f"{list(block_tables.shape)} {block_tables.dtype}"
        raise ValueError(f"block_tables must be [B, max_blocks] int32/int64, got {got}")
    B = block_tables.shape[0]
    _check_index(seq_lens, (B,), "seq_lens")
    _check_index(query_start, (B + 1,), "query_start")
    if hidden_keys is not None:
        if hidden_keys.dim() != 2:
            raise ValueError(f"hidden_keys must be [{B}, H] int64, got {list(hidden_keys.shape)}")
        check_tensor(hidden_keys, (B, hidden_keys.shape[1]), torch.long, "hidden_keys")
    if max_query_len < 1:
        raise ValueError(f"max_query_len must be >= 1, got {max_query_len}")


def _check_index(t: torch.Tensor, shape: tuple[int, ...], name: str) -> None:
    if tuple(t.shape) != shape or t.dtype not in _INDEX_DTYPES:
        raise ValueError(f"{name} must be {list(shape)} int32/int64, got {list(t.shape)} {t.dtype}")


def _check_decode_len(max_query_len: int) -> None:
    if max_query_len > MAX_DECODE_QUERY_LEN:
        raise ValueError(f"decode attention takes max_query_len <= {MAX_DECODE_QUERY_LEN}, got {max_query_len}")


# ---------------------------------------------------------------- Triton paths


def paged_decode_attention_triton(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start: torch.Tensor,
    hidden_keys: torch.Tensor | None,
    *,
    scale: float,
    max_query_len: int,
    block_n: int | None = None,
) -> torch.Tensor:  # [T, num_heads, head_dim], q's dtype
    """One program per (sequence, kv head): all n_b rows x group heads in one tile, one pass over the keys."""
    _check_decode_len(max_query_len)
    args = (q, k_pool, v_pool, block_tables, seq_lens, query_start, hidden_keys)
    return _launch(
        *args, scale=scale, max_query_len=max_query_len, block_m=None, block_n=block_n or DECODE_BLOCK_N,
        num_warps=2, num_stages=3,
    )


def paged_prefill_attention_triton(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start: torch.Tensor,
    hidden_keys: torch.Tensor | None,
    *,
    scale: float,
    max_query_len: int,
    block_m: int | None = None,
    block_n: int | None = None,
) -> torch.Tensor:  # [T, num_heads, head_dim], q's dtype
    """One program per (sequence, kv head, tile of block_m packed rows); a tile reads keys up to its last row."""
    args = (q, k_pool, v_pool, block_tables, seq_lens, query_start, hidden_keys)
    return _launch(
        *args, scale=scale, max_query_len=max_query_len, block_m=block_m or PREFILL_BLOCK_M,
        block_n=block_n or PREFILL_BLOCK_N, num_warps=4, num_stages=2,
    )


def _launch(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start: torch.Tensor,
    hidden_keys: torch.Tensor | None,
    *,
    scale: float,
    max_query_len: int,
    block_m: int | None,  # None: every row of a sequence in one tile
    block_n: int,
    num_warps: int,
    num_stages: int,
) -> torch.Tensor:  # [T, num_heads, head_dim], q's dtype
    _check_args(q, k_pool, v_pool, block_tables, seq_lens, query_start, hidden_keys, max_query_len)
    if k_pool.stride(3) != 1 or v_pool.stride(3) != 1:
        raise ValueError("k_pool and v_pool must be contiguous in head_dim")
    B = block_tables.shape[0]
    T, num_heads, head_dim = q.shape
    block_size, kv_heads = k_pool.shape[1], k_pool.shape[2]
    group = num_heads // kv_heads
    if block_m is None:
        block_m = max_query_len * group
    block_m = triton.next_power_of_2(max(block_m, group, 16))  # at least one row's group; tl.dot needs 16
    rows_per_tile = block_m // group
    block_n = triton.next_power_of_2(max(block_n, block_size, 16))
    q = q if q.stride(2) == 1 else q.contiguous()
    out = q.new_empty((T, num_heads, head_dim))  # [T, num_heads, head_dim] contiguous
    has_hidden = hidden_keys is not None and hidden_keys.shape[1] > 0
    num_hidden = hidden_keys.shape[1] if has_hidden else 0
    if B == 0:
        return out
    grid = (B, kv_heads, triton.cdiv(max_query_len, rows_per_tile))
    _paged_attention_kernel[grid](
        q, k_pool, v_pool, block_tables.contiguous(), seq_lens.contiguous(), query_start.contiguous(),
        hidden_keys.contiguous() if has_hidden else seq_lens, out,
        scale * math.log2(math.e),
        q.stride(0), q.stride(1),
        out.stride(0), out.stride(1),
        k_pool.stride(0), k_pool.stride(1), k_pool.stride(2),
        v_pool.stride(0), v_pool.stride(1), v_pool.stride(2),
        block_tables.shape[1], num_hidden, head_dim,
        BLOCK_SIZE=block_size, GROUP=group, ROWS=rows_per_tile, HAS_HIDDEN=has_hidden,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_H=triton.next_power_of_2(max(num_hidden, 1)),
        num_warps=num_warps, num_stages=num_stages,
    )
    return out


@triton.jit
def _paged_attention_kernel(
    q_ptr,  # [T, num_heads, head_dim] (strides stride_qt, stride_qh, 1)
    k_pool_ptr,  # [num_blocks, block_size, kv_heads, head_dim] (strides stride_kb, stride_ks, stride_kh, 1)
    v_pool_ptr,  # [num_blocks, block_size, kv_heads, head_dim] (strides stride_vb, stride_vs, stride_vh, 1)
    block_tables_ptr,  # [B, max_blocks] int32/int64, contiguous
    seq_lens_ptr,  # [B] int32/int64
    query_start_ptr,  # [B+1] int32/int64
    hidden_keys_ptr,  # [B, num_hidden] int64 (read iff HAS_HIDDEN)
    out_ptr,  # [T, num_heads, head_dim] (strides stride_ot, stride_oh, 1), q's dtype
    scale_log2,  # scale * log2(e): scores go through exp2
    stride_qt, stride_qh,
    stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    max_blocks,
    num_hidden,
    head_dim,
    BLOCK_SIZE: tl.constexpr,  # slots per pool block
    GROUP: tl.constexpr,  # query heads per kv head
    ROWS: tl.constexpr,  # query rows per tile: BLOCK_M // GROUP
    HAS_HIDDEN: tl.constexpr,
    BLOCK_M: tl.constexpr,  # packed (row, group head) pairs per tile
    BLOCK_N: tl.constexpr,  # keys per loop step
    BLOCK_D: tl.constexpr,  # head_dim rounded up to a power of 2
    BLOCK_H: tl.constexpr,  # num_hidden rounded up to a power of 2
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    row0 = tl.program_id(2) * ROWS  # first query row of this tile, within the sequence
    q_begin = tl.load(query_start_ptr + seq).to(tl.int64)
    n_rows = (tl.load(query_start_ptr + seq + 1) - q_begin).to(tl.int32)
    if row0 >= n_rows:
        return
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)

    m = tl.arange(0, BLOCK_M)  # [BLOCK_M] packed index: row-major (row, group head)
    row = row0 + m // GROUP  # [BLOCK_M] query row within the sequence
    head = kv_head * GROUP + m % GROUP  # [BLOCK_M] query head
    row_ok = (m < ROWS * GROUP) & (row < n_rows)
    position = seq_len - n_rows + row  # [BLOCK_M] the row's position: it sees keys 0..position
    d = tl.arange(0, BLOCK_D)
    d_ok = d < head_dim
    q_offs = (q_begin + row)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :]
    q = tl.load(q_ptr + q_offs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_M, BLOCK_D]

    hidden = tl.full([BLOCK_H], -1, tl.int64)
    if HAS_HIDDEN:
        h = tl.arange(0, BLOCK_H)
        hidden = tl.load(hidden_keys_ptr + seq.to(tl.int64) * num_hidden + h, mask=h < num_hidden, other=-1)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max of scaled scores (log2 units)
    l_i = tl.zeros([BLOCK_M], tl.float32)  # running sum of exp2(score - m_i)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    kv_end = seq_len - n_rows + tl.minimum(row0 + ROWS, n_rows)  # the tile's last position + 1 (<= seq_len)
    table = block_tables_ptr + seq.to(tl.int64) * max_blocks
    for start in range(0, kv_end, BLOCK_N):
        key = start + tl.arange(0, BLOCK_N)  # [BLOCK_N] key positions
        key_ok = key < kv_end
        if HAS_HIDDEN:
            key_ok &= tl.max((key[:, None] == hidden[None, :]).to(tl.int32), axis=1) == 0
        block = tl.load(table + key // BLOCK_SIZE, mask=key < kv_end, other=0).to(tl.int64)  # [BLOCK_N]
        slot = key % BLOCK_SIZE
        kv_mask = key_ok[:, None] & d_ok[None, :]
        k_offs = block[:, None] * stride_kb + slot[:, None] * stride_ks + kv_head * stride_kh + d[None, :]
        k = tl.load(k_pool_ptr + k_offs, mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
        v_offs = block[:, None] * stride_vb + slot[:, None] * stride_vs + kv_head * stride_vh + d[None, :]
        v = tl.load(v_pool_ptr + v_offs, mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]

        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale_log2  # [BLOCK_M, BLOCK_N]
        visible = key_ok[None, :] & (key[None, :] <= position[:, None])
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no key seen yet: keep exp2 finite
        p = tl.exp2(s - m_safe[:, None])  # [BLOCK_M, BLOCK_N], 0 where not visible
        alpha = tl.exp2(m_i - m_safe)  # [BLOCK_M]
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m_i = m_new

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # a row that sees no key: zeros
    out_offs = (q_begin + row)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
    tl.store(out_ptr + out_offs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
