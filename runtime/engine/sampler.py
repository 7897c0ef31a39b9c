"""Logits → the distribution each request samples from, and the target's logprobs.

Order, as in vLLM: logprobs come from the *raw* logits (what the model believes, vLLM's default
``raw_logprobs``: neither penalties nor ``logit_bias`` change them); frequency and presence
penalties, the request's ``logit_bias`` and its grammar mask (structured outputs: disallowed tokens
at −inf), then temperature, top-k and top-p shape the
distribution that is sampled. A sequence scores ``k + 1`` rows in a step (its pending token and ``k`` draft tokens);
row ``j`` predicts the token after ``drafts[:j]``, so its penalties count those drafts too.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from specdecode.runtime.engine.grammar import forbidden_tokens
from specdecode.runtime.engine.sequence import SamplingParams, TokenLogprob


@dataclass
class SamplerRow:
    """One sequence's rows in a step's logits."""

    params: SamplingParams
    seed: int  # position-keyed randomness (rng.py); unused by greedy rows
    first_position: int  # absolute position of the first token this step decides
    output_token_ids: list[int]  # generated so far (for penalties)
    draft_token_ids: list[int] = field(default_factory=list)
    draft_probs: torch.Tensor | None = None  # [len(draft_token_ids), V]; None = one-hot drafts
    allowed: torch.Tensor | None = None  # [num_rows, ceil(V/32)] int32 packed grammar bitmask (grammar.py); None = any

    @property
    def num_rows(self) -> int:
        return len(self.draft_token_ids) + 1


def row_starts(rows: list[SamplerRow]) -> list[int]:
    """Where each sequence's rows begin in the step's logits, then their total (len(rows) + 1 values)."""
    return list(itertools.accumulate((row.num_rows for row in rows), initial=0))


def apply_penalties(
    logits: torch.Tensor,  # [R, V] fp32 (R = Σ num_rows), modified in place
    rows: list[SamplerRow],
) -> None:
    for row, start in zip(rows, row_starts(rows)):
        p = row.params
        if p.has_penalties:
            history = row.output_token_ids + row.draft_token_ids
            base = len(row.output_token_ids)
            for j in range(row.num_rows):
                seen = history[: base + j]
                if seen:
                    counts = torch.bincount(torch.tensor(seen, device=logits.device), minlength=logits.shape[1])
                    counts = counts.to(logits.dtype)
                    logits[start + j] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)


def apply_logit_bias(
    logits: torch.Tensor,  # [R, V] fp32 (R = Σ num_rows), modified in place
    rows: list[SamplerRow],
) -> None:
    """Add each request's ``logit_bias`` to every row it scores (drafts' rows included)."""
    for row, start in zip(rows, row_starts(rows)):
        if row.params.logit_bias:
            ids, bias = zip(*row.params.logit_bias)
            logits[start : start + row.num_rows, list(ids)] += torch.tensor(bias, dtype=logits.dtype, device=logits.device)


def apply_grammar_masks(
    logits: torch.Tensor,  # [R, V] fp32 (R = Σ num_rows), modified in place
    rows: list[SamplerRow],
) -> None:
    """Set every token a row's grammar forbids to −inf (bit ``t % 32`` of word ``t // 32`` = token ``t``)."""
    constrained = [(row, start) for row, start in zip(rows, row_starts(rows)) if row.allowed is not None]
    if not constrained:
        return
    words = torch.cat([row.allowed for row, _ in constrained]).to(logits.device)  # [M, W] int32
    forbidden = forbidden_tokens(words, logits.shape[1])  # [M, V]
    at = 0
    for row, start in constrained:
        logits[start : start + row.num_rows].masked_fill_(forbidden[at : at + row.num_rows], float("-inf"))
        at += row.num_rows


def top_k_top_p_filter(
    logits: torch.Tensor,  # [N, V] fp32, temperature applied
    top_k: torch.Tensor,  # [N] long, 0 = off
    top_p: torch.Tensor,  # [N] fp32, 1 = off
) -> torch.Tensor:  # [N, V] with filtered-out entries at -inf
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[1]
    ranks = torch.arange(vocab, device=logits.device)
    k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab)
    drop = ranks[None, :] >= k[:, None]
    probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # probability of strictly better tokens
    drop |= mass_before >= top_p[:, None]
    drop[:, 0] = False  # the best token always survives
    return logits.scatter(1, order, sorted_logits.masked_fill(drop, float("-inf")))


def sampling_probs(
    logits: torch.Tensor,  # [N, V] fp32 after penalties
    params: list[SamplingParams],  # one per row
) -> torch.Tensor:  # [N, V] fp32
    dev = logits.device
    temps = torch.tensor([p.temperature for p in params], device=dev)
    top_k = torch.tensor([max(p.top_k, 0) for p in params], device=dev)
    top_p = torch.tensor([p.top_p for p in params], device=dev)
    return top_k_top_p_filter(logits / temps[:, None], top_k, top_p).softmax(dim=-1)


def gather_logprobs(
    logits: torch.Tensor,  # [R, V] fp32 raw target logits
    row_index: list[int],  # which row of logits scored each emitted token
    token_ids: list[int],
    num_top: list[int],
) -> list[TokenLogprob]:
    """The emitted tokens' logprobs and the top alternatives: log-softmax runs over the chosen rows
    only, top-k only when some token asks for alternatives, and only the requested columns move."""
    if not row_index:
        return []
    idx = torch.tensor(row_index, device=logits.device)
    chosen_rows = logits.index_select(0, idx).log_softmax(dim=-1)  # [N, V]
    chosen = chosen_rows.gather(1, torch.tensor(token_ids, device=idx.device)[:, None])[:, 0].tolist()
    width = max(num_top)
    top_vals, top_ids = chosen_rows.topk(width, dim=-1) if width else (None, None)
    top_vals = top_vals.tolist() if width else []
    top_ids = top_ids.tolist() if width else []
    return [
        TokenLogprob(t, c, list(zip(top_ids[i][:n], top_vals[i][:n])) if n else [])
        for i, (t, c, n) in enumerate(zip(token_ids, chosen, num_top))
    ]
