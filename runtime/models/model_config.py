"""Architecture hyper-parameters of a Llama/Qwen2-family decoder, read from a HF config.json dict."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

BODIES = {"llama": "llama", "qwen2": "qwen2", "mimo": "qwen2"}  # model_type → decoder body (MiMo: Qwen2 + MTP)


@dataclass(frozen=True)
class ModelConfig:
    architecture: str  # "llama" | "qwen2"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v projections carry a bias (qwen2)

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> "ModelConfig":
        """Build from a Hugging Face ``config.json`` dict; refuse what we cannot run faithfully."""
        arch = BODIES.get(cfg.get("model_type", ""))
        if arch is None:
            raise ValueError(f"unsupported model_type {cfg.get('model_type', '')!r}; supported: {', '.join(BODIES)}")
        # transformers >= 5 writes ``rope_parameters`` {rope_theta, rope_type, ...} instead of the two keys.
        rope_parameters = cfg.get("rope_parameters") or {}
        rope_scaling = cfg.get("rope_scaling") or rope_parameters
        if rope_scaling and rope_scaling.get("rope_type", rope_scaling.get("type")) not in (None, "default"):
            raise ValueError(f"unsupported rope_scaling {rope_scaling!r}")
        num_heads = cfg["num_attention_heads"]
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(cfg.get("rope_theta", rope_parameters.get("rope_theta", 10000.0))),
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", arch == "qwen2")),
        )

    def to_hf(self) -> dict[str, Any]:
        """The ``config.json`` dict transformers needs to build the same model."""
        model_cls = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[self.architecture]
        out = {
            "architectures": [model_cls],
            "model_type": self.architecture,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": "silu",
        }
        if self.architecture == "llama":
            out["attention_bias"] = self.attention_bias
        return out
