"""Logits → the distribution each request samples from, and the target's logprobs.

Order, as in vLLM: logprobs come from the *raw* logits (what the model believes, vLLM's default
``raw_logprobs``: neither penalties nor ``logit_bias`` change them); frequency and presence
penalties, the request's ``logit_bias`` and its grammar mask (structured outputs: disallowed tokens
at −inf), then temperature, top-k and top-p shape the
distribution that is sampled. A sequence scores ``k + 1`` rows in a step (its pending token and ``k`` draft tokens);
row ``j`` predicts the token after ``drafts[:j]``, so its penalties count those drafts too.
What the logits' shaping needs from the host is built as long lists (``logit_lists``,
``shaping_lists``) for the step's one upload; a batch's rows are then shaped by a fixed number of ops.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from specdecode.runtime.engine.grammar import forbidden_tokens
from specdecode.runtime.engine.sequence import SamplingParams, TokenLogprob
from specdecode.runtime.engine.transfer import as_bits, as_floats, bits_floats, float_bits, upload


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


def logit_lists(rows: list[SamplerRow], starts: list[int]) -> dict[str, list[int]]:
    """What ``apply_penalties``, ``apply_logit_bias`` and ``apply_grammar_masks`` need from the host,
    as long lists for the step's one upload (``transfer.upload``; floats as ``float_bits``).

    Penalties count, per row ``j`` of a sequence, its output tokens and its drafts before ``j``:
    only rows that have seen a token are penalized (``penalized_rows``, P of them). The output
    tokens are put once at their sequence's first penalized row (``seen_at``/``seen_token``) and
    copied to its other rows (``anchor``); each draft is put at every later row (``draft_at``/``draft_token``).
    """
    lists: dict[str, list[int]] = {name: [] for name in (
        "penalized_rows", "frequency", "presence", "anchor", "seen_at", "seen_token", "draft_at", "draft_token",
        "bias_rows", "bias_tokens", "bias", "constrained_rows")}
    for row, start in zip(rows, starts):
        p = row.params
        if p.has_penalties:
            base = len(row.output_token_ids)
            first = len(lists["penalized_rows"])
            for j in range(row.num_rows):
                if base + j == 0:
                    continue
                at = len(lists["penalized_rows"])
                lists["penalized_rows"].append(start + j)
                lists["anchor"].append(first)
                lists["draft_at"] += [at] * j
                lists["draft_token"] += row.draft_token_ids[:j]
            lists["seen_at"] += [first] * base
            lists["seen_token"] += row.output_token_ids
            count = len(lists["penalized_rows"]) - first
            lists["frequency"] += [p.frequency_penalty] * count
            lists["presence"] += [p.presence_penalty] * count
        if p.logit_bias:
            ids, bias = zip(*p.logit_bias)
            for j in range(row.num_rows):
                lists["bias_rows"] += [start + j] * len(ids)
                lists["bias_tokens"] += ids
                lists["bias"] += bias
        if row.allowed is not None:
            lists["constrained_rows"] += range(start, start + row.num_rows)
    for name in ("frequency", "presence", "bias"):
        lists[name] = float_bits(lists[name])
    return lists


def apply_penalties(
    logits: torch.Tensor,  # [R, V] fp32 (R = Σ num_rows), modified in place
    lists: dict[str, torch.Tensor],  # logit_lists' on the device
) -> None:
    rows = lists["penalized_rows"]  # [P]
    if not rows.numel():
        return
    seen = logits.new_zeros(rows.numel(), logits.shape[1])  # [P, V]
    seen.index_put_((lists["seen_at"], lists["seen_token"]), torch.ones_like(lists["seen_at"], dtype=logits.dtype),
                    accumulate=True)
    counts = seen.index_select(0, lists["anchor"])  # [P, V]: each row's sequence's output tokens
    counts.index_put_((lists["draft_at"], lists["draft_token"]), torch.ones_like(lists["draft_at"], dtype=logits.dtype),
                      accumulate=True)  # and its drafts before the row
    frequency, presence = as_floats(lists["frequency"])[:, None], as_floats(lists["presence"])[:, None]  # [P, 1]
    logits[rows] -= frequency * counts + presence * (counts > 0).to(logits.dtype)


def apply_logit_bias(
    logits: torch.Tensor,  # [R, V] fp32 (R = Σ num_rows), modified in place
    lists: dict[str, torch.Tensor],  # logit_lists' on the device
) -> None:
    """Add each request's ``logit_bias`` to every row it scores (drafts' rows included)."""
    if lists["bias_rows"].numel():
        logits[lists["bias_rows"], lists["bias_tokens"]] += as_floats(lists["bias"])


def apply_grammar_masks(
    logits: torch.Tensor,  # [R, V] fp32 (R = Σ num_rows), modified in place
    rows: list[SamplerRow],
    lists: dict[str, torch.Tensor],  # logit_lists' on the device
) -> None:
    """Set every token a row's grammar forbids to −inf (bit ``t % 32`` of word ``t // 32`` = token ``t``)."""
    constrained = lists["constrained_rows"]  # [M]
    if not constrained.numel():
        return
    words = torch.cat([row.allowed for row in rows if row.allowed is not None]).to(logits.device)  # [M, W] int32
    forbidden = forbidden_tokens(words, logits.shape[1])  # [M, V]
    logits[constrained] = logits[constrained].masked_fill(forbidden, float("-inf"))


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
    temperature, top_k, top_p = upload(shaping_lists(params), logits.device)
    return shaped_probs(logits, as_floats(temperature), top_k, as_floats(top_p))


def shaping_lists(params: list[SamplingParams]) -> list[list[int]]:
    """Temperatures, top-k and top-p of these rows as long lists for an upload (floats as their bits)."""
    return [float_bits([p.temperature for p in params]), [max(p.top_k, 0) for p in params],
            float_bits([p.top_p for p in params])]


def shaped_probs(
    logits: torch.Tensor,  # [N, V] fp32 after penalties
    temperature: torch.Tensor,  # [N] fp32
    top_k: torch.Tensor,  # [N] long, 0 = off
    top_p: torch.Tensor,  # [N] fp32
) -> torch.Tensor:  # [N, V] fp32
    return top_k_top_p_filter(logits / temperature[:, None], top_k, top_p).softmax(dim=-1)


def gather_logprobs(
    logits: torch.Tensor,  # [R, V] fp32 raw target logits
    row_index: list[int],  # which row of logits scored each emitted token
    token_ids: list[int],
    num_top: list[int],
) -> list[TokenLogprob]:
    """``read_logprobs`` of rows and tokens given on the host (one upload of both)."""
    if not row_index:
        return []
    rows, tokens = upload([row_index, token_ids], logits.device)
    return read_logprobs(logits, rows, tokens, token_ids, num_top)


def read_logprobs(
    logits: torch.Tensor,  # [R, V] fp32 raw target logits
    rows: torch.Tensor,  # [N] long: which row of logits scored each token
    tokens: torch.Tensor,  # [N] long: the tokens, on the device
    token_ids: list[int],  # [N] the same tokens, on the host
    num_top: list[int],  # [N] alternatives asked for with each
) -> list[TokenLogprob]:
    """The tokens' logprobs and the top alternatives, read back at once: log-softmax runs over the
    chosen rows only, top-k only when some token asks for alternatives, and only the requested
    columns move (fp32 values as their bits beside the alternatives' ids)."""
    chosen_rows = logits.index_select(0, rows).log_softmax(dim=-1)  # [N, V]
    values = chosen_rows.gather(1, tokens[:, None])  # [N, 1]
    width = max(num_top)
    if width:
        top_values, top_ids = chosen_rows.topk(width, dim=-1)  # [N, width] each
        read = torch.cat([as_bits(torch.cat([values, top_values], 1)), top_ids], 1).tolist()  # [N, 1 + 2·width]
    else:
        read = as_bits(values).tolist()
    out = []
    for t, n, row in zip(token_ids, num_top, read):
        chosen, *top_values = bits_floats(row[: 1 + width])
        out.append(TokenLogprob(t, chosen, list(zip(row[1 + width : 1 + width + n], top_values[:n]))))
    return out
