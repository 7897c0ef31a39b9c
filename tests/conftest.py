"""Shared test set-up. TRITON_INTERPRET must be set before any @triton.jit is applied."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(min(2, os.cpu_count() or 1))


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> "os.PathLike[str]":
    """A weight cache shared by every test of the session (the SmolLM2 dequantization runs once)."""
    return tmp_path_factory.mktemp("weight-cache")
