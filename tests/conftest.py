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


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


@pytest.fixture
def assert_greedy_match(full_forward):
    """Greedy outputs must be equal token for token, except after a proven near-tie.

    Where they first differ, the target's logits at that position (full recompute of
    prompt + common prefix) must have their top-2 within 1e-4 relative and both tokens must
    be those top-2; anything else fails. Never retried, never loosened.
    """

    def check(model, prompt: list[int], expected: list[int], actual: list[int]) -> None:
        i = first_difference(expected, actual)
        if i is None:
            return
        assert i < len(expected) and i < len(actual), f"lengths differ: {len(expected)} vs {len(actual)}"
        logits = full_forward(model, prompt + expected[:i])[-1]
        (top1, top2), ids = logits.topk(2)
        gap = float((top1 - top2) / top1.abs())
        assert {expected[i], actual[i]} == set(ids.tolist()) and gap < 1e-4, (
            f"outputs differ at {i} ({expected[i]} vs {actual[i]}) without a near-tie: top-2 {ids.tolist()}, gap {gap:.2e}"
        )

    return check
