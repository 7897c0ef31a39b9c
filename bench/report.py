"""Present one benchmark run: medians, speedups, acceptance, the table and the throughput plot.

Terms: a *run* is one pass over the prompt set at one concurrency; each system has one warm-up
run (not reported) then one timed run per concurrency in each of ``--runs`` *rounds* (every
system runs once per round, ``command.py``). Per timed run we take tokens/s (generated tokens /
wall time) and the p50 over requests of TTFT, ITL and e2e; the table shows the median of those
over the rounds. *vs ours-nospec* = tokens/s ÷ ours-nospec's, *vs transformers* = tokens/s ÷ the
transformers system doing the same thing (``System.peer``), both at the same concurrency and
taken within each round, then the median over rounds (``paired_ratios``): the machine's speed
drifts between rounds more than the ratios we judge; with several rounds the table also shows
the range of the per-round ratios vs ours-nospec. Acceptance, and a pipeline system's cost per
step (``PipelineSteps``), are pooled over the timed runs.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path

from specdecode.bench import acceptance
from specdecode.bench.correctness import Correctness
from specdecode.bench.records import PipelineSteps, SystemResult
from specdecode.bench.schedule import BUSY_CORES
from specdecode.bench.systems import NOSPEC, System


@dataclass
class Summary:
    system: str
    concurrency: int
    tokens_per_s: float
    ttft_p50_s: float
    itl_p50_s: float
    e2e_p50_s: float
    vs_nospec: float | None = None
    vs_nospec_range: tuple[float, float] | None = None  # lowest and highest per-round ratio
    vs_peer: float | None = None
    acceptance: acceptance.Acceptance | None = None  # ours with speculation only
    pipeline: PipelineSteps | None = None  # ours with pipeline stages only
    busy: bool = False  # a reported run had > BUSY_CORES of competing CPU: its timing is inflated
    check: str = ""


def summarize(result: SystemResult, concurrency: int) -> Summary:
    runs = result.timed(concurrency)

    def median_p50(metric: str) -> float:
        return statistics.median(statistics.median(getattr(t, metric) for t in r.requests) for r in runs)

    counts = [r.spec for r in runs if r.spec is not None]
    pipeline = [r.pipeline for r in runs if r.pipeline is not None]
    competing = [r.competing_cpu_cores for r in runs if r.competing_cpu_cores is not None]
    return Summary(
        result.system,
        concurrency,
        statistics.median(r.tokens_per_s for r in runs),
        median_p50("ttft_s"),
        median_p50("itl_s"),
        median_p50("e2e_s"),
        acceptance=acceptance.summarize(counts) if counts else None,
        pipeline=PipelineSteps.pool(pipeline),
        busy=max(competing, default=0.0) > BUSY_CORES,
    )


def build_summaries(systems: list[System], results: dict[str, SystemResult], correctness: Correctness) -> list[Summary]:
    """Rows by concurrency, then in the systems' order; ratios at the same concurrency."""
    rows = [summarize(results[s.name], c) for c in sorted({c for s in systems for c in s.concurrency})
            for s in systems if c in s.concurrency and results[s.name].timed(c)]
    peer_of = {s.name: s.peer for s in systems}
    for r in rows:
        r.check = correctness.label(r.system, r.concurrency)
        if r.system != NOSPEC and NOSPEC in results:
            r.vs_nospec = paired_ratio(results[r.system], results[NOSPEC], r.concurrency)
            ratios = paired_ratios(results[r.system], results[NOSPEC], r.concurrency)
            r.vs_nospec_range = (min(ratios), max(ratios)) if len(ratios) > 1 else None
        if peer_of.get(r.system) in results:
            r.vs_peer = paired_ratio(results[r.system], results[peer_of[r.system]], r.concurrency)
    return rows


def paired_ratios(system: SystemResult, baseline: SystemResult, concurrency: int) -> list[float]:
    """Per round that both ran at this concurrency: ``system``'s tokens/s ÷ ``baseline``'s."""
    base = {r.round: r.tokens_per_s for r in baseline.timed(concurrency)}
    return [r.tokens_per_s / base[r.round] for r in system.timed(concurrency) if r.round in base]


def paired_ratio(system: SystemResult, baseline: SystemResult, concurrency: int) -> float | None:
    """Median over rounds of ``paired_ratios``; None where they share no round at this concurrency."""
    ratios = paired_ratios(system, baseline, concurrency)
    return statistics.median(ratios) if ratios else None


def format_table(rows: list[Summary], k: int) -> str:
    """A Markdown table (pastes into the README as it is); "(busy)" marks inflated timings."""
    head = ["system", "c", "tokens/s", "TTFT p50 (ms)", "ITL p50 (ms)", "vs ours-nospec", "vs transformers",
            "accept rate", "mean accept len", f"accepted at position 1..{k}", "outputs"]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for r in rows:
        acc = r.acceptance
        cells = [
            r.system, str(r.concurrency), f"{r.tokens_per_s:.1f}" + (" (busy)" if r.busy else ""),
            f"{r.ttft_p50_s * 1e3:.0f}", f"{r.itl_p50_s * 1e3:.1f}",
            _ratio(r.vs_nospec) + (" ({:.2f}–{:.2f})".format(*r.vs_nospec_range) if r.vs_nospec_range else ""),
            _ratio(r.vs_peer),
            f"{acc.rate:.2f}" if acc and acc.rate is not None else "",
            f"{acc.mean_length:.2f}" if acc and acc.mean_length is not None else "",
            acceptance.format_per_position(acc.per_position, k) if acc and acc.num_drafts else "",
            r.check,
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def format_pipeline_table(rows: list[Summary]) -> str:
    """The pipeline systems' cost per engine step, pooled over their timed runs, as a Markdown
    table ("" without pipeline systems). Bubble = rank 0's wait from handing its hidden states on
    until the verdicts arrive."""
    piped = [r for r in rows if r.pipeline is not None]
    if not piped:
        return ""
    head = ["system", "c", "steps", "verdict bytes/step", "budget bytes/step", "bubble ms/step", "first stage ms/step"]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for r in piped:
        p = r.pipeline
        cells = [r.system, str(r.concurrency), str(p.steps), f"{p.verdict_bytes_per_step:.0f}",
                 f"{p.verdict_budget_bytes_per_step:.0f}", f"{p.waiting_s_per_step * 1e3:.1f}",
                 f"{p.first_stage_s_per_step * 1e3:.1f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _ratio(x: float | None) -> str:
    return f"{x:.2f}×" if x is not None else ""


def plot_throughput(rows: list[Summary], path: Path, title: str) -> None:
    """Grouped bars: tokens/s by concurrency, one bar per system. No pyplot: no global state."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    concurrencies = sorted({r.concurrency for r in rows})
    systems = list(dict.fromkeys(r.system for r in rows))
    by_key = {(r.system, r.concurrency): r for r in rows}
    width = 0.8 / len(systems)
    fig = Figure(figsize=(8, 4.5), dpi=120)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for s, system in enumerate(systems):
        xs = [i + (s - (len(systems) - 1) / 2) * width for i in range(len(concurrencies))]
        ys = [by_key[(system, c)].tokens_per_s if (system, c) in by_key else 0.0 for c in concurrencies]
        bars = ax.bar(xs, ys, width, label=system)
        ax.bar_label(bars, fmt="%.1f", fontsize=6)
    ax.set_xticks(range(len(concurrencies)), [str(c) for c in concurrencies])
    ax.set_xlabel("concurrency (requests in flight)")
    ax.set_ylabel("generated tokens/s")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
