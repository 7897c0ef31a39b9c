"""Judge and present one benchmark run: correctness checks, medians, the table, the JSON, the plot.

Terms: a *run* is one pass over the prompt set at one concurrency; each system has one warm-up
run (not reported) then ``--runs`` timed runs per concurrency. Per timed run we take tokens/s
(generated tokens / wall time) and the p50 over requests of TTFT, ITL and e2e; the table shows
the median of those over the timed runs. *Speedup* = our tokens/s / the peer's, same concurrency.
"""
from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path

from specdecode.runtime.bench.records import RunResult, SystemResult

TIE_RTOL = 1e-4  # a greedy mismatch is benign only where the reference's top-2 logits are this close


@dataclass
class Summary:
    system: str
    concurrency: int
    tokens_per_s: float
    ttft_p50_s: float
    itl_p50_s: float
    e2e_p50_s: float
    speedup: float | None = None  # ours / peer tokens/s; None for the peer or without one
    check: str = ""


@dataclass
class PeerMismatch:
    prompt_index: int
    position: int
    ours_token: int
    peer_token: int
    peer_top2_ids: list[int] | None
    peer_top2_logits: list[float] | None
    relative_gap: float | None
    near_tie: bool


@dataclass
class Correctness:
    self_checked: bool  # our concurrency 1 ran, so other concurrencies are compared with it
    peer_checked: bool  # concurrency 1 ran for both systems
    peer_mismatches: list[PeerMismatch] = field(default_factory=list)
    self_mismatches: dict[int, list[int]] = field(default_factory=dict)  # c → prompts ≠ our c=1 output
    peer_batch_differs: dict[int, list[int]] = field(default_factory=dict)  # info: peer c>1 vs peer c=1
    failures: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failures


def summarize(result: SystemResult, concurrency: int) -> Summary:
    runs = result.timed(concurrency)

    def median_p50(metric: str) -> float:
        return statistics.median(statistics.median(getattr(t, metric) for t in r.requests) for r in runs)

    return Summary(
        result.system,
        concurrency,
        statistics.median(r.tokens_per_s for r in runs),
        median_p50("ttft_s"),
        median_p50("itl_s"),
        median_p50("e2e_s"),
    )


def _first_outputs(result: SystemResult, concurrency: int) -> list[list[int]] | None:
    runs = result.timed(concurrency)
    return runs[0].outputs if runs else None


def _differing(runs: list[RunResult], reference: list[list[int]]) -> list[int]:
    return sorted({i for r in runs for i, (a, b) in enumerate(zip(r.outputs, reference)) if a != b})


def check_correctness(ours: SystemResult, peer: SystemResult | None, concurrencies: list[int]) -> Correctness:
    """At c=1 ours must equal the peer token for token (near-ties excepted); at every c, each of
    our timed runs must equal our first c=1 run (batch invariance and determinism)."""
    ours_single = _first_outputs(ours, 1)
    peer_single = _first_outputs(peer, 1) if peer else None
    out = Correctness(self_checked=ours_single is not None, peer_checked=ours_single is not None and peer_single is not None)
    if ours_single is None:  # concurrency 1 not asked for: nothing to check against
        return out
    for c in concurrencies:
        bad = _differing(ours.timed(c), ours_single)
        if bad:
            out.self_mismatches[c] = bad
            out.failures.append(f"ours at concurrency {c} differs from ours at concurrency 1 on prompts {bad}")
    if peer is None or peer_single is None:
        return out
    if peer.prompt_token_ids != ours.prompt_token_ids:
        out.failures.append("the systems were given different prompt token ids")
    ties = {t.prompt_index: t for t in peer.tie_checks}
    for i, (mine, theirs) in enumerate(zip(ours_single, peer_single)):
        pos = next((p for p, (a, b) in enumerate(zip(mine, theirs)) if a != b), None)
        if pos is None:
            continue
        tie = ties.get(i)
        near = tie is not None and tie.position == pos and tie.is_near_tie(TIE_RTOL)
        out.peer_mismatches.append(
            PeerMismatch(
                i, pos, mine[pos], theirs[pos],
                tie.top2_ids if tie else None, tie.top2_logits if tie else None, tie.relative_gap if tie else None, near,
            )
        )
        if not near:
            out.failures.append(f"prompt {i}: ours differs from transformers at generated token {pos} and it is not a near-tie")
    for c in concurrencies:
        if c != 1:
            bad = _differing(peer.timed(c), peer_single)
            if bad:
                out.peer_batch_differs[c] = bad
    return out


def build_summaries(ours: SystemResult, peer: SystemResult | None, concurrencies: list[int], correctness: Correctness) -> list[Summary]:
    rows = []
    for c in concurrencies:
        mine = summarize(ours, c)
        mine.check = _check_label(correctness, c)
        rows.append(mine)
        if peer is not None:
            theirs = summarize(peer, c)
            mine.speedup = mine.tokens_per_s / theirs.tokens_per_s
            rows.append(theirs)
    return rows


def _check_label(correctness: Correctness, c: int) -> str:
    if c in correctness.self_mismatches:
        return "FAILURE (≠ our c=1)"
    if c != 1:
        return "= our c=1" if correctness.self_checked else "not checked"
    if not correctness.peer_checked:
        return "not checked (no peer)"
    hard = [m for m in correctness.peer_mismatches if not m.near_tie]
    if hard:
        return f"FAILURE ({len(hard)} ≠ transformers)"
    ties = len(correctness.peer_mismatches)
    return f"= transformers ({ties} near-ties)" if ties else "= transformers"


def format_table(rows: list[Summary]) -> str:
    """A Markdown table (pastes into the README as it is)."""
    head = ["system", "concurrency", "tokens/s", "TTFT p50 (ms)", "ITL p50 (ms)", "e2e p50 (s)", "speedup vs peer", "outputs"]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for r in rows:
        speedup = f"{r.speedup:.2f}×" if r.speedup is not None else ""
        cells = [
            r.system, str(r.concurrency), f"{r.tokens_per_s:.1f}", f"{r.ttft_p50_s * 1e3:.0f}",
            f"{r.itl_p50_s * 1e3:.1f}", f"{r.e2e_p50_s:.2f}", speedup, r.check,
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot_throughput(rows: list[Summary], path: Path, title: str) -> None:
    """Grouped bars: tokens/s by concurrency, ours vs the peer. No pyplot: no global state."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    concurrencies = sorted({r.concurrency for r in rows})
    systems = list(dict.fromkeys(r.system for r in rows))
    by_key = {(r.system, r.concurrency): r for r in rows}
    width = 0.8 / len(systems)
    fig = Figure(figsize=(6, 4), dpi=120)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for s, system in enumerate(systems):
        xs = [i + (s - (len(systems) - 1) / 2) * width for i in range(len(concurrencies))]
        ys = [by_key[(system, c)].tokens_per_s if (system, c) in by_key else 0.0 for c in concurrencies]
        bars = ax.bar(xs, ys, width, label=system)
        ax.bar_label(bars, fmt="%.1f", fontsize=8)
    ax.set_xticks(range(len(concurrencies)), [str(c) for c in concurrencies])
    ax.set_xlabel("concurrency (requests in flight)")
    ax.set_ylabel("generated tokens/s")
    ax.set_title(title, fontsize=10)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


def correctness_json(correctness: Correctness) -> dict:
    return {**asdict(correctness), "ok": correctness.ok, "tie_rtol": TIE_RTOL}
