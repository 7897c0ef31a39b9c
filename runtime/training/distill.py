"""Self-distillation data: the target's own continuations of prompts, and at every position its
hidden state (where an MTP head taps it) and its greedy next token (the label a head learns).

The serving engine generates the continuations and a ``HiddenRecorder`` (a proposer that never
drafts: its requests ask for no speculation) keeps what each step's target forward computed, so
no second pass over the data is needed. Continuations are greedy, the paths greedy serving takes
(measured a little better for held-out greedy acceptance than continuations sampled at
temperature 0.7); labels are the target's argmax at each position, so a head learns what greedy
verification accepts: the token the step appended at a decode position, the LM head's argmax at
a prompt position.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from specdecode.runtime.config import CacheConfig, EngineConfig, SchedulerConfig
from specdecode.runtime.engine.llm_engine import LLMEngine
from specdecode.runtime.engine.scheduler import ScheduledSeq
from specdecode.runtime.engine.sequence import SamplingParams
from specdecode.runtime.models.decoder import DecoderLM
from specdecode.runtime.models.mtp import HiddenTap
from specdecode.runtime.proposers import Proposer

LOGIT_ROWS = 512  # rows per LM-head chunk when taking a prompt's argmax
MAX_RUNNING = 32  # sequences generated at once (batch 32 to 128 measured the same ~120 tokens/s on 2 cores)


@dataclass
class Distilled:
    """Per sequence: token ids [T], the tapped target hidden states [T, H] and the target's greedy
    next token at each position [T] (label[q] is what follows token_ids[: q + 1])."""

    token_ids: list[torch.Tensor]
    hidden: list[torch.Tensor]
    labels: list[torch.Tensor]

    @property
    def num_tokens(self) -> int:
        return sum(len(t) for t in self.token_ids)


@dataclass
class _Record:
    hidden: list[torch.Tensor] = field(default_factory=list)  # [n, H] chunks, in position order
    labels: list[torch.Tensor] = field(default_factory=list)  # [n] chunks
    num_positions: int = 0


class HiddenRecorder(Proposer):
    """Keeps every computed position's tapped hidden state and greedy label, per request."""

    def __init__(self, target: DecoderLM, tap: HiddenTap):
        self.target, self.tap = target, tap
        self.records: dict[str, _Record] = {}

    def propose(self, seqs, max_drafts):
        raise RuntimeError("the recorder never drafts: its requests ask for no speculation")

    @torch.inference_mode()
    def observe(self, scheduled: list[ScheduledSeq], hidden: torch.Tensor) -> None:
        first = 0
        for item in scheduled:
            rows = hidden[first : first + item.num_tokens]  # [n, H] positions start.. (no drafts)
            first += item.num_tokens
            seq = item.seq
            record = self.records.setdefault(seq.request_id, _Record())
            if item.start != record.num_positions:
                raise RuntimeError(f"request {seq.request_id} skipped or repeated positions (from {item.start}): "
                                   "record without prefix caching, in a pool that preempts nothing")
            if item.num_tokens == 1:  # a decode step: the token it appended is the greedy label
                labels = torch.tensor([seq.token_ids[item.start + 1]], dtype=torch.long)
            else:  # prompt positions: the target's own argmax
                labels = torch.cat([self.target.compute_logits(c).argmax(-1).cpu() for c in rows.split(LOGIT_ROWS)])
            tapped = self.tap.apply(self.target, rows)  # what the head reads at run time (MtpHead.tap)
            record.hidden.append(tapped.float().cpu())
            record.labels.append(labels)
            record.num_positions += item.num_tokens


def generate(
    model: DecoderLM, tokenizer, prompts: list[list[int]], max_tokens: int, tap: HiddenTap, device: torch.device,
    dtype: torch.dtype, progress: Callable[[int], None],
) -> Distilled:
    """Greedy continuations of ``prompts`` in one continuous batch, recorded as they are computed:
    without prefix caching (a cached prefix is not computed) and with a KV pool that holds every
    running sequence whole (a preempted one would be computed twice)."""
    longest = max(len(p) for p in prompts) + max_tokens
    cfg = EngineConfig(cache=CacheConfig(num_blocks=MAX_RUNNING * (-(-longest // 16)), enable_prefix_caching=False),
                       scheduler=SchedulerConfig(max_num_seqs=MAX_RUNNING))
    recorder = HiddenRecorder(model, tap)
    engine = LLMEngine(model, tokenizer, cfg, model.config.max_position_embeddings, device, dtype, proposer=recorder)
    sequences: dict[str, list[int]] = {}
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, num_speculative_tokens=0))
        sequences[str(i)] = list(prompt)
    while engine.has_unfinished():
        for out in engine.step():
            for delta in out.deltas:
                sequences[out.request_id] += delta.token_ids
            if out.finished:
                progress(1)
    data = Distilled([], [], [])
    for request_id, tokens in sequences.items():
        record = recorder.records[request_id]
        n = record.num_positions  # the last token was never fed back
        data.token_ids.append(torch.tensor(tokens[:n], dtype=torch.long))
        data.hidden.append(torch.cat(record.hidden))
        data.labels.append(torch.cat(record.labels))
    return data
