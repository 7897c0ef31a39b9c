"""Multi-token-prediction (MTP) heads in the DeepSeek-V3 form, sharing the target's embedding and LM head.

A head has L *modules* (DeepSeek's MTP depths; each one decoder block, or a few in Qwen3-Next's
layout). Module ℓ maps an input hidden state h and a token x to an output hidden state

    out = blocks(eh_proj(cat[enorm(embed(x)), hnorm(h)]))    embedding first (DeepSeek-V3, GLM, Qwen3-Next)
    out = blocks(eh_proj(cat[hnorm(h), enorm(embed(x))]))    hidden first (MiMo)

and drafts the token after x from the target's LM head over ``final_norm(out)``. The embedding
and the LM head are the target's: a head never holds a copy of them.

*Slots.* The head keeps paged K/V under the target's block tables. Module ℓ's slot q holds token
x_q fed with the input hidden state in_ℓ(q), at RoPE position q, and predicts x_{q+1}:

    in_0(q) = tap(h_{q-1})      the target's hidden state at q − 1 (zeros at q = 0)
    in_ℓ(q) = out_{ℓ-1}(q-1)    for ℓ ≥ 1 (zeros at q = 0)

``tap`` is the target's residual stream before its final norm or after it (``HiddenTap``, a field
of the head's config: MiMo's is pre-norm, DeepSeek-V3's and Qwen3-Next's post-norm, ours post-norm
unless trained otherwise). vLLM feeds the same pair (h_i, x_{i+1}) at position i; rotary scores
depend only on position differences, so position i + 1 here computes the same thing. DeepSeek
zeroes the embedding at its first position instead of having a slot 0; here slot 0 is fed a zero
hidden state (one extra key at the start of the head's context). A slot's K/V depends only on
x_0..x_q, exactly like the target's own slot q, so the head's KV is prefix-cached, rolled back by
position and recomputed after preemption together with the target's.

*Drafting* for a sequence of n tokens whose last the target has not computed yet: every module
runs slot n − 1 (final: x_{n-1} is known), module 0's output there gives draft 1; draft j + 1
(j ≥ 1) comes from module j mod L at slot n − 1 + j, fed the previous draft step's output and draft
j (vLLM's rule: with one module, that module is chained). A chained module attends its own final
slots and the chain slots where it ran (``chain_hidden_keys``), never a slot only another module
ran at.
"""
from __future__ import annotations

import hashlib
from enum import Enum

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import nn

from specdecode.runtime.models.attention import AttentionBatch
from specdecode.runtime.models.decoder import DecoderLayer, DecoderLM, RMSNorm, RotaryEmbedding
from specdecode.runtime.models.linear import Linear
from specdecode.runtime.models.model_config import ModelConfig
from specdecode.runtime.models.tensor_parallel import TensorParallel


class HiddenTap(str, Enum):
    """Which target hidden state feeds the head: fixed by each published naming (what its body's
    forward hands the MTP layers, ``models/mtp_checkpoint.py``), chosen at training for ours."""

    PRE_NORM = "pre_norm"  # the residual stream after the last decoder layer
    POST_NORM = "post_norm"  # after the target's final norm (what the LM head reads)

    def apply(self, target: DecoderLM, hidden: torch.Tensor) -> torch.Tensor:
        """The target's pre-norm hidden states [T, H] (as the runner returns them) → this tap's [T, H]."""
        return target.model.norm(hidden) if self is HiddenTap.POST_NORM else hidden


class ConcatOrder(str, Enum):
    EMBEDDING_FIRST = "embedding_first"  # DeepSeek-V3 (Megatron's code), GLM, Qwen3-Next
    HIDDEN_FIRST = "hidden_first"  # MiMo


class _Record(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class TargetFingerprint(_Record):
    """The target a head was trained for. The embedding is hashed by its sign pattern, which any
    dtype the target is loaded in (fp32, bf16, fp16) keeps."""

    name: str = Field(description="the target model as given to train-mtp (alias, file or folder name)")
    architecture: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    embedding_sign_sha256: str

    @classmethod
    def of(cls, model: DecoderLM, name: str) -> "TargetFingerprint":
        c = model.config
        return cls(name=name, architecture=c.architecture, vocab_size=c.vocab_size, hidden_size=c.hidden_size,
                   num_hidden_layers=c.num_layers, embedding_sign_sha256=embedding_sign_sha256(model))

    def describe(self) -> str:
        return (f"{self.name!r} ({self.architecture}, vocabulary {self.vocab_size}, hidden size {self.hidden_size}, "
                f"{self.num_hidden_layers} layers, embedding {self.embedding_sign_sha256[:12]})")

    def same_model(self, other: "TargetFingerprint") -> bool:
        return self.model_dump(exclude={"name"}) == other.model_dump(exclude={"name"})


class MtpConfig(_Record):
    """The head's own settings (the block shapes are the target's)."""

    num_modules: int = Field(ge=1, description="L: modules, each predicting from the previous one's output")
    blocks_per_module: int = Field(1, ge=1, description="decoder blocks inside each module (Qwen3-Next: its MTP layers)")
    hidden_tap: HiddenTap = HiddenTap.POST_NORM
    concat_order: ConcatOrder = ConcatOrder.EMBEDDING_FIRST
    draft_vocab_size: int = Field(0, ge=0, description="the reduced draft vocabulary's default size; 0 = full")
    target: TargetFingerprint | None = Field(None, description="the target trained for; None for a checkpoint's own layers")


def embedding_sign_sha256(model: DecoderLM) -> str:
    return sign_sha256(model.model.embed_tokens.weight)


def sign_sha256(weight: torch.Tensor) -> str:
    """SHA-256 of a tensor's sign pattern (which positive entries), packed to bits."""
    return hashlib.sha256(np.packbits((weight > 0).cpu().numpy()).tobytes()).hexdigest()


class MtpModule(nn.Module):
    """One MTP depth: norms and projection of (token embedding, hidden state), then decoder block(s)."""

    def __init__(self, cfg: ModelConfig, num_blocks: int, hidden_first: bool):
        super().__init__()
        self.hidden_first = hidden_first
        self.enorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.eh_proj = Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.blocks = nn.ModuleList(DecoderLayer(cfg, TensorParallel()) for _ in range(num_blocks))
        self.final_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def combine(self, hidden: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        """hidden, embeds: [T, H] → the first block's input [T, H]."""
        e, h = self.enorm(embeds), self.hnorm(hidden)
        return self.eh_proj(torch.cat([h, e] if self.hidden_first else [e, h], dim=-1))

    def forward(
        self,
        hidden: torch.Tensor,  # [T, H] input hidden states in_ℓ
        embeds: torch.Tensor,  # [T, H] the target's embedding of each slot's token
        rope: RotaryEmbedding,
        kv_pools: list[tuple[torch.Tensor, torch.Tensor]],  # one (K, V) pool per block
        batch: AttentionBatch,
    ) -> torch.Tensor:  # [T, H] out_ℓ, before final_norm
        x = self.combine(hidden, embeds)
        for block, pool in zip(self.blocks, kv_pools):
            x = block(x, rope, pool, batch)
        return x


class MtpHead(nn.Module):
    """The modules of a head (parameters ``layers.{ℓ}.…``) and, when it was trained with one, the
    draft vocabulary ``draft_vocab_ids`` [N] (token ids, most frequent in its training data first)."""

    def __init__(self, target_cfg: ModelConfig, cfg: MtpConfig, draft_vocab_ids: torch.Tensor | None = None):
        super().__init__()
        self.config = cfg
        hidden_first = cfg.concat_order is ConcatOrder.HIDDEN_FIRST
        self.layers = nn.ModuleList(
            MtpModule(target_cfg, cfg.blocks_per_module, hidden_first) for _ in range(cfg.num_modules)
        )
        self.draft_vocab_ids = draft_vocab_ids  # [N] long, or None

    def tap(self, target: DecoderLM, hidden: torch.Tensor) -> torch.Tensor:
        """The target's hidden states [T, H] (pre-norm, as the runner returns them) → the head's input."""
        return self.config.hidden_tap.apply(target, hidden)
