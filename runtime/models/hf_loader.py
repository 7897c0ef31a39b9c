"""Hugging Face checkpoint folders: ``config.json`` + ``*.safetensors`` (single or sharded) + tokenizer."""
from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from specdecode.runtime.tokenizer import Tokenizer

_INDEX = "model.safetensors.index.json"
# Buffers some old checkpoints saved that the model recomputes.
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


@dataclass
class HFCheckpoint:
    path: Path
    hf_config: dict[str, Any]
    weight_files: list[Path]
    tokenizer: Tokenizer

    def weights(self, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, tensor in ``dtype`` on the CPU), read shard by shard through memory maps."""
        for file in self.weight_files:
            with safe_open(file, framework="pt", device="cpu") as shard:
                for name in shard.keys():
                    if not name.endswith(_IGNORED_SUFFIXES):
                        yield name, shard.get_tensor(name).to(dtype)


def is_hf_folder(path: Path) -> bool:
    return path.is_dir() and (path / "config.json").is_file()


def open_hf_folder(path: str | Path) -> HFCheckpoint:
    path = Path(path)
    if not is_hf_folder(path):
        raise FileNotFoundError(f"{path} is not a Hugging Face model folder (no config.json)")
    return HFCheckpoint(
        path=path,
        hf_config=json.loads((path / "config.json").read_text(encoding="utf-8")),
        weight_files=safetensors_files(path),
        tokenizer=Tokenizer.from_hf_folder(path),
    )


def safetensors_files(folder: Path) -> list[Path]:
    """The shards named by the index, else ``model.safetensors``, else every ``*.safetensors``."""
    if (folder / _INDEX).is_file():
        weight_map = json.loads((folder / _INDEX).read_text(encoding="utf-8"))["weight_map"]
        files = [folder / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"{folder}: shards listed in {_INDEX} are missing: {missing}")
        return files
    if (folder / "model.safetensors").is_file():
        return [folder / "model.safetensors"]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"{folder} has no *.safetensors weights (PyTorch .bin checkpoints are not supported; convert them)"
        )
    return files
