"""Continuous batching with chunked prefill under a per-step token budget, and preemption.

Each step the scheduler hands out at most ``max_num_batched_tokens`` tokens: running sequences
first (one decode token each, or the next chunk of an unfinished prefill), then waiting ones in
arrival order. When the block pool runs dry, the most recently admitted running sequence is
*preempted*: its blocks are released and it goes back to the front of the queue to be
recomputed later from its full token list (prompt + what it generated so far), so nothing is
lost — the prefix cache usually gives most of it back.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from specdecode.runtime.config import SchedulerConfig
from specdecode.runtime.engine.block_manager import BlockManager
from specdecode.runtime.engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_tokens: int  # tokens computed this step from seq.num_computed_tokens on, drafts included
    num_draft: int = 0  # the last num_draft of them are seq.draft_token_ids[:num_draft]

    @property
    def samples(self) -> bool:
        """Whether this step reaches the end of the known tokens, so next tokens are decided."""
        return self.seq.num_computed_tokens + self.num_tokens - self.num_draft == len(self.seq)


class Scheduler:
    def __init__(self, cfg: SchedulerConfig, block_manager: BlockManager):
        self.cfg = cfg
        self.blocks = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.prefix_cache_hit_tokens = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def admits_waiting(self) -> bool:
        """Whether a waiting sequence has a free seat in the next step (KV room not checked)."""
        return bool(self.waiting) and len(self.running) < self.cfg.max_num_seqs

    def schedule(self) -> list[ScheduledSeq]:
        budget = self.cfg.max_num_batched_tokens
        scheduled: list[ScheduledSeq] = []
        for seq in list(self.running):
            if seq not in self.running:  # preempted by an earlier sequence of this loop
                continue
            num = min(len(seq) - seq.num_computed_tokens, budget)
            if num <= 0:
                continue
            num_draft = min(len(seq.draft_token_ids), budget - num) if num == len(seq) - seq.num_computed_tokens else 0
            if not self._grow_or_preempt(seq, seq.num_computed_tokens + num + num_draft):
                continue
            scheduled.append(ScheduledSeq(seq, num + num_draft, num_draft))
            budget -= num + num_draft
        while self.waiting and budget > 0 and len(self.running) < self.cfg.max_num_seqs:
            seq = self.waiting[0]
            prefix = self.blocks.match_prefix(seq.token_ids)
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

    def _grow_or_preempt(self, seq: Sequence, num_tokens: int) -> bool:
        while not self.blocks.grow(seq, num_tokens):
            victim = self.running[-1]
            self._preempt(victim)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.release(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
