"""Are the outputs right? Greedy outputs are compared token for token, per (system, concurrency).

- At concurrency 1 the *truth* is ``transformers-plain``: every other system (ours with and
  without speculation, transformers' prompt-lookup / assisted) must equal it. A difference is
  benign only where transformers-plain's top-2 logits at the first differing token hold exactly
  the two tokens and lie within ``TIE_RTOL`` (a floating-point near tie, ``records.TieCheck``);
  otherwise it is a MISMATCH. Without the peer (``--skip-peer``) ours are compared with
  ``ours-nospec`` and, with no logits to prove a tie, every difference is a MISMATCH.
- At concurrency > 1 each of our systems must equal its own reference's concurrency-1 output
  (``System.self_reference``): batch invariance and determinism. transformers' left-padded
  batches are only reported when they differ from its own concurrency 1 (information).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from specdecode.bench.records import SystemResult, TieCheck
from specdecode.bench.systems import NOSPEC, PEER_PLAIN, System

TIE_RTOL = 1e-4  # a greedy mismatch is benign only where the reference's top-2 logits are this close


@dataclass
class Mismatch:
    system: str
    concurrency: int
    reference: str  # the system whose concurrency-1 output this one must equal
    prompt_index: int
    position: int  # first differing generated token
    token: int
    reference_token: int
    top2_ids: list[int] | None = None  # the reference's top-2 there, where computed
    top2_logits: list[float] | None = None
    relative_gap: float | None = None
    near_tie: bool = False


@dataclass
class Correctness:
    references: dict[str, str] = field(default_factory=dict)  # "system@c" → its reference ("" = not checked)
    mismatches: list[Mismatch] = field(default_factory=list)
    peer_batch_differs: dict[int, list[int]] = field(default_factory=dict)  # info: peer c>1 vs peer c=1
    failures: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failures

    def label(self, system: str, concurrency: int) -> str:
        """The table's "outputs" cell."""
        reference = self.references.get(f"{system}@{concurrency}", "")
        if system == PEER_PLAIN:
            return "reference" if concurrency == 1 else ""
        if not reference:
            return "not checked"
        mine = [m for m in self.mismatches if m.system == system and m.concurrency == concurrency]
        hard = sum(not m.near_tie for m in mine)
        if hard:
            return f"MISMATCH ({hard} ≠ {reference})"
        return f"= {reference} ({len(mine)} near-ties)" if mine else f"= {reference}"

    def to_json(self) -> dict:
        return {**asdict(self), "ok": self.ok, "tie_rtol": TIE_RTOL}


def check(systems: list[System], results: dict[str, SystemResult]) -> Correctness:
    out = Correctness()
    truth = results.get(PEER_PLAIN)
    truth_single = _first_outputs(truth, 1) if truth else None
    ties = {(t.prompt_index, t.position, t.other_token): t for t in truth.tie_checks} if truth else {}
    for system in systems:
        result = results[system.name]
        for c in system.concurrency:
            if system.name == PEER_PLAIN:
                _note_peer_batch(out, result, c)
            elif c == 1 and truth_single is not None:
                _compare(out, result, c, PEER_PLAIN, truth_single, ties)
            elif c == 1 and system.runner == "ours":
                _compare(out, result, c, NOSPEC, _first_outputs(results[NOSPEC], 1), {})
            elif system.self_reference:
                reference = f"{system.self_reference} c=1"
                _compare(out, result, c, reference, _first_outputs(results[system.self_reference], 1), {})
    if truth and any(r.prompt_token_ids != truth.prompt_token_ids for r in results.values()):
        out.failures.append("the systems were given different prompt token ids")
    return out


def _compare(
    out: Correctness, result: SystemResult, c: int, reference: str,
    expected: list[list[int]] | None, ties: dict[tuple[int, int, int], TieCheck],
) -> None:
    """Every timed run of ``result`` at ``c`` against ``expected`` (None: nothing to compare with)."""
    if expected is None:
        return
    out.references[f"{result.system}@{c}"] = reference
    seen: set[tuple[int, int, int]] = set()
    for run in result.timed(c):
        for i, (mine, theirs) in enumerate(zip(run.outputs, expected)):
            pos = next((p for p, (a, b) in enumerate(zip(mine, theirs)) if a != b), None)
            if pos is None or (i, pos, mine[pos]) in seen:
                continue
            seen.add((i, pos, mine[pos]))
            tie = ties.get((i, pos, mine[pos]))
            near = tie is not None and tie.is_near_tie(TIE_RTOL)
            out.mismatches.append(Mismatch(
                result.system, c, reference, i, pos, mine[pos], theirs[pos],
                tie.top2_ids if tie else None, tie.top2_logits if tie else None, tie.relative_gap if tie else None, near,
            ))
            if not near:
                out.failures.append(f"{result.system} at concurrency {c}, prompt {i}: differs from {reference} "
                                    f"at generated token {pos} and it is not a near-tie")


def _note_peer_batch(out: Correctness, result: SystemResult, c: int) -> None:
    single = _first_outputs(result, 1)
    if c == 1 or single is None:
        return
    bad = sorted({i for r in result.timed(c) for i, (a, b) in enumerate(zip(r.outputs, single)) if a != b})
    if bad:
        out.peer_batch_differs[c] = bad


def _first_outputs(result: SystemResult, concurrency: int) -> list[list[int]] | None:
    runs = result.timed(concurrency)
    return runs[0].outputs if runs else None
