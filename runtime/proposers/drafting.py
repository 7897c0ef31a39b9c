"""How a model-based proposer turns its logits into draft tokens, and the distributions they came from.

Greedy requests draft the argmax (a one-hot distribution). Sampled requests draw from the
proposer's own distribution under the request's temperature, top-k and top-p (``sampling_probs``;
penalties are not applied) with a uniform keyed by (seed, position) on ``rng.Stream.DRAFT``, so a
seeded request drafts the same tokens in any batch. The distributions returned are exactly those
the drafts were drawn from: rejection sampling needs that q to stay lossless.

A constrained sequence drafts under its grammar (``Guides``, when ``grammar_drafts`` is on): the
tokens the grammar forces next come first (q one-hot: a forced draft is a function of the
context), and every later draft is drawn from the proposer's distribution *restricted to what the
grammar allows* after the drafts before it — so no draft the grammar forbids is ever scored, and
q is still exactly what the draft came from.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specdecode.kernels.sampling import inverse_cdf_sample
from specdecode.runtime.engine import rng
from specdecode.runtime.engine.grammar import Grammar, GrammarCompiler
from specdecode.runtime.engine.sampler import sampling_probs
from specdecode.runtime.engine.sequence import Sequence


@dataclass
class DraftGuide:
    """One constrained sequence's drafting in one step: its forced tokens, and a copy of its grammar
    advanced through the drafts as they are chosen."""

    grammar: Grammar
    forced: list[int]

    def take(self, token: int) -> bool:
        """Advance through a draft; False when the grammar refuses it (drafting stops there)."""
        return self.grammar.advance(token)


@dataclass
class Guides:
    """The guides of one proposal, one per sequence (None: unconstrained), and the compiler that
    fills their masks."""

    compiler: GrammarCompiler
    per_seq: list[DraftGuide | None]

    def forced(self, i: int) -> list[int]:
        guide = self.per_seq[i]
        return guide.forced if guide is not None else []


def guides_for(compiler: GrammarCompiler, seqs: list[Sequence], caps: list[int], max_forced: int) -> Guides | None:
    """Each constrained sequence's guide (a copy of its grammar, and the tokens it forces next, up to
    ``max_forced`` and its cap); None when none of ``seqs`` is constrained."""
    per_seq = [None if (g := seq.grammar) is None else DraftGuide(g.copy(), g.forced_tokens(min(max_forced, cap)))
               for seq, cap in zip(seqs, caps)]
    return Guides(compiler, per_seq) if any(per_seq) else None


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
        keys = [(b, seqs[b].seed, len(seqs[b]) + j) for b in sampled]
        index, seeds, positions = torch.tensor(keys, dtype=torch.long, device=logits.device).unbind(1)  # [S] each
        q_sampled = sampling_probs(logits.index_select(0, index), [seqs[b].params for b in sampled])  # [S, V']
        u = rng.device_uniforms(seeds, positions, 1, rng.Stream.DRAFT)[:, 0]  # [S]
        tokens[index] = inverse_cdf_sample(q_sampled, u)
        q[index] = q_sampled
    return tokens, q


def choose_guided_drafts(
    logits: torch.Tensor,  # [N, V'] fp32, one row per sequence of ``rows``
    seqs: list[Sequence],  # the proposal's sequences
    rows: list[int],  # which of them the logits are for
    j: int,
    want_probs: bool,
    guides: Guides | None,
    vocab_size: int,  # the target's: q comes back over it
    vocab_ids: torch.Tensor | None = None,  # [V'] target ids of a reduced draft vocabulary
) -> tuple[list[int | None], torch.Tensor | None]:  # draft j per row in target ids (None: drafting stops), q [N, V] or None
    """``choose_drafts`` for a proposal with guides: forced tokens where a guide has one at ``j``,
    else a draw under the grammar's mask; a row whose grammar allows none of V' stops drafting."""
    per_row = [guides.per_seq[i] if guides is not None else None for i in rows]
    free = [r for r, g in enumerate(per_row) if g is not None and j >= len(g.forced)]
    dead = {r for r in free if per_row[r].grammar.complete}  # nothing follows the end of the output
    if free:
        allowed = guides.compiler.allowed([per_row[r].grammar for r in free], vocab_size).to(logits.device)  # [F, V]
        if vocab_ids is not None:
            allowed = allowed.index_select(1, vocab_ids)  # [F, V']
        dead |= {r for r, ok in zip(free, allowed.any(dim=1).tolist()) if not ok}
        logits = logits.clone()
        logits[free] = logits[free].masked_fill(~allowed, float("-inf"))
        if dead:
            logits[sorted(dead)] = 0.0  # a finite row: its draw is discarded
    tokens, q = choose_drafts(logits, [seqs[i] for i in rows], j, want_probs)
    if vocab_ids is not None:
        tokens = vocab_ids[tokens]
        if q is not None:
            q = q.new_zeros(len(rows), vocab_size).index_copy_(1, vocab_ids, q)
    chosen: list[int | None] = tokens.tolist()
    for r, guide in enumerate(per_row):
        if guide is None:
            continue
        if j < len(guide.forced):
            chosen[r] = guide.forced[j]
            if q is not None:
                q[r] = 0.0
                q[r, chosen[r]] = 1.0
        if r in dead or not guide.take(chosen[r]):
            chosen[r] = None
    return chosen, q


def draft_probs(
    drafts: list[list[int]], drawn: dict[tuple[int, int], torch.Tensor], vocab_size: int, device: torch.device
) -> torch.Tensor:  # [B, K, V] fp32, K = the most drafts of a sequence
    """The proposal's q: ``drawn[i, j]`` where draft j of sequence i was drawn, one-hot elsewhere
    (forced tokens, and drafts of sequences that did not draw)."""
    probs = torch.zeros(len(drafts), max(map(len, drafts), default=0), vocab_size, device=device)
    for i, row in enumerate(drafts):
        for j, token in enumerate(row):
            q = drawn.get((i, j))
            if q is None:
                probs[i, j, token] = 1.0
            else:
                probs[i, j] = q
    return probs
