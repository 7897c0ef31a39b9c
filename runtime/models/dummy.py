"""Random weights of a model's shape, under the Hugging Face names the loader reads.

``--load-format dummy`` serves them (as vLLM's does): the model's config and tokenizer without its
weights, to time steps where the weights cannot travel (a GPU machine the checkpoint is not on:
``scripts/gpu_check.sh`` carries a config folder of a few MB). The same seed gives the same full
tensors on every rank, each loading its shard of them, so tensor and pipeline layouts still agree.
Outputs are noise; nothing but speed means anything with them.
"""
from __future__ import annotations

from collections.abc import Iterator

import torch

from specdecode.runtime.models.model_config import ModelConfig

DUMMY_SEED = 0
DUMMY_STD = 0.02  # Hugging Face's initializer_range for these models


def random_hf_weights(cfg: ModelConfig, seed: int = DUMMY_SEED, std: float = DUMMY_STD) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, fp32 tensor) for every weight of ``cfg``'s model, one at a time: norm weights near 1,
    the embedding at unit scale, the rest ``std``-scaled normals."""
    gen = torch.Generator().manual_seed(seed)
    H, I = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim

    def rand(*shape: int, scale: float = std) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * scale

    yield "model.embed_tokens.weight", rand(cfg.vocab_size, H, scale=1.0)
    yield "model.norm.weight", 1 + rand(H)
    if not cfg.tie_word_embeddings:
        yield "lm_head.weight", rand(cfg.vocab_size, H, scale=0.25)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        yield from ((p + "input_layernorm.weight", 1 + rand(H)), (p + "post_attention_layernorm.weight", 1 + rand(H)),
                    (p + "self_attn.q_proj.weight", rand(q, H)), (p + "self_attn.k_proj.weight", rand(kv, H)),
                    (p + "self_attn.v_proj.weight", rand(kv, H)), (p + "self_attn.o_proj.weight", rand(H, q)),
                    (p + "mlp.gate_proj.weight", rand(I, H)), (p + "mlp.up_proj.weight", rand(I, H)),
                    (p + "mlp.down_proj.weight", rand(H, I)))
        if cfg.attention_bias:
            yield from ((p + "self_attn.q_proj.bias", rand(q)), (p + "self_attn.k_proj.bias", rand(kv)),
                        (p + "self_attn.v_proj.bias", rand(kv)))
