"""Draft-token proposers, one file per method, behind the ``Proposer`` interface."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from specdecode.runtime.config import SpeculativeConfig, SpeculativeMethod
from specdecode.runtime.engine.scheduler import ScheduledSeq
from specdecode.runtime.engine.sequence import Sequence

if TYPE_CHECKING:
    from specdecode.runtime.models.decoder import DecoderLM
    from specdecode.runtime.proposers.drafting import Guides
    from specdecode.runtime.tokenizer import Tokenizer


@dataclass
class Proposal:
    token_ids: list[list[int]]  # per sequence, at most its max_drafts
    # Draft distributions for rejection sampling: [B, K, V] fp32 with K = max drafts in the batch
    # (rows past a sequence's own drafts are ignored). None = one-hot (n-gram, suffix).
    probs: torch.Tensor | None = None


class AheadDrafts:
    """A launched step's drafts for the next step, made on the device from its verdicts before they
    are read, and read with them (``Verifier``): what lets a step read the device once. What it needs
    from the host goes in the step's one upload (``parts``, handed back to ``compute``)."""

    parts: list[list[int]] = []  # long lists, uploaded with the step's inputs

    def compute(self, verdicts: torch.Tensor, parts: list[torch.Tensor]) -> torch.Tensor:
        """verdicts [N, K+1] long: row i the verdict tokens (accepted drafts, then the recovered or
        bonus token, placeholder-padded) of the step's deciding item i; ``parts`` on the device →
        a flat long tensor, read back with the verdicts and handed to ``take``."""
        raise NotImplementedError

    def take(self, values: list[int]) -> None:
        """``compute``'s values, read."""
        raise NotImplementedError


class Proposer:
    """What the engine asks of a proposer; the defaults suit proposers that read only token ids."""

    follows_guides: bool = True  # False: ``propose`` ignores guides (drafts made elsewhere, without the grammar)
    # target layers whose entering residual streams ``observe`` reads instead of the final hidden states
    # (ascending; an EAGLE-3 head's): the verify forward returns them, no extra pass
    aux_layer_ids: tuple[int, ...] = ()

    def propose(self, seqs: list[Sequence], max_drafts: list[int], guides: Guides | None = None) -> Proposal:
        """Draft tokens to follow each sequence's tokens; at most ``max_drafts[i]`` for ``seqs[i]``.
        Called after scheduling, for scheduled decoding sequences only. With ``guides``, a guided
        sequence's drafts start with its forced tokens (the engine caps them at ``max_drafts``) and
        continue from the sequence followed by them; a model-based proposer draws them under the
        grammar (``drafting.choose_guided_drafts``)."""
        raise NotImplementedError

    def draft_ahead(self, deciding: list[ScheduledSeq]) -> AheadDrafts | None:
        """For a step about to be launched with these deciding items (in the step's order): the
        next step's drafts to make from its verdicts on the device (``AheadDrafts``), or None for
        proposers that draft when asked."""
        return None

    def drafts_for(self, seq: Sequence) -> bool:
        """Whether ``seq`` may get drafts at all (the engine reserves room only for those)."""
        return True

    def catch_up(self, seq: Sequence) -> int:
        """Tokens of ``seq`` (before its last) the proposer must still run through a model before it
        can draft for it: what asking it for drafts costs beyond the drafts. 0 for proposers that
        read the tokens directly (n-gram; suffix indexes them in Python, cheap next to a forward)."""
        return 0

    def observe(self, scheduled: list[ScheduledSeq], hidden: torch.Tensor) -> None:
        """A step's target forward was verified and its tokens accepted: ``hidden`` [T, H] holds
        every scheduled token's hidden state before the final norm (rows in scheduled order, each
        item's ``num_tokens`` rows from position ``item.start``); positions below each sequence's
        ``num_computed_tokens`` are now final. Proposers that draft from hidden states take them here.
        With ``aux_layer_ids``, ``hidden`` holds instead the residual streams entering those layers,
        side by side in that order: [T, len(aux_layer_ids) · H]."""

    def preempted(self, seq: Sequence) -> None:
        """``seq`` lost its KV slots (it will be recomputed from its tokens)."""

    def finished(self, seq: Sequence) -> None:
        """A sequence ended (proposers that learn from outputs keep what they need)."""


def build_proposer(
    cfg: SpeculativeConfig,
    device,
    *,
    dtype: torch.dtype = torch.float32,
    target_vocab_size: int | None = None,
    tokenizer: Tokenizer | None = None,
    weight_cache_dir: Path | None = None,
    block_size: int = 16,
    num_blocks: int | None = None,
    max_num_batched_tokens: int | None = None,
    target: DecoderLM | None = None,
    target_source: str | None = None,
    buckets: list[int] | None = None,
    cuda_graphs: bool = False,
) -> Proposer | None:
    """The configured proposer; ``draft`` also needs the target's dtype, vocabulary size, tokenizer,
    weight cache, KV block size / pool size (its own pool defaults to the target's count) and
    per-step token budget (its prompt catch-ups are chunked to it); ``mtp`` the target model, what
    it was loaded from (``LoadConfig.model``: its checkpoint may carry the MTP layers) and the KV
    block size / pool size (the heads keep K/V under the target's block tables); ``eagle3`` the
    target model and the KV block size / pool size. A draft model's single-token steps and a head's
    drafting steps use the target's batch ``buckets``; a draft model, with ``cuda_graphs``, graphs of its own."""
    if cfg.method is SpeculativeMethod.NONE:
        if not cfg.grammar_drafts:
            return None
        from specdecode.runtime.proposers.forced import ForcedProposer

        return ForcedProposer()
    if cfg.method is SpeculativeMethod.NGRAM:
        from specdecode.runtime.proposers.ngram import NgramProposer

        return NgramProposer(cfg.prompt_lookup_min, cfg.prompt_lookup_max, cfg.num_speculative_tokens, device)
    if cfg.method is SpeculativeMethod.SUFFIX:
        from specdecode.runtime.proposers.suffix import SuffixProposer

        return SuffixProposer(cfg.suffix_max_depth, cfg.suffix_max_cached_requests, cfg.suffix_min_token_prob)
    if cfg.method is SpeculativeMethod.DRAFT:
        from specdecode.runtime.proposers.draft import DraftProposer

        if target_vocab_size is None or tokenizer is None or num_blocks is None or max_num_batched_tokens is None:
            raise ValueError("method 'draft' needs the target's vocabulary size, tokenizer, KV pool size and step token budget")
        return DraftProposer.load(
            cfg, device, dtype, target_vocab_size=target_vocab_size, tokenizer=tokenizer,
            weight_cache_dir=weight_cache_dir, block_size=block_size, num_blocks=num_blocks,
            max_catch_up_tokens=max_num_batched_tokens, buckets=buckets, cuda_graphs=cuda_graphs,
        )
    if cfg.method is SpeculativeMethod.MTP:
        from specdecode.runtime.proposers.mtp import load_mtp_proposer

        if target is None or target_source is None or num_blocks is None:
            raise ValueError("method 'mtp' needs the target model, where it was loaded from and its KV pool size")
        heads = load_mtp_proposer(cfg, target, target_source, block_size=block_size, num_blocks=num_blocks)
        heads.buckets = buckets
        return heads
    if cfg.method is SpeculativeMethod.EAGLE3:
        from specdecode.runtime.proposers.eagle3 import load_eagle3_proposer

        if target is None or num_blocks is None:
            raise ValueError("method 'eagle3' needs the target model and its KV pool size")
        head = load_eagle3_proposer(cfg, target, block_size=block_size, num_blocks=num_blocks)
        head.buckets = buckets
        return head
    raise ValueError(f"speculative method {cfg.method.value!r} is not available in this build yet")
