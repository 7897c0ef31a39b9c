"""``rng.device_uniforms`` is SplitMix64 in int64 torch ops: bit for bit the uint64 hash computed
here in Python ints (the scalar reference the engine used before, so seeded outputs are unchanged),
for seeds across the whole int64 range a request may carry, and without a Tensor→Python conversion."""
import random

import pytest
import torch

from specdecode.bench.step import counting
from specdecode.runtime.engine import rng

_MASK = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    z = (x + 0x9E3779B97F4A7C15) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


def reference_uniform(seed: int, position: int, stream: rng.Stream) -> float:
    return (_splitmix64(_splitmix64(seed * 4 + int(stream)) + position) >> 40) * 2.0**-24


def _seeds() -> list[int]:
    r = random.Random(34)
    edges = [0, 1, 2**61, 2**62 - 1, -1, -(2**63), 2**63 - 1]  # fresh_seed's range, then the API's (int64)
    return (edges + [r.randrange(2**61) for _ in range(40)] + [r.randrange(2**61, 2**62) for _ in range(40)]
            + [r.randrange(-(2**63), 2**63) for _ in range(40)])


@pytest.mark.parametrize("stream", list(rng.Stream), ids=lambda s: s.name)
@pytest.mark.parametrize("first_position", [0, 1, 2**31 - 1, 2**40])
def test_device_uniforms_equal_the_python_splitmix64_bit_for_bit(stream, first_position):
    seeds, count = _seeds(), 3
    got = rng.device_uniforms(
        torch.tensor(seeds), torch.full((len(seeds),), first_position), count, stream
    )  # [B, count]
    expected = torch.tensor(
        [[reference_uniform(s, first_position + i, stream) for i in range(count)] for s in seeds], dtype=torch.float32
    )
    assert got.dtype == torch.float32 and got.shape == (len(seeds), count)
    assert torch.equal(got.view(torch.int32), expected.view(torch.int32))
    assert 0.0 <= float(got.min()) and float(got.max()) < 1.0


def test_each_row_starts_at_its_own_position():
    got = rng.device_uniforms(torch.tensor([7, 7, 9]), torch.tensor([5, 6, 0]), 2, rng.Stream.SAMPLE)  # [3, 2]
    assert got[0, 1] == got[1, 0]
    assert got[2].tolist() == [reference_uniform(9, p, rng.Stream.SAMPLE) for p in (0, 1)]


def test_zero_rows_and_zero_count():
    empty = torch.zeros(0, dtype=torch.long)
    assert rng.device_uniforms(empty, empty, 4, rng.Stream.ACCEPT).shape == (0, 4)
    assert rng.device_uniforms(torch.tensor([3]), torch.tensor([0]), 0, rng.Stream.ACCEPT).shape == (1, 0)


def test_device_uniforms_convert_no_tensor_to_python():
    """What would make the host wait for the device (bench-step's syncs): none happens."""
    seeds, positions = torch.tensor([1, 2**62 - 1]), torch.tensor([0, 2**31 - 1])
    with counting() as counted:
        rng.device_uniforms(seeds, positions, 4, rng.Stream.DRAFT)
    assert counted["ops"] > 0  # the modes saw the torch ops
    assert counted["syncs"] == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_device_uniforms_on_cuda_equal_the_cpu_ones_bit_for_bit():
    """int64 multiplication wraps on CUDA as on the CPU: the same stream either way."""
    gen = torch.Generator().manual_seed(7)
    seeds = torch.randint(-(2**63), 2**63 - 1, (64,), generator=gen, dtype=torch.long)
    positions = torch.randint(0, 2**31, (64,), generator=gen, dtype=torch.long)
    for stream in rng.Stream:
        on_cpu = rng.device_uniforms(seeds, positions, 5, stream)
        on_cuda = rng.device_uniforms(seeds.cuda(), positions.cuda(), 5, stream).cpu()
        assert torch.equal(on_cpu.view(torch.int32), on_cuda.view(torch.int32))
