"""Prompt-lookup (n-gram) proposer over each sequence's prompt + generated tokens.

The longest suffix n-gram in [min_n, max_n] that occurred before wins, its most recent
occurrence is taken, and the tokens that followed it are proposed (see ``kernels/ngram.py``).

Each sequence's tokens live in a row of one device buffer (``DeviceContexts``): uploaded once,
then extended on the device. When a step is launched, ``draft_ahead`` prepares the next step's
match: after verification, before the verdicts are read, the verdict tokens are written after
each sequence's row and the match runs over the rows so extended (``AheadDrafts.compute``); its
drafts come back in the verdicts' own read. A step reads the device once, drafts included.
``propose`` hands out those drafts where a sequence's tokens are still what they were drafted
from, and matches on demand otherwise (forced tokens of a grammar; a step verified elsewhere, as
on a pipeline's last stage), which is one more read.
"""
from __future__ import annotations

import torch

from specdecode.kernels import PLACEHOLDER_TOKEN_ID
from specdecode.kernels.ngram import ngram_propose
from specdecode.runtime.engine.scheduler import ScheduledSeq
from specdecode.runtime.engine.sequence import Sequence
from specdecode.runtime.engine.transfer import upload
from specdecode.runtime.proposers import AheadDrafts, Proposal, Proposer
from specdecode.runtime.proposers.drafting import Guides

INITIAL_ROWS, INITIAL_WIDTH = 8, 256  # the buffer doubles in either direction when it must


class DeviceContexts:
    """Sequences' tokens in the rows of one device buffer ``[rows, width]`` long. Holding a sequence
    uploads only what it gained since it was last held (all sequences in one copy); tokens written
    past a row's held length (a grammar's forced tokens, a step's verdict tokens) count once the
    sequence is held that long (``held``)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.buffer = torch.full((INITIAL_ROWS, INITIAL_WIDTH), PLACEHOLDER_TOKEN_ID, dtype=torch.long, device=device)
        self.row_of: dict[int, int] = {}  # seq_id → row
        self.held: dict[int, int] = {}  # seq_id → tokens its row holds
        self.free = list(range(INITIAL_ROWS))

    @property
    def width(self) -> int:
        return self.buffer.shape[1]

    def hold(self, seqs: list[Sequence], tails: list[list[int]], room: int) -> list[int]:
        """Each sequence's row holding its tokens, then its tail (written, not held), with ``room``
        slots free after the longest; the rows."""
        rows = [self._row(seq.seq_id) for seq in seqs]
        self._fit(max(len(seq) + len(tail) for seq, tail in zip(seqs, tails)) + room)
        index: list[int] = []
        values: list[int] = []
        for row, seq, tail in zip(rows, seqs, tails):
            have = min(self.held.get(seq.seq_id, 0), len(seq))
            index += range(row * self.width + have, row * self.width + len(seq) + len(tail))
            values += seq.token_ids[have:] + tail
            self.held[seq.seq_id] = len(seq)
        if index:
            at, tokens = upload([index, values], self.device)
            self.buffer.view(-1).index_copy_(0, at, tokens)
        return rows

    def release(self, seq_id: int) -> None:
        row = self.row_of.pop(seq_id, None)
        self.held.pop(seq_id, None)
        if row is not None:
            self.free.append(row)

    def _row(self, seq_id: int) -> int:
        if seq_id not in self.row_of:
            if not self.free:
                self._grow(rows=2 * self.buffer.shape[0], width=self.width)
            self.row_of[seq_id] = self.free.pop()
        return self.row_of[seq_id]

    def _fit(self, width: int) -> None:
        if width > self.width:
            self._grow(rows=self.buffer.shape[0], width=max(2 * self.width, width))

    def _grow(self, rows: int, width: int) -> None:
        old = self.buffer
        self.buffer = torch.full((rows, width), PLACEHOLDER_TOKEN_ID, dtype=torch.long, device=self.device)
        self.buffer[: old.shape[0], : old.shape[1]] = old
        self.free += range(old.shape[0], rows)


class NgramAhead(AheadDrafts):
    """The next step's n-gram drafts of a launched step's deciding sequences (module docstring)."""

    def __init__(self, proposer: NgramProposer, seqs: list[Sequence], rows: list[int]):
        self.proposer, self.rows = proposer, rows
        self.seq_ids = [seq.seq_id for seq in seqs]
        self.lengths = [len(seq) for seq in seqs]  # where each row's verdict tokens go
        self.parts = [rows, self.lengths]
        self.drafted: list[tuple[int, list[int]]] | None = None  # per sequence: (its length then, drafts)

    def compute(self, verdicts: torch.Tensor, parts: list[torch.Tensor]) -> torch.Tensor:
        """verdicts [N, W] long, placeholder-padded → [N · k + 2N] long: the drafts, their counts,
        the new lengths."""
        contexts, k = self.proposer.contexts, self.proposer.k
        rows, lengths = parts  # [N] each
        width = verdicts.shape[1]  # ≤ the room held: the most rows a sequence had this step
        cols = lengths[:, None] + torch.arange(width, device=verdicts.device)  # [N, W]
        contexts.buffer.view(-1).index_copy_(0, (rows[:, None] * contexts.width + cols).flatten(), verdicts.flatten())
        lengths = lengths + (verdicts != PLACEHOLDER_TOKEN_ID).sum(1)  # [N]
        span = max(self.lengths) + width
        drafts, counts = ngram_propose(contexts.buffer[:, :span].index_select(0, rows), lengths,
                                       self.proposer.min_n, self.proposer.max_n, k)
        return torch.cat([drafts.flatten(), counts, lengths])

    def take(self, values: list[int]) -> None:
        n, k = len(self.rows), self.proposer.k
        drafts, counts, lengths = values[: n * k], values[n * k : n * k + n], values[n * k + n :]
        self.drafted = [(length, drafts[i * k : i * k + count]) for i, (count, length) in enumerate(zip(counts, lengths))]


class NgramProposer(Proposer):
    def __init__(self, min_n: int, max_n: int, k: int, device: torch.device):
        self.min_n, self.max_n, self.k = min_n, max_n, k
        self.contexts = DeviceContexts(device)
        self.ready: dict[int, tuple[int, list[int]]] = {}  # seq_id → (its length when drafted, drafts)
        self.pending: NgramAhead | None = None

    def propose(self, seqs: list[Sequence], max_drafts: list[int], guides: Guides | None = None) -> Proposal:
        """Matched over each sequence's tokens followed by its forced ones, which start its drafts."""
        self._take_pending()
        forced = [guides.forced(i) if guides is not None else [] for i in range(len(seqs))]
        drafts = [None if f else self._ready(seq) for seq, f in zip(seqs, forced)]
        cold = [i for i, d in enumerate(drafts) if d is None]
        if cold:
            for i, matched in zip(cold, self._match([seqs[i] for i in cold], [forced[i] for i in cold])):
                drafts[i] = matched
        return Proposal([(f + d)[:cap] for d, cap, f in zip(drafts, max_drafts, forced)])

    def draft_ahead(self, deciding: list[ScheduledSeq]) -> NgramAhead | None:
        self._take_pending()
        if not deciding:
            return None
        seqs = [item.seq for item in deciding]
        room = 1 + max(item.num_draft for item in deciding)
        self.pending = NgramAhead(self, seqs, self.contexts.hold(seqs, [[] for _ in seqs], room))
        return self.pending

    def finished(self, seq: Sequence) -> None:
        self.ready.pop(seq.seq_id, None)
        self.contexts.release(seq.seq_id)

    def _ready(self, seq: Sequence) -> list[int] | None:
        """The drafts the last verdicts' read brought for ``seq``, if its tokens are still those."""
        length, drafts = self.ready.get(seq.seq_id, (-1, []))
        return drafts if length == len(seq) else None

    def _take_pending(self) -> None:
        """What the last launched step drafted ahead, once its verdicts were read (a step abandoned
        before its read brings nothing; its writes lie past what the rows hold)."""
        pending, self.pending = self.pending, None
        if pending is None or pending.drafted is None:
            return
        for seq_id, (length, drafts) in zip(pending.seq_ids, pending.drafted):
            if seq_id in self.contexts.row_of:  # not finished since
                self.ready[seq_id] = (length, drafts)
                self.contexts.held[seq_id] = length

    def _match(self, seqs: list[Sequence], forced: list[list[int]]) -> list[list[int]]:
        """The n-gram drafts over each sequence's tokens followed by its forced ones, now: one read."""
        rows = self.contexts.hold(seqs, forced, 0)
        span = max(len(seq) + len(f) for seq, f in zip(seqs, forced))
        index, lengths = upload([rows, [len(seq) + len(f) for seq, f in zip(seqs, forced)]], self.contexts.device)
        drafts, counts = ngram_propose(self.contexts.buffer[:, :span].index_select(0, index), lengths,
                                       self.min_n, self.max_n, self.k)
        read = torch.cat([drafts, counts[:, None]], dim=1).tolist()  # [B, k + 1]: one read of both
        return [row[: row[-1]] for row in read]
