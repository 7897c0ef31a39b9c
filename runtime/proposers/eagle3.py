"""EAGLE-3 proposer: a head over the target's low, middle and high residual streams, taken from the
same forward that verifies, drafting over a reduced vocabulary mapped back to the target's.

No extra target pass: the proposer names its head's aux layers (``aux_layer_ids``), the verify
forward returns the residual streams entering them beside its hidden states, and ``observe`` gets
them instead of the hidden states: it fuses them (``fc``) and runs the head over the slots that
became final in the step (prompt chunks included). Slots, formulas and the chain are the head's
(``models/eagle3.py``): its K/V lives in its own pools under the target's block tables, so it is
prefix-cached, rolled back by position and recomputed after preemption with the target's.

The state, drafting and following the target are ``proposers/heads.py``'s (shared with MTP
heads), for one module: ``carry`` = in(count) = fc(aux(count − 1)). ``propose`` for a sequence of n
tokens: the head runs slot n − 1, its output drafts token 1; draft j + 1 comes from chain slot
n − 1 + j, fed draft j and ``chain_hidden`` of the output before. The chain attends every slot
before it (one module, no hidden keys). Once verified, the accepted slots run again in ``observe``
as final slots, fed the fused aux states, writing over the chain's K/V; later chain slots are
rewritten before they are read.

Drafts are chosen over the head's N draft rows: q comes back over the target vocabulary (the draft
rows' probabilities scattered to their target ids through ``d2t``, zero elsewhere), so rejection
stays exact.
"""
from __future__ import annotations

import torch

from specdecode.runtime.config import SpeculativeConfig
from specdecode.runtime.models.attention import AttentionBatch
from specdecode.runtime.models.decoder import DecoderLM
from specdecode.runtime.models.eagle3 import Eagle3Head
from specdecode.runtime.models.eagle3_checkpoint import load_eagle3_head
from specdecode.runtime.proposers.heads import HeadProposer


class Eagle3Proposer(HeadProposer):
    """One EAGLE-3 head: module 0 of a one-module ``HeadProposer``."""

    def __init__(self, head: Eagle3Head, target: DecoderLM, num_blocks: int, block_size: int):
        super().__init__(target, 1, head.config.hidden_size, num_blocks, block_size, head.target_ids())
        self.head = head
        self.aux_layer_ids = head.config.aux_layer_ids
        self.kv_pools = head.new_kv_pools(num_blocks, block_size, self.dtype, self.device)

    def _source(self, observed: torch.Tensor) -> torch.Tensor:  # the aux states [T, 3·H_t] → fc [T, H]
        return self.head.fuse(observed)

    def _embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.head.embed(self.target, token_ids)

    def _module(self, m: int, inputs: torch.Tensor, embeds: torch.Tensor, batch: AttentionBatch) -> torch.Tensor:
        return self.head(inputs, embeds, self.kv_pools, batch)

    def _chain_input(self, out: torch.Tensor) -> torch.Tensor:
        return self.head.chain_hidden(out)

    def _draft_logits(self, m: int, out: torch.Tensor) -> torch.Tensor:
        return self.head.draft_logits(out)


def load_eagle3_proposer(cfg: SpeculativeConfig, target: DecoderLM, *, block_size: int,
                         num_blocks: int) -> Eagle3Proposer:
    """The head in ``cfg.eagle3_path`` (refused by the loader, naming what is wrong, when it does not fit)."""
    return Eagle3Proposer(load_eagle3_head(cfg.eagle3_path, target), target, num_blocks, block_size)
