"""Cache of dequantized GGUF weights, so that only the first start pays for dequantization.

An entry is a Hugging Face folder (``config.json``, ``model.safetensors``, ``tokenizer.json``,
``tokenizer_config.json``, ``generation_config.json``) named after the GGUF file's identity
(resolved path, size, mtime) and the dtype; a hit loads it like any HF folder, memory-mapped.
The safetensors file is written while the weights stream into the model (no second copy in
memory), in a temporary folder renamed into place when complete, so a crash or a full disk
never leaves a half entry behind. Too little free space skips caching with a warning.
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import shutil
import struct
import tempfile
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import BinaryIO

import torch

from specdecode.runtime.models.gguf_loader import GGUFCheckpoint, TensorSpec
from specdecode.runtime.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

CACHE_FORMAT = 1
WEIGHTS_FILE = "model.safetensors"
_HEADROOM_BYTES = 64 << 20  # tokenizer files, filesystem slack
_SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


def entry_path(cache_dir: Path, gguf_path: Path, dtype: torch.dtype) -> Path:
    """``<cache_dir>/<stem>-<dtype>-<hash of path, size, mtime, format>``."""
    stat = gguf_path.stat()
    identity = f"{CACHE_FORMAT}|{gguf_path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{dtype}"
    digest = hashlib.sha256(identity.encode()).hexdigest()[:16]
    return Path(cache_dir) / f"{gguf_path.stem}-{str(dtype).removeprefix('torch.')}-{digest}"


def lookup(cache_dir: Path, gguf_path: Path, dtype: torch.dtype) -> Path | None:
    """The complete cache entry for this file and dtype, if one exists (entries appear atomically)."""
    entry = entry_path(cache_dir, gguf_path, dtype)
    return entry if (entry / WEIGHTS_FILE).is_file() else None


def required_bytes(specs: Sequence[TensorSpec], dtype: torch.dtype) -> int:
    itemsize = torch.empty((), dtype=dtype).element_size()
    return sum(math.prod(s.shape) for s in specs) * itemsize


def write_through(
    cache_dir: Path,
    checkpoint: GGUFCheckpoint,
    tokenizer: Tokenizer,
    weights: Iterable[tuple[str, torch.Tensor]],
    dtype: torch.dtype,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``weights`` unchanged while writing them to a new cache entry (when there is room)."""
    specs = checkpoint.tensor_specs
    final = entry_path(cache_dir, checkpoint.path, dtype)
    staging = _staging_dir(Path(cache_dir), final.name, required_bytes(specs, dtype) + _HEADROOM_BYTES)
    if staging is None:
        return (yield from weights)
    stream = _open_stream(staging / WEIGHTS_FILE, specs, dtype)
    try:
        for name, tensor in weights:
            if stream is not None:
                stream = _write_or_drop(stream, name, tensor, checkpoint.path.name)
            yield name, tensor
        if stream is not None:
            stream.close()
            _commit(staging, final, checkpoint, tokenizer)
    finally:
        if stream is not None:
            stream.close()
        shutil.rmtree(staging, ignore_errors=True)


def _staging_dir(cache_dir: Path, entry_name: str, needed: int) -> Path | None:
    """A fresh temporary folder in ``cache_dir``, or None (with a warning) when there is no room."""
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        free = shutil.disk_usage(cache_dir).free
        if free < needed:
            logger.warning("weight cache %s: %.2f GiB free < %.2f GiB needed; not caching %s",
                           cache_dir, free / 2**30, needed / 2**30, entry_name)
            return None
        return Path(tempfile.mkdtemp(prefix=f".{entry_name}.", dir=cache_dir))
    except OSError as exc:
        logger.warning("weight cache %s unusable (%s): loading without it", cache_dir, exc)
        return None


def _open_stream(path: Path, specs: Sequence[TensorSpec], dtype: torch.dtype) -> "_SafetensorsStream | None":
    try:
        return _SafetensorsStream(path, specs, dtype)
    except OSError as exc:
        logger.warning("weight cache %s not writable (%s): loading without it", path.parent.parent, exc)
        return None


def _write_or_drop(
    stream: "_SafetensorsStream", name: str, tensor: torch.Tensor, what: str
) -> "_SafetensorsStream | None":
    try:
        stream.write(name, tensor)
        return stream
    except OSError as exc:  # e.g. the disk filled up meanwhile: keep loading, drop the entry
        logger.warning("weight cache write failed (%s): not caching %s", exc, what)
        stream.close()
        return None


def _commit(staging: Path, final: Path, checkpoint: GGUFCheckpoint, tokenizer: Tokenizer) -> None:
    stat = checkpoint.path.stat()
    source = {"gguf": str(checkpoint.path.resolve()), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    try:
        (staging / "config.json").write_text(json.dumps(checkpoint.hf_config, indent=1))
        tokenizer.save(staging)
        (staging / "source.json").write_text(json.dumps(source, indent=1))
        staging.chmod(0o755)  # mkdtemp made it private; an entry is as readable as the cache folder
        os.rename(staging, final)
    except OSError as exc:
        if not (final / WEIGHTS_FILE).is_file():  # else another process committed this entry first
            logger.warning("weight cache commit to %s failed: %s", final, exc)
        return
    logger.info("cached dequantized weights in %s", final)


class _SafetensorsStream:
    """A safetensors file whose header is known up front, written one tensor at a time.

    Layout: u64 little-endian header length, JSON header (space-padded to 8 bytes) with each
    tensor's dtype, shape and ``data_offsets`` into the byte buffer that follows.
    """

    def __init__(self, path: Path, specs: Sequence[TensorSpec], dtype: torch.dtype):
        self.dtype = dtype
        itemsize = torch.empty((), dtype=dtype).element_size()
        header: dict[str, object] = {"__metadata__": {"format": "pt"}}
        offset = 0
        for spec in specs:
            size = math.prod(spec.shape) * itemsize
            header[spec.name] = {"dtype": _SAFETENSORS_DTYPES[dtype], "shape": list(spec.shape),
                                 "data_offsets": [offset, offset + size]}
            offset += size
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)
        self.pending = list(reversed(specs))
        self.file: BinaryIO = open(path, "wb")
        self.file.write(struct.pack("<Q", len(blob)))
        self.file.write(blob)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        spec = self.pending.pop()
        if spec.name != name or tuple(tensor.shape) != spec.shape or tensor.dtype != self.dtype:
            raise ValueError(f"cache stream expected {spec}, got {name} {tuple(tensor.shape)} {tensor.dtype}")
        self.file.write(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().data)

    def close(self) -> None:
        if self.file.closed:
            return
        try:
            self.file.flush()
            os.fsync(self.file.fileno())
        finally:
            self.file.close()
