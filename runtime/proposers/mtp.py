"""MTP proposer: the target's own hidden states, from the same forward that verifies, feed MTP heads.

The state, drafting and following the target are ``proposers/heads.py``'s (shared with EAGLE-3
heads); here: module 0 drafts from the target's hidden state as the head's ``HiddenTap`` takes it,
every module over the target's embedding, and drafts come from the target's LM head. With a
*reduced draft vocabulary* (the N tokens most frequent in the head's training data, EAGLE-3 style)
the logits are computed over those N rows of the LM head only; a token outside them is never
drafted and q is zero there, so q stays exact.
"""
from __future__ import annotations

from pathlib import Path

import torch

from specdecode.runtime.config import SpeculativeConfig
from specdecode.runtime.models.attention import AttentionBatch, kv_pool
from specdecode.runtime.models.decoder import DecoderLM
from specdecode.runtime.models.hf_loader import is_hf_folder
from specdecode.runtime.models.linear import linear
from specdecode.runtime.models.loader import served_name
from specdecode.runtime.models.mtp import MtpHead
from specdecode.runtime.models.mtp_checkpoint import LOOKED_FOR, load_mtp_head
from specdecode.runtime.proposers.heads import HeadProposer

class MtpProposer(HeadProposer):
    """MTP heads drafting from the target's hidden states (``HiddenTap``), over the target's embedding
    and LM head (or N of its rows)."""

    def __init__(
        self, head: MtpHead, target: DecoderLM, num_blocks: int, block_size: int, draft_vocab_size: int | None
    ):
        c = target.config
        vocab_ids, self.lm_weight = _draft_vocabulary(head, target, draft_vocab_size)
        super().__init__(target, len(head.layers), c.hidden_size, num_blocks, block_size, vocab_ids)
        self.head = head
        self.kv_pools = [[kv_pool(num_blocks, block_size, c.num_kv_heads, c.head_dim, dtype=self.dtype, device=self.device)
                          for _ in module.blocks] for module in head.layers]

    def _source(self, observed: torch.Tensor) -> torch.Tensor:  # the target's hidden [T, H] → tap [T, H]
        return self.head.tap(self.target, observed)

    def _embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.target.model.embed_tokens(token_ids)

    def _module(self, m: int, inputs: torch.Tensor, embeds: torch.Tensor, batch: AttentionBatch) -> torch.Tensor:
        return self.head.layers[m](inputs, embeds, self.target.rope, self.kv_pools[m], batch)

    def _draft_logits(self, m: int, out: torch.Tensor) -> torch.Tensor:
        return linear(self.head.layers[m].final_norm(out), self.lm_weight).float()


def _draft_vocabulary(head: MtpHead, target: DecoderLM, size: int | None) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(draft token ids [N] or None for the full vocabulary, the LM head rows drafted over [N or V, H])."""
    n = head.config.draft_vocab_size if size is None else size
    if n == 0:
        return None, target.lm_head_weight
    if head.draft_vocab_ids is None:
        raise ValueError("draft_vocab_size needs a head trained by `specdecode train-mtp` (it stores the draft "
                         "vocabulary); this head has none: leave draft_vocab_size unset or 0")
    if n > len(head.draft_vocab_ids):
        raise ValueError(f"draft_vocab_size {n} exceeds the head's draft vocabulary ({len(head.draft_vocab_ids)} tokens)")
    ids = head.draft_vocab_ids[:n].to(target.lm_head_weight.device)
    return ids, target.lm_head_weight.index_select(0, ids)


def load_mtp_proposer(
    cfg: SpeculativeConfig, target: DecoderLM, target_source: str, *, block_size: int, num_blocks: int
) -> MtpProposer:
    """The heads in ``cfg.mtp_path``, else the MTP layers of the target's own checkpoint folder;
    refused with what was looked for and how to train a head when there are none."""
    folder = cfg.mtp_path or target_source
    if cfg.mtp_path is None and not is_hf_folder(Path(target_source).expanduser()):
        raise ValueError(f"method 'mtp': the model {target_source!r} is not a Hugging Face folder, so it carries no MTP "
                         f"layers (looked for {LOOKED_FOR}); train a head with `specdecode train-mtp --model "
                         f"{target_source} --out DIR` and pass mtp_path")
    head = load_mtp_head(folder, target, served_name(target_source))
    return MtpProposer(head, target, num_blocks, block_size, cfg.draft_vocab_size)
