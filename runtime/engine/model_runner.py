"""Owns the KV pools and runs one target forward per step over every scheduled token.

All host→device traffic of a step happens in ``prepare``: the flat token batch, positions,
slot mapping and the attention groups are built on the host and moved once.
"""
from __future__ import annotations

import torch

from specdecode.runtime.engine.scheduler import ScheduledSeq
from specdecode.runtime.models.attention import AttentionBatch, AttentionGroup
from specdecode.runtime.models.decoder import DecoderLM

# Sequences computing at most this many tokens share one padded attention call.
SHORT_QUERY_TOKENS = 16


def kv_bytes_per_block(model: DecoderLM, block_size: int, dtype: torch.dtype) -> int:
    c = model.config
    return 2 * c.num_layers * block_size * c.num_kv_heads * c.head_dim * torch.finfo(dtype).bits // 8


class ModelRunner:
    def __init__(self, model: DecoderLM, num_blocks: int, block_size: int, device: torch.device, dtype: torch.dtype):
        c = model.config
        self.model = model
        self.block_size = block_size
        self.device = device
        shape = (num_blocks, block_size, c.num_kv_heads, c.head_dim)
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
        hidden = self.model(input_ids, self.kv_pools, batch)  # [T, hidden]
        self.num_forwards += 1
        return self.model.compute_logits(hidden[sample_rows])

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
