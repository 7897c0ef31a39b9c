"""How many draft tokens to ask for this step, from the batch size and measured acceptance.

Speculation trades extra target work per step for fewer steps. Under heavy load the target is
already busy, so a batch-size → K table turns it down (K = 0: off). And when acceptance falls
under a floor, proposals are mostly wasted: speculation switches off for ``reprobe_steps``
steps, then is probed again with a fresh window.

``goodput`` replaces guesses with this server's own measurements. Whether speculation pays
depends on the hardware as much as on acceptance: on a GPU, scoring 5 tokens per sequence
costs about what scoring 1 does; on a CPU it costs nearly 5 times as much once the batch is a
few sequences. So each step picks the K (up to the table's) that maximises

    expected tokens emitted per second = B · (1 + Σ_{i≤K} q_i · c_i) / T(B · (1 + Σ_{i≤K} q_i))

for B decoding sequences, where q_i is how often the proposer delivers a draft at position i
when asked for one, c_i how often a delivered draft at position i is accepted (so q_i · c_i is
the chance position i adds a token), and T(n) = t0 + a · n the time of a step that decides n
rows, fitted by least squares to the engine's own steps (``StepTimeModel``). All three forget
old data exponentially; none is kept unless ``goodput`` is on. Until both are measured it asks
for the table's K. After ``reprobe_steps`` steps at K = 0 it asks one sequence (not the batch:
at batch 32 on a CPU a whole-batch probe would cost a step five times as long) for the table's
K, so the estimates stay current at a negligible price.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch

from specdecode.runtime.config import LoadControl

SEQUENCE_DECAY = 0.995  # weight an old draft observation keeps per new one (about the last 200 sequences)
STEP_DECAY = 0.98  # weight an old step keeps per new one (about the last 50 steps)
MIN_SAMPLES = 16.0  # decayed observations each estimate needs before it is trusted


class StepTimeModel:
    """Seconds per engine step as ``t0 + a · decided rows + b · other tokens``, by exponentially
    weighted least squares. Decided rows (decode and verify positions, whose logits and sampling
    are computed) cost far more than prefill tokens — on a CPU the LM head alone is ~1 ms per row
    for SmolLM2 — so one slope fitted over both would price drafts at the cheap prefill rate."""

    def __init__(self) -> None:
        self.xx = [[0.0] * 3 for _ in range(3)]  # Σ w · x xᵀ, x = (1, rows, other tokens)
        self.xt = [0.0] * 3  # Σ w · x · seconds

    def observe(self, rows: int, other_tokens: int, seconds: float) -> None:
        x = (1.0, float(rows), float(other_tokens))
        for i in range(3):
            self.xt[i] = STEP_DECAY * self.xt[i] + x[i] * seconds
            for j in range(3):
                self.xx[i][j] = STEP_DECAY * self.xx[i][j] + x[i] * x[j]

    def decode_line(self) -> tuple[float, float] | None:
        """(t0, a): seconds of a step that scores n decided rows and nothing else is t0 + a · n.
        None until enough steps were seen with different numbers of rows to fit a slope."""
        w = self.xx[0][0]
        if w < MIN_SAMPLES:
            return None
        if self.xx[1][1] / w - (self.xx[0][1] / w) ** 2 < 1.0:  # every step the same size: no slope
            return None
        ridge = torch.diag(torch.tensor([0.0, 1e-6, 1e-6], dtype=torch.float64)) * w  # other tokens may all be 0
        xx, xt = torch.tensor(self.xx, dtype=torch.float64), torch.tensor(self.xt, dtype=torch.float64)
        t0, a, _ = torch.linalg.solve(xx + ridge, xt).tolist()
        return max(t0, 0.0), max(a, 0.0)


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


@dataclass(frozen=True)
class DraftBudget:
    """This step's drafts: up to ``k`` per sequence, for the first ``sequences`` decoding ones (None: all)."""

    k: int
    sequences: int | None = None


class LoadController:
    def __init__(self, cfg: LoadControl, num_speculative_tokens: int):
        self.cfg = cfg
        self.k = num_speculative_tokens
        self.window: deque[tuple[int, int]] = deque()  # (draft tokens, accepted) per step
        self.window_drafts = 0
        self.window_accepted = 0
        self.off_steps_left = 0
        self.step_time = StepTimeModel()
        self.positions = PositionStats(num_speculative_tokens)
        self.steps_without = 0  # goodput: steps in a row it chose K = 0 where the table allowed more

    @property
    def enabled(self) -> bool:
        """False while the acceptance floor or goodput holds speculation off (not for the table)."""
        return self.off_steps_left == 0 and self.steps_without == 0

    def budget(self, running: int, decoding: int) -> DraftBudget:
        """The table picks K by the ``running`` batch size; goodput weighs the ``decoding`` sequences."""
        if self.off_steps_left > 0:
            self.off_steps_left -= 1
            return DraftBudget(0)
        k = self._table_k(running)
        if self.cfg.goodput and k > 0:
            return self._goodput(decoding, k)
        return DraftBudget(k)

    def _table_k(self, batch_size: int) -> int:
        for rule in self.cfg.batch_size_table:
            if batch_size <= rule.max_batch_size:
                return min(self.k, rule.num_speculative_tokens)
        return self.k if not self.cfg.batch_size_table else 0

    def _goodput(self, batch_size: int, k_max: int) -> DraftBudget:
        """The K ≤ k_max with the most expected tokens per second (k_max while unmeasured; for one
        sequence when re-probing)."""
        line = self.step_time.decode_line()
        if line is None or not self.positions.known(k_max):
            return DraftBudget(k_max)
        if self.steps_without >= self.cfg.reprobe_steps:
            self.steps_without = 0
            return DraftBudget(k_max, sequences=1)
        t0, a = line
        best_k, best_rate = 0, batch_size / max(t0 + a * batch_size, 1e-9)
        gain = scored = 1.0
        for i in range(k_max):
            q = self.positions.delivery(i)
            gain += q * self.positions.acceptance(i)
            scored += q
            rate = batch_size * gain / max(t0 + a * batch_size * scored, 1e-9)
            if rate > best_rate:
                best_k, best_rate = i + 1, rate
        self.steps_without = self.steps_without + 1 if best_k == 0 else 0
        return DraftBudget(best_k)

    def observe_proposal(self, asked: list[int], delivered: list[int]) -> None:
        """Drafts asked for and delivered, per sequence, this step."""
        if not self.cfg.goodput:
            return
        for a, d in zip(asked, delivered):
            self.positions.proposed(a, d)

    def observe_step(self, rows: int, other_tokens: int, seconds: float) -> None:
        """A step's wall time, its decided rows (decode, verify, a prefill's last position) and other tokens."""
        if self.cfg.goodput:
            self.step_time.observe(rows, other_tokens, seconds)

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
