"""The records the benchmark's processes exchange as JSON: the job, and each system's results.

Torch-free, so the driving process stays light while the systems run in their subprocesses.
"""
from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from specdecode.runtime.bench.prompts import Messages


@dataclass
class Job:
    """What one system's subprocess must run."""

    model: str
    dtype: str
    device: str
    threads: int
    max_tokens: int
    concurrency: list[int]
    runs: int  # timed runs per concurrency, after one warm-up
    prompts: list[Messages]
    prompt_token_ids: list[list[int]] | None = None  # ours tokenizes; the peer reuses its ids
    tie_check_outputs: list[list[int]] | None = None  # ours at c=1: where the peer differs, check ties


@dataclass
class RequestTiming:
    ttft_s: float  # request start → first token
    itl_s: float  # mean gap per token after the first (0.0 for a one-token request)
    e2e_s: float  # request start → last token
    num_tokens: int

    @classmethod
    def from_arrivals(cls, start: float, arrivals: list[tuple[float, int]]) -> "RequestTiming":
        """``arrivals``: (time, number of tokens that arrived then), in order."""
        first, last = arrivals[0][0], arrivals[-1][0]
        num_tokens = sum(n for _, n in arrivals)
        itl = (last - first) / (num_tokens - 1) if num_tokens > 1 else 0.0
        return cls(first - start, itl, last - start, num_tokens)


@dataclass
class RunResult:
    concurrency: int
    warmup: bool
    wall_s: float
    num_tokens: int  # generated tokens over all requests
    requests: list[RequestTiming]
    outputs: list[list[int]]  # generated token ids, in prompt order
    competing_cpu_cores: float | None = None  # see CompetingCpu

    @property
    def tokens_per_s(self) -> float:
        return self.num_tokens / self.wall_s


class CompetingCpu:
    """How many cores the rest of the machine kept busy while we ran (other processes, plus time
    the hypervisor stole): machine-wide busy CPU time from /proc/stat minus this process's own,
    over the wall time. Linux only (None elsewhere). Started at construction."""

    def __init__(self) -> None:
        self._start = (_machine_busy_s(), _own_cpu_s(), time.perf_counter())

    def cores(self) -> float | None:
        busy0, own0, t0 = self._start
        busy1 = _machine_busy_s()
        if busy0 is None or busy1 is None:
            return None
        return max(0.0, (busy1 - busy0) - (_own_cpu_s() - own0)) / (time.perf_counter() - t0)


def _machine_busy_s() -> float | None:
    stat = Path("/proc/stat")
    if not stat.exists():
        return None
    # cpu  user nice system idle iowait irq softirq steal guest guest_nice (guest is inside user)
    fields = [int(x) for x in stat.read_text().split("\n", 1)[0].split()[1:9]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def _own_cpu_s() -> float:
    t = os.times()
    return t.user + t.system


@dataclass
class TieCheck:
    """Where a system's greedy output first differs from the reference's, the reference's top-2."""

    prompt_index: int
    position: int  # index into the generated tokens
    reference_token: int
    other_token: int
    top2_ids: list[int]
    top2_logits: list[float]

    @property
    def relative_gap(self) -> float:
        a, b = self.top2_logits
        return abs(a - b) / max(abs(a), abs(b), 1e-30)

    def is_near_tie(self, rtol: float) -> bool:
        """A benign mismatch: both tokens are the reference's top-2 and their logits are within rtol."""
        return set(self.top2_ids) == {self.reference_token, self.other_token} and self.relative_gap <= rtol


@dataclass
class SystemResult:
    system: str  # "ours" | "transformers"
    versions: dict[str, str]
    threads: int
    load_s: float
    prompt_token_ids: list[list[int]]
    runs: list[RunResult]
    tie_checks: list[TieCheck] = field(default_factory=list)

    @property
    def max_competing_cpu_cores(self) -> float | None:
        values = [r.competing_cpu_cores for r in self.runs if not r.warmup and r.competing_cpu_cores is not None]
        return max(values, default=None)

    def timed(self, concurrency: int) -> list[RunResult]:
        return [r for r in self.runs if r.concurrency == concurrency and not r.warmup]

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "SystemResult":
        runs = [
            RunResult(**{**r, "requests": [RequestTiming(**t) for t in r["requests"]]}) for r in data["runs"]
        ]
        ties = [TieCheck(**t) for t in data["tie_checks"]]
        return cls(**{**data, "runs": runs, "tie_checks": ties})


RunOnce = Callable[[list[list[int]], int, bool, str], RunResult]  # (prompt ids, concurrency, warmup, tag)


def run_schedule(system: str, job: Job, prompt_ids: list[list[int]], run_once: RunOnce) -> list[RunResult]:
    """Per concurrency: one warm-up run over the first max(2, c) prompts, then ``job.runs`` timed
    runs over all of them, each measured for competing CPU use and logged to stderr."""
    runs = []
    for c in job.concurrency:
        for r in range(job.runs + 1):
            warmup = r == 0
            meter = CompetingCpu()
            result = run_once(prompt_ids[: max(2, c)] if warmup else prompt_ids, c, warmup, f"c{c}r{r}")
            result.competing_cpu_cores = meter.cores()
            runs.append(result)
            label = "warm-up" if warmup else f"run {r}/{job.runs}"
            others = f", others {result.competing_cpu_cores:.2f} cores" if result.competing_cpu_cores is not None else ""
            print(f"[{system}] c={c} {label}: {result.tokens_per_s:.1f} tok/s ({result.wall_s:.1f} s{others})",
                  file=sys.stderr, flush=True)
    return runs


def write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=1), encoding="utf-8")


def read_job(path: Path) -> Job:
    return Job(**json.loads(path.read_text(encoding="utf-8")))
