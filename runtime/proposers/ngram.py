"""Prompt-lookup (n-gram) proposer over each sequence's prompt + generated tokens.

The longest suffix n-gram in [min_n, max_n] that occurred before wins, its most recent
occurrence is taken, and the tokens that followed it are proposed (see ``kernels/ngram.py``).
"""
from __future__ import annotations

import torch

from specdecode.kernels.ngram import ngram_propose
from specdecode.kernels import PLACEHOLDER_TOKEN_ID
from specdecode.runtime.engine.transfer import upload
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
        padded = [t for c in contexts for t in c + [PLACEHOLDER_TOKEN_ID] * (longest - len(c))]
        tokens, lengths = upload([padded, [len(c) for c in contexts]], self.device)  # [B·L], [B]
        k = max(max_drafts)
        drafts, counts = ngram_propose(tokens.view(len(seqs), longest), lengths, self.min_n, self.max_n, k)
        rows = torch.cat([drafts, counts[:, None]], dim=1).tolist()  # [B, K + 1]: one read of both
        return Proposal([(f + row[:row[-1]])[:cap] for row, cap, f in zip(rows, max_drafts, forced)])
