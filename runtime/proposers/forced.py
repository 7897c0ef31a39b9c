"""The proposer of ``method: none`` with ``grammar_drafts`` on: a constrained sequence drafts the
tokens its grammar forces next and nothing else; an unconstrained one is never asked."""
from __future__ import annotations

from specdecode.runtime.engine.sequence import Sequence
from specdecode.runtime.proposers import Proposal, Proposer
from specdecode.runtime.proposers.drafting import Guides


class ForcedProposer(Proposer):
    def propose(self, seqs: list[Sequence], max_drafts: list[int], guides: Guides | None = None) -> Proposal:
        return Proposal([guides.forced(i)[:k] if guides is not None else [] for i, k in enumerate(max_drafts)])

    def drafts_for(self, seq: Sequence) -> bool:
        return seq.grammar is not None
