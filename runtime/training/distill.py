"""Self-distillation data: the target's own continuations of prompts, and at every position what a
head reads there (the tapped hidden state of an MTP head, the aux states of an EAGLE-3 head) and
the target's greedy next token (the label a head learns).

The serving engine generates the continuations and a ``HiddenRecorder`` (a proposer that never
drafts: its requests ask for no speculation) keeps what each step's target forward computed, so
no second pass over the data is needed: with ``aux_layer_ids`` the forward returns the residual
streams entering those layers instead of its hidden states, as it does for an EAGLE-3 proposer.
Continuations are greedy, the paths greedy serving takes (measured a little better for held-out
greedy acceptance than continuations sampled at temperature 0.7); labels are the target's argmax
at each position, so a head learns what greedy verification accepts: the token the step appended
at a decode position, the top prompt logprob (the engine's, asked for with ``prompt_logprobs``) at
a prompt position.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from specdecode.runtime.config import CacheConfig, EngineConfig, SchedulerConfig
from specdecode.runtime.engine.llm_engine import LLMEngine
from specdecode.runtime.engine.scheduler import ScheduledSeq
from specdecode.runtime.engine.sequence import SamplingParams, Sequence
from specdecode.runtime.models.decoder import DecoderLM
from specdecode.runtime.proposers import Proposer

MAX_RUNNING = 32  # sequences generated at once (batch 32 to 128 measured the same ~120 tokens/s on 2 cores)
# what a head reads, from what the forward returned at the recorded rows: [n, H] or [n, A·H] → [n, S]
Source = Callable[[torch.Tensor], torch.Tensor]


@dataclass
class Distilled:
    """Per sequence: token ids [T], what the head reads at each position [T, S] (``HiddenRecorder``)
    and the target's greedy next token at each position [T] (label[q] is what follows token_ids[: q + 1])."""

    token_ids: list[torch.Tensor]
    source: list[torch.Tensor]
    labels: list[torch.Tensor]

    @property
    def num_tokens(self) -> int:
        return sum(len(t) for t in self.token_ids)

    def __add__(self, other: Distilled) -> Distilled:
        return Distilled(self.token_ids + other.token_ids, self.source + other.source, self.labels + other.labels)


@dataclass
class _Record:
    source: list[torch.Tensor] = field(default_factory=list)  # [n, S] chunks, in position order
    labels: list[torch.Tensor] = field(default_factory=list)  # [n] chunks
    num_positions: int = 0


class HiddenRecorder(Proposer):
    """Keeps every computed position's ``source`` of what the forward returned (its hidden states, or
    with ``aux_layer_ids`` the residual streams entering those layers) and greedy label, per request."""

    def __init__(self, source: Source, aux_layer_ids: tuple[int, ...] = ()):
        self.source, self.aux_layer_ids = source, aux_layer_ids
        self.records: dict[str, _Record] = {}

    def propose(self, seqs, max_drafts):
        raise RuntimeError("the recorder never drafts: its requests ask for no speculation")

    @torch.inference_mode()
    def observe(self, scheduled: list[ScheduledSeq], hidden: torch.Tensor) -> None:
        first = 0
        for item in scheduled:
            rows = hidden[first : first + item.num_tokens]  # [n, H] or [n, A·H], positions start.. (no drafts)
            first += item.num_tokens
            seq = item.seq
            record = self.records.setdefault(seq.request_id, _Record())
            if item.start != record.num_positions:
                raise RuntimeError(f"request {seq.request_id} skipped or repeated positions (from {item.start}): "
                                   "record without prefix caching, in a pool that preempts nothing")
            positions = range(item.start, item.start + item.num_tokens)
            record.source.append(self.source(rows).cpu())  # in the recording model's dtype
            record.labels.append(torch.tensor([_greedy_label(seq, p) for p in positions], dtype=torch.long))
            record.num_positions += item.num_tokens


def _greedy_label(seq: Sequence, position: int) -> int:
    """The target's greedy token after ``position``: the top prompt logprob of the next prompt token
    inside the prompt, the token the step appended from the prompt's last position on."""
    if position < seq.num_prompt_tokens - 1:
        return seq.prompt_logprobs[position].top[0][0]
    return seq.token_ids[position + 1]


def generate(
    model: DecoderLM, tokenizer, prompts: list[list[int]], max_tokens: int, recorder: HiddenRecorder,
    device: torch.device, dtype: torch.dtype, progress: Callable[[int], None],
) -> Distilled:
    """Greedy continuations of ``prompts`` in one continuous batch, recorded by ``recorder`` as they
    are computed: without prefix caching (a cached prefix is not computed) and with a KV pool that
    holds every running sequence whole (a preempted one would be computed twice). With ``max_tokens``
    1 only the prompts are recorded (one prefill each, teacher-forced: the appended token is never fed
    back)."""
    if not prompts:
        return Distilled([], [], [])
    longest = max(len(p) for p in prompts) + max_tokens
    cfg = EngineConfig(cache=CacheConfig(num_blocks=MAX_RUNNING * (-(-longest // 16)), enable_prefix_caching=False),
                       scheduler=SchedulerConfig(max_num_seqs=MAX_RUNNING))
    engine = LLMEngine(model, tokenizer, cfg, model.config.max_position_embeddings, device, dtype, proposer=recorder)
    sequences: dict[str, list[int]] = {}
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, prompt_logprobs=1, num_speculative_tokens=0)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
        sequences[str(i)] = list(prompt)
    while engine.has_unfinished():
        for out in engine.step():
            for delta in out.deltas:
                sequences[out.request_id] += delta.token_ids
            if out.finished:
                progress(1)
    data = Distilled([], [], [])
    for request_id, tokens in sequences.items():
        record = recorder.records.pop(request_id)  # consumed: the recorder serves the next call afresh
        n = record.num_positions  # the last token was never fed back
        data.token_ids.append(torch.tensor(tokens[:n], dtype=torch.long))
        data.source.append(torch.cat(record.source))
        data.labels.append(torch.cat(record.labels))
    return data
