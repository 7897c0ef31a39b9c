"""Llama/Qwen2-family decoder (RMSNorm, RoPE, GQA, SwiGLU) over a paged KV cache.

Parameter names follow Hugging Face (``model.layers.0.self_attn.q_proj.weight`` …) so HF
safetensors load as they are; q/k/v and gate/up are stored fused and filled by ``load_weights``.
Under tensor parallelism (``tensor_parallel``) each rank holds its heads and intermediate slice,
cut from the full checkpoint tensors as they load.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from specdecode.kernels.activation import silu_and_mul
from specdecode.kernels.rmsnorm import fused_add_rms_norm
from specdecode.kernels.rope import apply_rope
from specdecode.runtime.models.attention import AttentionBatch, paged_attention
from specdecode.runtime.models.linear import Linear, linear
from specdecode.runtime.models.model_config import ModelConfig
from specdecode.runtime.models.pipeline_stage import PipelineStage
from specdecode.runtime.models.tensor_parallel import RowParallelLinear, TensorParallel


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [T, dim] → [T, dim]
        return fused_add_rms_norm(x, None, self.weight, self.eps)[0]

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """residual + x, then its norm, in one pass: x, residual [T, dim] → (normed, residual + x) [T, dim]."""
        return fused_add_rms_norm(x, residual, self.weight, self.eps)


class RotaryEmbedding(nn.Module):
    """Non-interleaved RoPE (HF ``rotate_half`` layout), cos/sin tables indexed by position."""

    def __init__(self, head_dim: int, max_positions: int, theta: float):
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)  # [max_positions, head_dim]
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # x: [T, heads, head_dim], positions: [T] → [T, heads, head_dim]
        return apply_rope(x, positions, self.cos, self.sin)


class Attention(nn.Module):
    """This rank's heads: column-parallel fused q/k/v, row-parallel o_proj."""

    def __init__(self, cfg: ModelConfig, tp: TensorParallel):
        super().__init__()
        self.num_heads, self.num_kv_heads = cfg.num_heads // tp.size, cfg.num_kv_heads // tp.size
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * cfg.head_dim
        self.kv_size = self.num_kv_heads * cfg.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = RowParallelLinear(self.q_size, cfg.hidden_size, tp)
        self.scale = cfg.head_dim**-0.5

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        rope: RotaryEmbedding,
        kv_pool: tuple[torch.Tensor, torch.Tensor],
        batch: AttentionBatch,
    ) -> torch.Tensor:  # [T, hidden]
        q, k, v = self.project(x, rope, batch.positions)
        return self.o_proj(paged_attention(q, k, v, kv_pool[0], kv_pool[1], batch, self.scale))

    def project(
        self, x: torch.Tensor, rope: RotaryEmbedding, positions: torch.Tensor  # x: [T, hidden], positions: [T]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # q [T, heads, hd], k and v [T, kv_heads, hd]
        """Queries, keys and values with RoPE applied (the attention itself is the caller's)."""
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = rope(q.view(-1, self.num_heads, self.head_dim), positions)
        k = rope(k.view(-1, self.num_kv_heads, self.head_dim), positions)
        return q, k, v.view(-1, self.num_kv_heads, self.head_dim)


class MLP(nn.Module):
    """This rank's intermediate slice: column-parallel fused gate/up, row-parallel down_proj."""

    def __init__(self, cfg: ModelConfig, tp: TensorParallel):
        super().__init__()
        self.intermediate_size = cfg.intermediate_size // tp.size
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * self.intermediate_size, bias=False)
        self.down_proj = RowParallelLinear(self.intermediate_size, cfg.hidden_size, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [T, hidden]
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))  # [T, 2 · intermediate] → [T, intermediate]


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg, tp)

    def forward(self, x, rope, kv_pool, batch):  # x: [T, hidden] → [T, hidden]
        return self.run(x, lambda h: self.self_attn(h, rope, kv_pool, batch))

    def run(self, x: torch.Tensor, attention: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """The block around any attention (paged here; dense with its own mask when training MTP heads)."""
        h, x = self.post_attention_layernorm.add_and_norm(attention(self.input_layernorm(x)), x)  # x += attention
        return x + self.mlp(h)


class DecoderBody(nn.Module):
    """The stage's share of the body: its layers; the embedding and final norm where it holds them."""

    def __init__(self, cfg: ModelConfig, tp: TensorParallel, stage: PipelineStage):
        super().__init__()
        if stage.holds_embedding(cfg):
            self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, tp) for _ in stage.layers(cfg.num_layers))
        if stage.is_last:
            self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


# HF checkpoint name suffix → (our fused parameter, shard index within it)
_FUSED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


class DecoderLM(nn.Module):
    """Causal LM: ``forward`` returns the residual stream's hidden states (before the final norm),
    ``compute_logits`` applies the final norm and the LM head to selected rows only.

    With ``tp.size > 1`` this is one rank's shard: every rank must run the same forward (the
    row-parallel layers all-reduce); the LM head is replicated. With ``stage.size > 1`` it is one
    pipeline stage (``pipeline_stage.py``): its layers only, the embedding on the first stage, the
    final norm and LM head on the last; a later stage's forward starts from the previous stage's
    hidden states.
    """

    def __init__(self, cfg: ModelConfig, tp: TensorParallel = TensorParallel(), stage: PipelineStage = PipelineStage()):
        super().__init__()
        tp.check(cfg)
        stage.check(cfg)
        self.config = cfg
        self.tp = tp
        self.stage = stage
        self.num_local_kv_heads = cfg.num_kv_heads // tp.size  # the KV heads this rank caches
        self.model = DecoderBody(cfg, tp, stage)
        self.rope = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta)
        separate_head = stage.is_last and not cfg.tie_word_embeddings
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False) if separate_head else None

    @property
    def num_local_layers(self) -> int:  # the decoder layers (and KV pools) of this stage
        return len(self.model.layers)

    def forward(
        self,
        inputs: torch.Tensor,  # first stage: token ids [T] long; a later stage: the previous stage's [T, hidden]
        kv_pools: list[tuple[torch.Tensor, torch.Tensor]],  # per local layer (K pool, V pool)
        batch: AttentionBatch,
    ) -> torch.Tensor:  # [T, hidden] after this stage's layers (on the last stage: before the final norm)
        return self.forward_aux(inputs, kv_pools, batch, ())[0]

    def forward_aux(
        self,
        inputs: torch.Tensor,  # as ``forward``'s
        kv_pools: list[tuple[torch.Tensor, torch.Tensor]],
        batch: AttentionBatch,
        aux_layers: tuple[int, ...],  # global layer ids, ascending (any stage's)
    ) -> tuple[torch.Tensor, torch.Tensor]:  # hidden [T, hidden] as ``forward``'s, aux [T, A·hidden]
        """``forward``, and the residual streams entering the A layers of ``aux_layers`` this stage
        runs (id 0: the embedding's output, id i: layer i − 1's output, before any norm) side by side:
        what an EAGLE-3 head fuses, taken from this same pass (an empty [T, 0] without such ids)."""
        x = self.model.embed_tokens(inputs) if self.stage.is_first else inputs
        entering = []
        for i, layer, kv_pool in zip(self.stage.layers(self.config.num_layers), self.model.layers, kv_pools):
            if i in aux_layers:
                entering.append(x)
            x = layer(x, self.rope, kv_pool, batch)
        return x, torch.cat(entering, dim=-1) if entering else x.new_empty(x.shape[0], 0)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, hidden] pre-norm → [N, vocab] fp32
        return linear(self.model.norm(hidden), self.lm_head_weight).float()

    @property
    def lm_head_weight(self) -> torch.Tensor:  # [vocab, hidden]: the LM head, or the tied embedding
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named full tensors in (this rank's slice of each, this stage's weights only),
        filling the fused q/k/v and gate/up parameters shard by shard; ``lm_head.weight`` of a tied
        model is skipped (some checkpoints still carry a copy of the embedding)."""
        cfg, tied = self.config, self.config.tie_word_embeddings
        mine = ((self.stage.local_name(n, cfg), t) for n, t in weights if not (tied and n == "lm_head.weight"))
        load_hf_weights(self, ((n, t) for n, t in mine if n is not None), cfg, self.tp, cfg.architecture)


def load_hf_weights(
    module: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    cfg: ModelConfig,
    tp: TensorParallel,
    what: str,
) -> None:
    """Fill ``module``'s parameters from HF-named full tensors (names relative to ``module``): q/k/v
    and gate/up go shard by shard into the fused ``qkv_proj`` / ``gate_up_proj`` of decoder blocks
    built from ``cfg`` and ``tp``. Unexpected, missing or misshapen weights raise, naming ``what``."""
    params = dict(module.named_parameters())
    sizes = _fused_sizes(cfg, tp)
    loaded: set[str] = set()
    for name, tensor in weights:
        target, shard = name, None
        for part, (fused, index) in _FUSED.items():
            if f".{part}." in name:
                target, shard = name.replace(f".{part}.", f".{fused}."), index
                break
        if target not in params:
            raise KeyError(f"unexpected weight {name!r} for {what}")
        fused_sizes = sizes["qkv_proj" if ".qkv_proj." in target else "gate_up_proj"]
        _copy_shard(params[target], tp.shard(name, tensor), shard, fused_sizes, f"{what}: {name!r}")
        loaded.add(target if shard is None else f"{target}#{shard}")
    missing = _expected_keys(module) - loaded
    if missing:
        raise KeyError(f"{what}: checkpoint lacks {len(missing)} weights, e.g. {sorted(missing)[:3]}")


def _fused_sizes(cfg: ModelConfig, tp: TensorParallel) -> dict[str, list[int]]:
    """Row counts of the parts fused in each decoder block's qkv_proj and gate_up_proj on this rank."""
    q, kv = cfg.num_heads // tp.size * cfg.head_dim, cfg.num_kv_heads // tp.size * cfg.head_dim
    return {"qkv_proj": [q, kv, kv], "gate_up_proj": [cfg.intermediate_size // tp.size] * 2}


def _expected_keys(module: nn.Module) -> set[str]:
    keys = set()
    for name, _ in module.named_parameters():
        if ".qkv_proj." in name:
            keys |= {f"{name}#{i}" for i in range(3)}
        elif ".gate_up_proj." in name:
            keys |= {f"{name}#{i}" for i in range(2)}
        else:
            keys.add(name)
    return keys


def _copy_shard(param: torch.Tensor, tensor: torch.Tensor, shard: int | None, sizes: list[int], name: str) -> None:
    with torch.no_grad():
        if shard is None:
            dest = param
        else:
            start = sum(sizes[:shard])
            dest = param.narrow(0, start, sizes[shard])
        if dest.shape != tensor.shape:
            raise ValueError(f"shape mismatch for {name}: checkpoint {tuple(tensor.shape)} vs model {tuple(dest.shape)}")
        dest.copy_(tensor)
