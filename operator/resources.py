"""resources: what runtime pods request by default, how large their /dev/shm is, and when a memory
limit is too small for it.

Runtime pods request cpu and memory without limits (Burstable QoS: the scheduler reserves room,
and they are not the first evicted, yet may use a node's spare memory). /dev/shm is a
memory-backed emptyDir sized by the ranks sharing the pod: NCCL's shared-memory transport between
the GPUs of one pod needs room per rank. What is written there counts toward a memory limit, so
there is none by default, and a limit leaving the runtime less than ``MEMORY_FLOOR`` beside a full
/dev/shm is warned about at admission. docs/operator.md § Resources states these defaults.
"""
from __future__ import annotations

import math
from collections.abc import Iterator
from fractions import Fraction
from typing import TYPE_CHECKING

from specdecode.operator.kubeschema import quantity_value

if TYPE_CHECKING:  # spec.py takes its field descriptions from here
    from specdecode.operator.spec import Resources

DEFAULT_REQUESTS: dict[str, str] = {"cpu": "2", "memory": "8Gi"}
SHM_BASE_GIB = 1
SHM_PER_RANK_GIB = 1
MEMORY_FLOOR = "2Gi"  # beside /dev/shm: the Python process, CUDA's host allocations


def with_defaults(resources: Resources, ranks_per_pod: int) -> Resources:
    """``resources`` with ``DEFAULT_REQUESTS`` for each resource that has neither a request nor a
    limit there (Kubernetes takes a lone limit as the request, which a default must not undercut),
    and /dev/shm sized by ``ranks_per_pod`` unless ``shm_size`` is given."""
    defaults = {k: v for k, v in DEFAULT_REQUESTS.items() if k not in resources.limits}
    shm = resources.shm_size
    if shm is None:
        shm = f"{SHM_BASE_GIB + SHM_PER_RANK_GIB * ranks_per_pod}Gi"
    return resources.model_copy(update={"requests": {**defaults, **resources.requests}, "shm_size": shm})


def memory_limit_warnings(resources: Resources) -> Iterator[str]:
    """A warning for a memory limit below /dev/shm + ``MEMORY_FLOOR`` (``resources`` filled)."""
    limit, shm = resources.limits.get("memory"), resources.shm_size
    if limit is None or shm is None:
        return
    least = _amount(shm) + _amount(MEMORY_FLOOR)
    if _amount(limit) < least:
        yield (f"spec.resources.limits.memory: {limit} leaves the runtime less than {MEMORY_FLOOR} beside /dev/shm "
               f"({shm}, resources.shmSize), which counts toward the limit: the pod may be OOM-killed once /dev/shm "
               f"fills; raise the limit to at least {_spelled(least)}, lower shmSize, or remove the limit")


def _amount(quantity: int | str) -> Fraction:
    amount = quantity_value(quantity)
    assert amount is not None, quantity  # spec.Quantity checked it
    return amount


def _spelled(amount: Fraction) -> str:
    """``amount`` bytes as a quantity: in Gi or Mi where whole, else in bytes."""
    for suffix, unit in (("Gi", 1 << 30), ("Mi", 1 << 20)):
        if amount % unit == 0:
            return f"{amount // unit}{suffix}"
    return str(math.ceil(amount))
