"""How many draft tokens to ask for this step, from the batch size and measured acceptance.

Speculation trades extra target work per step for fewer steps. Under heavy load the target is
already busy, so a batch-size → K table turns it down (K = 0: off). And when acceptance falls
under a floor, proposals are mostly wasted: speculation switches off for ``reprobe_steps``
steps, then is probed again with a fresh window.

``goodput`` replaces guesses with this server's own measurements. Whether speculation pays
depends on the hardware as much as on acceptance: on a GPU, scoring 5 tokens per sequence
costs about what scoring 1 does; on a CPU it costs up to twice as much, and not in proportion to
the rows (SmolLM2 at batch 8 on a 2-core CPU: K = 1 costs ~1.5× a plain decode step, K = 4
~2×), so no straight line through step times predicts the cost of a K it has not seen. Each
step therefore picks the K (up to the table's) that maximises

    expected tokens emitted per second = (1 + Σ_{i≤K} q_i · c_i) / s(B, K)

where q_i is how often the proposer delivers a draft at position i when asked for one, c_i how
often a delivered draft at position i is accepted (so q_i · c_i is the chance position i adds a
token), and s(B, K) the measured seconds per sequence of a decode-only step that asks K drafts
of each of B sequences (``StepCosts``: the draft-free step's seconds per sequence plus K's extra
seconds per sequence asked; batch sizes in power-of-two buckets; the proposer's own time
included). All estimates forget old data exponentially; none is kept unless ``goodput`` is
on.

Measuring a K costs a few steps at that K, so only a K that could still win is measured:
K = 0 first, then the smallest K > 0 whose tokens could beat the best measured rate even at the
cost of the largest smaller K measured (more drafts never make a step cheaper), counting a
position whose acceptance has not been seen yet as always accepted. Where acceptance is low,
K = 0 and K = 1 are measured and the rest skipped; where drafting is dear, K = 1's cost alone can
rule out every larger K before any acceptance is known. Steps that carry a prefill chunk are not
costed (the chunk dominates them), so they never measure: they take the best measured K of this
batch bucket, or of the nearest bucket measured, and K = 0 while nothing is measured. A draft
costs a mixed step at least what it costs a decode step (its rows also take the chunk's token
budget, delaying admission), so only a K that has won in decode steps is spent there; presuming
speculation pays until measured cost a burst of 32 prompts with the draft model 30% (every
admission step at K = 4, ~90 ms an emitted token against 39 ms without drafts).
While K = 0 wins, every ``reprobe_steps`` decode steps one step asks for the
best K > 0 instead, so its cost and the acceptance estimates stay current; each probe that
confirms K = 0 doubles the interval (up to ``MAX_BACKOFF`` times), so a probe's extra cost
vanishes where speculation does not pay.

A step that explores (measuring a K, learning its acceptance, probing) asks drafts only of the
sequences the proposer can draft for without catching up, or, if fewer, of the
max(``EXPLORE_MIN``, batch / ``EXPLORE_SHARE``) with the least catch-up (``Budget``). A draft model
must feed a sequence's whole prompt before its first draft; exploring by asking every sequence
paid that for all 32 of a burst, most of what draft+lc lost to no-spec at c = 32 (0.87×). N-gram
and suffix have nothing to catch up, so they explore on every sequence, the cleanest measurement.
Extra seconds measured on a few sequences misprice a K somewhat: on a CPU they overprice a small
K (rows are padded to a multiple of 8), and a draft model's first catch-ups inflate them; on a GPU
a few extra rows are nearly free where every sequence's would not be. Steps that ask every
sequence feed the same estimate, so a K that won on a few and loses on all is dropped within a
few steps.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from itertools import accumulate

from specdecode.runtime.config import LoadControl

SEQUENCE_DECAY = 0.995  # weight an old draft observation keeps per new one (about the last 200 sequences)
STEP_DECAY = 0.9  # weight an old step keeps per new step of the same (batch bucket, K): about the last 10
MIN_SAMPLES = 16.0  # decayed draft observations the acceptance estimates need before they are trusted
MIN_STEPS = 3  # steps of a (batch bucket, K) before its cost is trusted
MIN_STEP_WEIGHT = sum(STEP_DECAY**i for i in range(MIN_STEPS))  # their decayed weight
MAX_BACKOFF = 16  # the probe interval grows up to this many times reprobe_steps
EXPLORE_SHARE = 16  # a step that explores asks at least 1/16 of the decoding sequences …
EXPLORE_MIN = 2  # … and at least 2 (or all, if fewer)


def batch_bucket(batch_size: int) -> int:
    """1 | 2 | 3-4 | 5-8 | 9-16 | 17-32 | …: a step's cost per sequence changes little inside a
    bucket, and a server full at a power-of-two batch drains inside one bucket for longest."""
    return (batch_size - 1).bit_length()


class StepCosts:
    """Decode-only step costs by batch bucket: seconds per sequence of steps without drafts, and for
    each K > 0 the extra seconds per sequence asked for K drafts — the step's time over what the
    bucket's draft-free step costs, shared by the sequences that were asked. So a step that asks
    only some sequences (exploring) prices K as well as one that asks all."""

    def __init__(self) -> None:
        self.weight: dict[tuple[int, int], float] = {}
        self.seconds: dict[tuple[int, int], float] = {}

    def observe(self, batch_size: int, k: int, drafting: int, seconds: float) -> None:
        """A step of ``batch_size`` decoding sequences, ``drafting`` of them asked for K drafts. A
        step with drafts is priced only once the bucket's draft-free cost is known."""
        bucket = batch_bucket(batch_size)
        if k == 0 or drafting == 0:
            self._add((bucket, 0), seconds / batch_size)
        elif (base := self._trusted((bucket, 0))) is not None:
            self._add((bucket, k), (seconds - base * batch_size) / drafting)

    def per_sequence(self, batch_size: int, k: int) -> float | None:
        """Seconds per sequence of a step asking every sequence for K; None until ``MIN_STEPS``
        steps of this bucket measured it."""
        return self._cost(batch_bucket(batch_size), k)

    def nearest_measured(self, batch_size: int, k_max: int) -> list[float | None]:
        """Costs of K = 0..k_max in the bucket nearest this batch size's that has one (all None if
        none has)."""
        bucket = batch_bucket(batch_size)
        measured = {b for (b, k) in self.weight if k <= k_max and self._cost(b, k) is not None}
        nearest = min(measured, key=lambda b: (abs(b - bucket), b), default=bucket)
        return [self._cost(nearest, k) for k in range(k_max + 1)]

    def _cost(self, bucket: int, k: int) -> float | None:
        base = self._trusted((bucket, 0))
        if k == 0 or base is None:
            return base
        extra = self._trusted((bucket, k))
        return None if extra is None else base + max(extra, 0.0)

    def _add(self, key: tuple[int, int], seconds: float) -> None:
        self.weight[key] = STEP_DECAY * self.weight.get(key, 0.0) + 1.0
        self.seconds[key] = STEP_DECAY * self.seconds.get(key, 0.0) + seconds

    def _trusted(self, key: tuple[int, int]) -> float | None:
        weight = self.weight.get(key, 0.0)
        return self.seconds[key] / weight if weight >= MIN_STEP_WEIGHT - 1e-9 else None


class PositionStats:
    """Per draft position i (0-based here): delivered / asked (q_i) over proposals, and
    accepted / drafted (c_i) over verifications — each ratio's two counts decay together."""

    def __init__(self, k: int) -> None:
        self.asked, self.delivered = [0.0] * k, [0.0] * k
        self.drafted, self.accepted = [0.0] * k, [0.0] * k

    def proposed(self, asked: int, delivered: int) -> None:
        for i in range(asked):
            self.asked[i] = SEQUENCE_DECAY * self.asked[i] + 1.0
            self.delivered[i] = SEQUENCE_DECAY * self.delivered[i] + (i < delivered)

    def verified(self, drafted: int, accepted: int) -> None:
        for i in range(drafted):
            self.drafted[i] = SEQUENCE_DECAY * self.drafted[i] + 1.0
            self.accepted[i] = SEQUENCE_DECAY * self.accepted[i] + (i < accepted)

    def known(self, k: int) -> bool:
        """Enough proposals seen at every position below ``k``."""
        return all(a >= MIN_SAMPLES for a in self.asked[:k])

    def gain(self, i: int) -> float:
        """The chance that position i adds a token, q_i · c_i — 1 until enough proposals reached
        it, so a K is never ruled out for acceptance not yet seen."""
        return self.delivery(i) * self.acceptance(i) if self.asked[i] >= MIN_SAMPLES else 1.0

    def delivery(self, i: int) -> float:
        return self.delivered[i] / self.asked[i] if self.asked[i] else 0.0

    def acceptance(self, i: int) -> float:
        return self.accepted[i] / self.drafted[i] if self.drafted[i] else 0.0


@dataclass(frozen=True)
class Budget:
    """This step's drafts: K per sequence asked, and whom to ask — every decoding sequence, or,
    in a step that explores (``explorers`` > 0), those the proposer can draft for without catching
    up, and at least ``explorers`` of them, least catch-up first."""

    k: int
    explorers: int = 0


class LoadController:
    def __init__(self, cfg: LoadControl, num_speculative_tokens: int):
        self.cfg = cfg
        self.k = num_speculative_tokens
        self.window: deque[tuple[int, int]] = deque()  # (draft tokens, accepted) per step
        self.window_drafts = 0
        self.window_accepted = 0
        self.off_steps_left = 0
        self.costs = StepCosts()
        self.positions = PositionStats(num_speculative_tokens)
        self.steps_without = 0  # goodput: steps in a row it chose K = 0 where the table allowed more
        self.backoff = 1  # goodput: the probe interval is backoff × reprobe_steps
        self.decided: tuple[int, int] | None = None  # goodput: (batch size, K) of this step, for its cost
        self.drafting = 0  # goodput: sequences asked for drafts this step

    @property
    def enabled(self) -> bool:
        """False while the acceptance floor or goodput holds speculation off (not for the table)."""
        return self.off_steps_left == 0 and self.steps_without == 0

    def budget(self, running: int, decoding: int, prefill: bool = False) -> Budget:
        """Drafts per decoding sequence this step: the table picks K by the ``running`` batch size;
        goodput weighs the ``decoding`` sequences, and does not explore in a step that will also
        carry a ``prefill`` chunk."""
        self.decided, self.drafting = None, 0
        if self.off_steps_left > 0:
            self.off_steps_left -= 1
            return Budget(0)
        k = self._table_k(running)
        if not (self.cfg.goodput and k > 0):
            return Budget(k)
        k, explore = self._goodput(decoding, k, prefill)
        self.decided = (decoding, k)
        return Budget(k, min(decoding, max(EXPLORE_MIN, -(-decoding // EXPLORE_SHARE))) if explore else 0)

    def max_k(self, running: int) -> int:
        """The most drafts per sequence ``budget`` could give a step of ``running`` sequences next
        (goodput may pick fewer); changes nothing."""
        return 0 if self.off_steps_left > 0 else self._table_k(running)

    def _table_k(self, batch_size: int) -> int:
        for rule in self.cfg.batch_size_table:
            if batch_size <= rule.max_batch_size:
                return min(self.k, rule.num_speculative_tokens)
        return self.k if not self.cfg.batch_size_table else 0

    def _goodput(self, batch_size: int, k_max: int, prefill: bool) -> tuple[int, bool]:
        """The K ≤ k_max with the most expected tokens per second, and whether this step explores:
        in a step with a ``prefill`` chunk, the best measured (``_measured_best``); in a
        decode-only step, first each K that could still win (``_worth_measuring``; acceptance not
        yet seen counts as perfect), then the best measured, asked of every sequence once its
        acceptance is known; a probe of the best K > 0 every backoff × reprobe_steps decode steps
        that K = 0 wins. Measuring, learning acceptance and probing explore."""
        if prefill:
            return self._measured_best(batch_size, k_max), False
        tokens = self._expected_tokens(k_max)
        costs = [self.costs.per_sequence(batch_size, k) for k in range(k_max + 1)]
        rates = _rates(tokens, costs)
        unmeasured = _worth_measuring(tokens, costs, max(rates.values(), default=0.0))
        if unmeasured is not None:
            return unmeasured, unmeasured > 0
        best = max(rates, key=rates.__getitem__)
        if best > 0:
            self.steps_without, self.backoff = 0, 1
            return best, not self.positions.known(best)
        self.steps_without += 1
        if self.steps_without <= self.cfg.reprobe_steps * self.backoff:
            return 0, False
        self.steps_without, self.backoff = 0, min(2 * self.backoff, MAX_BACKOFF)
        return max((k for k in rates if k > 0), key=rates.__getitem__, default=1), True

    def _measured_best(self, batch_size: int, k_max: int) -> int:
        """For a step that carries a prefill chunk: the best measured K whose acceptance is known, of
        this batch bucket (or of the nearest measured one); 0 until K = 0's cost there is known.
        Drafts in such a step are dearer than in a decode step (its rows compete with the chunk for
        the token budget and compute), so only a K that has beaten K = 0 in decode steps is worth them."""
        costs = self.costs.nearest_measured(batch_size, k_max)
        known = [cost if self.positions.known(k) else None for k, cost in enumerate(costs)]
        rates = _rates(self._expected_tokens(k_max), known)
        return max(rates, key=rates.__getitem__, default=0)

    def _expected_tokens(self, k_max: int) -> list[float]:
        """For k = 0..k_max, the tokens a sequence emits in a step that asks it for k drafts:
        1 + Σ_{i<k} q_i · c_i (optimistic where acceptance is not known yet)."""
        return list(accumulate((self.positions.gain(i) for i in range(k_max)), initial=1.0))

    def observe_proposal(self, asked: list[int], delivered: list[int]) -> None:
        """Drafts asked for and delivered, per sequence, this step."""
        if not self.cfg.goodput:
            return
        self.drafting = len(asked)
        for a, d in zip(asked, delivered):
            self.positions.proposed(a, d)

    def observe_step(self, other_tokens: int, seconds: float) -> None:
        """A step's wall time (drafting included) and its tokens other than decode and verify rows
        (prefill chunks): only decode-only steps that goodput decided are costed."""
        if self.decided is not None and other_tokens == 0:
            batch_size, k = self.decided
            self.costs.observe(batch_size, k, self.drafting, seconds)
        self.decided, self.drafting = None, 0

    def observe(self, draft_tokens: int, accepted: int) -> None:
        if draft_tokens and self.cfg.goodput:
            self.positions.verified(draft_tokens, accepted)
        if draft_tokens == 0 or self.cfg.acceptance_floor == 0.0:
            return
        self.window.append((draft_tokens, accepted))
        self.window_drafts += draft_tokens
        self.window_accepted += accepted
        while self.window_drafts - self.window[0][0] >= self.cfg.window_draft_tokens:
            d, a = self.window.popleft()
            self.window_drafts -= d
            self.window_accepted -= a
        full = self.window_drafts >= self.cfg.window_draft_tokens
        if full and self.window_accepted < self.cfg.acceptance_floor * self.window_drafts:
            self.off_steps_left = self.cfg.reprobe_steps
            self.window.clear()
            self.window_drafts = self.window_accepted = 0


def _rates(tokens: list[float], costs: list[float | None]) -> dict[int, float]:
    """Expected tokens per second of each measured K."""
    return {k: tokens[k] / max(cost, 1e-12) for k, cost in enumerate(costs) if cost is not None}


def _worth_measuring(tokens: list[float], costs: list[float | None], best_rate: float) -> int | None:
    """The smallest unmeasured K that could beat ``best_rate``: its cost is at least that of the
    largest smaller K measured, so its rate is at most its tokens over that cost."""
    floor = 0.0
    for k, cost in enumerate(costs):
        if cost is not None:
            floor = max(floor, cost)
        elif floor == 0.0 or tokens[k] / floor > best_rate:
            return k
    return None
