"""Paged attention over a per-layer KV pool, read in place through block tables.

The pool of one layer is ``[num_blocks + 1, block_size, kv_heads, head_dim]`` for K and for V
(``kv_pool``): the blocks the block manager hands out, ids ``0 … num_blocks − 1``, and the *null
block*, id ``num_blocks``, which belongs to no sequence. A token's *slot* is ``block_id ·
block_size + offset``. Each step writes the new tokens' K/V into their slots, then every query row
attends its sequence's keys where they lie.

What a step carries is metadata, not masks (``AttentionBatch``): the rows of a step are flat,
sequence b's ``query_start[b] : query_start[b + 1]``, at consecutive positions ending at
``seq_lens[b] − 1``; row i attends positions ``0 … its own`` of its sequence, through its block
table, except the ``hidden_keys`` an MTP chain step names. Block-table padding points at the null
block, and so does any padded row, so nothing of a padded entry ever touches a real block.
Rejected or stale slots need no cleanup: a row never reads past its own position.

On CUDA the Triton kernels of ``specdecode.kernels.paged_attention`` attend (one for a few rows per
sequence, decode and verify chains; one for prefill chunks). On the CPU ``attend_in_place`` does:
per sequence, its runs of consecutive blocks are views of the pool (a fresh pool hands blocks out
in order, so a sequence's table is one or a few runs), attended by torch's flash attention and
merged by log-sum-exp, without copying its KV.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch
import torch.nn.functional as F

from specdecode.kernels.paged_attention import MAX_DECODE_QUERY_LEN, paged_decode_attention, paged_prefill_attention



def kv_pool(num_blocks: int, block_size: int, kv_heads: int, head_dim: int, *, dtype: torch.dtype,
            device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's K and V pools: ``num_blocks`` blocks and the null block (id ``num_blocks``)."""
    shape = (num_blocks + 1, block_size, kv_heads, head_dim)
    return torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device)


@dataclass
class AttentionBatch:
    """Everything the model's attention needs for one step (small int tensors on the device)."""

    positions: torch.Tensor  # [T] long: absolute position of each flat row
    slot_mapping: torch.Tensor  # [T] long: pool slot each row's K/V is written to
    block_tables: torch.Tensor  # [B, max_blocks] long: pool block ids, padding → the null block
    seq_lens: torch.Tensor  # [B] long: keys sequence b attends after this step (its last row's position + 1)
    query_start: torch.Tensor  # [B + 1] long: sequence b's rows are query_start[b] : query_start[b + 1]
    block_size: int
    max_query_len: int  # the most rows of one sequence (a host int: it picks the kernel)
    hidden_keys: torch.Tensor | None = None  # [B, H] long, −1 padded: positions its rows never attend

    @cached_property
    def runs(self) -> list[tuple[int, int, list[tuple[int, int]], list[int]]]:
        """Per sequence, for the CPU path: (first row, rows, [(first slot, slots)] runs of
        consecutive blocks covering its keys, hidden positions); read once per step."""
        starts, lens, tables = self.query_start.tolist(), self.seq_lens.tolist(), self.block_tables.tolist()
        hidden = self.hidden_keys.tolist() if self.hidden_keys is not None else [[] for _ in lens]
        return [(starts[b], starts[b + 1] - starts[b], _runs(table[: -(-length // self.block_size)], self.block_size,
                                                               length), [h for h in hidden[b] if h >= 0])
                for b, (length, table) in enumerate(zip(lens, tables))]


def _runs(blocks: list[int], block_size: int, length: int) -> list[tuple[int, int]]:
    """(first slot, slots) of each run of consecutive block ids, the keys ``0 … length − 1`` in order."""
    runs: list[tuple[int, int]] = []
    for i, block in enumerate(blocks):
        slots = min(block_size, length - i * block_size)
        if runs and runs[-1][0] + runs[-1][1] == block * block_size and runs[-1][1] % block_size == 0:
            runs[-1] = (runs[-1][0], runs[-1][1] + slots)
        else:
            runs.append((block * block_size, slots))
    return runs


def paged_attention(
    q: torch.Tensor,  # [T, heads, head_dim]
    k: torch.Tensor,  # [T, kv_heads, head_dim]
    v: torch.Tensor,  # [T, kv_heads, head_dim]
    k_pool: torch.Tensor,  # [num_blocks + 1, block_size, kv_heads, head_dim]
    v_pool: torch.Tensor,  # [num_blocks + 1, block_size, kv_heads, head_dim]
    batch: AttentionBatch,
    scale: float,
) -> torch.Tensor:  # [T, heads * head_dim]
    num_tokens, num_heads, head_dim = q.shape
    kv_heads = k.shape[1]
    k_pool.view(-1, kv_heads, head_dim).index_copy_(0, batch.slot_mapping, k)
    v_pool.view(-1, kv_heads, head_dim).index_copy_(0, batch.slot_mapping, v)
    if q.is_cuda:
        attend = paged_decode_attention if batch.max_query_len <= MAX_DECODE_QUERY_LEN else paged_prefill_attention
        out = attend(q, k_pool, v_pool, batch.block_tables, batch.seq_lens, batch.query_start, batch.hidden_keys,
                     scale=scale, max_query_len=batch.max_query_len)
    else:
        out = attend_in_place(q, k_pool, v_pool, batch, scale)
    return out.reshape(num_tokens, num_heads * head_dim)


def attend_in_place(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, batch: AttentionBatch,
                    scale: float) -> torch.Tensor:  # q [T, heads, hd] → [T, heads, hd]
    """The CPU path, per sequence: torch's flash attention over its keys where they lie. A table
    that is one run of consecutive blocks is one view of the pool; otherwise each run of at least
    ``VIEW_MIN_SLOTS`` slots is a view and the shorter ones (blocks a decoding sequence took one at
    a time) are gathered into one small tensor, and the parts are merged by their log-sum-exp."""
    num_heads, head_dim = q.shape[1:]
    kv_heads = k_pool.shape[2]
    group = num_heads // kv_heads
    k_slots, v_slots = k_pool.view(-1, kv_heads, head_dim), v_pool.view(-1, kv_heads, head_dim)
    out = torch.empty_like(q)
    for first, rows, runs, hidden in batch.runs:
        length = sum(n for _, n in runs)
        mask = _mask(length - rows, rows, length, hidden, q.device) if rows > 1 or hidden else None
        if len(runs) == 1:
            (start, n), queries = runs[0], q[first : first + rows].transpose(0, 1)[None]  # [1, heads, rows, hd]
            attended = F.scaled_dot_product_attention(
                queries, k_slots[start : start + n].transpose(0, 1)[None], v_slots[start : start + n].transpose(0, 1)[None],
                attn_mask=mask, scale=scale, enable_gqa=group > 1)  # [1, heads, rows, hd]
            out[first : first + rows] = attended[0].transpose(0, 1)
            continue
        folded = q[first : first + rows].reshape(rows, kv_heads, group, head_dim).permute(1, 2, 0, 3)
        folded = folded.reshape(1, kv_heads, group * rows, head_dim)  # row g·rows + r: head g of row r
        attended = _merged(folded, _parts(runs, k_slots, v_slots), mask, group, scale)  # [1, kv, g·rows, hd]
        out[first : first + rows] = attended.view(kv_heads, group, rows, head_dim).permute(2, 0, 1, 3).reshape(
            rows, num_heads, head_dim)
    return out


VIEW_MIN_SLOTS = 64  # CPU: a run of consecutive slots at least this long is read as a view, not gathered


def _parts(runs: list[tuple[int, int]], k_slots: torch.Tensor, v_slots: torch.Tensor
           ) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(key positions [n], keys [n, kv, hd], values [n, kv, hd]) per part: each long run a view, the
    short runs gathered together."""
    parts, short, position = [], [], 0
    for start, n in runs:
        positions = torch.arange(position, position + n)
        if n >= VIEW_MIN_SLOTS:
            parts.append((positions, k_slots[start : start + n], v_slots[start : start + n]))
        else:
            short.append((positions, torch.arange(start, start + n)))
        position += n
    if short:
        slots = torch.cat([s for _, s in short]).to(k_slots.device)
        parts.append((torch.cat([p for p, _ in short]), k_slots.index_select(0, slots), v_slots.index_select(0, slots)))
    return parts


def _merged(folded: torch.Tensor, parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
            mask: torch.Tensor | None, group: int, scale: float) -> torch.Tensor:
    """folded [1, kv, g·rows, hd] over parts of its keys, ``mask`` [rows, keys] bool or None (all
    visible) → [1, kv, g·rows, hd], the parts weighed by their log-sum-exp. Flash attention for a
    view; plain scores for the gathered part, short enough that they cost less than a flash call."""
    outs, lses = [], []
    for positions, keys, values in parts:
        part_mask = None if mask is None else mask[:, positions.to(mask.device)].repeat(group, 1)  # [g·rows, n]
        if keys.shape[0] >= VIEW_MIN_SLOTS:
            additive = None if part_mask is None else torch.zeros(part_mask.shape, dtype=folded.dtype,
                                                                  device=folded.device).masked_fill_(~part_mask, -torch.inf)
            attended, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                folded, keys.transpose(0, 1)[None], values.transpose(0, 1)[None], attn_mask=additive, scale=scale)
        else:
            scores = torch.matmul(folded[0], keys.permute(1, 2, 0)).float().mul_(scale)  # [kv, g·rows, n]
            if part_mask is not None:
                scores.masked_fill_(~part_mask, -torch.inf)
            lse = torch.logsumexp(scores, dim=-1)[None]  # [1, kv, g·rows]
            attended = torch.matmul((scores - lse[0, ..., None]).exp_().to(folded.dtype), values.transpose(0, 1))[None]
        if part_mask is not None:  # a row that sees no key of this part: it weighs nothing
            lse = lse.masked_fill(~part_mask.any(-1), -torch.inf)
        outs.append(attended.nan_to_num_(0.0))
        lses.append(lse)
    top = torch.maximum(*lses) if len(lses) == 2 else torch.stack(lses).amax(0)
    weights = [(lse - top).exp_() for lse in lses]  # [1, kv, g·rows] each
    total = sum(weights)
    return sum(out * (w / total).unsqueeze(-1).to(folded.dtype) for out, w in zip(outs, weights))


def _mask(first_position: int, rows: int, length: int, hidden: list[int], device: torch.device) -> torch.Tensor:
    """[rows, length] bool: row i (at ``first_position + i``) attends keys up to its position, but
    no hidden one."""
    keys = torch.arange(length, device=device)
    mask = keys[None, :] <= torch.arange(first_position, first_position + rows, device=device)[:, None]
    if hidden:
        mask[:, [h for h in hidden if h < length]] = False
    return mask
