"""EAGLE-3 heads: a decoder block drafting from a fusion of the target's low, middle and high hidden
states plus the token embedding, chained on its own output, over a reduced draft vocabulary.

The computation (as vLLM's ``llama_eagle3.py`` and speculators' ``Eagle3DraftModel`` run it), for a
token x and an input hidden state g [H]:

    g      = fc(cat[a_low, a_mid, a_high])                 [3·H_t] → [H]: the fused target state
    e, h   = input_layernorm(embed(x)), hidden_norm(g)
    r      = h if norm_before_residual else g              the midlayer's residual
    s      = r + o_proj(attention(qkv_proj(cat[e, h])))    q/k/v project 2H, embedding first
    out    = s + mlp(post_attention_layernorm(s))          then any further plain decoder blocks
    logits = lm_head(norm(out))                            [N], the draft vocabulary
    target id of draft id d = d + d2t[d]

*Aux states.* a_i is the target's residual stream entering its layer i (vLLM's
``aux_hidden_state_layers``: id 0 is the embedding's output, id i the output of layer i − 1, before
any norm). The ids come from the checkpoint's config (``eagle_aux_hidden_state_layer_ids``), else
vLLM's default (2, L // 2, L − 3) for a target of L layers. They come from the verify forward the
target runs anyway: no extra target pass.

*Slots.* As for MTP heads (``models/mtp.py``) the head keeps paged K/V (one pool per block) under
the target's block tables. Slot q holds token x_q fed the input hidden state in(q), at RoPE position
q, and predicts x_{q+1}:

    in(q) = fc(aux(q − 1))    the target's fused aux states at q − 1 (zeros at q = 0: fc has no bias)

vLLM feeds the same pair (aux(i), x_{i+1}) at position i; rotary scores depend only on position
differences, so position i + 1 here computes the same thing, plus one key at slot 0. A final slot's
K/V depends only on x_0..x_q, like the target's own slot q: prefix-cached, rolled back by position
and recomputed after preemption with it.

*Drafting* for a sequence of n tokens whose last the target has not computed yet: slot n − 1 (final:
x_{n-1} is known, in(n − 1) = fc(aux(n − 2))) gives draft 1; draft j + 1 comes from slot n − 1 + j,
fed draft j and the head's own output at the slot before, ``chain_hidden(out(n − 2 + j))``: ``out``
itself, the state before the final norm, as vLLM chains it (``hidden_prenorm``), or ``norm(out)``
for a head trained with speculators' ``norm_output`` (EAGLE 3.1). Unlike a wrapped MTP module, every
chain step is the same head, so it attends every chain slot before it. Once the target has verified
the drafts, the accepted slots are run again as final slots (fed fc(aux)), writing over the chain's
K/V; slots past the accepted ones are never read again before they are rewritten.

*Embedding.* The target's (the head holds no copy), unless the checkpoint carries its own
``embed_tokens`` that differs from it (a head narrower than its target must).
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator
from torch import nn

from specdecode.runtime.models.attention import AttentionBatch, kv_pool
from specdecode.runtime.models.decoder import MLP, Attention, DecoderLayer, DecoderLM, RMSNorm, RotaryEmbedding
from specdecode.runtime.models.linear import Linear, linear
from specdecode.runtime.models.model_config import ModelConfig
from specdecode.runtime.models.tensor_parallel import TensorParallel

KVPool = tuple[torch.Tensor, torch.Tensor]


def default_aux_layer_ids(num_target_layers: int) -> tuple[int, int, int]:
    """vLLM's low, middle and high aux layers for a target of L layers: (2, L // 2, L − 3)."""
    return 2, num_target_layers // 2, num_target_layers - 3


class Eagle3Config(BaseModel):
    """What a published layout specifies about a head (its blocks are llama blocks of these sizes)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    hidden_size: int = Field(gt=0, description="H, the head's width")
    target_hidden_size: int = Field(gt=0, description="H_t, the width of each target aux state fed to fc")
    intermediate_size: int = Field(gt=0)
    num_layers: int = Field(1, ge=1, description="decoder blocks: the midlayer, then plain blocks")
    num_heads: int = Field(gt=0)
    num_kv_heads: int = Field(gt=0)
    head_dim: int = Field(gt=0)
    rms_norm_eps: float = Field(gt=0)
    rope_theta: float = Field(gt=0)
    max_position_embeddings: int = Field(gt=0)
    attention_bias: bool = False
    vocab_size: int = Field(gt=0, description="V, the target's vocabulary")
    draft_vocab_size: int = Field(gt=0, description="N ≤ V rows of the head's lm_head")
    aux_layer_ids: tuple[int, int, int] = Field(
        description="target layers whose input residual streams fc fuses, ascending: the order the target's "
        "forward returns them in (``DecoderLM.forward_aux``)")
    norm_before_residual: bool = Field(False, description="the midlayer's residual is hidden_norm(g), not g")
    norm_output: bool = Field(False, description="chain on norm(out) instead of out (speculators' EAGLE 3.1)")

    @field_validator("aux_layer_ids")
    @classmethod
    def _ascending(cls, ids: tuple[int, int, int]) -> tuple[int, int, int]:
        if list(ids) != sorted(set(ids)):
            raise ValueError(f"aux_layer_ids {list(ids)} must be distinct and ascending (the order fc fuses them in)")
        return ids

    def block_config(self) -> ModelConfig:
        """The llama block shapes of the head's decoder blocks."""
        return ModelConfig(
            architecture="llama", vocab_size=self.vocab_size, hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size, num_layers=self.num_layers, num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads, head_dim=self.head_dim, rms_norm_eps=self.rms_norm_eps,
            rope_theta=self.rope_theta, max_position_embeddings=self.max_position_embeddings,
            tie_word_embeddings=False, attention_bias=self.attention_bias,
        )


class Eagle3MidLayer(nn.Module):
    """The first block: attention over cat[input_layernorm(embedding), hidden_norm(g)] (2H → q/k/v)."""

    def __init__(self, cfg: ModelConfig, norm_before_residual: bool):
        super().__init__()
        self.norm_before_residual = norm_before_residual
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, TensorParallel())
        attn = self.self_attn  # its q/k/v read the two normed halves side by side
        attn.qkv_proj = Linear(2 * cfg.hidden_size, attn.q_size + 2 * attn.kv_size, bias=cfg.attention_bias)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg, TensorParallel())

    def forward(
        self,
        hidden: torch.Tensor,  # [T, H] g: fused aux states, or the chained output
        embeds: torch.Tensor,  # [T, H] each slot's token embedding
        rope: RotaryEmbedding,
        pool: KVPool,
        batch: AttentionBatch,
    ) -> torch.Tensor:  # [T, H] the residual stream after the block
        return self.run(hidden, embeds, lambda x: self.self_attn(x, rope, pool, batch))

    def run(self, hidden: torch.Tensor, embeds: torch.Tensor,
            attention: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:  # [T, H], [T, H] → [T, H]
        """The block around any attention [T, 2H] → [T, H] (paged here; dense with its own mask when training)."""
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        x = torch.cat([self.input_layernorm(embeds), normed], dim=-1)  # [T, 2H]
        h, residual = self.post_attention_layernorm.add_and_norm(attention(x), residual)
        return residual + self.mlp(h)


class Eagle3Head(nn.Module):
    """``fc``, ``layers`` (the midlayer, then plain decoder blocks), ``norm``, ``lm_head`` [N, H],
    ``d2t`` [N] and, where the checkpoint has its own, ``embed_tokens`` [V, H]: the parameters under
    the names the speculators layout uses (the original release's ``midlayer.`` is ``layers.0.``)."""

    def __init__(self, cfg: Eagle3Config, own_embedding: bool = False):
        super().__init__()
        self.config = cfg
        block = cfg.block_config()
        self.fc = Linear(len(cfg.aux_layer_ids) * cfg.target_hidden_size, cfg.hidden_size, bias=False)
        self.layers = nn.ModuleList([Eagle3MidLayer(block, cfg.norm_before_residual)]
                                    + [DecoderLayer(block, TensorParallel()) for _ in range(cfg.num_layers - 1)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size) if own_embedding else None
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        self.rope = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta)

    def fuse(self, aux: torch.Tensor) -> torch.Tensor:  # [T, 3·H_t] cat[a_low, a_mid, a_high] → [T, H] g
        return self.fc(aux)

    def embed(self, target: DecoderLM, tokens: torch.Tensor) -> torch.Tensor:  # [T] long → [T, H]
        table = self.embed_tokens if self.embed_tokens is not None else target.model.embed_tokens
        return table(tokens)

    def forward(
        self,
        hidden: torch.Tensor,  # [T, H] in(q): fused aux states (final slots) or chained outputs
        embeds: torch.Tensor,  # [T, H] the embedding of each slot's token
        kv_pools: list[KVPool],  # one (K, V) pool per block, under the target's block tables
        batch: AttentionBatch,
    ) -> torch.Tensor:  # [T, H] out, before the final norm
        x = self.layers[0](hidden, embeds, self.rope, kv_pools[0], batch)
        for block, pool in zip(self.layers[1:], kv_pools[1:]):
            x = block(x, self.rope, pool, batch)
        return x

    def chain_hidden(self, out: torch.Tensor) -> torch.Tensor:  # [T, H] out → [T, H] in(q + 1) of a chain slot
        return self.norm(out) if self.config.norm_output else out

    def draft_logits(self, out: torch.Tensor) -> torch.Tensor:  # [T, H] out → [T, N] fp32
        return linear(self.norm(out), self.lm_head.weight).float()

    def target_ids(self) -> torch.Tensor:  # [N] long: the target token id of each draft-vocabulary row
        return torch.arange(len(self.d2t), device=self.d2t.device) + self.d2t

    def new_kv_pools(self, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device) -> list[KVPool]:
        """One empty (K, V) pool per block, with ``num_blocks`` blocks and the null block."""
        c = self.config
        return [kv_pool(num_blocks, block_size, c.num_kv_heads, c.head_dim, dtype=dtype, device=device)
                for _ in self.layers]
