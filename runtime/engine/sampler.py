"""Turn the target's logits into next tokens, per request's sampling parameters.

Order, as in vLLM: logprobs are taken from the *raw* logits (what the model believes), then
frequency/presence penalties, temperature, top-k and top-p shape the distribution that is
sampled. Sampling draws one exponential race per row from the sequence's own generator
(``argmax(p / E)`` with ``E ~ Exp(1)`` is a sample of ``p``), so a seeded request produces the
same tokens whatever batch it shares a step with.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specdecode.runtime.engine.sequence import SamplingParams, TokenLogprob


@dataclass
class SamplerRow:
    params: SamplingParams
    output_token_ids: list[int]  # tokens generated so far (for penalties)
    generator: torch.Generator | None  # None for greedy rows


def apply_penalties(
    logits: torch.Tensor,  # [N, V] fp32, modified in place
    rows: list[SamplerRow],
) -> None:
    for i, row in enumerate(rows):
        p = row.params
        if not p.has_penalties or not row.output_token_ids:
            continue
        ids = torch.tensor(row.output_token_ids, device=logits.device)
        counts = torch.bincount(ids, minlength=logits.shape[1]).to(logits.dtype)
        logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)


def top_k_top_p_mask(
    logits: torch.Tensor,  # [N, V] fp32, temperature applied; modified in place
    top_k: torch.Tensor,  # [N] long, 0 = off
    top_p: torch.Tensor,  # [N] fp32, 1 = off
) -> torch.Tensor:
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[1]
    ranks = torch.arange(vocab, device=logits.device)
    k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab)
    drop = ranks[None, :] >= k[:, None]
    probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # probability of strictly better tokens
    drop |= mass_before >= top_p[:, None]
    drop[:, 0] = False  # the best token always survives
    return logits.scatter_(1, order, sorted_logits.masked_fill(drop, float("-inf")))


def sample(
    logits: torch.Tensor,  # [N, V] fp32 (raw target logits)
    rows: list[SamplerRow],
) -> tuple[list[int], list[TokenLogprob | None]]:
    raw_logprobs = logits.log_softmax(dim=-1) if any(r.params.logprobs is not None for r in rows) else None
    logits = logits.clone()
    apply_penalties(logits, rows)
    tokens = logits.argmax(dim=-1)  # greedy rows keep these
    sampled = [i for i, r in enumerate(rows) if not r.params.greedy]
    if sampled:
        idx = torch.tensor(sampled, device=logits.device)
        temps = torch.tensor([rows[i].params.temperature for i in sampled], device=logits.device)
        scaled = logits[idx] / temps[:, None]
        top_k = torch.tensor([max(rows[i].params.top_k, 0) for i in sampled], device=logits.device)
        top_p = torch.tensor([rows[i].params.top_p for i in sampled], device=logits.device)
        probs = top_k_top_p_mask(scaled, top_k, top_p).softmax(dim=-1)
        races = torch.stack(
            [torch.empty(logits.shape[1], device=logits.device).exponential_(generator=rows[i].generator) for i in sampled]
        )  # [S, V]
        tokens[idx] = (probs / races).argmax(dim=-1)
    token_list = tokens.tolist()
    return token_list, gather_logprobs(raw_logprobs, token_list, rows)


def gather_logprobs(
    raw_logprobs: torch.Tensor | None,  # [N, V] or None when no row asked
    token_ids: list[int],
    rows: list[SamplerRow],
) -> list[TokenLogprob | None]:
    if raw_logprobs is None:
        return [None] * len(rows)
    max_top = max(r.params.logprobs or 0 for r in rows)
    chosen = raw_logprobs.gather(1, torch.tensor(token_ids, device=raw_logprobs.device)[:, None])[:, 0].tolist()
    top_vals, top_ids = raw_logprobs.topk(max_top, dim=-1) if max_top else (None, None)
    top_vals = top_vals.tolist() if max_top else None
    top_ids = top_ids.tolist() if max_top else None
    out: list[TokenLogprob | None] = []
    for i, row in enumerate(rows):
        n = row.params.logprobs
        if n is None:
            out.append(None)
            continue
        top = list(zip(top_ids[i][:n], top_vals[i][:n])) if n else []
        out.append(TokenLogprob(token_ids[i], chosen[i], top))
    return out
