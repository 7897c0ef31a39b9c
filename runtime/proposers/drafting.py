"""How a model-based proposer turns its logits into draft tokens, and the distributions they came from.

Greedy requests draft the argmax (a one-hot distribution). Sampled requests draw from the
proposer's own distribution under the request's temperature, top-k and top-p (``sampling_probs``;
penalties are not applied) with a uniform keyed by (seed, position) on ``rng.Stream.DRAFT``, so a
seeded request drafts the same tokens in any batch. The distributions returned are exactly those
the drafts were drawn from: rejection sampling needs that q to stay lossless.
"""
from __future__ import annotations

import torch

from specdecode.kernels.sampling import inverse_cdf_sample
from specdecode.runtime.engine import rng
from specdecode.runtime.engine.sampler import sampling_probs
from specdecode.runtime.engine.sequence import Sequence


def choose_drafts(
    logits: torch.Tensor,  # [N, V'] fp32: one row per sequence (V' may be a reduced draft vocabulary)
    seqs: list[Sequence],
    j: int,  # which draft of each sequence (0-based): its position is len(seq) + j
    want_probs: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:  # draft ids [N] long (indices into V'), distributions [N, V'] or None
    tokens = logits.argmax(dim=-1)  # [N]
    q = torch.nn.functional.one_hot(tokens, logits.shape[1]).float() if want_probs else None  # [N, V']
    sampled = [b for b, s in enumerate(seqs) if not s.params.greedy]
    if sampled:
        index = torch.tensor(sampled, device=logits.device)
        q_sampled = sampling_probs(logits.index_select(0, index), [seqs[b].params for b in sampled])  # [S, V']
        u = [rng.uniform(seqs[b].seed, len(seqs[b]) + j, rng.Stream.DRAFT) for b in sampled]
        tokens[index] = inverse_cdf_sample(q_sampled, torch.tensor(u, dtype=torch.float32, device=logits.device))
        q[index] = q_sampled
    return tokens, q
