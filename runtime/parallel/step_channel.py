"""Rank 0 → every other rank: each step's model inputs, then at the end a shutdown message.

A step is three broadcasts from rank 0, then the same forward on every rank:

1. the *header* on the gloo control group (CPU, fixed length ``3 + 4 * max_groups``):
   ``[kind, T, G, (B, Q, N, M) per attention group…, 0 padding]`` — the sizes of what follows;
2. one long tensor on the default group: ``input_ids, positions, slot_mapping`` ([T] each), then
   per group ``token_index`` [B·Q], ``valid_rows`` [N], ``block_tables`` [B·M];
3. one uint8 tensor on the default group: every group's ``mask`` [B·1·Q·(M·block_size)].

That is exactly what ``ModelRunner.prepare`` built on rank 0, already on the device. Only rank 0
computes logits, samples and verifies. A step that fails part-way (a peer died or timed out, or
rank 0's own forward raised) leaves the ranks out of lockstep: the channel is then *broken* for
good and rank 0's engine stops (its ``/health`` fails) rather than sending another step.
"""
from __future__ import annotations

import itertools
from collections.abc import Callable

import torch
import torch.distributed as dist

from specdecode.runtime.models.attention import AttentionBatch, AttentionGroup

SHUTDOWN, STEP = 0, 1
Forward = Callable[[torch.Tensor, AttentionBatch], torch.Tensor]  # (input_ids [T], batch) → hidden [T, H]


class TensorParallelBroken(RuntimeError):
    """A tensor-parallel step failed part-way: the ranks are no longer in lockstep."""


class StepChannel:
    def __init__(self, control: dist.ProcessGroup, device: torch.device, block_size: int, max_groups: int):
        self.control = control  # gloo, CPU: the headers
        self.device = device  # where the step tensors live (default group: NCCL on CUDA, gloo on CPU)
        self.block_size = block_size
        self.max_groups = max_groups  # at most one attention group per scheduled sequence
        self.broken = False

    # -- rank 0 ---------------------------------------------------------------------------------

    def run_step(self, input_ids: torch.Tensor, batch: AttentionBatch, forward: Forward) -> torch.Tensor:
        """Send the step and run ``forward`` in lockstep with the other ranks: hidden [T, hidden]."""
        if self.broken:
            raise TensorParallelBroken("an earlier step failed part-way; the tensor-parallel group is unusable")
        try:
            self._send(input_ids, batch)
            return forward(input_ids, batch)
        except Exception as exc:
            self.broken = True
            raise TensorParallelBroken(f"tensor-parallel step failed: {exc}") from exc

    def close(self) -> None:
        """Tell every other rank to leave its loop (nothing is sent once broken)."""
        if not self.broken:
            dist.broadcast(self._header(SHUTDOWN, 0, []), 0, group=self.control)

    def _send(self, input_ids: torch.Tensor, batch: AttentionBatch) -> None:
        groups = batch.groups
        dims = [(*g.token_index.shape, g.valid_rows.numel(), g.block_tables.shape[1]) for g in groups]
        dist.broadcast(self._header(STEP, input_ids.numel(), dims), 0, group=self.control)
        per_group = (t.reshape(-1) for g in groups for t in (g.token_index, g.valid_rows, g.block_tables))
        dist.broadcast(torch.cat([input_ids, batch.positions, batch.slot_mapping, *per_group]), 0)
        dist.broadcast(torch.cat([g.mask.reshape(-1) for g in groups]).view(torch.uint8), 0)

    def _header(self, kind: int, num_tokens: int, dims: list[tuple[int, int, int, int]]) -> torch.Tensor:
        if len(dims) > self.max_groups:
            raise ValueError(f"{len(dims)} attention groups exceed the channel's {self.max_groups}")
        header = torch.zeros(3 + 4 * self.max_groups, dtype=torch.long)  # [3 + 4·max_groups] CPU
        values = [kind, num_tokens, len(dims), *itertools.chain.from_iterable(dims)]
        header[: len(values)] = torch.tensor(values, dtype=torch.long)
        return header

    # -- every other rank -----------------------------------------------------------------------

    def receive(self) -> tuple[torch.Tensor, AttentionBatch] | None:
        """Wait for rank 0's next step: (input_ids [T], batch), or None once told to shut down."""
        header = torch.zeros(3 + 4 * self.max_groups, dtype=torch.long)
        dist.broadcast(header, 0, group=self.control)
        kind, num_tokens, num_groups, *rest = header.tolist()
        if kind == SHUTDOWN:
            return None
        dims = [rest[4 * i : 4 * i + 4] for i in range(num_groups)]  # (B, Q, N, M) per group
        sizes = [num_tokens] * 3 + [n for b, q, v, m in dims for n in (b * q, v, b * m)]
        longs = torch.empty(sum(sizes), dtype=torch.long, device=self.device)
        dist.broadcast(longs, 0)
        mask_sizes = [b * q * m * self.block_size for b, q, _, m in dims]
        masks = torch.empty(sum(mask_sizes), dtype=torch.uint8, device=self.device)
        dist.broadcast(masks, 0)
        input_ids, positions, slot_mapping, *parts = longs.split(sizes)
        groups = [
            AttentionGroup(
                token_index=parts[3 * i].view(b, q),
                valid_rows=parts[3 * i + 1],
                block_tables=parts[3 * i + 2].view(b, m),
                mask=mask.view(torch.bool).view(b, 1, q, m * self.block_size),
            )
            for i, ((b, q, _, m), mask) in enumerate(zip(dims, masks.split(mask_sizes)))
        ]
        return input_ids, AttentionBatch(positions, slot_mapping, groups)
