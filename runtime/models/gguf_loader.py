"""GGUF files (llama.cpp's format) → a HF-style config dict, tokenizer metadata and HF-named weights.

GGUF stores shapes in ggml order (fastest dimension first), i.e. reversed from torch; the
reader's numpy views are already in torch order. Quantized tensors are dequantized with the
``gguf`` package's numpy dequantizers. For the llama architecture, llama.cpp's converter
permuted the rows of q_proj/k_proj (and their biases) from HF's rotate-half RoPE layout to
its interleaved one; ``unpermute_rows`` undoes that. Qwen2 files are not permuted.
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGUFReader
from gguf.quants import dequantize
from tqdm import tqdm

from specdecode.runtime.tokenizer import TokenizerMetadata

SUPPORTED_ARCHITECTURES = ("llama", "qwen2")

# blk.N.<gguf part> → model.layers.N.<hf part>
_LAYER_TENSORS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def hf_tensor_name(gguf_name: str) -> str:
    """``blk.3.attn_q.weight`` → ``model.layers.3.self_attn.q_proj.weight``."""
    base, _, kind = gguf_name.rpartition(".")
    if base.startswith("blk."):
        _, layer, part = base.split(".", 2)
        if part in _LAYER_TENSORS:
            return f"model.layers.{layer}.{_LAYER_TENSORS[part]}.{kind}"
    elif base in _GLOBAL_TENSORS:
        return f"{_GLOBAL_TENSORS[base]}.{kind}"
    raise ValueError(f"GGUF tensor {gguf_name!r} has no Llama/Qwen2 counterpart (unsupported model variant)")


def unpermute_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation: per head, rows (2, d/2) were stored as (d/2, 2).

    weight: [num_heads * head_dim, ...] (a projection weight or its bias) → same shape.
    """
    rows = weight.shape[0]
    return (
        weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def dequantize_tensor(tensor: Any) -> np.ndarray:
    """One reader tensor → float32 numpy array in torch order (``[out, in]`` for a weight)."""
    array = dequantize(tensor.data, tensor.tensor_type)
    return array.reshape(tuple(int(d) for d in reversed(tensor.shape)))


@dataclass(frozen=True)
class TensorSpec:
    name: str  # HF name
    shape: tuple[int, ...]  # torch order


@dataclass
class GGUFCheckpoint:
    """An opened GGUF file: metadata parsed, tensors memory-mapped and dequantized on iteration."""

    path: Path
    reader: GGUFReader
    hf_config: dict[str, Any]  # for ModelConfig.from_hf
    tokenizer: TokenizerMetadata

    @property
    def tensor_specs(self) -> list[TensorSpec]:
        return [
            TensorSpec(hf_tensor_name(t.name), tuple(int(d) for d in reversed(t.shape))) for t in self.reader.tensors
        ]

    def weights(self, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, dequantized tensor in ``dtype`` on the CPU), in file order, with a progress bar."""
        permuted = {
            "q_proj": self.hf_config["num_attention_heads"],
            "k_proj": self.hf_config["num_key_value_heads"],
        } if self.hf_config["model_type"] == "llama" else {}
        tensors = tqdm(self.reader.tensors, desc=f"dequantizing {self.path.name}", unit="tensor", leave=False)
        for tensor in tensors:
            name = hf_tensor_name(tensor.name)
            array = dequantize_tensor(tensor)
            for proj, heads in permuted.items():
                if f".{proj}." in name:
                    array = unpermute_rows(array, heads)
            if not array.flags.writeable:  # F32 tensors come back as views of the read-only memory map
                array = array.copy()
            yield name, torch.from_numpy(array).to(dtype)


def open_gguf(path: str | Path) -> GGUFCheckpoint:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    try:
        reader = GGUFReader(path)
    except ValueError as exc:  # gguf raises ValueError on a bad magic / truncated file
        raise ValueError(f"{path} is not a readable GGUF file: {exc}") from exc
    return GGUFCheckpoint(path=path, reader=reader, hf_config=gguf_hf_config(reader),
                          tokenizer=gguf_tokenizer_metadata(reader))


def _field(reader: GGUFReader, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def gguf_hf_config(reader: GGUFReader) -> dict[str, Any]:
    """The ``config.json`` dict Hugging Face would have for this file (``{arch}.*`` metadata keys)."""
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"unsupported GGUF architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")

    def key(name: str, default: Any = ...) -> Any:
        value = _field(reader, f"{arch}.{name}", default)
        if value is ...:
            raise ValueError(f"GGUF metadata lacks {arch}.{name}")
        return value

    tensors = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in tensors:
        raise ValueError("GGUF file has no token_embd.weight tensor")
    num_heads, hidden = key("attention.head_count"), key("embedding_length")
    num_kv_heads = key("attention.head_count_kv", num_heads)
    if isinstance(num_kv_heads, list):  # per-layer list: only a uniform one is a plain decoder
        if len(set(num_kv_heads)) != 1:
            raise ValueError(f"per-layer KV head counts {sorted(set(num_kv_heads))} are not supported")
        num_kv_heads = num_kv_heads[0]
    head_dim = key("attention.key_length", hidden // num_heads)
    rope_dim = key("rope.dimension_count", head_dim)
    if rope_dim != head_dim:
        raise ValueError(f"partial rotary embeddings (rope dim {rope_dim} < head dim {head_dim}) are not supported")
    config = {
        "architectures": [{"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[arch]],
        "model_type": arch,
        "vocab_size": int(tensors["token_embd.weight"].shape[1]),  # ggml order: [hidden, vocab]
        "hidden_size": hidden,
        "intermediate_size": key("feed_forward_length"),
        "num_hidden_layers": key("block_count"),
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim,
        "rms_norm_eps": key("attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": float(key("rope.freq_base", 10000.0)),
        "max_position_embeddings": key("context_length"),
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": "blk.0.attn_q.bias" in tensors,
        "hidden_act": "silu",
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
    }
    scaling = key("rope.scaling.type", "none")
    if scaling not in ("none", "", None):  # refused by ModelConfig.from_hf with a clear message
        config["rope_scaling"] = {"rope_type": scaling, "factor": key("rope.scaling.factor", 1.0)}
    return config


def gguf_tokenizer_metadata(reader: GGUFReader) -> TokenizerMetadata:
    def tok(name: str, default: Any = None) -> Any:
        return _field(reader, f"tokenizer.ggml.{name}", default)

    tokens = tok("tokens")
    if not tokens:
        raise ValueError("GGUF file carries no tokenizer (tokenizer.ggml.tokens is missing)")
    return TokenizerMetadata(
        model=tok("model"),
        pre=tok("pre"),
        tokens=tokens,
        token_types=tok("token_type", []),
        merges=tok("merges", []),
        bos_token_id=tok("bos_token_id"),
        eos_token_id=tok("eos_token_id"),
        eot_token_id=tok("eot_token_id"),
        eom_token_id=tok("eom_token_id"),
        padding_token_id=tok("padding_token_id"),
        unknown_token_id=tok("unknown_token_id"),
        add_bos_token=bool(tok("add_bos_token", False)),
        add_eos_token=bool(tok("add_eos_token", False)),
        chat_template=_field(reader, "tokenizer.chat_template"),
    )
