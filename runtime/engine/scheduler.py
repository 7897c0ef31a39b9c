"""Continuous batching with chunked prefill under a per-step token budget, and preemption.

Each step the scheduler hands out at most ``max_num_batched_tokens`` tokens: running sequences
first (one decode token each, or the next chunk of an unfinished prefill), then waiting ones in
arrival order. A decoding sequence may score draft tokens after its own: the engine gives a cap
per sequence, the scheduler reserves budget and KV slots for up to that many, the proposer fills
them, and only then are waiting sequences admitted with the budget left. Under KV pressure the
drafts shrink first; when even a sequence's own tokens do not fit, the most recently admitted
running sequence is *preempted*: its blocks are released and it goes back to the front of the queue to be
recomputed later from its full token list (prompt + what it generated so far), so nothing is
lost — the prefix cache usually gives most of it back.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from specdecode.runtime.config import SchedulerConfig
from specdecode.runtime.engine.block_manager import BlockManager
from specdecode.runtime.engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledSeq:
    """One sequence's share of a step: ``num_tokens`` computed from position ``start`` on, the last
    ``num_draft`` of them draft tokens. The scheduler reserves KV slots and token budget for at most
    the draft cap it was given; the proposer then fills ``draft_token_ids`` (and, for drafts drawn
    from a distribution, ``draft_probs``) and ``set_drafts`` trims the reservation to what came.
    Drafts live on this record only, so they never outlive their step."""

    seq: Sequence
    num_tokens: int  # tokens computed this step from ``start`` on, drafts included
    num_draft: int = 0  # the last num_draft of them are draft_token_ids
    draft_token_ids: list[int] = field(default_factory=list)
    draft_probs: Any = None  # torch [num_draft, V]: the distributions drafts were drawn from; None = one-hot
    start: int = field(init=False)  # the sequence's num_computed_tokens when scheduled

    def __post_init__(self) -> None:
        self.start = self.seq.num_computed_tokens

    @property
    def samples(self) -> bool:
        """Whether this step reaches the end of the known tokens, so next tokens are decided."""
        return self.start + self.num_tokens - self.num_draft == len(self.seq)

    @property
    def prompt_logprob_positions(self) -> range:
        """Positions whose row scores the next *prompt* token's logprob this step (asked for with
        ``prompt_logprobs``); the last prompt position's row samples the first output instead."""
        seq = self.seq
        if not seq.wants_prompt_logprobs:
            return range(0)
        end = min(self.start + self.num_tokens - self.num_draft, seq.num_prompt_tokens - 1)
        return range(self.start, max(self.start, end))

    @property
    def decoding(self) -> bool:
        """A decode step: only the sequence's last (pending) token is new, drafts may follow it."""
        return self.samples and self.num_tokens - self.num_draft == 1

    def set_drafts(self, token_ids: list[int], probs: Any = None) -> None:
        """Take the proposer's drafts (at most ``num_draft``), trimming the reservation to them."""
        if len(token_ids) > self.num_draft:
            raise ValueError(f"the proposer returned {len(token_ids)} drafts; {self.num_draft} were reserved")
        self.num_tokens -= self.num_draft - len(token_ids)
        self.num_draft = len(token_ids)
        self.draft_token_ids = token_ids
        self.draft_probs = None if probs is None else probs[: len(token_ids)]


class Scheduler:
    def __init__(self, cfg: SchedulerConfig, block_manager: BlockManager):
        self.cfg = cfg
        self.blocks = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.prefix_cache_hit_tokens = 0
        self.preempted: list[Sequence] = []  # preempted during the latest ``schedule``

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def admits_waiting(self) -> bool:
        """Whether a waiting sequence has a free seat in the next step (KV room not checked)."""
        return bool(self.waiting) and len(self.running) < self.cfg.max_num_seqs

    def schedule(
        self,
        draft_caps: Mapping[int, int] | None = None,
        propose: Callable[[list[ScheduledSeq]], None] | None = None,
    ) -> list[ScheduledSeq]:
        """This step's sequences: running ones first, each decoding one with room reserved for up to
        ``draft_caps[seq_id]`` drafts; then ``propose`` fills the running ones' drafts (trimming
        what it does not use), and waiting sequences are admitted with the token budget left."""
        self.preempted = []
        scheduled = self.schedule_running(list(self.running), self.cfg.max_num_batched_tokens, draft_caps, propose)
        return scheduled + self._admit(self.cfg.max_num_batched_tokens - sum(i.num_tokens for i in scheduled))

    def schedule_ahead(self, reserved_tokens: int) -> list[ScheduledSeq]:
        """Overlap scheduling: while a step runs, the next step's work that does not depend on its
        verdicts — the next prompt chunks of running sequences that decide nothing in the running
        step (those that do have nothing left to compute until their verdicts come) and newly
        admitted sequences — within the budget left after ``reserved_tokens`` (the decode rows
        that follow the verdicts). Never preempts: a chunk without free blocks waits a step."""
        self.preempted = []
        budget = self.cfg.max_num_batched_tokens - reserved_tokens
        scheduled = []
        for seq in list(self.running):
            num = min(len(seq) - seq.num_computed_tokens, budget)
            if num > 0 and self.blocks.grow(seq, seq.num_computed_tokens + num):
                scheduled.append(ScheduledSeq(seq, num))
                budget -= num
        return scheduled + self._admit(budget)

    def schedule_running(
        self,
        seqs: list[Sequence],
        budget: int,
        draft_caps: Mapping[int, int] | None = None,
        propose: Callable[[list[ScheduledSeq]], None] | None = None,
    ) -> list[ScheduledSeq]:
        """``seqs`` (running) within ``budget`` tokens, drafts reserved up to their caps and filled
        by ``propose``; under KV pressure drafts shrink, then the most recently admitted running
        sequences are preempted (``preempted`` lists them). ``seqs`` are taken in admission order
        (``running``'s), whatever order they come in: a sequence then only ever preempts sequences
        admitted after it, which the loop has not reached, so none it already scheduled loses its
        blocks (the overlap look-ahead hands its decode rows in the previous step's order)."""
        caps = draft_caps or {}
        wanted = {seq.seq_id for seq in seqs}
        scheduled: list[ScheduledSeq] = []
        for seq in [seq for seq in self.running if seq.seq_id in wanted]:
            if seq not in self.running:  # preempted by an earlier sequence of this loop
                continue
            num = min(len(seq) - seq.num_computed_tokens, budget)
            if num <= 0:
                continue
            cap = min(caps.get(seq.seq_id, 0), budget - num) if num == len(seq) - seq.num_computed_tokens else 0
            num_draft = self._reserve(seq, num, cap)
            if num_draft is None:
                continue
            scheduled.append(ScheduledSeq(seq, num + num_draft, num_draft))
            budget -= num + num_draft
        if propose is not None and scheduled:
            propose(scheduled)
        return scheduled

    def _admit(self, budget: int) -> list[ScheduledSeq]:
        """Waiting sequences in arrival order, while the budget, the seats and the free blocks last."""
        scheduled = []
        while self.waiting and budget > 0 and len(self.running) < self.cfg.max_num_seqs:
            seq = self.waiting[0]
            # a prefix-cache hit would skip positions whose logprobs are still to be computed
            prefix = [] if seq.missing_prompt_logprobs else self.blocks.match_prefix(seq.token_ids)
            num = min(len(seq) - len(prefix) * self.blocks.block_size, budget)
            if not self.blocks.admit(seq, prefix, num):
                break
            self.waiting.popleft()
            self.prefix_cache_hit_tokens += seq.num_cached_prefix_tokens
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            scheduled.append(ScheduledSeq(seq, num))
            budget -= num
        return scheduled

    def finish(self, seq: Sequence) -> None:
        """Release a finished (or aborted) sequence wherever it is."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.release(seq)
        seq.status = SequenceStatus.FINISHED

    def _reserve(self, seq: Sequence, num: int, num_draft: int) -> int | None:
        """Grow ``seq``'s blocks for ``num`` tokens and up to ``num_draft`` drafts: the drafts shrink
        to what the free blocks hold before anyone is preempted, and only the ``num`` tokens
        themselves preempt others (most recently admitted first). The drafts reserved, or None if
        ``seq`` itself had to be preempted."""
        end = seq.num_computed_tokens + num
        room = (len(seq.block_table) + self.blocks.num_free_blocks) * self.blocks.block_size - end
        if room >= 0:
            num_draft = min(num_draft, room)
            if not self.blocks.grow(seq, end + num_draft):
                raise RuntimeError("the block pool refused the room it reported")
            return num_draft
        while not self.blocks.grow(seq, end):
            victim = self.running[-1]
            self._preempt(victim)
            if victim is seq:
                return None
        return 0

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.release(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
        self.preempted.append(seq)
