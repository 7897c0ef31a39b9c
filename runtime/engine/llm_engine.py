"""The engine: add requests, then ``step()`` until they finish.

One step = schedule (room for drafts reserved) → propose (drafts for the scheduled decoding
sequences only) → build the inputs → score (one target forward over every scheduled token,
drafts included) → verify → accept (append, check stops) → let the proposer observe the forward's
hidden states → report deltas. Without a proposer the propose step is empty and verification of
zero drafts is plain sampling. Scoring and verifying run in an ``Execution`` (this process, or the
pipeline stages).

*Overlap scheduling* (``SchedulerConfig.overlap``): while step N runs, the engine schedules step
N+1's prompt chunks and admissions and builds their inputs (``Scheduler.schedule_ahead``),
keeping FastDeploy's ``next_real_bsz * token_num_one_step`` tokens of the budget for the decode
rows — per sequence deciding in step N, one token plus the drafts it may get (its own cap: load
control's K and the request's). When step N's verdicts arrive they are applied first; then the
decode rows of the sequences still running are scheduled (drafts proposed from the accepted
tokens) and built, so lengths and positions come from the verdicts, never from a guess. A
sequence that finished in step N gets no row in N+1 (its reservation is discarded), and nothing
more is emitted for it. ``events`` records the order (tests read it); with overlap off every
step is scheduled and built only after the previous one's verdicts.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import itertools
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from specdecode.runtime.config import EngineConfig, VerifyStrategy
from specdecode.runtime.engine import rng
from specdecode.runtime.engine.block_manager import BlockManager
from specdecode.runtime.engine.buckets import batch_buckets
from specdecode.runtime.engine.detokenizer import IncrementalDetokenizer
from specdecode.runtime.engine.load_control import LoadController
from specdecode.runtime.engine.execution import Execution, LocalExecution, StepResult
from specdecode.runtime.engine.grammar import GrammarCompiler
from specdecode.runtime.engine.model_runner import ModelRunner, StepLists, num_kv_blocks
from specdecode.runtime.engine.sampler import SamplerRow
from specdecode.runtime.engine.scheduler import ScheduledSeq, Scheduler
from specdecode.runtime.engine.sequence import (
    CompletionDelta,
    FinishReason,
    RequestOutput,
    SamplingParams,
    Sequence,
    SequenceStatus,
    SpecCounts,
    TokenLogprob,
)
from specdecode.runtime.engine.verifier import Verdict, Verifier
from specdecode.runtime.proposers import Proposer, build_proposer
from specdecode.runtime.proposers.drafting import Guides, guides_for
from specdecode.runtime.models.decoder import DecoderLM

if TYPE_CHECKING:
    from specdecode.runtime.parallel.step_channel import StepChannel
    from specdecode.runtime.tokenizer import Tokenizer


log = logging.getLogger(__name__)


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
    reported_tokens: int = 0
    reported: bool = False  # its finish has been reported
    stop_reason: str | int | None = None


def draft_cap(seq: Sequence, k: int, max_model_len: int) -> int:
    """Drafts worth scoring: never past max_tokens or the context (one slot stays for the bonus)."""
    p = seq.params
    if p.num_speculative_tokens is not None:
        k = min(k, p.num_speculative_tokens)
    return max(0, min(k, p.max_tokens - seq.num_output_tokens - 1, max_model_len - len(seq) - 1))


@dataclass
class _Plan:
    """A step ready to launch: its sequences, their inputs and the deciding items' sampler rows."""

    scheduled: list[ScheduledSeq]
    inputs: StepLists
    deciding: list[ScheduledSeq]  # the items whose step decides tokens (``samples`` turns False once they are appended)
    rows: list[SamplerRow]  # theirs


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
        channel: StepChannel | None = None,  # rank 0 of a tensor-parallel group: sends each step to the others
        proposer: Proposer | None = None,  # instead of the one ``cfg.speculative`` builds
        execution: Callable[[ModelRunner], Execution] | None = None,  # instead of this process (pipeline stages)
    ):
        block_size = cfg.cache.block_size
        num_blocks = num_kv_blocks(cfg.cache, model, dtype)
        self.tokenizer = tokenizer
        self.max_model_len = min(cfg.scheduler.max_model_len or max_model_len, model.config.max_position_embeddings)
        self.device = device
        self.blocks = BlockManager(num_blocks, block_size, cfg.cache.enable_prefix_caching)
        self.scheduler = Scheduler(cfg.scheduler, self.blocks)
        spec = cfg.speculative
        buckets, graph_width = self._graphs(cfg, device)
        self.runner = ModelRunner(model, num_blocks, block_size, device, dtype, channel, buckets, graph_width)
        if spec.enabled and spec.verify is VerifyStrategy.TOPP:
            log.warning("verify strategy 'topp' is LOSSY: sampled outputs do not follow the target distribution")
        self.proposer = proposer or build_proposer(
            spec, device, dtype=dtype, target_vocab_size=model.config.vocab_size, tokenizer=tokenizer,
            weight_cache_dir=cfg.load.weight_cache_dir, block_size=block_size, num_blocks=num_blocks,
            max_num_batched_tokens=cfg.scheduler.max_num_batched_tokens, target=model, target_source=cfg.load.model,
            buckets=buckets, cuda_graphs=cfg.graphs.cuda_graphs,
        )
        self.verifier = Verifier(spec.verify, spec.verify_top_p)
        self.grammars = GrammarCompiler(tokenizer, model.config.vocab_size)
        overlap = cfg.scheduler.overlap
        self.overlap = cfg.parallel.pipeline_parallel_size > 1 if overlap is None else overlap
        local = LocalExecution(self.runner, self.verifier, self.overlap, self.proposer) if execution is None else None
        self.execution = local or execution(self.runner)
        self.load_control = LoadController(spec.load_control, spec.max_drafts)
        self.speculative = spec
        self.events: deque[tuple[str, int]] = deque(maxlen=4096)  # (what, step number): the order of a step's phases
        self._step_number = 0
        self._next: _Plan | None = None  # step N+1, prepared while step N ran
        self.overlapped_host_s = 0.0  # host seconds spent on step N+1 while step N ran (what overlap hides)
        self.spec = SpecCounts()
        self.requests: dict[str, _Request] = {}
        self._seq_ids = itertools.count()
        self._touched: set[str] = set()

    def _graphs(self, cfg: EngineConfig, device: torch.device) -> tuple[list[int] | None, int | None]:
        """The runner's batch buckets and, with CUDA graphs, their block-table width: room for any
        position a padded row reaches (the context plus the most drafts)."""
        if cfg.graphs.cuda_graphs and device.type != "cuda":
            raise ValueError(f"cuda_graphs needs a CUDA device (the engine runs on {device})")
        buckets = batch_buckets(cfg.scheduler.max_num_seqs) if cfg.graphs.buckets else None
        reach = self.max_model_len + cfg.speculative.max_drafts + 1
        return buckets, -(-reach // cfg.cache.block_size) if cfg.graphs.cuda_graphs else None

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Queue a request; raises ValueError with a user-facing message if it can never run."""
        self._validate(request_id, prompt_token_ids, params)
        if params.structured is not None:
            self.grammars.compile(params.structured)  # a ValueError before any sequence exists
        now = time.monotonic()
        completions = []
        for index in range(params.n):
            seed = params.seed + index if params.seed is not None else rng.fresh_seed()
            seq = Sequence(
                next(self._seq_ids), request_id, index, list(prompt_token_ids), len(prompt_token_ids), params, now, seed
            )
            if params.structured is not None:
                seq.grammar = self.grammars.grammar(params.structured)
            detok = IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params.stop)
            completions.append(_Completion(seq, detok))
            self.scheduler.add(seq)
        self.requests[request_id] = _Request(request_id, params, completions)

    def abort_request(self, request_id: str) -> None:
        request = self.requests.pop(request_id, None)
        if request is None:
            return
        for c in request.completions:
            if not c.seq.is_finished:
                c.seq.finish_reason = FinishReason.ABORT
                self._release(c.seq)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def step(self) -> list[RequestOutput]:
        plan = self._launchable(self._next) or self._plan_now()
        self._next = None
        if plan is None:
            return []
        started = time.perf_counter()
        self._step_number += 1
        pending = self.execution.launch(plan.scheduled, plan.inputs, plan.rows)
        self._event("launched")
        try:  # a launched step's result is read, or abandoned: never left for the next read
            ahead = self._while_running(plan)
            result = pending()
        except BaseException as exc:
            raise self.execution.abandon(exc)
        self._event("verdicts read")
        self._apply(plan, result)
        if ahead is not None:
            self._next = self._complete(plan, *ahead)
        scored = sum(row.num_rows for row in plan.rows)
        self.load_control.observe_step(sum(item.num_tokens for item in plan.scheduled) - scored,
                                       time.perf_counter() - started)
        return self._collect_outputs()

    def shutdown(self) -> None:
        self.execution.close()

    def _event(self, what: str, step: int | None = None) -> None:
        self.events.append((what, self._step_number if step is None else step))

    def _plan_now(self) -> _Plan | None:
        """Schedule and build a step after the previous one's verdicts (overlap off, or nothing prepared)."""
        scheduled = self.scheduler.schedule(self._draft_caps(), self._propose)
        self._forget_preempted()
        return self._build(scheduled) if scheduled else None

    def _build(self, scheduled: list[ScheduledSeq], inputs: StepLists | None = None) -> _Plan:
        self._event("inputs built", self._step_number + 1)
        inputs = inputs or self.runner.prepare(scheduled)
        deciding = [item for item in scheduled if item.samples]
        if self.execution.draft_slots_ahead:
            for item in deciding:  # best effort: never preempts (the proposer drafts less where it gets none)
                self.blocks.grow(item.seq, item.start + item.num_tokens + self.execution.draft_slots_ahead)
        rows = [self._sampler_row(item) for item in deciding]
        self._mask_rows(deciding, rows)
        return _Plan(scheduled, inputs, deciding, rows)

    def _mask_rows(self, deciding: list[ScheduledSeq], rows: list[SamplerRow]) -> None:
        """Give the rows of constrained sequences their grammar masks (grammar.py), in one llguidance call."""
        constrained = [(item.seq.grammar, row) for item, row in zip(deciding, rows) if item.seq.grammar is not None]
        if not constrained:
            return
        jobs, first = [], 0
        for grammar, row in constrained:
            jobs.append((grammar, first, row.draft_token_ids))
            first += row.num_rows
        masks = self.grammars.fill_masks(jobs, first)  # [Σ rows, ceil(V/32)]
        for (_, row), (_, first, _) in zip(constrained, jobs):
            row.allowed = masks[first : first + row.num_rows]

    def _launchable(self, plan: _Plan | None) -> _Plan | None:
        """The prepared ``plan`` without the sequences that stopped running since (aborted; rebuilt then)."""
        if plan is None:
            return None
        kept = [item for item in plan.scheduled if item.seq.status is SequenceStatus.RUNNING]
        if len(kept) == len(plan.scheduled):
            return plan
        self._event("rebuilt: a sequence stopped running", self._step_number + 1)
        return self._build(kept) if kept else None

    def _while_running(self, plan: _Plan) -> tuple[list[ScheduledSeq], StepLists | None] | None:
        """Count the launched step's tokens as computed; with overlap, plan step N+1 ahead meanwhile."""
        for item in plan.scheduled:
            item.seq.num_computed_tokens += item.num_tokens - item.num_draft
        if not self.overlap:
            return None
        before = time.perf_counter()
        ahead = self._plan_ahead(plan)
        self.overlapped_host_s += time.perf_counter() - before
        return ahead

    def _plan_ahead(self, plan: _Plan) -> tuple[list[ScheduledSeq], StepLists | None]:
        """Step N+1's prompt chunks and admissions, built while step N runs (see the module docstring)."""
        ahead = self.scheduler.schedule_ahead(self._decode_reservation(plan.deciding))
        inputs = self.runner.prepare(ahead) if ahead else None
        self._event("inputs built ahead", self._step_number + 1)
        return ahead, inputs

    @property
    def proposes(self) -> bool:
        """A proposer of its own is configured, not only a grammar's forced tokens."""
        return self.speculative.enabled

    def _decode_reservation(self, deciding: list[ScheduledSeq]) -> int:
        """The budget step N+1's decode rows may take: one token per sequence deciding in step N plus
        the drafts it may get then (its cap now: it only shrinks as its verdict's tokens are appended)."""
        if self.proposer is None:
            return len(deciding)
        k = self.load_control.max_k(len(self.scheduler.running))
        return sum(1 + (draft_cap(item.seq, k, self.max_model_len) if self.proposer.drafts_for(item.seq) else 0)
                   for item in deciding)

    def _complete(self, plan: _Plan, ahead: list[ScheduledSeq], ahead_inputs: StepLists | None) -> _Plan | None:
        """Step N+1 once step N's verdicts are in: the decode rows of its deciding sequences that
        still run (drafts proposed now), before the rows built ahead."""
        decoding = []
        for item in plan.deciding:
            if item.seq.is_finished:
                self._event(f"discarded seq {item.seq.seq_id}", self._step_number + 1)
            else:
                decoding.append(item.seq)
        budget = self.scheduler.cfg.max_num_batched_tokens - sum(item.num_tokens for item in ahead)
        decode = self.scheduler.schedule_running(decoding, budget, self._draft_caps(), self._propose)
        if self.scheduler.preempted:
            self._event("preempted by a look-ahead decode row", self._step_number + 1)
        self._forget_preempted()
        kept = [item for item in ahead if item.seq in self.scheduler.running]
        scheduled = decode + kept
        if not scheduled:
            return None
        rebuilt = len(kept) < len(ahead)
        if rebuilt:
            self._event("rebuilt: a decode row preempted a sequence built ahead", self._step_number + 1)
        if rebuilt or ahead_inputs is None:
            return self._build(scheduled)
        return self._build(scheduled, self.runner.prepare(decode, pad=False).then(ahead_inputs) if decode else ahead_inputs)

    def _apply(self, plan: _Plan, result: StepResult) -> None:
        """Accept step N's verdicts, let the proposer observe, commit the full blocks."""
        self._take_prompt_logprobs(plan.scheduled, result.prompt_logprobs)
        for item, verdict in zip(plan.deciding, result.verdicts):
            self._accept(item, verdict)
        if self.proposer is not None and result.hidden is not None:
            self.proposer.observe(plan.scheduled, result.hidden)
        for item in plan.scheduled:
            if not item.seq.is_finished:
                self.blocks.commit_full_blocks(item.seq)

    @staticmethod
    def _take_prompt_logprobs(scheduled: list[ScheduledSeq], logprobs: list[TokenLogprob]) -> None:
        """Hand each item the prompt logprobs its rows scored; positions a sequence already has
        (it was preempted and recomputes its prompt) are not taken twice."""
        scored = iter(logprobs)
        for item in scheduled:
            for position, logprob in zip(item.prompt_logprob_positions, scored):
                if position == len(item.seq.prompt_logprobs):
                    item.seq.prompt_logprobs.append(logprob)

    def _draft_caps(self) -> dict[int, int]:
        """Drafts each decoding sequence may get this step (by seq_id), from load control and the
        request's own cap; the scheduler reserves room for them before the proposer is asked."""
        running = self.scheduler.running
        if self.proposer is None or not running:
            return {}
        decoding = [s for s in running if len(s) - s.num_computed_tokens == 1 and self.proposer.drafts_for(s)]
        if not decoding:  # prefill chunks only, or no sequence the proposer drafts for: no load-control decision
            return {}
        prefill = len(decoding) < len(running) or self.scheduler.admits_waiting()
        budget = self.load_control.budget(len(running), len(decoding), prefill)
        asked = self._explorers(decoding, budget.explorers) if budget.explorers else decoding
        return {s.seq_id: cap for s in asked if (cap := draft_cap(s, budget.k, self.max_model_len)) > 0}

    def _propose(self, scheduled: list[ScheduledSeq]) -> None:
        """Fill the drafts of the scheduled sequences that have room reserved for them."""
        asked = [item for item in scheduled if item.num_draft > 0]
        if not asked:
            return
        guides = self._guides(asked)
        proposal = self.proposer.propose([item.seq for item in asked], [item.num_draft for item in asked], guides)
        self.load_control.observe_proposal([item.num_draft for item in asked], [len(t) for t in proposal.token_ids])
        for i, (item, tokens) in enumerate(zip(asked, proposal.token_ids)):
            probs = None if proposal.probs is None else proposal.probs[i]
            # drafts relayed from a pipeline's last stage may be dense (their q stays there): never cut under rejection
            drawn = probs is not None or not self.proposer.follows_guides
            item.set_drafts(self._grammar_drafts(item.seq, tokens, drawn), probs)

    def _guides(self, asked: list[ScheduledSeq]) -> Guides | None:
        """Grammar-aware drafting (``grammar_drafts``): each constrained sequence's forced tokens, up
        to ``max_grammar_drafts`` and its draft cap, and its grammar for a model-based proposer."""
        if not self.speculative.grammar_drafts or not self.proposer.follows_guides:
            return None
        return guides_for(self.grammars, [item.seq for item in asked], [item.num_draft for item in asked],
                          self.speculative.max_grammar_drafts)

    def _grammar_drafts(self, seq: Sequence, tokens: list[int], drawn: bool) -> list[int]:
        """A constrained sequence scores its drafts only up to the first one its grammar forbids,
        where dropping that draft cannot change what is emitted (docs/runtime.md, "Grammar-aware
        drafting"): greedy requests (the argmax never reads q); under target_match (q never read);
        one-hot drafts (n-gram, suffix, forced: a rejected one-hot draft's residual is p itself, so
        the recovered token equals the bonus token drawn with the same uniform). A draft drawn from
        a dense q under rejection is kept: cutting it would draw from p where the residual is due,
        which biases the output. Drafts drawn under the grammar (a local draft model or MTP head)
        are never forbidden."""
        q_unread = self.speculative.verify in (VerifyStrategy.GREEDY, VerifyStrategy.TARGET_MATCH)
        if seq.grammar is None or not (seq.params.greedy or q_unread or not drawn):
            return tokens
        return tokens[: seq.grammar.valid_prefix(tokens)]

    def _forget_preempted(self) -> None:
        """Preempted sequences lost their KV: proposers that keep state in the target's slots recompute it."""
        for seq in self.scheduler.preempted:
            self.execution.preempted(seq)
            if self.proposer is not None:
                self.proposer.preempted(seq)

    def _explorers(self, decoding: list[Sequence], at_least: int) -> list[Sequence]:
        """Whom a step that explores asks for drafts: every sequence the proposer can draft for
        without catching up, or, if fewer, the ``at_least`` with the least catch-up — so exploring
        with a draft model never feeds it every sequence's prompt."""
        catch_up = [self.proposer.catch_up(s) for s in decoding]
        ready = [s for s, c in zip(decoding, catch_up) if c == 0]
        if len(ready) >= at_least:
            return ready
        return [decoding[i] for i in sorted(range(len(decoding)), key=catch_up.__getitem__)[:at_least]]

    def _accept(self, item: ScheduledSeq, verdict: Verdict) -> None:
        """Append the verdict's tokens; accepted drafts already have K/V, so they count as computed."""
        seq = item.seq
        if seq.params.max_tokens == 0:  # the prompt's logprobs were all it asked for
            self._touched.add(seq.request_id)
            self._finish(self.requests[seq.request_id].completions[seq.index], FinishReason.LENGTH, None)
            return
        seq.spec.record(item.num_draft, verdict.num_accepted)
        self.spec.record(item.num_draft, verdict.num_accepted)
        self.load_control.observe(item.num_draft, verdict.num_accepted)
        for j, token_id in enumerate(verdict.token_ids):
            if j > 0:
                seq.num_computed_tokens += 1  # the token before this one was an accepted draft
            self._append(seq, token_id, verdict.logprobs[j] if verdict.logprobs else None)
            if seq.is_finished:
                return

    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_cache_usage=self.blocks.usage,
            num_free_blocks=self.blocks.num_free_blocks,
            num_total_blocks=self.blocks.num_blocks,
            num_preemptions=self.scheduler.num_preemptions,
            prefix_cache_hit_tokens=self.scheduler.prefix_cache_hit_tokens,
            spec_decode_num_drafts=self.spec.num_drafts,
            spec_decode_num_draft_tokens=self.spec.num_draft_tokens,
            spec_decode_num_accepted_tokens=self.spec.num_accepted_tokens,
            spec_decode_num_accepted_tokens_per_pos=tuple(self.spec.accepted_per_position),
            spec_decode_enabled=self.proposes and self.load_control.enabled,
        )

    def _validate(self, request_id: str, prompt: list[int], params: SamplingParams) -> None:
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if not prompt:
            raise ValueError("the prompt is empty")
        vocab = self.runner.model.config.vocab_size
        if min(prompt) < 0 or max(prompt) >= vocab:
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        if any(not 0 <= token_id < vocab for token_id, _ in params.logit_bias):
            raise ValueError(f"logit_bias token ids must be in [0, {vocab})")
        if params.prompt_logprobs is not None and not self.execution.scores_prompt_logprobs:
            raise ValueError("prompt logprobs are not available with pipeline parallelism")
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

    @staticmethod
    def _sampler_row(item: ScheduledSeq) -> SamplerRow:
        seq = item.seq
        return SamplerRow(seq.params, seq.seed, len(seq), seq.output_token_ids, item.draft_token_ids, item.draft_probs)

    def _append(self, seq: Sequence, token_id: int, logprob) -> None:
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
        elif seq.grammar is not None and not seq.grammar.advance(token_id):
            log.error("request %s: the grammar refused emitted token %d (a mask was not applied)", seq.request_id, token_id)
            self._finish(completion, FinishReason.ABORT, None)
        else:
            completion.detok.append(token_id)
            if completion.detok.stop_reason is not None:
                self._finish(completion, FinishReason.STOP, completion.detok.stop_reason)
            elif seq.grammar is not None and seq.grammar.complete:
                self._finish(completion, FinishReason.STOP, None)
            elif seq.num_output_tokens >= params.max_tokens or len(seq) >= self.max_model_len:
                self._finish(completion, FinishReason.LENGTH, None)

    def _finish(self, completion: _Completion, reason: FinishReason, stop_reason: str | int | None) -> None:
        completion.seq.finish_reason = reason
        completion.stop_reason = stop_reason
        self._release(completion.seq)

    def _release(self, seq: Sequence) -> None:
        self.scheduler.finish(seq)
        self.execution.finished(seq)
        if self.proposer is not None:
            self.proposer.finished(seq)

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
            spec = SpecCounts()
            for seq in seqs:
                spec.record_counts(seq.spec)
            outputs.append(
                RequestOutput(
                    request_id=request_id,
                    deltas=deltas,
                    num_prompt_tokens=seqs[0].num_prompt_tokens,
                    num_output_tokens=sum(s.num_output_tokens for s in seqs),
                    num_cached_tokens=seqs[0].num_cached_prefix_tokens,
                    finished=finished,
                    spec=spec,
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
        first = c.reported_tokens == 0
        c.reported_tokens = seq.num_output_tokens
        c.reported = seq.is_finished
        prompt_logprobs = seq.prompt_logprobs if first and seq.params.prompt_logprobs is not None else None
        return CompletionDelta(seq.index, new_tokens, text, new_logprobs, seq.finish_reason, c.stop_reason,
                               prompt_logprobs)
