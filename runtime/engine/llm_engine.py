"""The synchronous engine: add requests, then ``step()`` until they finish.

One step = schedule → one target forward over every scheduled token → sample → append and
check stops → report deltas. (Speculation will slot in as propose → score → verify → accept.)
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import itertools
import random
import time
from dataclasses import dataclass

import torch

from specdecode.runtime.config import EngineConfig
from specdecode.runtime.engine.block_manager import BlockManager
from specdecode.runtime.engine.detokenizer import IncrementalDetokenizer
from specdecode.runtime.engine.model_runner import ModelRunner, kv_bytes_per_block
from specdecode.runtime.engine.sampler import SamplerRow, sample
from specdecode.runtime.engine.scheduler import Scheduler
from specdecode.runtime.engine.sequence import (
    CompletionDelta,
    FinishReason,
    RequestOutput,
    SamplingParams,
    Sequence,
    TokenLogprob,
)
from specdecode.runtime.models.decoder import DecoderLM

if TYPE_CHECKING:
    from specdecode.runtime.tokenizer import Tokenizer


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float  # 0..1
    num_free_blocks: int
    num_total_blocks: int
    num_preemptions: int  # cumulative
    prefix_cache_hit_tokens: int  # cumulative
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: tuple[int, ...] = ()
    spec_decode_enabled: bool = False


@dataclass
class _Completion:
    seq: Sequence
    detok: IncrementalDetokenizer
    generator: torch.Generator | None
    reported_tokens: int = 0
    reported: bool = False  # its finish has been reported
    stop_reason: str | int | None = None


@dataclass
class _Request:
    request_id: str
    params: SamplingParams
    completions: list[_Completion]

    @property
    def finished(self) -> bool:
        return all(c.seq.is_finished for c in self.completions)


class LLMEngine:
    def __init__(
        self,
        model: DecoderLM,
        tokenizer: Tokenizer,
        cfg: EngineConfig,
        max_model_len: int,
        device: torch.device,
        dtype: torch.dtype,
    ):
        block_size = cfg.cache.block_size
        num_blocks = cfg.cache.num_blocks or max(
            2, int(cfg.cache.memory_gib * 2**30) // kv_bytes_per_block(model, block_size, dtype)
        )
        self.tokenizer = tokenizer
        self.max_model_len = min(cfg.scheduler.max_model_len or max_model_len, model.config.max_position_embeddings)
        self.device = device
        self.blocks = BlockManager(num_blocks, block_size, cfg.cache.enable_prefix_caching)
        self.scheduler = Scheduler(cfg.scheduler, self.blocks)
        self.runner = ModelRunner(model, num_blocks, block_size, device, dtype)
        self.requests: dict[str, _Request] = {}
        self._seq_ids = itertools.count()
        self._touched: set[str] = set()

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Queue a request; raises ValueError with a user-facing message if it can never run."""
        self._validate(request_id, prompt_token_ids, params)
        now = time.monotonic()
        completions = []
        for index in range(params.n):
            seq = Sequence(next(self._seq_ids), request_id, index, list(prompt_token_ids), len(prompt_token_ids), params, now)
            detok = IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params.stop)
            completions.append(_Completion(seq, detok, self._generator(params, index)))
            self.scheduler.add(seq)
        self.requests[request_id] = _Request(request_id, params, completions)

    def abort_request(self, request_id: str) -> None:
        request = self.requests.pop(request_id, None)
        if request is None:
            return
        for c in request.completions:
            if not c.seq.is_finished:
                c.seq.finish_reason = FinishReason.ABORT
                self.scheduler.finish(c.seq)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def step(self) -> list[RequestOutput]:
        scheduled = self.scheduler.schedule()
        if not scheduled:
            return []
        logits = self.runner.execute(scheduled)  # [num_sampling, vocab]
        sampling = [item for item in scheduled if item.samples]
        rows = [self._sampler_row(item.seq) for item in sampling]
        for item in scheduled:
            item.seq.num_computed_tokens += item.num_tokens
            self.blocks.commit_full_blocks(item.seq)
        if sampling:
            token_ids, logprobs = sample(logits, rows)
            for item, token_id, logprob in zip(sampling, token_ids, logprobs):
                self._append(item.seq, token_id, logprob)
        return self._collect_outputs()

    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_cache_usage=self.blocks.usage,
            num_free_blocks=self.blocks.num_free_blocks,
            num_total_blocks=self.blocks.num_blocks,
            num_preemptions=self.scheduler.num_preemptions,
            prefix_cache_hit_tokens=self.scheduler.prefix_cache_hit_tokens,
        )

    def _validate(self, request_id: str, prompt: list[int], params: SamplingParams) -> None:
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if not prompt:
            raise ValueError("the prompt is empty")
        vocab = self.runner.model.config.vocab_size
        if min(prompt) < 0 or max(prompt) >= vocab:
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        total = len(prompt) + params.max_tokens
        if total > self.max_model_len:
            raise ValueError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{total} tokens ({len(prompt)} in the prompt, {params.max_tokens} for the completion). "
                "Please reduce the length of the prompt or max_tokens."
            )
        if self.blocks.blocks_for(total) > self.blocks.num_blocks:
            raise ValueError(
                f"the request needs {self.blocks.blocks_for(total)} KV cache blocks but the pool has "
                f"{self.blocks.num_blocks}; reduce the prompt or max_tokens"
            )

    def _generator(self, params: SamplingParams, index: int) -> torch.Generator | None:
        if params.greedy:
            return None
        seed = params.seed + index if params.seed is not None else random.SystemRandom().randrange(2**63)
        return torch.Generator(device=self.device).manual_seed(seed)

    def _sampler_row(self, seq: Sequence) -> SamplerRow:
        completion = self.requests[seq.request_id].completions[seq.index]
        return SamplerRow(seq.params, seq.output_token_ids, completion.generator)

    def _append(self, seq: Sequence, token_id: int, logprob: TokenLogprob | None) -> None:
        completion = self.requests[seq.request_id].completions[seq.index]
        params = seq.params
        seq.token_ids.append(token_id)
        if logprob is not None:
            seq.logprobs.append(logprob)
        if seq.first_token_time is None:
            seq.first_token_time = time.monotonic()
        self._touched.add(seq.request_id)
        if token_id in params.stop_token_ids:
            self._finish(completion, FinishReason.STOP, token_id)
        elif token_id in self.tokenizer.eos_token_ids and not params.ignore_eos:
            self._finish(completion, FinishReason.STOP, None)
        else:
            completion.detok.append(token_id)
            if completion.detok.stop_reason is not None:
                self._finish(completion, FinishReason.STOP, completion.detok.stop_reason)
            elif seq.num_output_tokens >= params.max_tokens or len(seq) >= self.max_model_len:
                self._finish(completion, FinishReason.LENGTH, None)

    def _finish(self, completion: _Completion, reason: FinishReason, stop_reason: str | int | None) -> None:
        completion.seq.finish_reason = reason
        completion.stop_reason = stop_reason
        self.scheduler.finish(completion.seq)

    def _collect_outputs(self) -> list[RequestOutput]:
        outputs = []
        for request_id in self._touched:
            request = self.requests.get(request_id)
            if request is None:  # aborted since
                continue
            deltas = [d for c in request.completions if (d := self._delta(c)) is not None]
            finished = request.finished
            if finished:
                del self.requests[request_id]
            seqs = [c.seq for c in request.completions]
            outputs.append(
                RequestOutput(
                    request_id=request_id,
                    deltas=deltas,
                    num_prompt_tokens=seqs[0].num_prompt_tokens,
                    num_output_tokens=sum(s.num_output_tokens for s in seqs),
                    num_cached_tokens=seqs[0].num_cached_prefix_tokens,
                    finished=finished,
                )
            )
        self._touched.clear()
        return outputs

    def _delta(self, c: _Completion) -> CompletionDelta | None:
        seq = c.seq
        if c.reported:
            return None
        new_tokens = seq.output_token_ids[c.reported_tokens :]
        new_logprobs = seq.logprobs[c.reported_tokens :] if seq.params.logprobs is not None else []
        text = c.detok.take(final=seq.is_finished)
        if not new_tokens and not seq.is_finished:
            return None
        c.reported_tokens = seq.num_output_tokens
        c.reported = seq.is_finished
        return CompletionDelta(seq.index, new_tokens, text, new_logprobs, seq.finish_reason, c.stop_reason)
