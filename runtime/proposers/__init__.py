"""Draft-token proposers, one file per method, behind the ``Proposer`` interface."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from specdecode.runtime.config import SpeculativeConfig, SpeculativeMethod
from specdecode.runtime.engine.sequence import Sequence


@dataclass
class Proposal:
    token_ids: list[list[int]]  # per sequence, at most its max_drafts
    # Draft distributions for rejection sampling: [B, K, V] fp32 with K = max drafts in the batch
    # (rows past a sequence's own drafts are ignored). None = one-hot (n-gram, suffix).
    probs: torch.Tensor | None = None


class Proposer(Protocol):
    def propose(self, seqs: list[Sequence], max_drafts: list[int]) -> Proposal:
        """Draft tokens to follow each sequence's tokens; at most ``max_drafts[i]`` for ``seqs[i]``."""
        ...

    def finished(self, seq: Sequence) -> None:
        """A sequence ended (proposers that learn from outputs keep what they need)."""
        ...


def build_proposer(cfg: SpeculativeConfig, device) -> Proposer | None:
    if cfg.method is SpeculativeMethod.NONE:
        return None
    if cfg.method is SpeculativeMethod.NGRAM:
        from specdecode.runtime.proposers.ngram import NgramProposer

        return NgramProposer(cfg.prompt_lookup_min, cfg.prompt_lookup_max, cfg.num_speculative_tokens, device)
    raise ValueError(f"speculative method {cfg.method.value!r} is not available in this build yet")
