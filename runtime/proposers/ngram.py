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


class NgramProposer(Proposer):
    def __init__(self, min_n: int, max_n: int, k: int, device: torch.device):
        self.min_n, self.max_n, self.k = min_n, max_n, k
        self.device = device

    def propose(self, seqs: list[Sequence], max_drafts: list[int]) -> Proposal:
        longest = max(len(s) for s in seqs)
        tokens = torch.full((len(seqs), longest), PLACEHOLDER_TOKEN_ID, dtype=torch.long)  # [B, L]
        for i, s in enumerate(seqs):
            tokens[i, : len(s)] = torch.tensor(s.token_ids)
        lengths = torch.tensor([len(s) for s in seqs], dtype=torch.long)  # [B]
        k = max(max_drafts)
        drafts, counts = ngram_propose(tokens.to(self.device), lengths.to(self.device), self.min_n, self.max_n, k)
        return Proposal([row[: min(n, cap)] for row, n, cap in zip(drafts.tolist(), counts.tolist(), max_drafts)])
