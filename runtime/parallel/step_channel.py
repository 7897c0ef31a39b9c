"""Rank 0 → every other rank: each step's model inputs, then at the end a shutdown message.

A step is two broadcasts from rank 0, then the same forward on every rank:

1. the *header* on the gloo control group (CPU, ``HEADER`` longs):
   ``[kind, T, B, M, H, max_query_len, block_size]`` — the sizes of what follows;
2. one long tensor on the default group: ``input_ids, positions, slot_mapping`` ([T] each), then
   ``block_tables`` [B·M], ``seq_lens`` [B], ``query_start`` [B + 1] and ``hidden_keys`` [B·H].

That is exactly what ``ModelRunner.prepare`` built on rank 0, already on the device: metadata a
few hundred longs long, never a mask. Only rank 0 computes logits, samples and verifies. A step
that fails part-way (a peer died or timed out, or rank 0's own forward raised) leaves the ranks
out of lockstep: the channel is then *broken* for good and rank 0's engine stops (its ``/health``
fails) rather than sending another step.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from specdecode.runtime.models.attention import AttentionBatch

SHUTDOWN, STEP = 0, 1
HEADER = 7  # longs: kind, T, B, M, H, max_query_len, block_size
Forward = Callable[[torch.Tensor, AttentionBatch], torch.Tensor]  # (input_ids [T], batch) → hidden [T, H]


class TensorParallelBroken(RuntimeError):
    """A tensor-parallel step failed part-way: the ranks are no longer in lockstep."""


class StepChannel:
    def __init__(self, control: dist.ProcessGroup, device: torch.device):
        self.control = control  # gloo, CPU: the headers
        self.device = device  # where the step tensors live (default group: NCCL on CUDA, gloo on CPU)
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
            dist.broadcast(torch.tensor([SHUTDOWN] + [0] * (HEADER - 1), dtype=torch.long), 0, group=self.control)

    def _send(self, input_ids: torch.Tensor, batch: AttentionBatch) -> None:
        (num_seqs, width), hidden = batch.block_tables.shape, batch.hidden_keys
        header = [STEP, input_ids.numel(), num_seqs, width, 0 if hidden is None else hidden.shape[1],
                  batch.max_query_len, batch.block_size]
        dist.broadcast(torch.tensor(header, dtype=torch.long), 0, group=self.control)
        parts = [input_ids, batch.positions, batch.slot_mapping, batch.block_tables.reshape(-1), batch.seq_lens,
                 batch.query_start, *([] if hidden is None else [hidden.reshape(-1)])]
        dist.broadcast(torch.cat(parts), 0)

    # -- every other rank -----------------------------------------------------------------------

    def receive(self) -> tuple[torch.Tensor, AttentionBatch] | None:
        """Wait for rank 0's next step: (input_ids [T], batch), or None once told to shut down."""
        header = torch.zeros(HEADER, dtype=torch.long)
        dist.broadcast(header, 0, group=self.control)
        kind, num_tokens, num_seqs, width, hidden, max_query_len, block_size = header.tolist()
        if kind == SHUTDOWN:
            return None
        sizes = [num_tokens] * 3 + [num_seqs * width, num_seqs, num_seqs + 1, num_seqs * hidden]
        longs = torch.empty(sum(sizes), dtype=torch.long, device=self.device)
        dist.broadcast(longs, 0)
        input_ids, positions, slot_mapping, tables, seq_lens, query_start, hidden_keys = longs.split(sizes)
        return input_ids, AttentionBatch(
            positions, slot_mapping, tables.view(num_seqs, width), seq_lens, query_start, block_size=block_size,
            max_query_len=max_query_len, hidden_keys=hidden_keys.view(num_seqs, hidden) if hidden else None)
