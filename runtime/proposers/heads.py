"""Drafting heads that follow the target's own states: the machinery MTP heads (``proposers/mtp.py``)
and EAGLE-3 heads (``proposers/eagle3.py``) share.

No extra target pass: after each step the engine hands the forward's states (the hidden states, or
an EAGLE-3 head's aux states) to ``observe``, which runs every head module over the slots that
became final in that step (prompt chunks included, so a new sequence drafts as soon as its prompt
is in). A head's K/V lives in its own pools under the target's block tables (slots and formulas in
``models/mtp.py`` and ``models/eagle3.py``), so it is prefix-cached, rolled back by position and
recomputed after preemption with the target's.

Per sequence the proposer keeps a *state*: ``count``, the slots final in every module, and
``carry``, the input states in_ℓ(count) of the next slot, one per module. The input of the first
slot after a full block is also kept per block (``block_carry``), so a sequence admitted on a cached
prefix starts from it.

``propose`` for a sequence of n tokens: every module runs slot n − 1 (x_{n-1} is known; the carry
is its input), module 0's output drafts token 1, then draft j + 1 comes from module j mod L at slot
n − 1 + j, fed draft j and the previous draft step's output (``_chain_input``); a chained module
never attends a chain slot where another module ran. Per decoding sequence and step a head runs
1 + (K − 1) rows there and, in ``observe``, one row per accepted draft (chained slots are recomputed
from the target's states once verified): at most 2K rows.

Draft choice (``choose_guided_drafts``): argmax for greedy requests, sampled from the head's
distribution under the request's temperature / top-k / top-p otherwise, with those exact
distributions returned for rejection sampling; a constrained sequence's forced tokens are taken as
chain tokens and the rest drawn under its grammar (drafting.py). A head drafting over a reduced
vocabulary (``vocab_ids``: its N rows' target ids) never drafts a token outside it, and q is zero
there, so q stays exact.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specdecode.runtime.engine.buckets import bucket_for
from specdecode.runtime.engine.model_runner import Span, attention_lists
from specdecode.runtime.engine.scheduler import ScheduledSeq
from specdecode.runtime.engine.sequence import Sequence
from specdecode.runtime.engine.transfer import upload
from specdecode.runtime.models.attention import AttentionBatch
from specdecode.runtime.models.decoder import DecoderLM
from specdecode.runtime.proposers import Proposal, Proposer
from specdecode.runtime.proposers.drafting import Guides, choose_guided_drafts, draft_probs


@dataclass
class _State:
    count: int  # slots < count are final in every module's pool
    carry: torch.Tensor  # [L, H]: in_ℓ(count) per module
    carry_ready: bool = True  # False right after drafting: in_0(count) comes with the step's forward


@dataclass
class _CatchUp:
    """Slots [start, end) of one sequence to run through every module as final slots."""

    seq: Sequence
    state: _State
    start: int
    end: int
    source_rows: list[int]  # rows of the observed states giving in_0(q) for q in (start, end)
    next_source_row: int | None  # the row giving in_0(end); None while drafting (not computed yet)


class HeadProposer(Proposer):
    """A head of ``num_modules`` modules over ``hidden_size`` states; subclasses say how its modules
    run (``_module``), what they draft from (``_source``, ``_embed``, ``_chain_input``) and over which
    rows of which LM head (``_draft_logits``, ``vocab_ids``)."""

    def __init__(self, target: DecoderLM, num_modules: int, hidden_size: int, num_blocks: int, block_size: int,
                 vocab_ids: torch.Tensor | None):
        weight = target.model.embed_tokens.weight
        self.target = target
        self.block_size = block_size
        self.device, self.dtype = weight.device, weight.dtype
        self.null_block = num_blocks
        self.num_modules = num_modules
        self.block_carry = torch.zeros(num_blocks, num_modules, hidden_size, dtype=self.dtype, device=self.device)
        self.states: dict[int, _State] = {}
        self.vocab_ids = vocab_ids  # [N] target ids of the draft rows; None: the whole vocabulary
        # the target's batch buckets, set where the proposer is built: drafting steps (one row a
        # sequence) are padded to them as the target's decode steps are (``_batch``)
        self.buckets: list[int] | None = None

    # -- what a head is -----------------------------------------------------------------------------

    def _source(self, observed: torch.Tensor) -> torch.Tensor:
        """The states ``observe`` gets [T, ·] → module 0's inputs [T, H]."""
        raise NotImplementedError

    def _embed(self, token_ids: torch.Tensor) -> torch.Tensor:  # [T] → [T, H]
        raise NotImplementedError

    def _module(self, m: int, inputs: torch.Tensor, embeds: torch.Tensor, batch: AttentionBatch) -> torch.Tensor:
        """Module m over inputs, embeds [T, H] at ``batch``'s slots (its K/V written) → out [T, H]."""
        raise NotImplementedError

    def _chain_input(self, out: torch.Tensor) -> torch.Tensor:
        """A chain step's input from the previous draft step's output [B, H] (that output, by default)."""
        return out

    def _draft_logits(self, m: int, out: torch.Tensor) -> torch.Tensor:  # out [B, H] → [B, N] fp32
        raise NotImplementedError

    # -- drafting -----------------------------------------------------------------------------------

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], max_drafts: list[int], guides: Guides | None = None) -> Proposal:
        # draft j is written at slot n − 1 + j: no further than the block table reaches (the scheduler
        # reserves that; a pipeline's last stage drafts a step ahead, into the slots rank 0 could spare)
        max_drafts = [min(k, len(s.block_table) * self.block_size - len(s) + 1) for s, k in zip(seqs, max_drafts)]
        rows = [i for i, s in enumerate(seqs) if self._can_draft(s) and max_drafts[i] > 0]
        drafts = [guides.forced(i)[:k] if guides is not None and i not in rows else [] for i, k in enumerate(max_drafts)]
        if not rows:
            return Proposal(drafts)
        want_probs = any(not seqs[i].params.greedy for i in rows)
        q_rows: dict[tuple[int, int], torch.Tensor] = {}
        jobs = [_CatchUp(seqs[i], self.states[seqs[i].seq_id], len(seqs[i]) - 1, len(seqs[i]), [], None) for i in rows]
        out = self._run(jobs, self.block_carry.new_empty(0, self.block_carry.shape[2]))[0]  # [B, H]: module 0, slot n − 1
        vocab = self.target.config.vocab_size
        for j in range(max(max_drafts[i] for i in rows)):
            if j > 0:
                alive = [r for r, i in enumerate(rows) if max_drafts[i] > j]
                if not alive:
                    break
                rows = [rows[r] for r in alive]
                out = self._chain(j, [seqs[i] for i in rows], out[alive], [drafts[i][-1] for i in rows])
            logits = self._draft_logits(j % self.num_modules, out)
            tokens, q = choose_guided_drafts(logits, seqs, rows, j, want_probs, guides, vocab, self.vocab_ids)
            for r, (i, token) in enumerate(zip(rows, tokens)):
                if token is None:
                    max_drafts[i] = j
                    continue
                drafts[i].append(token)
                if q is not None:
                    q_rows[i, j] = q[r]
        return Proposal(drafts, draft_probs(drafts, q_rows, vocab, self.device) if want_probs else None)

    def _can_draft(self, seq: Sequence) -> bool:
        state = self.states.get(seq.seq_id)
        return state is not None and state.carry_ready and state.count == seq.num_computed_tokens == len(seq) - 1

    def _chain(self, j: int, seqs: list[Sequence], prev: torch.Tensor, tokens: list[int]) -> torch.Tensor:
        """Draft step j ≥ 1: module m = j mod L at slot n − 1 + j, fed ``_chain_input`` of the previous
        step's output prev [B, H] and draft j; it does not see chain slots where another module ran."""
        m = j % self.num_modules
        others = [i for i in range(1, j) if i % self.num_modules != m]
        spans = [Span(s.block_table, len(s) - 1 + j, 1, tuple(len(s) - 1 + i for i in others)) for s in seqs]
        batch, tokens = self._batch(spans, tokens)
        return self._padded_module(m, self._chain_input(prev), self._embed(tokens), batch)  # [B, H]

    # -- following the target -----------------------------------------------------------------------

    @torch.inference_mode()
    def observe(self, scheduled: list[ScheduledSeq], hidden: torch.Tensor) -> None:
        source = self._source(hidden)  # [T, H]: module 0's inputs, row r giving in_0 of the slot after r's
        jobs: list[_CatchUp] = []
        first = 0  # the item's first row in ``hidden``: its position ``start``
        for item in scheduled:
            seq, start, row = item.seq, item.start, first
            first += item.num_tokens
            if seq.is_finished:
                continue
            state = self.states.get(seq.seq_id)
            if state is None or not start <= state.count <= start + 1:
                state = self._fresh_state(seq, start)
            if not state.carry_ready:  # it drafted this step: slot ``start`` is final, row 0 gives in_0(start + 1)
                state.carry[0] = source[row]
                state.carry_ready = True
                self._keep_block_carry(seq, state.count, state.carry)
            end = seq.num_computed_tokens
            if state.count < end:
                source_rows = [row + q - 1 - start for q in range(state.count + 1, end)]
                jobs.append(_CatchUp(seq, state, state.count, end, source_rows, row + end - 1 - start))
        if jobs:
            self._run(jobs, source)

    def _fresh_state(self, seq: Sequence, start: int) -> _State:
        """A sequence new to the proposer (or back from preemption) starting at ``start``: 0, or the
        end of a cached prefix, whose first slot's inputs were kept with the prefix's last block."""
        if start % self.block_size:
            raise RuntimeError(f"sequence {seq.seq_id} starts at {start}, not at the end of a cached block")
        if start == 0:
            carry = self.block_carry.new_zeros(self.block_carry.shape[1:])
        else:
            carry = self.block_carry[seq.block_table[start // self.block_size - 1]].clone()
        state = _State(start, carry)
        self.states[seq.seq_id] = state
        return state

    def _run(self, jobs: list[_CatchUp], source: torch.Tensor) -> list[torch.Tensor]:
        """Run every job's slots through every module (final K/V), advance its state to ``end``, and
        return each module's output at each job's last slot: L tensors [len(jobs), H].

        Module 0's input at slot q is the carry at q = start, else source[source_rows]; module m ≥ 1's
        is the carry at q = start, else module m − 1's output at q − 1."""
        spans = [Span(job.seq.block_table, job.start, job.end - job.start) for job in jobs]
        tokens = [t for job in jobs for t in job.seq.token_ids[job.start : job.end]]
        batch, token_ids = self._batch(spans, tokens)
        embeds = self._embed(token_ids)  # [T_pad, H]
        carries = torch.stack([job.state.carry for job in jobs])  # [J, L, H]
        firsts = [0]
        for job in jobs:
            firsts.append(firsts[-1] + job.end - job.start)
        to = dict(dtype=torch.long, device=self.device)
        lasts = torch.tensor([f - 1 for f in firsts[1:]], **to)
        source_index = torch.tensor([i for n, job in enumerate(jobs) for i in [len(source) + n, *job.source_rows]], **to)
        shift_index = torch.tensor([i for n, job in enumerate(jobs)
                                    for i in [len(tokens) + n, *range(firsts[n], firsts[n + 1] - 1)]], **to)
        inputs, outs = [], []
        for m in range(self.num_modules):
            prior = torch.cat([source, carries[:, 0]]) if m == 0 else torch.cat([outs[-1], carries[:, m]])
            inputs.append(prior.index_select(0, source_index if m == 0 else shift_index))  # [T', H] in_m
            outs.append(self._padded_module(m, inputs[-1], embeds, batch))  # [T', H] out_m
        ends = [out.index_select(0, lasts) for out in outs]  # [J, H] per module
        inputs_by_slot = torch.stack(inputs, dim=1)  # [T', L, H]
        for n, job in enumerate(jobs):
            first_boundary = (job.start // self.block_size + 1) * self.block_size
            for q in range(first_boundary, job.end, self.block_size):  # full blocks inside the job's slots
                self._keep_block_carry(job.seq, q, inputs_by_slot[firsts[n] + q - job.start])
            state = job.state
            state.count = job.end
            state.carry = torch.stack([state.carry[0], *(e[n] for e in ends[:-1])])  # in_m(end) = out_{m-1}(end − 1)
            if job.next_source_row is None:
                state.carry_ready = False
            else:
                state.carry[0] = source[job.next_source_row]
                self._keep_block_carry(job.seq, job.end, state.carry)
        return ends

    def _batch(self, spans: list[Span], tokens: list[int]) -> tuple[AttentionBatch, torch.Tensor]:
        """The spans' attention batch and their tokens [T_pad] on the device, in one upload. One row a
        span (a drafting step) with batch buckets: padded to the bucket with spans of one row at
        position 0 over the null block (their K/V goes there, no real row reads it), so the step has
        the bucket's shapes, as the target's bucketed decode steps do."""
        one_row = all(span.count == 1 for span in spans)
        if self.buckets is not None and one_row and len(spans) <= self.buckets[-1]:
            padding = bucket_for(len(spans), self.buckets) - len(spans)
            spans = spans + [Span([self.null_block], 0, 1)] * padding
            tokens = tokens + [0] * padding
        lists = attention_lists(spans, self.block_size, self.null_block)
        if self.buckets is not None and one_row:
            lists.uniform_query_len = 1
        token_ids, *parts = upload([tokens, *lists.parts], self.device)
        return lists.batch(parts), token_ids

    def _padded_module(self, m: int, inputs: torch.Tensor, embeds: torch.Tensor, batch: AttentionBatch) -> torch.Tensor:
        """``_module`` over inputs [T, H] padded with zero rows to the batch's, embeds [T_pad, H] → [T, H]."""
        rows = inputs.shape[0]
        if embeds.shape[0] > rows:
            inputs = torch.nn.functional.pad(inputs, (0, 0, 0, embeds.shape[0] - rows))
        return self._module(m, inputs, embeds, batch)[:rows]

    def _keep_block_carry(self, seq: Sequence, slot: int, inputs: torch.Tensor) -> None:
        """``inputs`` [L, H] = in_ℓ(slot); kept with the block that ends right before ``slot``."""
        if slot > 0 and slot % self.block_size == 0:
            self.block_carry[seq.block_table[slot // self.block_size - 1]] = inputs

    def preempted(self, seq: Sequence) -> None:
        self.states.pop(seq.seq_id, None)

    def finished(self, seq: Sequence) -> None:
        self.states.pop(seq.seq_id, None)
