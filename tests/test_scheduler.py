"""The scheduler's draft reservations: drafts shrink to the free KV before anyone is preempted, are
proposed only for sequences scheduled this step (after the running ones are placed, before waiting
ones are admitted), and never outlive their step."""
from __future__ import annotations

import pytest

from specdecode.runtime.config import SchedulerConfig
from specdecode.runtime.engine.block_manager import BlockManager
from specdecode.runtime.engine.scheduler import Scheduler
from specdecode.runtime.engine.sequence import SamplingParams, Sequence, SequenceStatus
from specdecode.runtime.proposers import Proposal, Proposer

GREEDY = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)


def decoding(seq_id: int, num_tokens: int, blocks: BlockManager, sched: Scheduler) -> Sequence:
    """A running sequence whose tokens but the last have K/V (its pending token is decoded next)."""
    seq = Sequence(seq_id, str(seq_id), 0, list(range(num_tokens)), num_tokens - 1, GREEDY, 0.0)
    assert blocks.admit(seq, [], num_tokens - 1)
    seq.num_computed_tokens = num_tokens - 1
    seq.status = SequenceStatus.RUNNING
    sched.running.append(seq)
    return seq


def test_drafts_shrink_to_the_free_blocks_before_anyone_is_preempted():
    blocks = BlockManager(num_blocks=4, block_size=4, enable_prefix_caching=False)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64), blocks)
    a = decoding(0, 4, blocks, sched)  # 3 computed: block 1 of 4 slots, pending slot 3 fits
    b = decoding(1, 8, blocks, sched)  # 7 computed: 2 blocks, pending slot 7 fits
    assert blocks.num_free_blocks == 1
    items = sched.schedule(draft_caps={a.seq_id: 6, b.seq_id: 6})
    assert sched.num_preemptions == 0 and sched.preempted == []
    assert [(i.seq.seq_id, i.num_draft) for i in items] == [(0, 4), (1, 0)]  # a took the last block, b kept its seat
    assert [i.num_tokens for i in items] == [5, 1]


def test_only_a_sequences_own_tokens_preempt_others():
    blocks = BlockManager(num_blocks=3, block_size=4, enable_prefix_caching=False)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64), blocks)
    a = decoding(0, 8, blocks, sched)  # 2 blocks, pending slot 7: no room needed
    b = decoding(1, 5, blocks, sched)  # 1 block holds slots 0..3; pending slot 4 needs a block: none free
    items = sched.schedule(draft_caps={a.seq_id: 4, b.seq_id: 4})
    assert sched.preempted == [b] and [i.seq.seq_id for i in items] == [0]
    assert items[0].num_draft == 0  # the only free block went back with b; a's drafts did not take it first


def test_propose_runs_after_the_running_sequences_are_placed_and_before_admission():
    blocks = BlockManager(num_blocks=32, block_size=4, enable_prefix_caching=False)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=10), blocks)
    a = decoding(0, 4, blocks, sched)
    waiting = Sequence(9, "w", 0, list(range(12)), 12, GREEDY, 0.0)
    sched.add(waiting)
    seen = []

    def propose(items):
        seen.append([(i.seq.seq_id, i.num_draft) for i in items])
        items[0].set_drafts([7])  # fewer than reserved: the rest of the budget goes to admission

    items = sched.schedule(draft_caps={a.seq_id: 4}, propose=propose)
    assert seen == [[(0, 4)]]
    assert [(i.seq.seq_id, i.num_tokens, i.num_draft, i.draft_token_ids) for i in items] == [(0, 2, 1, [7]), (9, 8, 0, [])]


class SpyProposer(Proposer):
    """Drafts token 0 for every sequence asked; records who was asked in which step."""

    def __init__(self):
        self.asked: list[list[int]] = []

    def propose(self, seqs, max_drafts, guides=None):
        self.asked.append([s.seq_id for s in seqs])
        return Proposal([[0] * k for k in max_drafts])


@pytest.mark.parametrize("overlap", [True, False])
def test_drafts_are_asked_only_of_scheduled_sequences_and_die_with_their_step(sharp, make_engine, overlap):
    model, tok = sharp
    engine = make_engine(model, tok, spec={"method": "ngram", "num_speculative_tokens": 3}, budget=6, overlap=overlap)
    spy = engine.proposer = SpyProposer()
    scheduled_per_step = []
    original = engine.scheduler.schedule_running  # the running sequences' share of a step, with or without overlap

    def schedule(*args, **kwargs):
        items = original(*args, **kwargs)
        scheduled_per_step.append({i.seq.seq_id: i for i in items})
        return items

    engine.scheduler.schedule_running = schedule
    for i in range(4):
        engine.add_request(str(i), tok.encode("hello hello hello"), GREEDY)
    for _ in range(12):
        engine.step()
    asked_steps = [s for s in scheduled_per_step if any(i.num_draft for i in s.values())]
    assert len(spy.asked) == len(asked_steps) > 0
    assert any(len(s) < 4 for s in scheduled_per_step[1:])  # the budget left sequences out of steps
    for asked, scheduled in zip(spy.asked, asked_steps):
        assert set(asked) <= set(scheduled)  # never a sequence the step left out
    for scheduled in scheduled_per_step:
        for item in scheduled.values():
            assert len(item.draft_token_ids) == item.num_draft
            assert not hasattr(item.seq, "draft_token_ids")  # drafts live on the step's record only
