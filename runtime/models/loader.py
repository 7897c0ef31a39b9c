"""``load_model``: an alias, a ``*.gguf`` file or a Hugging Face folder → a ready ``DecoderLM``.

GGUF weights are dequantized once and cached (``weight_cache``); a cache hit is loaded as the
HF folder it is. Big models are allocated uninitialised (meta device), straight in the target
dtype and device, then filled. Under tensor parallelism each rank reads the full weights (the
cache stays full-size) and keeps its own slice.
"""
from __future__ import annotations

import contextlib
import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from specdecode.runtime.config import LoadConfig, LoadFormat
from specdecode.runtime.device import resolve_device, resolve_dtype
from specdecode.runtime.models import aliases, weight_cache
from specdecode.runtime.models.decoder import DecoderLM, RotaryEmbedding
from specdecode.runtime.models.dummy import random_hf_weights
from specdecode.runtime.models.gguf_loader import open_gguf
from specdecode.runtime.models.hf_loader import is_hf_folder, open_hf_folder
from specdecode.runtime.models.model_config import ModelConfig
from specdecode.runtime.models.mtp_checkpoint import is_mtp_weight
from specdecode.runtime.models.pipeline_stage import PipelineStage
from specdecode.runtime.models.tensor_parallel import TensorParallel
from specdecode.runtime.tokenizer import Tokenizer


@dataclass
class LoadedModel:
    model: DecoderLM  # eval mode, requires_grad off, on ``device`` in ``dtype``; this rank's shard
    tokenizer: Tokenizer
    config: ModelConfig
    name: str  # default served model name: the alias, or the file/folder stem
    max_model_len: int  # the model's context length
    device: torch.device
    dtype: torch.dtype


class Checkpoint(Protocol):
    hf_config: dict[str, Any]

    def weights(self, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]: ...


def load_model(cfg: LoadConfig, tp: TensorParallel = TensorParallel(), stage: PipelineStage = PipelineStage()) -> LoadedModel:
    """The model (``tp.rank``'s shard of ``stage``'s part of it) and its tokenizer; a ``tp.size``
    that does not divide the model's heads, or more stages than layers, raises ValueError naming
    the numbers, before any weight is read."""
    device = resolve_device(cfg.device)
    dtype = resolve_dtype(cfg.dtype, device)
    with _model_path(cfg) as path:
        config_dict, weights, tokenizer = _open(path, cfg, dtype)
        config = ModelConfig.from_hf(config_dict)
        model = build_model(config, weights, device, dtype, tp, stage)
    if cfg.chat_template is not None:
        tokenizer = tokenizer.with_chat_template_file(cfg.chat_template)
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        config=config,
        name=served_name(cfg.model),
        max_model_len=config.max_position_embeddings,
        device=device,
        dtype=dtype,
    )


def save_model_shape(model: str, folder: Path) -> None:
    """What ``load_format`` dummy needs of ``model`` (an alias, GGUF file or folder) into ``folder``:
    config.json and the tokenizer's files, a few MB that travel where the weights do not."""
    cfg = LoadConfig(model=model, load_format=LoadFormat.DUMMY)
    with _model_path(cfg) as path:
        hf_config, _, tokenizer = _open(path, cfg, torch.float32)  # the weights, lazy, are never drawn
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(hf_config, indent=1), encoding="utf-8")
    tokenizer.save(folder)


def served_name(model: str) -> str:
    if aliases.is_alias(model):
        return model.lower()
    path = Path(model)
    return path.stem if path.suffix.lower() == ".gguf" else path.resolve().name


@contextlib.contextmanager
def _model_path(cfg: LoadConfig) -> Iterator[Path]:
    if aliases.is_alias(cfg.model):
        with aliases.alias_gguf(cfg.model, cfg.weight_cache_dir) as path:
            yield path
        return
    path = Path(cfg.model).expanduser()
    if not path.exists():
        raise FileNotFoundError(
            f"model {cfg.model!r} is neither a known alias ({', '.join(aliases.ALIASES)}) nor an existing path"
        )
    yield path


def _open(
    path: Path, cfg: LoadConfig, dtype: torch.dtype
) -> tuple[dict[str, Any], Iterable[tuple[str, torch.Tensor]], Tokenizer]:
    """(HF config dict, weight iterator in ``dtype``, tokenizer) for a GGUF file or an HF folder;
    with ``load_format`` dummy no weight is read (a folder needs only config.json and the tokenizer)."""
    dummy = cfg.load_format is LoadFormat.DUMMY
    if path.is_dir():
        if not is_hf_folder(path):
            ggufs = sorted(p.name for p in path.glob("*.gguf"))
            hint = f"; pass one of its GGUF files instead: {ggufs}" if ggufs else ""
            raise ValueError(f"{path} is not a Hugging Face model folder (no config.json){hint}")
        if dummy:
            hf_config = json.loads((path / "config.json").read_text(encoding="utf-8"))
            return hf_config, _dummy_weights(hf_config, dtype), Tokenizer.from_hf_folder(path)
        hf = open_hf_folder(path)
        num_layers = hf.hf_config.get("num_hidden_layers", 0)
        weights = ((n, t) for n, t in hf.weights(dtype) if not is_mtp_weight(n, num_layers))  # the head's, loaded apart
        return hf.hf_config, weights, hf.tokenizer
    if path.suffix.lower() != ".gguf":
        raise ValueError(f"{path}: expected a *.gguf file or a Hugging Face folder")
    cache_dir = cfg.weight_cache_dir
    if dummy:
        gguf = open_gguf(path)
        return gguf.hf_config, _dummy_weights(gguf.hf_config, dtype), Tokenizer.from_gguf_metadata(gguf.tokenizer)
    entry = weight_cache.lookup(cache_dir, path, dtype) if cache_dir is not None else None
    if entry is not None:
        cached = open_hf_folder(entry)
        return cached.hf_config, cached.weights(dtype), cached.tokenizer
    gguf = open_gguf(path)
    tokenizer = Tokenizer.from_gguf_metadata(gguf.tokenizer)
    weights: Iterable[tuple[str, torch.Tensor]] = gguf.weights(dtype)
    if cache_dir is not None:
        weights = weight_cache.write_through(cache_dir, gguf, tokenizer, weights, dtype)
    return gguf.hf_config, weights, tokenizer


def _dummy_weights(hf_config: dict[str, Any], dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    return ((name, t.to(dtype)) for name, t in random_hf_weights(ModelConfig.from_hf(hf_config)))


def build_model(
    config: ModelConfig,
    weights: Iterable[tuple[str, torch.Tensor]],
    device: torch.device,
    dtype: torch.dtype,
    tp: TensorParallel = TensorParallel(),
    stage: PipelineStage = PipelineStage(),
) -> DecoderLM:
    """Allocate (``tp``'s shard of ``stage``'s part) on ``device`` in ``dtype``, fill from the full
    ``weights`` (the other stages' are skipped), freeze."""
    model = _allocate(config, device, dtype, tp, stage)
    model.load_weights(weights)  # raises on any missing or unexpected weight
    model.eval()
    model.requires_grad_(False)
    return model


# Random initialisation that the checkpoint overwrites costs seconds for big models (13 s for a
# 1.5B model on 2 CPU cores), so those are built on the meta device and allocated uninitialised.
# Small ones are built directly: the meta path costs ~1.5 s once per process (a meta nn.Embedding
# init imports torch._dynamo), which would dominate loading a tiny test model.
_META_INIT_MIN_PARAMS = 50_000_000


def _allocate(
    config: ModelConfig, device: torch.device, dtype: torch.dtype, tp: TensorParallel, stage: PipelineStage
) -> DecoderLM:
    if _num_params(config) < _META_INIT_MIN_PARAMS:
        with torch.device(device):
            model = DecoderLM(config, tp, stage).to(dtype)
    else:
        with torch.device("meta"):
            model = DecoderLM(config, tp, stage)
        model = model.to(dtype).to_empty(device=device)
    # The RoPE tables are computed buffers, not weights: (re)build them for real, in fp32 as constructed.
    model.rope = RotaryEmbedding(config.head_dim, config.max_position_embeddings, config.rope_theta).to(device)
    return model


def _num_params(c: ModelConfig) -> int:
    attention = c.hidden_size * (2 * c.num_heads + 2 * c.num_kv_heads) * c.head_dim
    per_layer = attention + 3 * c.hidden_size * c.intermediate_size
    return c.vocab_size * c.hidden_size * (1 if c.tie_word_embeddings else 2) + c.num_layers * per_layer
