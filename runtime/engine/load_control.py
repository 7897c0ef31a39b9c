"""How many draft tokens to ask for this step, from the batch size and measured acceptance.

Speculation trades extra target work per step for fewer steps. Under heavy load the target is
already busy, so a batch-size → K table turns it down (K = 0: off). And when acceptance falls
under a floor, proposals are mostly wasted: speculation switches off for ``reprobe_steps``
steps, then is probed again with a fresh window.
"""
from __future__ import annotations

from collections import deque

from specdecode.runtime.config import LoadControl


class LoadController:
    def __init__(self, cfg: LoadControl, num_speculative_tokens: int):
        self.cfg = cfg
        self.k = num_speculative_tokens
        self.window: deque[tuple[int, int]] = deque()  # (draft tokens, accepted) per step
        self.window_drafts = 0
        self.window_accepted = 0
        self.off_steps_left = 0

    @property
    def enabled(self) -> bool:
        return self.off_steps_left == 0

    def num_speculative_tokens(self, batch_size: int) -> int:
        if self.off_steps_left > 0:
            self.off_steps_left -= 1
            return 0
        for rule in self.cfg.batch_size_table:
            if batch_size <= rule.max_batch_size:
                return min(self.k, rule.num_speculative_tokens)
        return self.k if not self.cfg.batch_size_table else 0

    def observe(self, draft_tokens: int, accepted: int) -> None:
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
