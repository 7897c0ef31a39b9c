"""Acceptance statistics of one system at one concurrency, from the engine's own counters.

Terms as in DESIGN.md §3 and ``/metrics``: a *draft* is one step's proposal for one sequence
(at least one draft token); *acceptance rate* = accepted tokens / draft tokens; *mean
acceptance length* = 1 + accepted tokens / drafts (tokens emitted per verify step of a sequence,
the bonus or recovered token included); *per-position acceptance* [i] = drafts whose token i was
accepted / drafts (vLLM's definition: with short drafts, a position may be proposed less often
than there are drafts).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from specdecode.runtime.engine.sequence import SpecCounts


@dataclass
class Acceptance:
    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int
    rate: float | None  # None without draft tokens
    mean_length: float | None  # None without drafts
    per_position: list[float]


def summarize(counts: list[SpecCounts]) -> Acceptance:
    """Pool the counters of several runs (sums, then ratios: not a mean of per-run ratios)."""
    total = SpecCounts()
    for c in counts:
        total.record_counts(c)
    drafts = total.num_drafts
    return Acceptance(
        drafts,
        total.num_draft_tokens,
        total.num_accepted_tokens,
        total.num_accepted_tokens / total.num_draft_tokens if total.num_draft_tokens else None,
        1 + total.num_accepted_tokens / drafts if drafts else None,
        [n / drafts for n in total.accepted_per_position] if drafts else [],
    )


def format_per_position(per_position: list[float], k: int) -> str:
    """``0.71/0.52/0.40/0.31`` over positions 0..k-1 (positions never accepted read 0.00)."""
    padded = per_position[:k] + [0.0] * (k - len(per_position[:k]))
    return "/".join(f"{p:.2f}" for p in padded)


def plot_per_position(curves: dict[str, list[float]], k: int, path: Path, title: str) -> None:
    """One line per (system, concurrency): acceptance at draft positions 1..k. No pyplot."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6, 4), dpi=120)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    positions = list(range(1, k + 1))
    for label, per_position in curves.items():
        padded = per_position[:k] + [0.0] * (k - len(per_position[:k]))
        ax.plot(positions, padded, marker="o", label=label)
    ax.set_xticks(positions)
    ax.set_ylim(0, 1)
    ax.set_xlabel("draft position")
    ax.set_ylabel("drafts accepted at this position / drafts")
    ax.set_title(title, fontsize=10)
    if curves:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
