"""How a pipeline's ranks hand each other a step: the one interface ``pipeline.py`` talks through.

A step moves five kinds of message (``pipeline`` says what each holds):

- the step's inputs, rank 0 → every rank (``run_step``; the other ranks receive them in their
  loop, ``StepChannel.receive``);
- the ``TailPlan``, rank 0 → the verifier rank (``send_plan`` / ``receive_plan``);
- hidden states, each stage's rank (s, t) → (s + 1, t) (``send_hidden`` / ``receive_hidden``), with
  an EAGLE-3 head's aux states beside them in the same message (``pipeline.handed_on``);
- the verdict message, verifier → rank 0 (``send_verdict`` / ``receive_verdict``);
- the verdicts' logprobs, verifier → rank 0, only when a request asked (``send_logprobs`` /
  ``receive_logprobs``).

``GlooTransport`` moves them over torch.distributed (the default group for tensors, the gloo
link group of rank 0 and the verifier for objects). The tests' in-process transport moves them
between stages living in one process, so the real ``PipelineExecution``, ``StageWorker`` and
``PipelineTail`` run under the engine fuzzer without process groups.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from specdecode.runtime.models.attention import AttentionBatch
from specdecode.runtime.parallel.step_channel import Forward, StepChannel

if TYPE_CHECKING:
    from specdecode.runtime.parallel.pipeline import TailPlan


class PipelineTransport:
    """What the pipeline's ranks ask of whatever carries their messages (see the module docstring).
    ``broken``: a step failed part-way and the ranks are out of lockstep; nothing more is sent."""

    broken: bool = False

    # -- rank 0 ---------------------------------------------------------------------------------

    def run_step(self, input_ids: torch.Tensor, batch: AttentionBatch, forward: Forward) -> torch.Tensor:
        """Send the step's inputs to every rank, then run rank 0's ``forward``: hidden [T, H]."""
        raise NotImplementedError

    def send_plan(self, plan: TailPlan) -> None:
        raise NotImplementedError

    def receive_verdict(self, numel: int, device: torch.device) -> torch.Tensor:
        """The verifier's message: int32 [numel]."""
        raise NotImplementedError

    def receive_logprobs(self) -> list[Any]:
        raise NotImplementedError

    # -- every rank -----------------------------------------------------------------------------

    def send_hidden(self, hidden: torch.Tensor, dst: int) -> None:
        """hidden [T, (1 + a)·H] (a aux states beside the hidden states) to global rank ``dst`` (the next
        stage's rank of the same tensor rank)."""
        raise NotImplementedError

    def receive_hidden(self, out: torch.Tensor, src: int) -> torch.Tensor:
        """Fill ``out`` [T, (1 + a)·H] with what global rank ``src`` sent; returns ``out``."""
        raise NotImplementedError

    # -- the verifier rank ----------------------------------------------------------------------

    def receive_plan(self) -> TailPlan:
        raise NotImplementedError

    def send_verdict(self, flat: torch.Tensor) -> None:
        raise NotImplementedError

    def send_logprobs(self, logprobs: list[Any]) -> None:
        raise NotImplementedError


class GlooTransport(PipelineTransport):
    """The messages over torch.distributed: tensors point to point on the default group, objects on
    the ``link`` group (rank 0 ↔ the verifier rank; None on the ranks outside that pair); rank 0's
    step inputs through its ``channel``."""

    def __init__(self, link: dist.ProcessGroup | None, verifier_rank: int, channel: StepChannel | None = None):
        self.link = link
        self.verifier_rank = verifier_rank
        self.channel = channel  # rank 0 only

    @property
    def broken(self) -> bool:
        return self.channel is not None and self.channel.broken

    @broken.setter
    def broken(self, value: bool) -> None:
        self.channel.broken = value

    def run_step(self, input_ids: torch.Tensor, batch: AttentionBatch, forward: Forward) -> torch.Tensor:
        return self.channel.run_step(input_ids, batch, forward)

    def send_plan(self, plan: TailPlan) -> None:
        dist.broadcast_object_list([plan], src=0, group=self.link)

    def receive_plan(self) -> TailPlan:
        return self._receive_object(0)

    def send_hidden(self, hidden: torch.Tensor, dst: int) -> None:
        dist.send(hidden.contiguous(), dst)

    def receive_hidden(self, out: torch.Tensor, src: int) -> torch.Tensor:
        dist.recv(out, src)
        return out

    def send_verdict(self, flat: torch.Tensor) -> None:
        dist.send(flat, 0)

    def receive_verdict(self, numel: int, device: torch.device) -> torch.Tensor:
        flat = torch.empty(numel, dtype=torch.int32, device=device)
        dist.recv(flat, self.verifier_rank)
        return flat

    def send_logprobs(self, logprobs: list[Any]) -> None:
        dist.broadcast_object_list([logprobs], src=self.verifier_rank, group=self.link)

    def receive_logprobs(self) -> list[Any]:
        return self._receive_object(self.verifier_rank)

    def _receive_object(self, src: int) -> Any:
        box: list = [None]
        dist.broadcast_object_list(box, src=src, group=self.link)
        return box[0]
