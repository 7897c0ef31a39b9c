"""The order of a system's runs, and guarding them against a noisy, shared machine.

Per concurrency: one warm-up run over the first max(2, c) prompts (not reported), then
``job.runs`` timed runs over all of them. Around each run we measure the *competing CPU*: the
cores the rest of the machine kept busy meanwhile (other processes, plus time the hypervisor
stole), i.e. machine-wide busy CPU time from /proc/stat minus that of this process and its
descendants (a pipeline group's other ranks are the system under test too), over the wall
time. Before a timed run we wait (up to ``job.quiet_wait_s``) for the machine to go quiet; a
timed run with more than ``BUSY_CORES`` of competing CPU is *discarded* (kept in the JSON,
left out of the medians) and repeated, up to ``job.busy_retries`` times.
"""
from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

from specdecode.bench.records import Job, RunResult

BUSY_CORES = 0.25
QUIET_SAMPLE_S = 2.0

RunOnce = Callable[[list[list[int]], int, bool, str], RunResult]  # (prompt ids, concurrency, warmup, tag)


class CompetingCpu:
    """Cores the rest of the machine kept busy from construction to ``cores()``; None off Linux."""

    def __init__(self) -> None:
        self._start = (_machine_busy_s(), _own_cpu_s(), time.perf_counter())

    def cores(self) -> float | None:
        busy0, own0, t0 = self._start
        busy1 = _machine_busy_s()
        if busy0 is None or busy1 is None:
            return None
        return max(0.0, (busy1 - busy0) - (_own_cpu_s() - own0)) / (time.perf_counter() - t0)


def run_schedule(system: str, job: Job, prompt_ids: list[list[int]], run_once: RunOnce) -> list[RunResult]:
    runs = []
    for c in job.concurrency:
        runs.append(_measured(system, run_once, prompt_ids[: max(2, c)], c, True, f"c{c}w", "warm-up"))
        for r in range(1, job.runs + 1):
            for attempt in range(job.busy_retries + 1):
                _wait_until_quiet(system, job.quiet_wait_s)
                result = _measured(system, run_once, prompt_ids, c, False, f"c{c}r{r}a{attempt}", f"run {r}/{job.runs}")
                runs.append(result)
                busy = result.competing_cpu_cores is not None and result.competing_cpu_cores > BUSY_CORES
                if not busy or attempt == job.busy_retries:
                    break
                result.discarded = True
                print(f"[{system}]   discarded (machine busy), repeating", file=sys.stderr, flush=True)
    return runs


def _measured(system: str, run_once: RunOnce, ids: list[list[int]], c: int, warmup: bool, tag: str, label: str) -> RunResult:
    meter = CompetingCpu()
    result = run_once(ids, c, warmup, tag)
    result.competing_cpu_cores = meter.cores()
    others = f", others {result.competing_cpu_cores:.2f} cores" if result.competing_cpu_cores is not None else ""
    print(f"[{system}] c={c} {label}: {result.tokens_per_s:.1f} tok/s ({result.wall_s:.1f} s{others})",
          file=sys.stderr, flush=True)
    return result


def _wait_until_quiet(system: str, max_wait_s: float) -> None:
    deadline = time.monotonic() + max_wait_s
    told = False
    while time.monotonic() < deadline:
        meter = CompetingCpu()
        time.sleep(QUIET_SAMPLE_S)
        cores = meter.cores()
        if cores is None or cores <= BUSY_CORES:
            return
        if not told:
            print(f"[{system}]   waiting for the machine to go quiet (others use {cores:.2f} cores)", file=sys.stderr, flush=True)
            told = True


def _machine_busy_s() -> float | None:
    stat = Path("/proc/stat")
    if not stat.exists():
        return None
    # cpu  user nice system idle iowait irq softirq steal (guest time is inside user)
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in stat.read_text().split("\n", 1)[0].split()[1:9])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def _own_cpu_s() -> float:
    """CPU seconds of this process and of its live descendants."""
    t = os.times()
    return t.user + t.system + sum(_descendants_cpu_s(os.getpid()))


def _descendants_cpu_s(root: int) -> list[float]:
    """CPU seconds of each live descendant of ``root``, from /proc (none off Linux)."""
    children: dict[int, list[int]] = {}
    cpu: dict[int, float] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:  # the process ended meanwhile
            continue
        # pid (comm) state ppid … utime stime: comm may hold spaces and parentheses, so split after its last ")"
        fields = text[text.rindex(")") + 2:].split()
        pid = int(stat.parent.name)
        children.setdefault(int(fields[1]), []).append(pid)
        cpu[pid] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    found, stack = [], list(children.get(root, []))
    while stack:
        pid = stack.pop()
        found.append(cpu[pid])
        stack.extend(children.get(pid, []))
    return found
