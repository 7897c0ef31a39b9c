"""Paged attention over a per-layer KV pool, read through block tables.

The pool of one layer is ``[num_blocks + 1, block_size, kv_heads, head_dim]`` for K and for V
(``kv_pool``): the blocks the block manager hands out, ids ``0 … num_blocks − 1``, and the *null
block*, id ``num_blocks``, which belongs to no sequence. A token's *slot* is ``block_id ·
block_size + offset``. Each step writes the new tokens' K/V into their slots, then every query row
attends its sequence's keys.

What a step carries is metadata, not masks (``AttentionBatch``): the rows of a step are flat,
sequence b's ``query_start[b] : query_start[b + 1]``, at consecutive positions ending at
``seq_lens[b] − 1``; row i attends positions ``0 … its own`` of its sequence, through its block
table, except the ``hidden_keys`` an MTP chain step names. Block-table padding points at the null
block, so a padded entry never touches a real block; a bucketed step's padding rows write their
K/V there too (``engine/buckets.py``), and its one CPU group has shapes that depend on the bucket
only (``_uniform_group``).
Rejected or stale slots need no cleanup: a row never reads past its own position.

On CUDA the Triton kernels of ``specdecode.kernels.paged_attention`` attend in place (one for a few
rows per sequence, decode and verify chains; one for prefill chunks). On the CPU ``attend_on_cpu``
streams decode and verify rows' keys through a cache-sized buffer, a span of blocks at a time, and
gathers a prefill chunk's keys for one SDPA call (docs/runtime.md, "CPU attention").
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from specdecode.kernels.paged_attention import MAX_DECODE_QUERY_LEN, paged_decode_attention, paged_prefill_attention



def kv_pool(num_blocks: int, block_size: int, kv_heads: int, head_dim: int, *, dtype: torch.dtype,
            device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's K and V pools: ``num_blocks`` blocks and the null block (id ``num_blocks``).

    Shaped ``[num_blocks + 1, block_size, kv_heads, head_dim]`` but stored KV-head-major (a view of
    ``[kv_heads, num_blocks + 1, block_size, head_dim]``): the kernels read through strides, and the
    CPU path gathers one KV head's blocks as contiguous ``[keys, head_dim]`` matrices."""
    shape = (kv_heads, num_blocks + 1, block_size, head_dim)
    return tuple(torch.zeros(shape, dtype=dtype, device=device).permute(1, 2, 0, 3) for _ in range(2))


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
    # query_start and seq_lens as host lists, where the builder had them: the CPU path groups by them
    # without reading the device (a batch received from rank 0 has none: they are read back once)
    query_start_list: list[int] | None = None
    seq_lens_list: list[int] | None = None
    # Q: every sequence has exactly Q rows (a bucketed step): the CPU path's one group is built from
    # the device tensors alone, with shapes that depend on B, Q and the table width only
    uniform_query_len: int | None = None
    _groups: list[SequenceGroup] | None = field(default=None, init=False, repr=False)

    @property
    def groups(self) -> list[SequenceGroup]:
        """The CPU path's padded groups of sequences, built by the first layer and kept for the others
        (a plain attribute, not ``cached_property``, whose lock ``torch.compile`` cannot trace)."""
        if self._groups is None:
            self._groups = self._build_groups()
        return self._groups

    def _build_groups(self) -> list[SequenceGroup]:
        """Every short sequence (≤ ``MAX_DECODE_QUERY_LEN`` rows) in one group, each longer one alone,
        so a 512-row prefill chunk never pads the decode rows of the others; a bucketed step is one group."""
        if self.uniform_query_len is not None:
            return [_uniform_group(self, self.uniform_query_len)]
        starts = self.query_start.tolist() if self.query_start_list is None else self.query_start_list
        lens = self.seq_lens.tolist() if self.seq_lens_list is None else self.seq_lens_list
        rows = [b - a for a, b in zip(starts, starts[1:])]
        short = [b for b, n in enumerate(rows) if n <= MAX_DECODE_QUERY_LEN]
        members = ([short] if short else []) + [[b] for b, n in enumerate(rows) if n > MAX_DECODE_QUERY_LEN]
        return [_group(self, sequences, starts, lens, rows) for sequences in members]


@dataclass
class SequenceGroup:
    """Sequences attended in one padded SDPA call on the CPU."""

    token_index: torch.Tensor  # [B, Q] long: row in the step's flat batch (padding → 0)
    valid_rows: torch.Tensor  # [N] long: which of the B·Q padded rows are real
    block_tables: torch.Tensor  # [B, M] long: the blocks its keys lie in (padding → the null block)
    mask: torch.Tensor  # [B, 1, Q, M·block_size] bool: True = attend
    any_hidden: bool  # hidden keys mask some slots: a real row may see no key at all


def _group(batch: AttentionBatch, sequences: list[int], starts: list[int], lens: list[int],
           rows: list[int]) -> SequenceGroup:
    device, block_size = batch.block_tables.device, batch.block_size
    q_len = max(rows[b] for b in sequences)
    width = max(-(-lens[b] // block_size) for b in sequences)
    index = torch.tensor(sequences, device=device)
    offsets = torch.arange(q_len, device=device)
    first = torch.tensor([starts[b] for b in sequences], device=device)[:, None]
    count = torch.tensor([rows[b] for b in sequences], device=device)[:, None]
    valid = offsets[None, :] < count  # [B, Q]
    query_pos = torch.tensor([lens[b] - rows[b] for b in sequences], device=device)[:, None] + offsets[None, :]
    mask = torch.arange(width * block_size, device=device)[None, None, :] <= query_pos[:, :, None]
    if batch.hidden_keys is not None:  # only MTP chain steps have any: the target's forward skips this
        hidden = batch.hidden_keys.index_select(0, index)  # [B, H]
        keys = torch.arange(width * block_size, device=device)
        mask &= ~(keys[None, None, :] == hidden[:, :, None]).any(1)[:, None, :]
    valid_rows = [i * q_len + j for i, b in enumerate(sequences) for j in range(rows[b])]  # host-built: no sync
    return SequenceGroup(token_index=torch.where(valid, first + offsets[None, :], 0),
                         valid_rows=torch.tensor(valid_rows, device=device),
                         block_tables=batch.block_tables.index_select(0, index)[:, :width],
                         mask=mask.unsqueeze(1), any_hidden=batch.hidden_keys is not None)


def _uniform_group(batch: AttentionBatch, q_len: int) -> SequenceGroup:
    """All of a bucketed step's sequences, Q rows each, over their whole block tables: static shapes,
    no host list and no read of the device (what ``torch.compile(fullgraph=True)`` and graph capture
    need); a row attends the keys up to its own position."""
    device, (bsz, width) = batch.block_tables.device, batch.block_tables.shape
    rows = torch.arange(bsz * q_len, device=device)
    keys = torch.arange(width * batch.block_size, device=device)
    mask = keys[None, None, :] <= batch.positions.view(bsz, q_len, 1)  # [B, Q, M·block_size]
    if batch.hidden_keys is not None:
        mask &= ~(keys[None, None, :] == batch.hidden_keys[:, :, None]).any(1)[:, None, :]
    return SequenceGroup(token_index=rows.view(bsz, q_len), valid_rows=rows, block_tables=batch.block_tables,
                         mask=mask.unsqueeze(1), any_hidden=batch.hidden_keys is not None)


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
    # [slots, kv_heads, head_dim]: a view of either layout (view, not flatten: a copy would drop the writes)
    k_pool.view(-1, kv_heads, head_dim).index_copy_(0, batch.slot_mapping, k)
    v_pool.view(-1, kv_heads, head_dim).index_copy_(0, batch.slot_mapping, v)
    if q.is_cuda:
        attend = paged_decode_attention if batch.max_query_len <= MAX_DECODE_QUERY_LEN else paged_prefill_attention
        out = attend(q, k_pool, v_pool, batch.block_tables, batch.seq_lens, batch.query_start, batch.hidden_keys,
                     scale=scale, max_query_len=batch.max_query_len)
    else:
        out = attend_on_cpu(q, k_pool, v_pool, batch, scale)
    return out.reshape(num_tokens, num_heads * head_dim)


def attend_on_cpu(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, batch: AttentionBatch,
                  scale: float) -> torch.Tensor:  # q [T, heads, hd] → [T, heads, hd]
    """The CPU path, group by group: decode rows and verify chains over more than a span of blocks
    stream their keys through a cache-sized buffer (``attend_streamed``); a prefill chunk
    (compute-bound), or a group whose keys fit one span anyway, is gathered whole for one flash SDPA
    call (``attend_gathered``: fewer ops, the same memory traffic)."""
    num_tokens, num_heads, head_dim = q.shape
    out = q.new_empty(num_tokens, num_heads, head_dim)
    for group in batch.groups:
        bsz, q_len = group.token_index.shape
        # index_select, not advanced indexing: on CPU, x[idx] is a parallel TensorIterator op whose
        # thread sync costs milliseconds per call when another process holds a core.
        qg = q.index_select(0, group.token_index.view(-1)).view(bsz, q_len, num_heads, head_dim)
        stream = q_len <= MAX_DECODE_QUERY_LEN and group.block_tables.shape[1] > STREAM_BLOCKS
        attend = attend_streamed if stream else attend_gathered
        og = attend(qg, k_pool, v_pool, group, scale).reshape(bsz * q_len, num_heads, head_dim)
        out.index_copy_(0, group.token_index.view(-1).index_select(0, group.valid_rows),
                        og.index_select(0, group.valid_rows))
    return out


STREAM_BLOCKS = 16  # blocks per sequence gathered at once (1.6 MB at batch 8 for SmolLM2: it stays in cache)


def attend_streamed(qg: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, group: SequenceGroup,
                    scale: float) -> torch.Tensor:  # qg [B, Q, heads, hd] → [B, Q, heads, hd]
    """Two passes over the group's blocks, ``STREAM_BLOCKS`` per sequence at a time, each gathered
    into a small buffer that stays in cache: the scores (one matmul per KV head and sequence, its
    GQA heads × rows against the keys), one masked softmax, then the weighted values accumulated.
    A step reads each key once from memory, where gathering whole sequences wrote and re-read them:
    at batch 8 and 1k context, 390 MB a step (docs/gpu.md)."""
    bsz, q_len, num_heads, head_dim = qg.shape
    kv_heads, block_size = k_pool.shape[2], k_pool.shape[1]
    group_size = num_heads // kv_heads
    rows = q_len * group_size  # per (KV head, sequence): its rows × its GQA heads
    by_head = qg.view(bsz, q_len, kv_heads, group_size, head_dim).permute(2, 0, 1, 3, 4)
    qk = by_head.reshape(kv_heads, bsz, rows, head_dim) * scale  # scaled here: fewer elements than the scores
    width = group.block_tables.shape[1]
    spans = [group.block_tables[:, a : a + STREAM_BLOCKS] for a in range(0, width, STREAM_BLOCKS)]
    scores = torch.cat([qk @ _key_blocks(k_pool, tables).transpose(-1, -2) for tables in spans], -1)  # [kv, B, rows, keys]
    scores.view(kv_heads, bsz, q_len, group_size, -1).masked_fill_(~group.mask.view(1, bsz, q_len, 1, -1), float("-inf"))
    weights = scores.softmax(-1)
    if group.any_hidden:
        weights.nan_to_num_(0.0)  # a row whose keys are all hidden sees none: zeros, as the kernels give
    out = None
    for i, tables in enumerate(spans):
        first = i * STREAM_BLOCKS * block_size
        chunk = weights[..., first : first + tables.shape[1] * block_size].reshape(kv_heads * bsz, rows, -1)
        values = _key_blocks(v_pool, tables).view(kv_heads * bsz, -1, head_dim)
        out = torch.bmm(chunk, values) if out is None else out.baddbmm_(chunk, values)
    return out.view(kv_heads, bsz, q_len, group_size, head_dim).permute(1, 2, 0, 3, 4).reshape(bsz, q_len, num_heads, head_dim)


def _key_blocks(pool: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
    """``[kv_heads, B, n · block_size, head_dim]``: the blocks of ``tables [B, n]``, per KV head."""
    by_head = pool.permute(2, 0, 1, 3)  # [kv_heads, blocks, block_size, head_dim]: contiguous as kv_pool stores it
    bsz = tables.shape[0]
    return by_head.index_select(1, tables.reshape(-1)).view(by_head.shape[0], bsz, -1, by_head.shape[3])


def attend_gathered(qg: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, group: SequenceGroup,
                    scale: float) -> torch.Tensor:  # qg [B, Q, heads, hd] → [B, Q, heads, hd]
    """The group's keys gathered into padded tensors for one masked SDPA call."""
    num_heads, kv_heads = qg.shape[2], k_pool.shape[2]
    kg, vg = _key_blocks(k_pool, group.block_tables).transpose(0, 1), _key_blocks(v_pool, group.block_tables).transpose(0, 1)
    og = F.scaled_dot_product_attention(qg.transpose(1, 2), kg, vg, attn_mask=group.mask, scale=scale,
                                        enable_gqa=num_heads != kv_heads)  # [B, heads, Q, hd]
    return og.transpose(1, 2)
