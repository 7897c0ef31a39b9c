"""CUDA graphs of the decode/verify forward, one per batch bucket and rows per sequence.

A bucketed step (``buckets.py``) has static shapes: ``B_pad · Q`` rows, block tables ``width``
wide. The first step of a (B_pad, Q) shape is run eagerly on a side stream (Triton compiles, the
allocator warms), then captured into a graph that reads persistent input buffers and writes a
persistent output (the hidden states and the aux states an EAGLE-3 head reads, ``[T, 0]`` where
the runner has no aux layers); every later step of that shape copies its inputs into those buffers (device to
device: ``prepare`` already uploaded them) and replays the graph, one launch instead of hundreds.
All graphs share one memory pool, as nano-vllm's do, so their intermediates take the largest one's
memory, not the sum. Capture is lazy: only the shapes the traffic uses are captured.

The captured forward is the eager one (``ModelRunner.forward``) over the same buffers, so replay
computes what eager computes; the gpu tier checks it token for token (``scripts/gpu_check.sh``).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from specdecode.runtime.models.attention import AttentionBatch

STEP_TENSORS = ("positions", "slot_mapping", "block_tables", "seq_lens", "query_start")  # AttentionBatch's, per step
# (input_ids [T], batch) → (hidden [T, hidden], aux [T, A·hidden]): ``ModelRunner.forward_aux``
Forward = Callable[[torch.Tensor, AttentionBatch], tuple[torch.Tensor, torch.Tensor]]


@dataclass
class Captured:
    """One shape's graph and the buffers it reads and writes."""

    graph: torch.cuda.CUDAGraph
    input_ids: torch.Tensor  # [B_pad · Q] long
    batch: AttentionBatch  # over persistent positions, slots, tables [B_pad, width], seq_lens, query starts
    hidden: torch.Tensor  # [B_pad · Q, hidden]: what each replay writes
    aux: torch.Tensor  # [B_pad · Q, A·hidden]: and its aux states

    def load(self, input_ids: torch.Tensor, batch: AttentionBatch) -> None:
        """Copy a step of this shape into the buffers (no host sync: device-to-device copies)."""
        self.input_ids.copy_(input_ids, non_blocking=True)
        for name in STEP_TENSORS:
            getattr(self.batch, name).copy_(getattr(batch, name), non_blocking=True)


class CudaGraphs:
    def __init__(self, forward: Forward, width: int):
        self.forward = forward
        self.width = width  # every captured step's block-table width (``bucketed_lists``' min_width)
        self.captured: dict[tuple[int, int], Captured] = {}
        self.pool = None  # the graphs' shared memory pool, made by the first capture
        self.num_replays = 0

    def fits(self, batch: AttentionBatch) -> bool:
        """Whether a bucketed step's tables have the graphs' width (a wider one, never expected, runs eagerly)."""
        return batch.block_tables.shape[1] == self.width

    def run(self, input_ids: torch.Tensor, batch: AttentionBatch,
            shape: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The forward of a bucketed step of ``shape`` (B_pad, Q), replayed → (hidden [B_pad · Q, hidden],
        aux [B_pad · Q, A·hidden]) (copies: the graph's output buffers are rewritten by the next replay)."""
        captured = self.captured.get(shape)
        if captured is None:
            captured = self.captured[shape] = self._capture(input_ids, batch)
        captured.load(input_ids, batch)
        captured.graph.replay()
        self.num_replays += 1
        return captured.hidden.clone(), captured.aux.clone()

    def _capture(self, input_ids: torch.Tensor, batch: AttentionBatch) -> Captured:
        static_ids = input_ids.clone()
        static = replace(batch, query_start_list=None, seq_lens_list=None, **{
            name: getattr(batch, name).clone() for name in STEP_TENSORS})
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up: kernels compile and the allocator settles outside the capture
            self.forward(static_ids, static)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            hidden, aux = self.forward(static_ids, static)
        self.pool = graph.pool()
        return Captured(graph, static_ids, static, hidden, aux)
