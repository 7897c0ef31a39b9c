"""Decide each sequence's emitted tokens for a step: verify its drafts, then recover or add a bonus.

Terms (as in ``specdecode.kernels.verify``): *draft tokens* are proposed; *accepted tokens* are
the drafts the target agrees with, in order; at the first rejected position the target's
*recovered token* replaces the draft, and when all drafts are accepted a *bonus token* is
sampled from the row after them. A sequence without drafts is the plain case: it emits one
token from its only row, so sampling without speculation is verification of zero drafts.

Every row is judged against the target's distribution after the request's penalties,
``logit_bias`` and grammar mask, so speculation keeps that distribution (greedy: the argmax of the
masked, biased logits); a draft the grammar forbids has probability zero and is never accepted.
Greedy requests (temperature 0) always verify by argmax. Sampled requests use the configured
strategy; ``greedy`` as a strategy means ``target_match`` for them, its lossless sampled analogue.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specdecode.kernels import PLACEHOLDER_TOKEN_ID
from specdecode.kernels.verify import (
    greedy_verify,
    rejection_verify,
    target_match_verify,
    topp_verify,
)
from specdecode.runtime.config import VerifyStrategy
from specdecode.runtime.engine import rng
from specdecode.runtime.engine.sampler import (
    SamplerRow,
    apply_grammar_masks,
    apply_logit_bias,
    apply_penalties,
    gather_logprobs,
    row_starts,
    sampling_probs,
)
from specdecode.runtime.engine.sequence import TokenLogprob


@dataclass
class Verdict:
    token_ids: list[int]  # accepted drafts, then the recovered or bonus token
    num_accepted: int
    logprobs: list[TokenLogprob]  # one per emitted token when the request asked, else empty


class Verifier:
    def __init__(self, strategy: VerifyStrategy, verify_top_p: float):
        self.strategy = VerifyStrategy.TARGET_MATCH if strategy is VerifyStrategy.GREEDY else strategy
        self.verify_top_p = verify_top_p

    def __call__(
        self,
        logits: torch.Tensor,  # [R, V] fp32 raw target logits, R = Σ row.num_rows in row order
        rows: list[SamplerRow],
    ) -> list[Verdict]:
        raw = logits  # logprobs come from the raw logits
        logits = logits.clone()
        apply_penalties(logits, rows)
        apply_logit_bias(logits, rows)
        apply_grammar_masks(logits, rows)
        starts = row_starts(rows)
        width = max(r.num_rows for r in rows)  # K + 1
        out: list[list[int]] = [[] for _ in rows]
        greedy = [i for i, r in enumerate(rows) if r.params.greedy]
        sampled = [i for i, r in enumerate(rows) if not r.params.greedy]
        if greedy:
            self._verify_greedy(logits, rows, starts, width, greedy, out)
        if sampled:
            self._verify_sampled(logits, rows, starts, width, sampled, out)
        logprobs = self._logprobs(raw, rows, starts, out)
        return [Verdict(tokens, len(tokens) - 1, lp) for tokens, lp in zip(out, logprobs)]

    def _verify_greedy(self, logits, rows, starts, width, which, out) -> None:
        pad = self._pad_index(rows, starts, width, which, logits.device)  # [G, K+1]
        argmax = logits.argmax(dim=-1)[pad]  # [G, K+1]
        drafts, num_drafts = self._drafts(rows, width, which, logits.device)
        self._scatter(greedy_verify(drafts, num_drafts, argmax), which, out)

    def _verify_sampled(self, logits, rows, starts, width, which, out) -> None:
        dev = logits.device
        pad = self._pad_index(rows, starts, width, which, dev)  # [S, K+1]
        flat = pad.view(-1)
        params = [rows[i].params for i in which for _ in range(width)]
        probs = sampling_probs(logits.index_select(0, flat), params).view(len(which), width, -1)  # [S, K+1, V]
        drafts, num_drafts = self._drafts(rows, width, which, dev)
        keys = torch.tensor([(rows[i].seed, rows[i].first_position) for i in which], dtype=torch.long, device=dev)
        seeds, first_positions = keys.unbind(1)  # [S] each, from one transfer
        sample_u = rng.device_uniforms(seeds, first_positions, width, rng.Stream.SAMPLE)  # [S, K+1]
        if self.strategy is VerifyStrategy.TARGET_MATCH:
            result = target_match_verify(drafts, num_drafts, probs, sample_u)
        elif self.strategy is VerifyStrategy.REJECTION:
            accept_u = rng.device_uniforms(seeds, first_positions, width - 1, rng.Stream.ACCEPT)  # [S, K]
            result = rejection_verify(drafts, num_drafts, probs, self._draft_probs(rows, which, probs), accept_u, sample_u)
        else:
            top_p = torch.full((len(which),), self.verify_top_p, device=dev)
            result = topp_verify(drafts, num_drafts, probs, top_p, sample_u)
        self._scatter(result, which, out)

    @staticmethod
    def _draft_probs(rows, which, probs: torch.Tensor) -> torch.Tensor | None:
        """[S, K, V] draft distributions q, or None when every draft is one-hot.

        In a batch with dense q, a row without draft probabilities (n-gram, suffix) is one-hot on
        its drafts: a zero q there would accept every draft (p/q = inf). Past a row's drafts, q is
        zero and never read.
        """
        if all(rows[i].draft_probs is None for i in which):
            return None
        s, width, vocab = probs.shape
        q = probs.new_zeros(s, width - 1, vocab)
        for b, i in enumerate(which):
            row = rows[i]
            if row.draft_probs is not None:
                q[b, : row.draft_probs.shape[0]] = row.draft_probs
            elif row.draft_token_ids:
                num = len(row.draft_token_ids)
                drafts = torch.tensor(row.draft_token_ids, dtype=torch.long, device=q.device)
                q[b, torch.arange(num, device=q.device), drafts] = 1.0
        return q

    @staticmethod
    def _pad_index(rows, starts, width, which, device) -> torch.Tensor:  # [len(which), width] long
        index = [[starts[i] + min(j, rows[i].num_rows - 1) for j in range(width)] for i in which]
        return torch.tensor(index, dtype=torch.long, device=device)

    @staticmethod
    def _drafts(rows, width, which, device) -> tuple[torch.Tensor, torch.Tensor]:
        k = width - 1
        drafts = [rows[i].draft_token_ids + [PLACEHOLDER_TOKEN_ID] * (k - len(rows[i].draft_token_ids)) for i in which]
        nums = [len(rows[i].draft_token_ids) for i in which]
        return (
            torch.tensor(drafts, dtype=torch.long, device=device).view(len(which), k),  # [B, K]
            torch.tensor(nums, dtype=torch.long, device=device),  # [B]
        )

    @staticmethod
    def _scatter(result: torch.Tensor, which: list[int], out: list[list[int]]) -> None:
        for i, tokens in zip(which, result.tolist()):  # result: [B, K+1]
            out[i] = [t for t in tokens if t != PLACEHOLDER_TOKEN_ID]

    @staticmethod
    def _logprobs(raw, rows, starts, out) -> list[list[TokenLogprob]]:
        """Each row's emitted tokens' logprobs, for the requests that asked (empty for the others).

        Only the rows that scored an emitted token of such a request are read: one batch of
        log-softmax over those rows, and a top-k only when some request asked for alternatives.
        """
        asking = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
        per_row: list[list[TokenLogprob]] = [[] for _ in rows]
        if not asking:
            return per_row
        row_index = [starts[i] + j for i in asking for j in range(len(out[i]))]  # row j scored token j
        token_ids = [t for i in asking for t in out[i]]
        num_top = [rows[i].params.logprobs for i in asking for _ in out[i]]
        gathered = gather_logprobs(raw, row_index, token_ids, num_top)
        at = 0
        for i in asking:
            per_row[i] = gathered[at : at + len(out[i])]
            at += len(out[i])
        return per_row
