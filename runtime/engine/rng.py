"""Position-keyed random numbers: a request's randomness is a pure function of (seed, position).

A stateful generator would advance differently with and without speculation (a step that
verifies K drafts consumes more draws than one that samples one token), so seeded output would
depend on the proposer. Keying each draw on the absolute position of the token it decides makes
``target_match`` reproduce seeded no-spec sampling token for token, keeps preemption-recompute
reproducible, and is independent of batch composition. SplitMix64 is the hash.

The uniform for (seed, position, stream) is
``top24(splitmix64(splitmix64(seed * 4 + stream) + position)) * 2^-24``, exact in fp32, hashed
modulo 2^64. It is computed where the seeds are, in int64 torch ops, without a host sync: two's
complement addition, multiplication and xor wrap exactly as uint64's do (so ``seed * 4`` of any
int64 seed keeps its bits), and only the right shifts, arithmetic in int64, are masked to be logical.
"""
from __future__ import annotations

import random
from enum import IntEnum

import torch

_GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)  # SplitMix64's constants above 2^63, as int64
_MIX1 = 0xBF58476D1CE4E5B9 - (1 << 64)
_MIX2 = 0x94D049BB133111EB - (1 << 64)


class Stream(IntEnum):
    SAMPLE = 1  # inverse-CDF sampling of an emitted token (plain, recovered or bonus)
    ACCEPT = 2  # rejection sampling's accept test
    DRAFT = 3  # the draft model's sample of a draft token


def _shift_right(z: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64: the arithmetic shift with the copied sign bits cleared."""
    return (z >> bits) & ((1 << (64 - bits)) - 1)


def _splitmix64(x: torch.Tensor) -> torch.Tensor:  # int64, any shape
    z = x + _GOLDEN
    z = (z ^ _shift_right(z, 30)) * _MIX1
    z = (z ^ _shift_right(z, 27)) * _MIX2
    return z ^ _shift_right(z, 31)


def device_uniforms(
    seeds: torch.Tensor,  # [B] int64
    first_positions: torch.Tensor,  # [B] int64
    count: int,
    stream: Stream,
) -> torch.Tensor:  # [B, count] fp32 in [0, 1): row b, column i decides position first_positions[b] + i
    keys = _splitmix64(seeds * 4 + int(stream))  # [B]
    positions = first_positions[:, None] + torch.arange(count, device=seeds.device)  # [B, count]
    return _shift_right(_splitmix64(keys[:, None] + positions), 40).to(torch.float32) * 2.0**-24


def fresh_seed() -> int:
    return random.SystemRandom().randrange(1 << 62)
