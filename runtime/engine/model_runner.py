"""Owns the KV pools and runs one target forward per step over every scheduled token.

All host→device traffic of a step happens in ``prepare``: the flat token batch, positions,
slot mapping and the attention groups are built on the host and moved once. Under tensor
parallelism rank 0's runner hands what ``prepare`` built to its ``StepChannel``, which sends it
to the other ranks and runs the forward in lockstep with theirs; each rank's pools hold its own
KV heads under the same block tables.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from specdecode.runtime.config import CacheConfig
from specdecode.runtime.engine.scheduler import ScheduledSeq
from specdecode.runtime.models.attention import AttentionBatch, AttentionGroup
from specdecode.runtime.models.decoder import DecoderLM

if TYPE_CHECKING:
    from specdecode.runtime.parallel.step_channel import StepChannel

# Sequences computing at most this many tokens share one padded attention call.
SHORT_QUERY_TOKENS = 16


def kv_bytes_per_block(model: DecoderLM, block_size: int, dtype: torch.dtype) -> int:
    c = model.config
    return 2 * c.num_layers * block_size * model.num_local_kv_heads * c.head_dim * torch.finfo(dtype).bits // 8


def num_kv_blocks(cache: CacheConfig, model: DecoderLM, dtype: torch.dtype) -> int:
    """The pool size in blocks: as configured, or what the memory budget holds (the same on every rank)."""
    if cache.num_blocks:
        return cache.num_blocks
    return max(2, int(cache.memory_gib * 2**30) // kv_bytes_per_block(model, cache.block_size, dtype))


class ModelRunner:
    def __init__(
        self,
        model: DecoderLM,
        num_blocks: int,
        block_size: int,
        device: torch.device,
        dtype: torch.dtype,
        channel: StepChannel | None = None,
    ):
        c = model.config
        self.model = model
        self.block_size = block_size
        self.device = device
        self.channel = channel  # rank 0 of a tensor-parallel group; None otherwise
        shape = (num_blocks, block_size, model.num_local_kv_heads, c.head_dim)
        self.kv_pools = [
            (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(c.num_layers)
        ]
        self.num_forwards = 0

    @torch.inference_mode()
    def execute(self, scheduled: list[ScheduledSeq]) -> torch.Tensor:
        """Forward every scheduled token; return the logits of every deciding row: [R, vocab] fp32,
        R = Σ (num_draft + 1) over the sequences that decide tokens this step, in scheduled order."""
        input_ids, batch, sample_rows = self.prepare(scheduled)
        if self.channel is None:
            hidden = self.forward(input_ids, batch)
        else:
            hidden = self.channel.run_step(input_ids, batch, self.forward)
        return self.model.compute_logits(hidden[sample_rows])

    def forward(self, input_ids: torch.Tensor, batch: AttentionBatch) -> torch.Tensor:
        """input_ids: [T] long → hidden states [T, hidden], K/V written into the pools (under inference mode)."""
        self.num_forwards += 1
        return self.model(input_ids, self.kv_pools, batch)

    def prepare(self, scheduled: list[ScheduledSeq]) -> tuple[torch.Tensor, AttentionBatch, torch.Tensor]:
        tokens: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        sample_rows: list[int] = []
        spans: list[tuple[int, int, ScheduledSeq]] = []  # (first flat row, count, item)
        for item in scheduled:
            seq, start = item.seq, item.seq.num_computed_tokens
            first = len(tokens)
            num_real = item.num_tokens - item.num_draft
            tokens += seq.token_ids[start : start + num_real] + seq.draft_token_ids[: item.num_draft]
            for pos in range(start, start + item.num_tokens):
                positions.append(pos)
                slots.append(seq.block_table[pos // self.block_size] * self.block_size + pos % self.block_size)
            spans.append((first, item.num_tokens, item))
            if item.samples:
                sample_rows += range(len(tokens) - item.num_draft - 1, len(tokens))
        short = [s for s in spans if s[1] <= SHORT_QUERY_TOKENS]
        groups = [self._group(short)] if short else []
        groups += [self._group([s]) for s in spans if s[1] > SHORT_QUERY_TOKENS]
        to = dict(device=self.device, dtype=torch.long)
        batch = AttentionBatch(torch.tensor(positions, **to), torch.tensor(slots, **to), groups)
        return torch.tensor(tokens, **to), batch, torch.tensor(sample_rows, **to)

    def _group(self, spans: list[tuple[int, int, ScheduledSeq]]) -> AttentionGroup:
        q_len = max(count for _, count, _ in spans)
        num_blocks = max(len(item.seq.block_table) for _, _, item in spans)
        bsz = len(spans)
        token_index = torch.zeros(bsz, q_len, dtype=torch.long)
        query_pos = torch.zeros(bsz, q_len, dtype=torch.long)
        block_tables = torch.zeros(bsz, num_blocks, dtype=torch.long)
        for b, (first, count, item) in enumerate(spans):
            token_index[b, :count] = torch.arange(first, first + count)
            start = item.seq.num_computed_tokens
            query_pos[b, :count] = torch.arange(start, start + count)
            block_tables[b, : len(item.seq.block_table)] = torch.tensor(item.seq.block_table)
        token_valid = torch.arange(q_len)[None, :] < torch.tensor([c for _, c, _ in spans])[:, None]
        valid_rows = token_valid.view(-1).nonzero()[:, 0]
        key_pos = torch.arange(num_blocks * self.block_size)
        mask = (key_pos[None, None, :] <= query_pos[:, :, None]).unsqueeze(1)  # [B, 1, Q, K]
        dev = self.device
        return AttentionGroup(token_index.to(dev), valid_rows.to(dev), block_tables.to(dev), mask.to(dev))
