"""equivalence: does the canary give the stable's greedy outputs? The probe behind
``rollout.analysis.equivalence``.

Greedy decoding with the same target model must give the same tokens whatever the speculative
configuration (the runtime's promise, and the differential fuzzer's); a verifier, KV or kernel bug
breaks it silently. So each analysis interval, on one ready stable replica and one ready canary
replica, called directly (not through the router or the Service):

1. *alone*: each of the interval's prompts to the stable, one at a time;
2. *beside load*: every prompt to the stable again and to the canary, all at once.

Outputs are compared token by token. At the first position where two differ, the gap between the
stable's top-2 logprobs there (from its alone run) decides: under ``nearTieLogprobGap`` nats the
two candidates were a near-tie that floating-point noise may flip — shown, not failed; otherwise
the outputs *diverged*. The control (the stable beside load against the stable alone) comes first:
if it diverges, this hardware does not keep greedy outputs when batching changes (GPU kernels that
are not batch-invariant), nothing can be proven, and the probe is ``Inconclusive``, never a
failure. Otherwise a canary that diverged is rolled back at once (``OutputDiverged``).

The prompts (``PROBE_PROMPTS`` or the spec's) are taken ``promptsPerInterval`` at a time, in turn,
continuing where the last interval stopped. A probe runs on a thread of its own (``Probing``): the
loop starts one at an analysis interval when none runs, and reads its result at the first
interval after it ended. A canary on another model (``spec.model.uri`` other
than the stable's) is not probed: its status says so (``Skipped``).
"""
from __future__ import annotations

import math
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from enum import Enum
from typing import Any

from specdecode.operator import scrape
from specdecode.operator.spec import Equivalence, EquivalenceState, EquivalenceStatus, OutputDivergence

Obj = dict[str, Any]
REQUEST_TIMEOUT_SECONDS = 120.0
PROMPT_CHARS_SHOWN = 80  # of a prompt, in status and Events

# Short prompts of several kinds: definite answers (code, arithmetic, facts) and open ones (a story,
# a continuation), whose greedy paths pass closer calls and so show a numerical change sooner.
PROBE_PROMPTS: tuple[str, ...] = (
    "What is the capital of France?",
    "Write a Python function that adds two numbers.",
    "List the first five prime numbers.",
    "Translate 'good morning' into Spanish.",
    "What is 17 times 3?",
    "Name three primary colours.",
    "Write a haiku about autumn leaves.",
    "What does HTTP stand for?",
    "Give a one-sentence definition of gravity.",
    "Write a SQL query that counts the rows of a table named users.",
    "Tell me a story about a dragon.",
    "Continue: Once upon a time,",
    "Write a bash command that prints the current directory.",
    "Name the largest planet in the solar system.",
    "Complete the sequence: 2, 4, 8, 16,",
    "Explain what a linked list is in one sentence.",
)


# -- comparing two outputs ----------------------------------------------------------------------


@dataclass(frozen=True)
class Output:
    """A greedy completion: its tokens and, at each, the top-1 minus top-2 logprob (None where
    only one candidate came back)."""

    tokens: tuple[str, ...]
    gaps: tuple[float | None, ...]


def output_of(answer: Obj) -> Output:
    """The ``Output`` of a chat completion asked with ``logprobs`` and ``top_logprobs: 2``."""
    content = ((answer.get("choices") or [{}])[0].get("logprobs") or {}).get("content")
    if not isinstance(content, list):
        raise scrape.ScrapeError("the completion carries no logprobs (the runtime must honour logprobs)")
    return Output(tuple(item["token"] for item in content), tuple(_gap(item) for item in content))


def _gap(item: Obj) -> float | None:
    top = sorted((t["logprob"] for t in item.get("top_logprobs") or []), reverse=True)
    return top[0] - top[1] if len(top) >= 2 and all(math.isfinite(x) for x in top[:2]) else None


class Match(str, Enum):
    SAME = "same"
    NEAR_TIE = "near-tie"
    DIVERGED = "diverged"


@dataclass(frozen=True)
class Comparison:
    match: Match
    divergence: OutputDivergence | None = None  # where they first differ (near-tie or divergence)


def compare(prompt: str, stable: Output, other: Output, near_tie_gap: float) -> Comparison:
    """``other`` against ``stable`` (the reference, whose gaps decide a near-tie). Where one output
    ended before the other, its token there is ''; where the stable's had ended, no gap can show a
    near-tie, so the difference counts as a divergence."""
    position = next((i for i, (a, b) in enumerate(zip(stable.tokens, other.tokens)) if a != b),
                    min(len(stable.tokens), len(other.tokens)))
    if position == len(stable.tokens) == len(other.tokens):
        return Comparison(Match.SAME)
    gap = stable.gaps[position] if position < len(stable.tokens) else None
    divergence = OutputDivergence(
        prompt=prompt[:PROMPT_CHARS_SHOWN], position=position, logprob_gap=gap,
        stable_token=stable.tokens[position] if position < len(stable.tokens) else "",
        other_token=other.tokens[position] if position < len(other.tokens) else "")
    near_tie = gap is not None and gap < near_tie_gap
    return Comparison(Match.NEAR_TIE if near_tie else Match.DIVERGED, divergence)


# -- one probe ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class ProbeResult:
    """One interval's probe of ``revision``: counts of its prompts, and the divergence that decided
    a ``DIVERGED`` or ``INCONCLUSIVE`` state."""

    revision: str
    state: EquivalenceState
    same: int = 0
    near_ties: int = 0
    divergence: OutputDivergence | None = None
    message: str = ""


def skipped(revision: str, why: str) -> ProbeResult:
    return ProbeResult(revision, EquivalenceState.SKIPPED, message=why)


def prompts_for(config: Equivalence, done: int) -> list[str]:
    """The next ``promptsPerInterval`` prompts in turn, after the ``done`` probed before."""
    prompts = config.prompts or PROBE_PROMPTS
    count = min(config.prompts_per_interval, len(prompts))
    return [prompts[(done + i) % len(prompts)] for i in range(count)]


def probe(stable_url: str, canary_url: str, *, revision: str, model: str, prompts: Sequence[str],
          config: Equivalence, timeout: float = REQUEST_TIMEOUT_SECONDS) -> ProbeResult:
    """Probe the canary at ``canary_url`` against the stable at ``stable_url`` (base URLs) on
    ``prompts`` (the module docstring). A request that fails makes the probe inconclusive."""
    def complete(url: str, prompt: str) -> Output:
        body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": config.max_tokens,
                "temperature": 0, "logprobs": True, "top_logprobs": 2}
        return output_of(scrape.post_json(f"{url}/v1/chat/completions", body, timeout))

    try:
        alone = [complete(stable_url, p) for p in prompts]
        with ThreadPoolExecutor(max_workers=2 * len(prompts)) as pool:
            stable_beside = list(pool.map(lambda p: complete(stable_url, p), prompts))
            canary_beside = list(pool.map(lambda p: complete(canary_url, p), prompts))
    except scrape.ScrapeError as exc:
        return ProbeResult(revision, EquivalenceState.INCONCLUSIVE, message=f"probe requests failed: {exc}")
    gap = config.near_tie_logprob_gap
    control = [compare(p, a, b, gap) for p, a, b in zip(prompts, alone, stable_beside)]
    tests = [compare(p, a, c, gap) for p, a, c in zip(prompts, alone, canary_beside)]
    if (broken := next((c for c in control if c.match is Match.DIVERGED), None)) is not None:
        return ProbeResult(revision, EquivalenceState.INCONCLUSIVE, divergence=broken.divergence, message=(
            f"the stable disagreed with itself (alone and beside load), {_where(broken.divergence)}: equivalence "
            "cannot be proven on this hardware (its kernels are not batch-invariant)"))
    if (diverged := next((c for c in tests if c.match is Match.DIVERGED), None)) is not None:
        return ProbeResult(revision, EquivalenceState.DIVERGED, divergence=diverged.divergence,
                           message=f"canary {revision}'s greedy output diverged from the stable's, "
                                   f"{_where(diverged.divergence)}")
    near = [c for c in tests if c.match is Match.NEAR_TIE]
    return ProbeResult(revision, EquivalenceState.PROBING, same=len(tests) - len(near), near_ties=len(near),
                       divergence=near[-1].divergence if near else None,
                       message=f"{len(tests) - len(near)} of {len(tests)} prompts gave the stable's tokens"
                               + (f", {len(near)} differed first at a near-tie" if near else ""))


class Probing:
    """One probe running on a thread of its own, so that the loop that started it (and the
    analysis samples it takes every interval) never waits for a generation: ``result()`` is None
    until it has ended. A probe that raised ends inconclusive, with the error."""

    def __init__(self, revision: str, run: Callable[[], ProbeResult]) -> None:
        self.revision = revision
        self._result: ProbeResult | None = None
        self._thread = threading.Thread(target=self._run, args=(run,), name=f"probe-{revision}", daemon=True)
        self._thread.start()

    def _run(self, run: Callable[[], ProbeResult]) -> None:
        try:
            self._result = run()
        except Exception as exc:  # noqa: BLE001 - any failure is this probe's verdict, never the loop's
            self._result = ProbeResult(self.revision, EquivalenceState.INCONCLUSIVE, message=f"probe failed: {exc!r}")

    def result(self) -> ProbeResult | None:
        return None if self._thread.is_alive() else self._result


def _where(d: OutputDivergence | None) -> str:
    if d is None:
        return ""
    gap = "its output had ended" if d.logprob_gap is None else f"top-2 logprob gap {d.logprob_gap:.3f} nats"
    return (f"on prompt {d.prompt!r} at generated token {d.position}: stable {d.stable_token!r} ({gap}), "
            f"other {d.other_token!r}")


def recorded(before: EquivalenceStatus | None, result: ProbeResult) -> EquivalenceStatus:
    """The status after ``result``: counts add up per revision; a divergence stays."""
    if before is None or before.revision != result.revision:
        before = EquivalenceStatus(revision=result.revision, state=EquivalenceState.PROBING)
    elif before.state is EquivalenceState.DIVERGED:
        return before
    return before.model_copy(update={
        "state": result.state, "prompts_same": before.prompts_same + result.same,
        "near_ties": before.near_ties + result.near_ties, "message": result.message,
        "last_divergence": result.divergence or before.last_divergence})
