"""EAGLE-3 proposer: a head over the target's low, middle and high residual streams, taken from the
same forward that verifies, drafting over a reduced vocabulary mapped back to the target's.

No extra target pass: the proposer names its head's aux layers (``aux_layer_ids``), the verify
forward returns the residual streams entering them beside its hidden states, and ``observe`` gets
them instead of the hidden states: it fuses them (``fc``) and runs the head over the slots that
became final in the step (prompt chunks included). Slots, formulas and the chain are the head's
(``models/eagle3.py``): its K/V lives in its own pools under the target's block tables, so it is
prefix-cached, rolled back by position and recomputed after preemption with the target's.

Per sequence the proposer keeps a *state*, as the MTP proposer does (``proposers/mtp.py``), for
its one module: ``count``, the slots final in the head's pools, and ``carry`` = in(count) =
fc(aux(count − 1)), the next slot's input. The input of the first slot after a full block is kept
per block (``block_carry``), so a sequence admitted on a cached prefix starts from it.

``propose`` for a sequence of n tokens: the head runs slot n − 1 (final: x_{n-1} is known, its input
is the carry), its output drafts token 1; draft j + 1 comes from chain slot n − 1 + j, fed draft j
and ``chain_hidden`` of the output before. The chain attends every slot before it (one head, no
hidden keys). Once verified, the accepted slots run again in ``observe`` as final slots, fed the
fused aux states, writing over the chain's K/V; later chain slots are rewritten before they are read.

Draft choice is the MTP proposer's (``choose_guided_drafts``) over the head's N draft rows: argmax
for greedy requests, drawn from the head's distribution under the request's sampling otherwise,
under a constrained sequence's grammar; q comes back over the target vocabulary (the draft rows'
probabilities scattered to their target ids through ``d2t``, zero elsewhere), so rejection stays exact.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specdecode.runtime.config import SpeculativeConfig
from specdecode.runtime.engine.model_runner import Span, build_attention_batch
from specdecode.runtime.engine.scheduler import ScheduledSeq
from specdecode.runtime.engine.sequence import Sequence
from specdecode.runtime.models.decoder import DecoderLM
from specdecode.runtime.models.eagle3 import Eagle3Head
from specdecode.runtime.models.eagle3_checkpoint import load_eagle3_head
from specdecode.runtime.proposers import Proposal, Proposer
from specdecode.runtime.proposers.drafting import Guides, choose_guided_drafts, draft_probs


@dataclass
class _State:
    count: int  # slots < count are final in the head's pools
    carry: torch.Tensor  # [H]: in(count) = fc(aux(count − 1))
    carry_ready: bool = True  # False right after drafting: aux(count − 1) comes with the step's forward


@dataclass
class _CatchUp:
    """Slots [start, end) of one sequence to run as final slots."""

    seq: Sequence
    state: _State
    start: int
    end: int
    fused_rows: list[int]  # rows of the fused aux states: fc(aux(q − 1)) for q in (start, end)
    next_fused_row: int | None  # the row of fc(aux(end − 1)) = in(end); None while drafting (not computed yet)


class Eagle3Proposer(Proposer):
    def __init__(self, head: Eagle3Head, target: DecoderLM, num_blocks: int, block_size: int):
        weight = target.model.embed_tokens.weight
        self.head, self.target = head, target
        self.aux_layer_ids = head.config.aux_layer_ids
        self.block_size = block_size
        self.device, self.dtype = weight.device, weight.dtype
        self.null_block = num_blocks
        self.kv_pools = head.new_kv_pools(num_blocks, block_size, self.dtype, self.device)
        self.block_carry = torch.zeros(num_blocks, head.config.hidden_size, dtype=self.dtype, device=self.device)
        self.states: dict[int, _State] = {}
        self.vocab_ids = head.target_ids()  # [N]

    # -- drafting ---------------------------------------------------------------------------------

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], max_drafts: list[int], guides: Guides | None = None) -> Proposal:
        # draft j is written at slot n − 1 + j: no further than the block table reaches
        max_drafts = [min(k, len(s.block_table) * self.block_size - len(s) + 1) for s, k in zip(seqs, max_drafts)]
        rows = [i for i, s in enumerate(seqs) if self._can_draft(s) and max_drafts[i] > 0]
        drafts = [guides.forced(i)[:k] if guides is not None and i not in rows else [] for i, k in enumerate(max_drafts)]
        if not rows:
            return Proposal(drafts)
        want_probs = any(not seqs[i].params.greedy for i in rows)
        q_rows: dict[tuple[int, int], torch.Tensor] = {}
        jobs = [_CatchUp(seqs[i], self.states[seqs[i].seq_id], len(seqs[i]) - 1, len(seqs[i]), [], None) for i in rows]
        out = self._run(jobs, self.block_carry.new_empty(0, self.block_carry.shape[1]))  # [B, H]: slot n − 1
        for j in range(max(max_drafts[i] for i in rows)):
            if j > 0:
                alive = [r for r, i in enumerate(rows) if max_drafts[i] > j]
                if not alive:
                    break
                rows = [rows[r] for r in alive]
                out = self._chain(j, [seqs[i] for i in rows], out[alive], [drafts[i][-1] for i in rows])
            tokens, q = choose_guided_drafts(self.head.draft_logits(out), seqs, rows, j, want_probs, guides,
                                             self.target.config.vocab_size, self.vocab_ids)
            for r, (i, token) in enumerate(zip(rows, tokens)):
                if token is None:
                    max_drafts[i] = j
                    continue
                drafts[i].append(token)
                if q is not None:
                    q_rows[i, j] = q[r]
        vocab = self.target.config.vocab_size
        return Proposal(drafts, draft_probs(drafts, q_rows, vocab, self.device) if want_probs else None)

    def _can_draft(self, seq: Sequence) -> bool:
        state = self.states.get(seq.seq_id)
        return state is not None and state.carry_ready and state.count == seq.num_computed_tokens == len(seq) - 1

    def _chain(self, j: int, seqs: list[Sequence], prev: torch.Tensor, tokens: list[int]) -> torch.Tensor:
        """Draft step j ≥ 1: chain slot n − 1 + j, fed ``chain_hidden`` of the previous step's output
        prev [B, H] and draft j → out [B, H]."""
        spans = [Span(s.block_table, len(s) - 1 + j, 1) for s in seqs]
        batch = build_attention_batch(spans, self.block_size, self.null_block, self.device)
        embeds = self.head.embed(self.target, torch.tensor(tokens, dtype=torch.long, device=self.device))
        return self.head(self.head.chain_hidden(prev), embeds, self.kv_pools, batch)

    # -- following the target ---------------------------------------------------------------------

    @torch.inference_mode()
    def observe(self, scheduled: list[ScheduledSeq], hidden: torch.Tensor) -> None:
        fused = self.head.fuse(hidden)  # hidden: the aux states [T, 3·H_t] → [T, H]
        jobs: list[_CatchUp] = []
        first = 0  # the item's first row: its position ``start``
        for item in scheduled:
            seq, start, row = item.seq, item.start, first
            first += item.num_tokens
            if seq.is_finished:
                continue
            state = self.states.get(seq.seq_id)
            if state is None or not start <= state.count <= start + 1:
                state = self._fresh_state(seq, start)
            if not state.carry_ready:  # it drafted this step: slot ``start`` is final, aux(start) is row 0
                state.carry.copy_(fused[row])
                state.carry_ready = True
                self._keep_block_carry(seq, state.count, state.carry)
            end = seq.num_computed_tokens
            if state.count < end:
                fused_rows = [row + q - 1 - start for q in range(state.count + 1, end)]
                jobs.append(_CatchUp(seq, state, state.count, end, fused_rows, row + end - 1 - start))
        if jobs:
            self._run(jobs, fused)

    def _fresh_state(self, seq: Sequence, start: int) -> _State:
        """A sequence new to the proposer (or back from preemption) starting at ``start``: 0, or the
        end of a cached prefix, whose first slot's input was kept with the prefix's last block."""
        if start % self.block_size:
            raise RuntimeError(f"sequence {seq.seq_id} starts at {start}, not at the end of a cached block")
        if start == 0:
            carry = self.block_carry.new_zeros(self.block_carry.shape[1])
        else:
            carry = self.block_carry[seq.block_table[start // self.block_size - 1]].clone()
        state = _State(start, carry)
        self.states[seq.seq_id] = state
        return state

    def _run(self, jobs: list[_CatchUp], fused: torch.Tensor) -> torch.Tensor:
        """Run every job's slots as final slots, advance its state to ``end``, and return the head's
        output at each job's last slot [len(jobs), H]. Slot q's input is the carry at q = start, else
        fused[fused_rows] (fused: [T, H])."""
        spans = [Span(job.seq.block_table, job.start, job.end - job.start) for job in jobs]
        batch = build_attention_batch(spans, self.block_size, self.null_block, self.device)
        tokens = [t for job in jobs for t in job.seq.token_ids[job.start : job.end]]
        embeds = self.head.embed(self.target, torch.tensor(tokens, dtype=torch.long, device=self.device))  # [T', H]
        carries = torch.stack([job.state.carry for job in jobs])  # [J, H]
        firsts = [0]
        for job in jobs:
            firsts.append(firsts[-1] + job.end - job.start)
        to = dict(dtype=torch.long, device=self.device)
        lasts = torch.tensor([f - 1 for f in firsts[1:]], **to)
        index = torch.tensor([i for n, job in enumerate(jobs) for i in [len(fused) + n, *job.fused_rows]], **to)
        inputs = torch.cat([fused, carries]).index_select(0, index)  # [T', H] in(q)
        ends = self.head(inputs, embeds, self.kv_pools, batch).index_select(0, lasts)  # [J, H]
        for n, job in enumerate(jobs):
            first_boundary = (job.start // self.block_size + 1) * self.block_size
            for q in range(first_boundary, job.end, self.block_size):  # full blocks inside the job's slots
                self._keep_block_carry(job.seq, q, inputs[firsts[n] + q - job.start])
            state = job.state
            state.count = job.end
            if job.next_fused_row is None:
                state.carry_ready = False
            else:
                state.carry.copy_(fused[job.next_fused_row])
                self._keep_block_carry(job.seq, job.end, state.carry)
        return ends

    def _keep_block_carry(self, seq: Sequence, slot: int, carry: torch.Tensor) -> None:
        """``carry`` [H] = in(slot); kept with the block that ends right before ``slot``."""
        if slot > 0 and slot % self.block_size == 0:
            self.block_carry[seq.block_table[slot // self.block_size - 1]] = carry

    def preempted(self, seq: Sequence) -> None:
        self.states.pop(seq.seq_id, None)

    def finished(self, seq: Sequence) -> None:
        self.states.pop(seq.seq_id, None)


def load_eagle3_proposer(cfg: SpeculativeConfig, target: DecoderLM, *, block_size: int,
                         num_blocks: int) -> Eagle3Proposer:
    """The head in ``cfg.eagle3_path`` (refused by the loader, naming what is wrong, when it does not fit)."""
    return Eagle3Proposer(load_eagle3_head(cfg.eagle3_path, target), target, num_blocks, block_size)
