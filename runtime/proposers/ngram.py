"""Prompt-lookup (n-gram) proposer over each sequence's prompt + generated tokens.

The longest suffix n-gram in [min_n, max_n] that occurred before wins, its most recent
occurrence is taken, and the tokens that followed it are proposed (see ``kernels/ngram.py``).
"""
from __future__ import annotations

import torch

from specdecode.kernels.ngram import ngram_propose
from specdecode.kernels import PLACEHOLDER_TOKEN_ID
from specdecode.runtime.engine.sequence import Sequence
from specdecode.runtime.proposers import Proposal, Proposer
from specdecode.runtime.proposers.drafting import Guides


class NgramProposer(Proposer):
    def __init__(self, min_n: int, max_n: int, k: int, device: torch.device):
        self.min_n, self.max_n, self.k = min_n, max_n, k
        self.device = device

    def propose(self, seqs: list[Sequence], max_drafts: list[int], guides: Guides | None = None) -> Proposal:
        """Matched over each sequence's tokens followed by its forced ones, which start its drafts."""
        forced = [guides.forced(i) if guides is not None else [] for i in range(len(seqs))]
        contexts = [s.token_ids + f for s, f in zip(seqs, forced)]
        longest = max(len(c) for c in contexts)
        tokens = torch.full((len(seqs), longest), PLACEHOLDER_TOKEN_ID, dtype=torch.long)  # [B, L]
        for i, c in enumerate(contexts):
            tokens[i, : len(c)] = torch.tensor(c)
        lengths = torch.tensor([len(c) for c in contexts], dtype=torch.long)  # [B]
        k = max(max_drafts)
        drafts, counts = ngram_propose(tokens.to(self.device), lengths.to(self.device), self.min_n, self.max_n, k)
        return Proposal([(f + row[:n])[:cap] for row, n, cap, f in zip(drafts.tolist(), counts.tolist(), max_drafts, forced)])
