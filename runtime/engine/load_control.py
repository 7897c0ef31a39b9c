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
token), and s(B, K) the measured seconds per sequence of decode-only steps that asked K drafts
of each of B sequences (``StepCosts``; batch sizes in power-of-two buckets; the proposer's own
time included). All estimates forget old data exponentially; none is kept unless ``goodput`` is
on.

Measuring a K costs a few steps at that K, so only a K that could still win is measured:
smallest first, and none whose tokens could not beat the best measured rate even at the cost of
the largest smaller K measured (more drafts never make a step cheaper). Where acceptance is low,
K = 0 and K = 1 are measured and the rest skipped. Steps that carry a prefill chunk are not
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
"""
from __future__ import annotations

from collections import deque
from itertools import accumulate

from specdecode.runtime.config import LoadControl

SEQUENCE_DECAY = 0.995  # weight an old draft observation keeps per new one (about the last 200 sequences)
STEP_DECAY = 0.9  # weight an old step keeps per new step of the same (batch bucket, K): about the last 10
MIN_SAMPLES = 16.0  # decayed draft observations the acceptance estimates need before they are trusted
MIN_STEPS = 3  # steps of a (batch bucket, K) before its cost is trusted
MIN_STEP_WEIGHT = sum(STEP_DECAY**i for i in range(MIN_STEPS))  # their decayed weight
MAX_BACKOFF = 16  # the probe interval grows up to this many times reprobe_steps


def batch_bucket(batch_size: int) -> int:
    """1 | 2-3 | 4-7 | 8-15 | …: a step's cost per sequence changes little inside a bucket."""
    return batch_size.bit_length()


class StepCosts:
    """Seconds per decoding sequence of decode-only steps, by (batch bucket, K asked)."""

    def __init__(self) -> None:
        self.weight: dict[tuple[int, int], float] = {}
        self.seconds: dict[tuple[int, int], float] = {}

    def observe(self, batch_size: int, k: int, seconds: float) -> None:
        key = (batch_bucket(batch_size), k)
        self.weight[key] = STEP_DECAY * self.weight.get(key, 0.0) + 1.0
        self.seconds[key] = STEP_DECAY * self.seconds.get(key, 0.0) + seconds / batch_size

    def per_sequence(self, batch_size: int, k: int) -> float | None:
        """None until ``MIN_STEPS`` steps of this bucket asked for K."""
        return self._trusted((batch_bucket(batch_size), k))

    def nearest_measured(self, batch_size: int, k_max: int) -> list[float | None]:
        """Costs of K = 0..k_max in the bucket nearest this batch size's that has one (all None if
        none has)."""
        bucket = batch_bucket(batch_size)
        measured = {b for (b, k) in self.weight if k <= k_max and self._trusted((b, k)) is not None}
        nearest = min(measured, key=lambda b: (abs(b - bucket), b), default=bucket)
        return [self._trusted((nearest, k)) for k in range(k_max + 1)]

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
        """Enough proposals seen at every position up to ``k``, and some verified drafts."""
        return self.asked[0] >= MIN_SAMPLES and all(a >= 1.0 for a in self.asked[:k]) and self.drafted[0] >= 1.0

    def delivery(self, i: int) -> float:
        return self.delivered[i] / self.asked[i] if self.asked[i] else 0.0

    def acceptance(self, i: int) -> float:
        return self.accepted[i] / self.drafted[i] if self.drafted[i] else 0.0


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

    @property
    def enabled(self) -> bool:
        """False while the acceptance floor or goodput holds speculation off (not for the table)."""
        return self.off_steps_left == 0 and self.steps_without == 0

    def budget(self, running: int, decoding: int, prefill: bool = False) -> int:
        """Drafts per decoding sequence this step: the table picks K by the ``running`` batch size;
        goodput weighs the ``decoding`` sequences, and does not explore in a step that will also
        carry a ``prefill`` chunk."""
        self.decided = None
        if self.off_steps_left > 0:
            self.off_steps_left -= 1
            return 0
        k = self._table_k(running)
        if self.cfg.goodput and k > 0:
            k = self._goodput(decoding, k, prefill)
            self.decided = (decoding, k)
        return k

    def _table_k(self, batch_size: int) -> int:
        for rule in self.cfg.batch_size_table:
            if batch_size <= rule.max_batch_size:
                return min(self.k, rule.num_speculative_tokens)
        return self.k if not self.cfg.batch_size_table else 0

    def _goodput(self, batch_size: int, k_max: int, prefill: bool) -> int:
        """The K ≤ k_max with the most expected tokens per second: in a step with a ``prefill``
        chunk, the best measured (``_measured_best``); in a decode-only step, k_max until acceptance
        is measured, then first each K that could still win (``_worth_measuring``);
        a probe of the best K > 0 every backoff × reprobe_steps decode steps that K = 0 wins."""
        if prefill:
            return self._measured_best(batch_size, k_max)
        if not self.positions.known(k_max):
            return k_max
        tokens = self._expected_tokens(k_max)
        costs = [self.costs.per_sequence(batch_size, k) for k in range(k_max + 1)]
        rates = _rates(tokens, costs)
        unmeasured = _worth_measuring(tokens, costs, max(rates.values(), default=0.0))
        if unmeasured is not None:
            return unmeasured
        best = max(rates, key=rates.__getitem__)
        if best > 0:
            self.steps_without, self.backoff = 0, 1
            return best
        self.steps_without += 1
        if self.steps_without <= self.cfg.reprobe_steps * self.backoff:
            return 0
        self.steps_without, self.backoff = 0, min(2 * self.backoff, MAX_BACKOFF)
        return max((k for k in rates if k > 0), key=rates.__getitem__, default=1)

    def _measured_best(self, batch_size: int, k_max: int) -> int:
        """For a step that carries a prefill chunk: the best measured K of this batch bucket (or of
        the nearest measured one), 0 until acceptance and K = 0's cost there are known. Drafts in
        such a step are dearer than in a decode step (its rows compete with the chunk for the
        token budget and compute), so only a K that has beaten K = 0 in decode steps is worth them."""
        costs = self.costs.nearest_measured(batch_size, k_max)
        if not self.positions.known(k_max) or costs[0] is None:
            return 0
        rates = _rates(self._expected_tokens(k_max), costs)
        return max(rates, key=rates.__getitem__)

    def _expected_tokens(self, k_max: int) -> list[float]:
        """For k = 0..k_max, the tokens a sequence emits in a step that asks it for k drafts:
        1 + Σ_{i<k} q_i · c_i."""
        p = self.positions
        return list(accumulate((p.delivery(i) * p.acceptance(i) for i in range(k_max)), initial=1.0))

    def observe_proposal(self, asked: list[int], delivered: list[int]) -> None:
        """Drafts asked for and delivered, per sequence, this step."""
        if not self.cfg.goodput:
            return
        for a, d in zip(asked, delivered):
            self.positions.proposed(a, d)

    def observe_step(self, other_tokens: int, seconds: float) -> None:
        """A step's wall time (drafting included) and its tokens other than decode and verify rows
        (prefill chunks): only decode-only steps that goodput decided are costed."""
        if self.decided is not None and other_tokens == 0:
            self.costs.observe(*self.decided, seconds)
        self.decided = None

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
