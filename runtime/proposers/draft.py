"""Draft-model proposer: a smaller model with the target's tokenizer drafts K tokens autoregressively.

The draft keeps its own paged KV cache (its own ``BlockManager`` and ``ModelRunner`` pools) and,
per sequence, a *draft state*: its block table and the tokens it holds K/V for, by position.

Each step, for the sequences asked for drafts:

1. *Catch up.* The longest prefix of the state's tokens that the sequence still has is
   *confirmed*; past it, the state is rolled back by position (the K/V of rejected drafts stays in
   its slots until overwritten: the mask never reads past a query's position). The tokens the
   draft has not seen are forwarded in one batched call — after a step, the accepted drafts the
   draft did not feed itself plus the recovered or bonus token (1 or 2 tokens, at most K+1); the
   whole prompt for a new sequence. Its last row gives draft token 1. Catch-ups share a budget
   of ``max_catch_up_tokens`` per step (the target's ``max_num_batched_tokens``), shortest
   first: a long prompt is fed in chunks over several steps, drafting nothing until it is in,
   so no step forwards a whole long prompt through the draft (its attention mask alone would be
   prompt² entries) and the sequences already drafting keep their drafts meanwhile.
2. *Draft.* K−1 single-token forwards batched over the sequences, each feeding the previous draft
   token and giving the next. The last draft token is never fed: the next catch-up feeds it if
   it was accepted. With batch buckets these steps are padded to the target's buckets (the
   draft's own runner: ``engine/buckets.py``) and, with CUDA graphs, replayed from its own graphs.

So a step forwards at most max(budget, (K+1)·B) + (K−1)·B tokens, never the prefix again.

Draft tokens are chosen by ``choose_guided_drafts``: the argmax for greedy requests, drawn from the
draft's own distribution for sampled ones, and those distributions are returned so rejection
sampling is exact; a constrained sequence's forced tokens are fed as its first drafts and the rest
drawn under its grammar (drafting.py). A sequence that does not fit in the draft pool, or past
the draft model's context, gets no drafts this step; the step never fails for it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import torch

from specdecode.runtime.config import Device, DType, LoadConfig, SpeculativeConfig
from specdecode.runtime.engine.block_manager import BlockManager
from specdecode.runtime.engine.model_runner import ModelRunner
from specdecode.runtime.engine.scheduler import ScheduledSeq
from specdecode.runtime.engine.sequence import Sequence
from specdecode.runtime.models.decoder import DecoderLM
from specdecode.runtime.models.loader import LoadedModel, load_model
from specdecode.runtime.proposers import Proposal, Proposer
from specdecode.runtime.proposers.drafting import Guides, choose_guided_drafts, draft_probs
from specdecode.runtime.tokenizer import Tokenizer

_DTYPES = {torch.float32: DType.FLOAT32, torch.bfloat16: DType.BFLOAT16, torch.float16: DType.FLOAT16}
TOKENIZER_SAMPLE = 512  # token strings compared (evenly spaced ids, plus the last ones)


@dataclass
class DraftState:
    """The draft model's view of one sequence, shaped like a ``Sequence`` for the runner and block manager."""

    token_ids: list[int] = field(default_factory=list)  # the sequence's tokens, then this step's draft tokens
    num_computed_tokens: int = 0  # leading positions with K/V in the draft pool
    num_confirmed: int = 0  # leading positions known equal to the sequence's tokens
    block_table: list[int] = field(default_factory=list)
    wants_prompt_logprobs: ClassVar[bool] = False  # the draft model's prefill scores none

    def __len__(self) -> int:
        return len(self.token_ids)


class DraftProposer(Proposer):
    def __init__(
        self, model: DecoderLM, num_blocks: int, block_size: int, device: torch.device, dtype: torch.dtype,
        max_catch_up_tokens: int, buckets: list[int] | None = None, cuda_graphs: bool = False,
    ):
        self.model = model
        self.device = device
        self.max_catch_up_tokens = max_catch_up_tokens
        self.blocks = BlockManager(num_blocks, block_size, enable_prefix_caching=False)
        # a graph's tables reach the draft's last position (drafts never feed past it)
        width = -(-(model.config.max_position_embeddings + 1) // block_size) if cuda_graphs else None
        self.runner = ModelRunner(model, num_blocks, block_size, device, dtype, buckets=buckets, graph_width=width)
        self.states: dict[int, DraftState] = {}  # by seq_id

    @classmethod
    def load(
        cls,
        cfg: SpeculativeConfig,
        device: torch.device,
        dtype: torch.dtype,
        *,
        target_vocab_size: int,
        tokenizer: Tokenizer,
        weight_cache_dir: Path | None,
        block_size: int,
        num_blocks: int,
        max_catch_up_tokens: int,
        buckets: list[int] | None = None,
        cuda_graphs: bool = False,
    ) -> "DraftProposer":
        """Load ``cfg.draft_model`` on the target's device in its dtype; refuse one that does not share its tokenizer."""
        load = LoadConfig(
            model=cfg.draft_model, device=Device(device.type), dtype=_DTYPES[dtype], weight_cache_dir=weight_cache_dir
        )
        loaded = load_model(load)
        check_same_tokenizer(loaded, target_vocab_size, tokenizer)
        return cls(loaded.model, cfg.draft_kv_cache_blocks or num_blocks, block_size, device, dtype, max_catch_up_tokens,
                   buckets, cuda_graphs)

    def propose(self, seqs: list[Sequence], max_drafts: list[int], guides: Guides | None = None) -> Proposal:
        ks, fed = self._catch_up_all(seqs, max_drafts)  # drafts this step (0: none), tokens queued to feed
        drafts = [guides.forced(i)[:k] if guides is not None and not ks[i] else [] for i, k in enumerate(max_drafts)]
        q_rows: dict[tuple[int, int], torch.Tensor] = {}  # (sequence, draft) → the distribution it was drawn from
        want_probs = any(k and not seq.params.greedy for seq, k in zip(seqs, ks))
        for j in range(max(1, max(ks))) if any(fed) else ():  # j = 0 also feeds the catch-ups that draft nothing yet
            rows = [i for i, k in enumerate(ks) if k > j or (j == 0 and fed[i])]
            states = [self.states[seqs[i].seq_id] for i in rows]
            logits = self.runner.execute([ScheduledSeq(s, len(s) - s.num_computed_tokens) for s in states]).logits  # [len(rows), V]
            for state in states:
                state.num_computed_tokens = len(state)
            drafting = [r for r, i in enumerate(rows) if ks[i] > j]
            if not drafting:
                continue
            rows = [rows[r] for r in drafting]
            logits = logits.index_select(0, torch.tensor(drafting, device=logits.device))
            tokens, q = choose_guided_drafts(logits, seqs, rows, j, want_probs, guides, self.model.config.vocab_size)
            for r, (i, token) in enumerate(zip(rows, tokens)):
                if token is None:
                    ks[i] = j
                    continue
                self.states[seqs[i].seq_id].token_ids.append(token)
                drafts[i].append(token)
                if q is not None:
                    q_rows[i, j] = q[r]
        return Proposal(drafts, draft_probs(drafts, q_rows, self.model.config.vocab_size, self.device) if want_probs else None)

    def finished(self, seq: Sequence) -> None:
        state = self.states.pop(seq.seq_id, None)
        if state is not None:
            self.blocks.release(state)

    def _catch_up_all(self, seqs: list[Sequence], max_drafts: list[int]) -> tuple[list[int], list[int]]:
        """Per sequence, the drafts it gets this step and the tokens queued to feed its draft state;
        the shortest catch-ups go first under ``max_catch_up_tokens``."""
        ks, fed = [0] * len(seqs), [0] * len(seqs)
        budget = self.max_catch_up_tokens
        for i in sorted(range(len(seqs)), key=lambda i: self.catch_up(seqs[i])):
            ks[i], fed[i] = self._catch_up(seqs[i], max_drafts[i], budget)
            budget -= fed[i]
        return ks, fed

    def catch_up(self, seq: Sequence) -> int:
        """Tokens of ``seq`` before its last that its draft state would need fed (an estimate: drafts
        not yet compared count as seen): 0 or 1 after a step that drafted, the prompt for a new sequence."""
        state = self.states.get(seq.seq_id)
        return len(seq) - 1 - (min(state.num_computed_tokens, len(seq) - 1) if state else 0)

    def _catch_up(self, seq: Sequence, cap: int, budget: int) -> tuple[int, int]:
        """Roll ``seq``'s draft state back to its confirmed tokens and queue up to ``budget`` unseen
        ones; return (drafts this step, tokens queued). No drafts when the catch-up does not fit in
        the budget (it goes on next step), the pool is short or the draft's context ends."""
        k = min(cap, self.model.config.max_position_embeddings + 1 - len(seq))  # feeds positions < len + k - 1
        if k <= 0 or budget <= 0:
            return 0, 0
        state = self.states.setdefault(seq.seq_id, DraftState())
        n = min(state.num_confirmed, len(seq) - 1)
        limit = min(state.num_computed_tokens, len(seq) - 1)  # the last token is always fed: its row drafts
        while n < limit and state.token_ids[n] == seq.token_ids[n]:
            n += 1
        end = min(len(seq), n + budget)
        if end < len(seq):
            k = 0
        if not self.blocks.grow(state, end + max(k - 1, 0)):
            return 0, 0
        del state.token_ids[n:]
        state.token_ids += seq.token_ids[n:end]
        state.num_computed_tokens = n
        state.num_confirmed = end
        return k, end - n


def check_same_tokenizer(draft: LoadedModel, target_vocab_size: int, tokenizer: Tokenizer) -> None:
    """Raise ValueError unless the draft's vocabulary size, eos ids and token strings equal the target's."""
    size = draft.config.vocab_size
    if size != target_vocab_size:
        raise ValueError(
            f"draft model {draft.name!r} has a vocabulary of {size} tokens but the target's has {target_vocab_size}: "
            "a draft model must share the target's tokenizer"
        )
    theirs, ours = draft.tokenizer, tokenizer
    if theirs.eos_token_ids != ours.eos_token_ids:
        raise ValueError(
            f"draft model {draft.name!r} ends sequences with token ids {sorted(theirs.eos_token_ids)}, "
            f"the target with {sorted(ours.eos_token_ids)}: a draft model must share the target's tokenizer"
        )
    n = min(theirs.vocab_size, ours.vocab_size)
    ids = sorted(set(range(0, n, max(1, n // TOKENIZER_SAMPLE))) | set(range(max(0, n - 64), n)))
    for i in ids:
        if theirs.id_to_token(i) != ours.id_to_token(i):
            raise ValueError(
                f"draft model {draft.name!r} spells token {i} {theirs.id_to_token(i)!r}, the target "
                f"{ours.id_to_token(i)!r}: a draft model must share the target's tokenizer"
            )
    if theirs.vocab_size != ours.vocab_size:
        raise ValueError(
            f"draft model {draft.name!r}'s tokenizer has {theirs.vocab_size} tokens, the target's {ours.vocab_size}: "
            "a draft model must share the target's tokenizer"
        )
