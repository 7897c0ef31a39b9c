"""Where a step's target forward and verification run, and when the engine reads their result.

The engine *launches* a prepared step and gets back a ``Pending``; calling it reads the step's
verdicts. Between the two the engine may prepare the next step (overlap scheduling, see
``LLMEngine``). ``LocalExecution`` runs both in this process — under tensor parallelism rank 0
drives the other ranks through its step channel; with overlap on it runs them in one background
thread (torch releases the GIL inside its ops, and on CUDA the kernels run asynchronously anyway),
so the host work of the next step happens while this one computes. ``PipelineExecution``
(``parallel/pipeline.py``) hands the step to the pipeline stages and reads the last stage's verdicts.
"""
from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from specdecode.runtime.engine.model_runner import ModelRunner, PreparedStep, StepLists
from specdecode.runtime.engine.sampler import SamplerRow
from specdecode.runtime.engine.scheduler import ScheduledSeq
from specdecode.runtime.engine.sequence import Sequence, TokenLogprob
from specdecode.runtime.engine.transfer import upload_groups
from specdecode.runtime.engine.verifier import Verdict, Verifier, VerifyLists

if TYPE_CHECKING:
    from specdecode.runtime.proposers import AheadDrafts, Proposer


@dataclass
class StepResult:
    verdicts: list[Verdict]  # one per deciding item of the step, in order
    # what the proposer observes (``Proposer.observe``): [T, hidden] pre-norm, or the aux states [T, A·hidden]
    # of a proposer with ``aux_layer_ids``; None where the proposer runs elsewhere
    hidden: torch.Tensor | None
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)  # one per prompt row of the step, in order


Pending = Callable[[], StepResult]


class Execution:
    """What the engine asks of whoever runs its steps."""

    # KV slots past a deciding sequence's step the proposer writes before the next step is scheduled
    # (MTP heads on a pipeline's last stage draft right after verifying); the engine reserves them if free
    draft_slots_ahead: int = 0
    # whether the steps' prompt rows get their logprobs (``SamplingParams.prompt_logprobs``)
    scores_prompt_logprobs: bool = False

    def launch(self, scheduled: list[ScheduledSeq], step: StepLists, rows: list[SamplerRow]) -> Pending:
        raise NotImplementedError

    def abandon(self, exc: BaseException) -> BaseException:
        """The launched step's result will never be read: ``exc`` was raised before it was. Leave
        nothing of that step in flight; what the engine raises instead of ``exc``."""
        return exc

    def preempted(self, seq: Sequence) -> None:
        """``seq`` lost its KV slots."""

    def finished(self, seq: Sequence) -> None:
        """``seq`` ended or was aborted: it never appears in a step again."""

    def close(self) -> None:
        """Stop any thread this execution started."""


@dataclass
class _Sent:
    """A launched step's inputs on the device: the forward's, the verifier's and the proposer's."""

    step: PreparedStep
    rows: list[SamplerRow]
    checks: VerifyLists | None
    on: dict[str, torch.Tensor]  # ``checks`` on the device
    ahead: tuple[AheadDrafts, list[torch.Tensor]] | None  # the drafts made ahead and their parts on the device


class LocalExecution(Execution):
    scores_prompt_logprobs = True

    def __init__(self, runner: ModelRunner, verifier: Verifier, overlap: bool, proposer: Proposer | None = None):
        self.runner = runner
        self.verifier = verifier
        self.proposer = proposer  # asked for drafts ahead of each step's verdicts (``Proposer.draft_ahead``)
        if proposer is not None:  # the forward also returns what the proposer drafts from
            runner.aux_layers = proposer.aux_layer_ids
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="specdecode-step") if overlap else None

    def launch(self, scheduled: list[ScheduledSeq], step: StepLists, rows: list[SamplerRow]) -> Pending:
        """The step's one upload — its model inputs, its verifier's and its proposer's lists — then
        its forward and verification (in the background with overlap)."""
        deciding = [item for item in scheduled if item.samples]  # the rows' items, in order
        ahead = self.proposer.draft_ahead(deciding) if self.proposer is not None and rows else None
        checks = self.verifier.lists(rows) if rows else None
        inputs, on, ahead_parts = upload_groups(
            [step.parts, checks.parts if checks else [], ahead.parts if ahead else []], self.runner.device)
        sent = _Sent(step.on_device(inputs), rows, checks, checks.on_device(on) if checks else {},
                     (ahead, ahead_parts) if ahead is not None else None)
        if self._thread is None:
            result = self._run(sent)
            return lambda: result
        return self._thread.submit(self._run, sent).result

    def abandon(self, exc: BaseException) -> BaseException:
        """Wait for the step still running in the background: it writes the KV pools the next step reads.
        An ordinary failed step then: this process holds all that the step changed."""
        if self._thread is not None:
            self._thread.submit(lambda: None).result()  # one worker thread: this runs after that step
        return exc

    @torch.inference_mode()
    def _run(self, sent: _Sent) -> StepResult:
        step = sent.step
        out = self.runner.run(step)
        verdicts = self.verifier.verify(out.logits, sent.rows, sent.checks, sent.on, sent.ahead) if sent.rows else []
        prompt_logprobs = self.runner.prompt_logprobs(step, out.hidden) if step.prompt_token_ids else []
        observed = out.aux if self.runner.aux_layers else out.hidden
        return StepResult(verdicts, observed, prompt_logprobs)

    def close(self) -> None:
        if self._thread is not None:
            self._thread.shutdown(wait=True)
