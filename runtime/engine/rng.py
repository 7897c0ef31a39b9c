"""Position-keyed random numbers: a request's randomness is a pure function of (seed, position).

A stateful generator would advance differently with and without speculation (a step that
verifies K drafts consumes more draws than one that samples one token), so seeded output would
depend on the proposer. Keying each draw on the absolute position of the token it decides makes
``target_match`` reproduce seeded no-spec sampling token for token, keeps preemption-recompute
reproducible, and is independent of batch composition. SplitMix64 is the hash.
"""
from __future__ import annotations

import random
from enum import IntEnum

import torch

_MASK = (1 << 64) - 1


class Stream(IntEnum):
    SAMPLE = 1  # inverse-CDF sampling of an emitted token (plain, recovered or bonus)
    ACCEPT = 2  # rejection sampling's accept test
    DRAFT = 3  # the draft model's sample of a draft token


def _splitmix64(x: int) -> int:
    z = (x + 0x9E3779B97F4A7C15) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


def uniform(seed: int, position: int, stream: Stream) -> float:
    """A float in [0, 1), exact in fp32 (24 bits), for the token at ``position``."""
    return (_splitmix64(_splitmix64(seed * 4 + int(stream)) + position) >> 40) * 2.0**-24


def uniforms(seed: int, first_position: int, count: int, stream: Stream) -> list[float]:
    return [uniform(seed, first_position + i, stream) for i in range(count)]


def fresh_seed() -> int:
    return random.SystemRandom().randrange(1 << 62)


def as_tensor(rows: list[list[float]], width: int, device: torch.device) -> torch.Tensor:
    """Pad rows to ``width`` and move them in one transfer: [len(rows), width] fp32."""
    return torch.tensor([r + [0.0] * (width - len(r)) for r in rows], dtype=torch.float32, device=device)
