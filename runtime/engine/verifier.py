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
from typing import TYPE_CHECKING

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
    logit_lists,
    read_logprobs,
    row_starts,
    shaped_probs,
    shaping_lists,
)
from specdecode.runtime.engine.sequence import TokenLogprob
from specdecode.runtime.engine.transfer import as_floats, upload

if TYPE_CHECKING:
    from specdecode.runtime.proposers import AheadDrafts


@dataclass
class Verdict:
    token_ids: list[int]  # accepted drafts, then the recovered or bonus token
    num_accepted: int
    logprobs: list[TokenLogprob]  # one per emitted token when the request asked, else empty


@dataclass
class VerifyLists:
    """What a step's verification reads from the host (``Verifier.lists``): long lists for the step's
    one upload (``parts``), and the order its kernels take the sequences in."""

    lists: dict[str, list[int]]
    greedy: list[int]  # the greedy sequences' indices, then
    sampled: list[int]  # the sampled ones'
    width: int  # K + 1: rows per sequence, padded

    @property
    def parts(self) -> list[list[int]]:
        return list(self.lists.values())

    def on_device(self, parts: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        return dict(zip(self.lists, parts))


class Verifier:
    """A step's verification takes its host inputs (``lists``) to the device with the step's other
    inputs in one upload and reads every sequence's verdict back at once, with the proposer's drafts
    for the next step where it makes them from the verdicts (``AheadDrafts``); logprobs, when a
    request asked, are a second read."""

    def __init__(self, strategy: VerifyStrategy, verify_top_p: float):
        self.strategy = VerifyStrategy.TARGET_MATCH if strategy is VerifyStrategy.GREEDY else strategy
        self.verify_top_p = verify_top_p

    def __call__(self, logits: torch.Tensor, rows: list[SamplerRow]) -> list[Verdict]:
        """``verify`` with an upload of its own (where the step's inputs went to the device elsewhere)."""
        lists = self.lists(rows)
        return self.verify(logits, rows, lists, lists.on_device(upload(lists.parts, logits.device)))

    def verify(
        self,
        logits: torch.Tensor,  # [R, V] fp32 raw target logits, R = Σ row.num_rows in row order
        rows: list[SamplerRow],
        lists: VerifyLists,  # ``lists(rows)``
        on: dict[str, torch.Tensor],  # ``lists`` on the device
        ahead: tuple[AheadDrafts, list[torch.Tensor]] | None = None,  # the proposer's drafts for the next
        # step, read with the verdicts, and its parts on the device
    ) -> list[Verdict]:
        raw = logits  # logprobs come from the raw logits
        if lists.lists["penalized_rows"] or lists.lists["bias_rows"] or lists.lists["constrained_rows"]:
            logits = logits.clone()  # shaped in place below; raw stays as it was
        apply_penalties(logits, on)
        apply_logit_bias(logits, on)
        apply_grammar_masks(logits, rows, on)
        greedy, sampled, width = lists.greedy, lists.sampled, lists.width
        g, b = len(greedy), len(rows)
        pad = on["pad"].view(b, width)  # [G+S, K+1]: greedy sequences, then sampled ones
        drafts, num_drafts = on["drafts"].view(b, width - 1), on["num_drafts"]  # [G+S, K], [G+S]
        results = []
        if greedy:
            results.append(greedy_verify(drafts[:g], num_drafts[:g], logits.argmax(dim=-1)[pad[:g]]))
        if sampled:
            results.append(self._verify_sampled(logits, [rows[i] for i in sampled], pad[g:], drafts[g:], num_drafts[g:], on))
        result = torch.cat(results).index_select(0, on["row_order"])  # [B, K+1]: back in row order
        out = [[t for t in tokens if t != PLACEHOLDER_TOKEN_ID] for tokens in _read(result, ahead)]
        logprobs = self._logprobs(raw, rows, result, on, out)
        return [Verdict(tokens, len(tokens) - 1, lp) for tokens, lp in zip(out, logprobs)]

    def lists(self, rows: list[SamplerRow]) -> VerifyLists:
        """Everything the step's verification reads from the host, as long lists (``logit_lists``' too):
        per sequence (greedy ones, then sampled ones) its rows padded to K + 1 by repeating its last
        (``pad``), its drafts padded with placeholders and their count; where each sequence's verdict
        lies in that order (``row_order``); per sampled sequence its randomness keys and, per padded
        row, its temperature, top-k and top-p; the draft-probability layout for rejection sampling;
        the rows and result positions of the logprobs asked for."""
        starts = row_starts(rows)
        width = max(r.num_rows for r in rows)  # K + 1
        greedy = [i for i, r in enumerate(rows) if r.params.greedy]
        sampled = [i for i, r in enumerate(rows) if not r.params.greedy]
        k = width - 1
        order = greedy + sampled
        lists = logit_lists(rows, starts)
        lists["pad"] = [starts[i] + min(j, rows[i].num_rows - 1) for i in order for j in range(width)]
        lists["drafts"] = [t for i in order for t in rows[i].draft_token_ids + [PLACEHOLDER_TOKEN_ID] * (k + 1 - rows[i].num_rows)]
        lists["num_drafts"] = [len(rows[i].draft_token_ids) for i in order]
        lists["row_order"] = sorted(range(len(order)), key=order.__getitem__)
        lists["seeds"] = [rows[i].seed for i in sampled]
        lists["positions"] = [rows[i].first_position for i in sampled]
        lists["temperature"], lists["top_k"], lists["top_p"] = shaping_lists(
            [rows[i].params for i in sampled for _ in range(width)])
        if self.strategy is VerifyStrategy.REJECTION:
            lists |= _draft_prob_lists([rows[i] for i in sampled], k)
        asking = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
        lists["logprob_rows"] = [starts[i] + j for i in asking for j in range(rows[i].num_rows)]
        lists["logprob_at"] = [i * width + j for i in asking for j in range(rows[i].num_rows)]
        return VerifyLists(lists, greedy, sampled, width)

    def _verify_sampled(self, logits, rows, pad, drafts, num_drafts, on) -> torch.Tensor:  # [S, K+1]
        s, width = pad.shape
        temperature, top_p = as_floats(on["temperature"]), as_floats(on["top_p"])  # [S·(K+1)] each
        probs = shaped_probs(logits.index_select(0, pad.flatten()), temperature, on["top_k"], top_p).view(s, width, -1)  # [S, K+1, V]
        seeds, first_positions = on["seeds"], on["positions"]  # [S] each
        sample_u = rng.device_uniforms(seeds, first_positions, width, rng.Stream.SAMPLE)  # [S, K+1]
        if self.strategy is VerifyStrategy.TARGET_MATCH:
            return target_match_verify(drafts, num_drafts, probs, sample_u)
        if self.strategy is VerifyStrategy.REJECTION:
            accept_u = rng.device_uniforms(seeds, first_positions, width - 1, rng.Stream.ACCEPT)  # [S, K]
            return rejection_verify(drafts, num_drafts, probs, _draft_probs(rows, probs, on), accept_u, sample_u)
        top_p = torch.full((s,), self.verify_top_p, device=logits.device)
        return topp_verify(drafts, num_drafts, probs, top_p, sample_u)

    @staticmethod
    def _logprobs(raw, rows, result, on, out) -> list[list[TokenLogprob]]:
        """Each row's emitted tokens' logprobs, for the requests that asked (empty for the others).

        Only the rows of such requests are read (row j scored token j; the emitted tokens are taken
        from ``result`` on the device): one batch of log-softmax over those rows, and a top-k only
        when some request asked for alternatives.
        """
        asking = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
        per_row: list[list[TokenLogprob]] = [[] for _ in rows]
        if not asking:
            return per_row
        token_ids = [t for i in asking for t in out[i] + [PLACEHOLDER_TOKEN_ID] * (rows[i].num_rows - len(out[i]))]
        num_top = [rows[i].params.logprobs for i in asking for _ in range(rows[i].num_rows)]
        tokens = result.flatten()[on["logprob_at"]].clamp(min=0)  # [Σ num_rows of asking]: placeholders read token 0
        read = read_logprobs(raw, on["logprob_rows"], tokens, token_ids, num_top)
        at = 0
        for i in asking:
            per_row[i] = read[at : at + len(out[i])]
            at += rows[i].num_rows
        return per_row


def _read(result: torch.Tensor, ahead: tuple[AheadDrafts, list[torch.Tensor]] | None) -> list[list[int]]:
    """The verdicts ``result [B, K+1]`` as rows of tokens, in one read with what ``ahead`` drafted
    from them on the device."""
    if ahead is None:
        return result.tolist()
    drafts, parts = ahead
    values = torch.cat([result.flatten(), drafts.compute(result, parts)]).tolist()
    width, split = result.shape[1], result.numel()
    drafts.take(values[split:])
    return [values[r : r + width] for r in range(0, split, width)]


def _draft_prob_lists(rows: list[SamplerRow], k: int) -> dict[str, list[int]]:
    """Where each sampled row's draft distributions go in q viewed as [S·K, V]: dense ones' rows
    (``dense_at``), and one-hot drafts' (row, token) for rows without draft probabilities."""
    lists: dict[str, list[int]] = {"dense_at": [], "one_hot_at": [], "one_hot_tokens": []}
    for b, row in enumerate(rows):
        if row.draft_probs is not None:
            lists["dense_at"] += range(b * k, b * k + row.draft_probs.shape[0])
        else:
            lists["one_hot_at"] += range(b * k, b * k + len(row.draft_token_ids))
            lists["one_hot_tokens"] += row.draft_token_ids
    return lists


def _draft_probs(rows: list[SamplerRow], probs: torch.Tensor, on: dict[str, torch.Tensor]) -> torch.Tensor | None:
    """[S, K, V] draft distributions q, or None when every draft is one-hot.

    In a batch with dense q, a row without draft probabilities (n-gram, suffix) is one-hot on
    its drafts: a zero q there would accept every draft (p/q = inf). Past a row's drafts, q is
    zero and never read.
    """
    dense = [row.draft_probs for row in rows if row.draft_probs is not None]
    if not dense:
        return None
    s, width, vocab = probs.shape
    q = probs.new_zeros(s * (width - 1), vocab)
    q[on["dense_at"]] = torch.cat(dense)
    q[on["one_hot_at"], on["one_hot_tokens"]] = 1.0
    return q.view(s, width - 1, vocab)
