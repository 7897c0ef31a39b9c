"""Pipeline parallelism: stages hand hidden states on; the last stage verifies and answers rank 0.

Placement. Global rank 0 (first stage) schedules, proposes with n-gram or suffix, builds each
step's inputs and emits outputs; the *verifier rank* (the last stage's first rank) applies the
final norm and the LM head, samples, verifies, and holds the draft model or the MTP heads. Every
other rank only runs its stage's layers.

A step (``PipelineExecution.launch``):

1. rank 0 broadcasts the step's inputs to every rank (``StepChannel``: token ids, positions, KV
   slots, block tables, sequence lengths, query offsets — the same for every stage, so every
   stage writes the same slots);
2. rank 0 sends the verifier a ``TailPlan`` on the link group: what it must know of the step's
   sequences to sample them (new sequences' prompts and sampling parameters once, then per item
   its start, token count, drafts, block table and — for a constrained sequence — its rows' grammar
   masks, which only rank 0 can compute: the grammar states live with its sequences; sequences
   gone or preempted since);
3. stage s runs its layers on the hidden states stage s − 1 sent (rank (s, t) → (s+1, t)) and
   sends its own on; the first stage starts from the token ids. With an EAGLE-3 head on the
   verifier, the ranks of tensor rank 0 (the chain that ends at the verifier) send with them, in one
   message ``[T, (1 + a)·H]``, the a residual streams entering the head's aux layers that ran so far
   (``hands_on_aux``): each stage appends those entering its own layers to what it was handed, so the
   last stage has all of them in layer order; a stage before the first aux layer sends its hidden
   states alone, as without a head;
4. the verifier verifies and sends rank 0 one int32 tensor (``VerdictMessage``): per deciding
   sequence the emitted tokens ``[R, W]`` (W = most drafts + 1 ≤ K + 1, padded with −1), the
   accepted and emitted counts ``[2, R]``, and — with the draft model or a head on the verifier —
   the next step's drafts ``[R, K]`` (−1 padded). Logprobs follow on the link group only when a
   request asked for them.

Every message goes through a ``PipelineTransport`` (``transport.py``): gloo between processes, or
between stages in one process under the tests' engine fuzzer; nothing here knows which.

Rank 0 advances every sequence's computed-token count only from that message (``LLMEngine._accept``),
and the positions and slots of the next step are derived from it, then broadcast: no stage keeps
a count of its own, so none can drift after a rejection. The verifier keeps a mirror of each
sequence (tokens, count, block table) updated from the plans and its own verdicts; its proposer
runs on those. With grammar-aware drafting a constrained mirror holds its own copy of the grammar,
compiled from the request and advanced through the same verdicts, so the draft model or the heads
draft the forced tokens first and draw under the mask as they do in one process (the masks that
verification applies still come from rank 0).
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from specdecode.runtime.config import HEAD_METHODS, EngineConfig, ParallelConfig, SpeculativeMethod
from specdecode.runtime.engine.execution import Execution, Pending, StepResult
from specdecode.runtime.engine.grammar import GrammarCompiler
from specdecode.runtime.engine.llm_engine import draft_cap
from specdecode.runtime.engine.model_runner import ModelRunner, StepLists
from specdecode.runtime.engine.sampler import SamplerRow
from specdecode.runtime.engine.scheduler import ScheduledSeq
from specdecode.runtime.engine.sequence import SamplingParams, Sequence, SequenceStatus
from specdecode.runtime.engine.verifier import Verdict, Verifier
from specdecode.runtime.models.attention import AttentionBatch
from specdecode.runtime.models.decoder import DecoderLM
from specdecode.runtime.parallel.step_channel import TensorParallelBroken
from specdecode.runtime.parallel.transport import PipelineTransport
from specdecode.runtime.proposers import Proposal, Proposer, build_proposer
from specdecode.runtime.proposers.drafting import Guides, guides_for

PAD = -1


class StepTrace:
    """``ParallelConfig.trace_dir``: one JSON line per record in ``rank<N>.jsonl`` (nothing when off)."""

    def __init__(self, par: ParallelConfig, rank: int):
        self.path = None if par.trace_dir is None else Path(par.trace_dir) / f"rank{rank}.jsonl"
        self.rank, self.stage = rank, par.stage_of(rank)
        self.step = 0
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text("")

    def holds(self, runner: ModelRunner) -> None:
        """What this rank holds: its parameters and KV pools."""
        self._write(kind="holds", params=[name for name, _ in runner.model.named_parameters()],
                    kv_layers=len(runner.kv_pools), layers=list(runner.model.stage.layers(runner.model.config.num_layers)))

    def ran(self, batch: AttentionBatch, **extra) -> None:
        """A step this rank ran: the positions and KV slots of its rows."""
        self.step += 1
        if self.path is not None:
            self._write(kind="step", step=self.step, positions=batch.positions.tolist(),
                        slots=batch.slot_mapping.tolist(), **extra)

    def _write(self, **record) -> None:
        if self.path is not None:
            with self.path.open("a") as f:
                f.write(json.dumps({"rank": self.rank, "stage": self.stage, **record}) + "\n")


def proposes_on_verifier(method: SpeculativeMethod) -> bool:
    """Draft models, MTP and EAGLE-3 heads sit on the last stage (they read its states or need its
    LM head); n-gram and suffix run where the scheduler runs."""
    return method is SpeculativeMethod.DRAFT or method in HEAD_METHODS


def hands_on_aux(cfg: EngineConfig, rank: int) -> bool:
    """Whether global ``rank`` sends the EAGLE-3 head's aux states on with its hidden states: the first
    tensor rank of each stage, whose chain of sends ends at the verifier (the others' would be copies)."""
    return cfg.speculative.method is SpeculativeMethod.EAGLE3 and cfg.parallel.tp_rank_of(rank) == 0


def handed_on(hidden: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
    """What a stage sends the next: hidden [T, H] beside the aux states so far [T, a·H] → [T, (1 + a)·H]
    (the hidden states themselves when a = 0)."""
    return torch.cat([hidden, aux], dim=-1) if aux.shape[-1] else hidden


# -- what rank 0 tells the verifier -----------------------------------------------------------


@dataclass(frozen=True)
class SeqIntro:
    """A sequence the verifier has not seen: sent once."""

    seq_id: int
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    seed: int


@dataclass(frozen=True)
class ItemPlan:
    """One scheduled item, as ``ScheduledSeq`` has it."""

    seq_id: int
    start: int
    num_tokens: int
    draft_token_ids: list[int]
    block_table: list[int]
    allowed: torch.Tensor | None = None  # [drafts + 1, ceil(V/32)] int32 grammar masks of a deciding item


@dataclass
class TailPlan:
    new: list[SeqIntro] = field(default_factory=list)
    gone: list[int] = field(default_factory=list)  # finished or aborted since the last step
    preempted: list[int] = field(default_factory=list)
    items: list[ItemPlan] = field(default_factory=list)


# -- what the verifier answers ----------------------------------------------------------------


@dataclass
class VerdictMessage:
    """The verifier's answer as one int32 tensor: tokens [R, W], counts [2, R], drafts [R, K]."""

    tokens: list[list[int]]  # per deciding item: the emitted tokens
    num_accepted: list[int]
    drafts: list[list[int]]  # per deciding item: the next step's drafts ([] each when K = 0)

    @staticmethod
    def numel(num_rows: int, width: int, num_drafts: int) -> int:
        return num_rows * (width + 2 + num_drafts)

    def encode(self, width: int, num_drafts: int, device: torch.device) -> torch.Tensor:
        r = len(self.tokens)
        out = torch.full((r, width + 2 + num_drafts), PAD, dtype=torch.int32)
        for i, (tokens, accepted, drafts) in enumerate(zip(self.tokens, self.num_accepted, self.drafts)):
            out[i, : len(tokens)] = torch.tensor(tokens, dtype=torch.int32)
            out[i, width] = accepted
            out[i, width + 1] = len(tokens)
            if drafts:
                out[i, width + 2 : width + 2 + len(drafts)] = torch.tensor(drafts, dtype=torch.int32)
        # columns regrouped so the wire layout is tokens [R, W], then counts [2, R], then drafts [R, K]
        flat = torch.cat([out[:, :width].reshape(-1), out[:, width : width + 2].t().reshape(-1),
                          out[:, width + 2 :].reshape(-1)])
        return flat.to(device)

    @classmethod
    def decode(cls, flat: torch.Tensor, num_rows: int, width: int, num_drafts: int) -> VerdictMessage:
        flat = flat.cpu()
        tokens, counts, drafts = flat.split([num_rows * width, 2 * num_rows, num_rows * num_drafts])
        tokens, counts = tokens.view(num_rows, width).tolist(), counts.view(2, num_rows).tolist()
        draft_rows = drafts.view(num_rows, num_drafts).tolist()
        return cls([row[:n] for row, n in zip(tokens, counts[1])], counts[0],
                   [[t for t in row if t != PAD] for row in draft_rows])


# -- rank 0 -------------------------------------------------------------------------------------


class RelayedDrafts(Proposer):
    """Rank 0's face of a proposer on the verifier: the drafts that came with the last verdicts,
    valid for the sequence length they were made for."""

    # rank 0 builds no guides for them: the verifier drafts under mirrors of the grammars itself
    # (PipelineTail), or, with grammar_drafts off, not at all and rank 0 cuts them where that is safe
    follows_guides = False

    def __init__(self) -> None:
        self.drafts: dict[int, tuple[int, list[int]]] = {}  # seq_id → (len(seq) they follow, drafts)

    def keep(self, seq_id: int, length: int, drafts: list[int]) -> None:
        """``drafts`` for sequence ``seq_id`` once it has ``length`` tokens."""
        self.drafts[seq_id] = (length, drafts)

    def propose(self, seqs: list[Sequence], max_drafts: list[int], guides: Guides | None = None) -> Proposal:
        return Proposal([self._ready(seq)[:k] for seq, k in zip(seqs, max_drafts)])

    def catch_up(self, seq: Sequence) -> int:
        return 0 if self._ready(seq) else 1  # no drafts for its length: it would have to wait a step

    def _ready(self, seq: Sequence) -> list[int]:
        length, drafts = self.drafts.get(seq.seq_id, (-1, []))
        return drafts if length == len(seq) else []

    def preempted(self, seq: Sequence) -> None:
        self.drafts.pop(seq.seq_id, None)

    def finished(self, seq: Sequence) -> None:
        self.drafts.pop(seq.seq_id, None)


@dataclass
class PipelineStats:
    """What the pipeline cost so far (rank 0's view)."""

    steps: int = 0
    verdict_bytes: int = 0  # the verdict messages' payload
    verdict_budget_bytes: int = 0  # Σ R·(K+1) tokens + 2R counts (+ R·K drafts), 4 bytes each
    first_stage_s: float = 0.0  # rank 0's own stage forward (and sending its inputs)
    waiting_s: float = 0.0  # from handing the hidden states on to the verdicts' arrival


class PipelineExecution(Execution):
    """Rank 0's side of a pipeline: launch = inputs to every stage, the plan to the verifier, this
    stage's forward, the hidden states on; the pending result = the verifier's message."""

    def __init__(self, runner: ModelRunner, transport: PipelineTransport, par: ParallelConfig,
                 num_speculative_tokens: int, relayed: RelayedDrafts | None, draft_slots_ahead: int = 0,
                 aux_layers: tuple[int, ...] = ()):
        """``aux_layers``: the verifier's head's (``hands_on_aux``), whose entering streams this stage sends on."""
        self.runner = runner
        runner.aux_layers = aux_layers
        self.draft_slots_ahead = draft_slots_ahead
        self.transport = transport
        self.par = par
        self.k = num_speculative_tokens
        self.relayed = relayed
        self.stats = PipelineStats()
        self.trace = StepTrace(par, 0)
        self.trace.holds(runner)
        self._known: set[int] = set()  # sequences the verifier has been introduced to
        self._gone: list[int] = []
        self._preempted: dict[int, None] = {}  # ordered set: preempted since the last launch, still known

    def preempted(self, seq: Sequence) -> None:
        if seq.seq_id in self._known:
            self._preempted[seq.seq_id] = None

    def finished(self, seq: Sequence) -> None:
        """A sequence gone since the last launch is only gone: the verifier drops its mirror, so it
        must not also hear that it was preempted (preempted, then finished or aborted before the next
        launch)."""
        if seq.seq_id in self._known:
            self._known.discard(seq.seq_id)
            self._preempted.pop(seq.seq_id, None)
            self._gone.append(seq.seq_id)

    def abandon(self, exc: BaseException) -> BaseException:
        """Anything that failed between the launch and the verdicts' arrival — the wait itself, or the
        host work meanwhile — leaves the stages out of step for good: an unread answer would be the
        next step's (an interrupt stays one)."""
        self.transport.broken = True
        if isinstance(exc, TensorParallelBroken) or not isinstance(exc, Exception):
            return exc
        broken = TensorParallelBroken(f"pipeline step failed before its verdicts were read: {exc}")
        broken.__cause__ = exc
        return broken

    def launch(self, scheduled: list[ScheduledSeq], lists: StepLists, rows: list[SamplerRow]) -> Pending:
        step = lists.upload(self.runner.device)  # the verifier's inputs go to the last stage in the plan
        plan = self._plan(scheduled, rows)
        deciding = [item for item in scheduled if item.samples]
        width = max((item.num_draft for item in deciding), default=0) + 1
        num_drafts = self.k if self.relayed is not None else 0
        wants_logprobs = any(row.params.logprobs is not None for row in rows)
        started = time.perf_counter()
        self.transport.run_step(step.input_ids, step.batch, lambda ids, batch: self._first_stage(plan, ids, batch))
        self._sent(plan)
        handed_on = time.perf_counter()
        self.stats.first_stage_s += handed_on - started

        def verdicts() -> StepResult:
            numel = VerdictMessage.numel(len(deciding), width, num_drafts)
            flat = self.transport.receive_verdict(numel, self.runner.device)  # a failure here: ``abandon``
            logprobs = self.transport.receive_logprobs() if wants_logprobs else None
            message = VerdictMessage.decode(flat, len(deciding), width, num_drafts)
            self._count(numel, len(deciding), handed_on)
            self.trace.ran(step.batch, items=[[i.seq_id, i.start, i.num_tokens, len(i.draft_token_ids)] for i in plan.items],
                           verdicts=[[item.seq.seq_id, a, len(t)] for item, a, t in
                                     zip(deciding, message.num_accepted, message.tokens)])
            return StepResult(self._verdicts(deciding, message, logprobs), None)

        return verdicts

    def _first_stage(self, plan: TailPlan, input_ids: torch.Tensor, batch: AttentionBatch) -> torch.Tensor:
        self.transport.send_plan(plan)
        hidden, aux = self.runner.forward_aux(input_ids, batch)
        self.transport.send_hidden(handed_on(hidden, aux), self.par.tensor_parallel_size)
        return hidden

    def _plan(self, scheduled: list[ScheduledSeq], rows: list[SamplerRow]) -> TailPlan:
        """The step's plan; what the verifier knows changes only once it is sent (``_sent``)."""
        plan = TailPlan(gone=list(self._gone), preempted=list(self._preempted))
        masks = iter(row.allowed for row in rows)  # rows: the deciding items', in order
        for item in scheduled:
            seq = item.seq
            if seq.seq_id not in self._known:
                plan.new.append(SeqIntro(seq.seq_id, list(seq.token_ids), seq.num_prompt_tokens, seq.params, seq.seed))
            plan.items.append(ItemPlan(seq.seq_id, item.start, item.num_tokens, list(item.draft_token_ids),
                                       list(seq.block_table), next(masks) if item.samples else None))
        return plan

    def _sent(self, plan: TailPlan) -> None:
        self._known.update(intro.seq_id for intro in plan.new)
        self._gone, self._preempted = [], {}

    def _verdicts(self, deciding: list[ScheduledSeq], message: VerdictMessage, logprobs: list | None) -> list[Verdict]:
        out = []
        for i, item in enumerate(deciding):
            out.append(Verdict(message.tokens[i], message.num_accepted[i], logprobs[i] if logprobs else []))
            if self.relayed is not None:
                # the drafts follow the sequence once all its emitted tokens are appended
                self.relayed.keep(item.seq.seq_id, len(item.seq) + len(message.tokens[i]), message.drafts[i])
        return out

    def _count(self, numel: int, num_rows: int, handed_on: float) -> None:
        s = self.stats
        s.steps += 1
        s.verdict_bytes += 4 * numel
        s.verdict_budget_bytes += 4 * num_rows * (self.k + 1 + 2 + (self.k if self.relayed is not None else 0))
        s.waiting_s += time.perf_counter() - handed_on


# -- every other rank ---------------------------------------------------------------------------


class StageWorker:
    """A rank of any stage but rank 0: runs its layers on what the previous stage sent, sends the
    result on; on the verifier rank, ``tail`` verifies."""

    def __init__(self, runner: ModelRunner, par: ParallelConfig, rank: int, tail: PipelineTail | None,
                 transport: PipelineTransport):
        self.runner = runner
        self.transport = transport
        self.stage = runner.model.stage
        self.rank = rank
        self.tp = par.tensor_parallel_size
        self.tail = tail
        self.trace = StepTrace(par, rank)
        self.trace.holds(runner)

    @torch.inference_mode()
    def run(self, input_ids: torch.Tensor, batch: AttentionBatch) -> None:
        plan = self.tail.receive_plan() if self.tail is not None else None
        if self.stage.is_first:
            inputs, handed = input_ids, None
        else:
            inputs, handed = self._receive(input_ids.numel())
        hidden, aux = self.runner.forward_aux(inputs, batch)  # aux: [T, A·H] of this stage's aux layers
        if handed is not None:
            aux = torch.cat([handed, aux], dim=-1)
        if not self.stage.is_last:
            self.transport.send_hidden(handed_on(hidden, aux), self.rank + self.tp)
        elif self.tail is not None:
            self.tail.verify(plan, hidden, aux)
        self.trace.ran(batch)

    def _receive(self, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The previous stage's hidden states [T, H] and the a aux states it handed on [T, a·H]."""
        size = self.runner.model.config.hidden_size
        a = self.stage.aux_handed_in(self.runner.aux_layers, self.runner.model.config.num_layers)
        states = self.transport.receive_hidden(
            torch.empty(num_tokens, (1 + a) * size, dtype=self.runner.dtype, device=self.runner.device),
            self.rank - self.tp)
        hidden, handed = states.split([size, a * size], dim=-1)
        return hidden.contiguous(), handed


class PipelineTail:
    """The verifier rank's sampling, verification and proposer, over mirrors of rank 0's sequences."""

    def __init__(self, model: DecoderLM, tokenizer, cfg: EngineConfig, transport: PipelineTransport,
                 device: torch.device, dtype: torch.dtype, max_model_len: int, num_blocks: int):
        spec = cfg.speculative
        self.model = model
        self.transport = transport
        self.device = device
        self.max_model_len = max_model_len
        self.k = spec.num_speculative_tokens
        self.verifier = Verifier(spec.verify, spec.verify_top_p)
        self.proposer = None
        if proposes_on_verifier(spec.method):
            self.proposer = build_proposer(
                spec, device, dtype=dtype, target_vocab_size=model.config.vocab_size, tokenizer=tokenizer,
                weight_cache_dir=cfg.load.weight_cache_dir, block_size=cfg.cache.block_size, num_blocks=num_blocks,
                max_num_batched_tokens=cfg.scheduler.max_num_batched_tokens, target=model, target_source=cfg.load.model)
        # grammar-aware drafting on this rank: mirrors of the constrained sequences' grammars
        self.grammars = GrammarCompiler(tokenizer, model.config.vocab_size) \
            if self.proposer is not None and spec.grammar_drafts else None
        self.max_forced = spec.max_grammar_drafts
        self.seqs: dict[int, Sequence] = {}
        self.draft_probs: dict[int, torch.Tensor] = {}  # seq_id → the distributions its relayed drafts came from

    @property
    def aux_layers(self) -> tuple[int, ...]:
        """The layers whose entering residual streams the proposer drafts from (an EAGLE-3 head's)."""
        return self.proposer.aux_layer_ids if self.proposer is not None else ()

    def receive_plan(self) -> TailPlan:
        return self.transport.receive_plan()

    def verify(self, plan: TailPlan, hidden: torch.Tensor, aux: torch.Tensor) -> None:
        """hidden [T, H] pre-norm, the last stage's; aux [T, A·H] the streams entering ``aux_layers``."""
        scheduled = self._mirror(plan)
        deciding = [item for item in scheduled if item.samples]
        masks = [it.allowed for it, item in zip(plan.items, scheduled) if item.samples]
        sample_rows, first = [], 0
        for item in scheduled:
            first += item.num_tokens
            if item.samples:
                sample_rows += range(first - item.num_draft - 1, first)
        rows = [SamplerRow(s.seq.params, s.seq.seed, len(s.seq), s.seq.output_token_ids, s.draft_token_ids,
                           s.draft_probs, allowed) for s, allowed in zip(deciding, masks)]
        logits = self.model.compute_logits(hidden[torch.tensor(sample_rows, dtype=torch.long, device=hidden.device)])
        verdicts = self.verifier(logits, rows) if rows else []
        for item in scheduled:
            item.seq.num_computed_tokens += item.num_tokens - item.num_draft
        for item, verdict in zip(deciding, verdicts):
            item.seq.token_ids += verdict.token_ids
            item.seq.num_computed_tokens += verdict.num_accepted
            self._advance_grammar(item.seq, verdict.token_ids)
        drafts = self._next_drafts(scheduled, aux if self.aux_layers else hidden, [item.seq for item in deciding])
        message = VerdictMessage([v.token_ids for v in verdicts], [v.num_accepted for v in verdicts], drafts)
        width = max((item.num_draft for item in deciding), default=0) + 1
        self.transport.send_verdict(message.encode(width, self.k if self.proposer is not None else 0, self.device))
        if any(row.params.logprobs is not None for row in rows):
            self.transport.send_logprobs([v.logprobs for v in verdicts])

    def _mirror(self, plan: TailPlan) -> list[ScheduledSeq]:
        """Apply rank 0's plan to the mirrors; the step's items as ``ScheduledSeq`` over them."""
        for intro in plan.new:
            seq = Sequence(intro.seq_id, "", 0, list(intro.token_ids), intro.num_prompt_tokens, intro.params, 0.0,
                           intro.seed, status=SequenceStatus.RUNNING)
            if self.grammars is not None and intro.params.structured is not None:
                seq.grammar = self.grammars.grammar(intro.params.structured)
                self._advance_grammar(seq, seq.output_token_ids)
            self.seqs[intro.seq_id] = seq
        for seq_id in plan.gone:
            seq = self.seqs.pop(seq_id)
            self.draft_probs.pop(seq_id, None)
            if self.proposer is not None:
                self.proposer.finished(seq)
        for seq_id in plan.preempted:
            self.draft_probs.pop(seq_id, None)
            if self.proposer is not None:
                self.proposer.preempted(self.seqs[seq_id])
        scheduled = []
        for it in plan.items:
            seq = self.seqs[it.seq_id]
            seq.num_computed_tokens, seq.block_table = it.start, it.block_table
            num_draft = len(it.draft_token_ids)
            item = ScheduledSeq(seq, it.num_tokens, num_draft)
            probs = self.draft_probs.pop(it.seq_id, None)
            item.draft_token_ids = it.draft_token_ids
            item.draft_probs = None if probs is None or not num_draft else probs[:num_draft]
            scheduled.append(item)
        return scheduled

    @staticmethod
    def _advance_grammar(seq: Sequence, tokens: list[int]) -> None:
        """Keep a mirror's grammar where rank 0's is, through the tokens it emitted. A token the
        grammar refuses (a stop token or EOS past the end) finishes the sequence on rank 0: until
        the plan says it is gone, the mirror drafts for it without a grammar, and rank 0 drops them."""
        for token in tokens:
            if seq.grammar is None:
                return
            if not seq.grammar.advance(token):
                seq.grammar = None

    def _next_drafts(self, scheduled: list[ScheduledSeq], observed: torch.Tensor,
                     deciding: list[Sequence]) -> list[list[int]]:
        """The proposer's drafts for the step after this one, for every sequence that decided;
        ``observed``: what it follows the target by (``Proposer.observe``)."""
        if self.proposer is None:
            return [[] for _ in deciding]
        self.proposer.observe(scheduled, observed)
        caps = [draft_cap(seq, self.k, self.max_model_len) for seq in deciding]
        asked = [i for i, cap in enumerate(caps) if cap > 0]
        drafts: list[list[int]] = [[] for _ in deciding]
        if asked:
            seqs, seq_caps = [deciding[i] for i in asked], [caps[i] for i in asked]
            guides = guides_for(self.grammars, seqs, seq_caps, self.max_forced) if self.grammars is not None else None
            proposal = self.proposer.propose(seqs, seq_caps, guides)
            for j, i in enumerate(asked):
                drafts[i] = proposal.token_ids[j]
                if proposal.probs is not None:
                    self.draft_probs[deciding[i].seq_id] = proposal.probs[j, : len(drafts[i])]
        return drafts
