"""Paged attention over a per-layer KV pool, read through block tables.

The pool of one layer is ``[num_blocks, block_size, kv_heads, head_dim]`` for K and for V; a
token's *slot* is ``block_id * block_size + offset``. No per-request KV tensor exists: each step
writes the new tokens' K/V into their slots, then gathers every sequence's context from its
block table. Rejected or stale slots need no cleanup: the mask only admits keys at positions
``<=`` the query's own position, so a slot beyond a sequence's current length is never read.

Sequences of a step are split into *groups* that share one padded SDPA call: all short queries
(decode, or a few speculative positions) together, and each long prefill chunk alone, so a
512-token chunk never pads the decode rows of 31 other sequences.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class AttentionGroup:
    """Sequences attended in one padded SDPA call."""

    token_index: torch.Tensor  # [B, Q] long: row in the step's flat token batch (padding → 0)
    valid_rows: torch.Tensor  # [N] long: which of the B*Q padded rows are real tokens
    block_tables: torch.Tensor  # [B, max_blocks] long: pool block ids (padding → 0)
    mask: torch.Tensor  # [B, 1, Q, max_blocks * block_size] bool: True = attend


@dataclass
class AttentionBatch:
    """Everything the model's attention needs for one step."""

    positions: torch.Tensor  # [T] long: absolute position of each flat token
    slot_mapping: torch.Tensor  # [T] long: pool slot each token's K/V is written to
    groups: list[AttentionGroup]


def paged_attention(
    q: torch.Tensor,  # [T, heads, head_dim]
    k: torch.Tensor,  # [T, kv_heads, head_dim]
    v: torch.Tensor,  # [T, kv_heads, head_dim]
    k_pool: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    v_pool: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    batch: AttentionBatch,
    scale: float,
) -> torch.Tensor:  # [T, heads * head_dim]
    num_tokens, num_heads, head_dim = q.shape
    kv_heads = k.shape[1]
    k_pool.view(-1, kv_heads, head_dim).index_copy_(0, batch.slot_mapping, k)
    v_pool.view(-1, kv_heads, head_dim).index_copy_(0, batch.slot_mapping, v)
    out = q.new_empty(num_tokens, num_heads * head_dim)
    for group in batch.groups:
        bsz, q_len = group.token_index.shape
        # index_select, not advanced indexing: on CPU, x[idx] is a parallel TensorIterator op whose
        # thread sync costs milliseconds per call when another process holds a core.
        qg = q.index_select(0, group.token_index.view(-1)).view(bsz, q_len, num_heads, head_dim).transpose(1, 2)
        blocks = group.block_tables.view(-1)
        kg = k_pool.index_select(0, blocks).view(bsz, -1, kv_heads, head_dim).transpose(1, 2)  # [B, kv, K, hd]
        vg = v_pool.index_select(0, blocks).view(bsz, -1, kv_heads, head_dim).transpose(1, 2)
        og = F.scaled_dot_product_attention(
            qg, kg, vg, attn_mask=group.mask, scale=scale, enable_gqa=num_heads != kv_heads
        )  # [B, heads, Q, head_dim]
        og = og.transpose(1, 2).reshape(bsz, q_len, num_heads * head_dim)
        og = og.reshape(bsz * q_len, -1).index_select(0, group.valid_rows)
        out.index_copy_(0, group.token_index.view(-1).index_select(0, group.valid_rows), og)
    return out
