"""The training loop and the dense unrolling of a head's chains that MTP and EAGLE-3 heads share.

A head is trained over whole sequences at once, with dense attention instead of the paged KV its
proposer uses; each pass computes exactly what the proposer computes at its slots:

- *lockstep pass* of module m (its K/V at final slots): input at slot q is source(q − 1) for m = 0
  (the tapped hidden state, or an EAGLE-3 head's fused aux states), module m − 1's lockstep output at
  q − 1 for m ≥ 1 (zeros at q = 0); causal attention;
- *draft pass* j (draft j + 1 of a chain that starts at slot c = q − j; pass 0 is module 0's
  lockstep pass): module m = j mod L, input = ``chain_input`` of pass j − 1's output at q − 1, token
  x_q (the drafts before it were right, or it would not count), attending module m's lockstep keys at
  slots ≤ c and the keys of the earlier draft passes that ran module m at their slots c + i, never
  another module's.

This is EAGLE-3's *training-time test*: draft pass j ≥ 1 is fed the head's own outputs, not the
target's, as at serving time. Each head's loss (``mtp_head.py``, ``eagle3_head.py``) scores the
passes' logits against the target's greedy next tokens over a ``TrainVocabulary``; ``train`` runs
AdamW over batches of similar-length sequences.
"""
from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from specdecode.runtime.models.decoder import Attention, RotaryEmbedding
from specdecode.runtime.training.distill import Distilled

KV = tuple[torch.Tensor, torch.Tensor]  # (K, V) [B, kv_heads, T, head_dim]
# (tokens [B, T] long, recorded source [B, T, S], labels [B, T] long, −1 = padding) → the mean loss
BatchLoss = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
# (module m, input hidden [B, T, H], earlier passes' K/V per block, mask) → (output [B, T, H], its K/V per block)
RunModule = Callable[[int, torch.Tensor, list[list[KV]], torch.Tensor], tuple[torch.Tensor, list[KV]]]


@dataclass(frozen=True)
class TrainVocabulary:
    """The tokens the loss is taken over: ``ids`` [N] (the reduced draft vocabulary) and ``index``
    [V] mapping a token id to its place in ``ids``, −1 outside (such labels do not count)."""

    ids: torch.Tensor
    index: torch.Tensor

    @classmethod
    def of(cls, ids: torch.Tensor, vocab_size: int) -> "TrainVocabulary":
        index = torch.full((vocab_size,), -1, dtype=torch.long, device=ids.device)
        index[ids] = torch.arange(len(ids), device=ids.device)
        return cls(ids, index)

    def classes(self, labels: torch.Tensor) -> torch.Tensor:  # [...] token ids, −1 = padding → places, −1 outside
        return torch.where(labels >= 0, self.index[labels.clamp(min=0)], labels)


@dataclass(frozen=True)
class TrainConfig:
    epochs: int
    depth: int  # draft passes trained: drafts 1..depth of a chain
    lr: float = 3e-3
    batch_tokens: int = 256
    weight_decay: float = 0.0
    warmup_steps: int = 20
    seed: int = 0
    autocast: torch.dtype | None = None  # bfloat16: the head's matmuls in bf16 (weights and AdamW stay float32)


def train(head: nn.Module, data: Distilled, cfg: TrainConfig, loss_fn: BatchLoss, device: torch.device,
          dtype: torch.dtype, progress: Callable[[int, float], None]) -> list[float]:
    """AdamW with warm-up and cosine decay over ``head``'s trainable parameters, ``loss_fn`` per batch
    (under ``cfg.autocast``, mixed precision: the forward's matmuls in that dtype, the backward following
    it); ``progress(steps, loss)`` after each step. Returns the mean loss of each epoch."""
    rng = random.Random(cfg.seed)
    torch.manual_seed(cfg.seed)
    batches = _batches(data, cfg.batch_tokens)
    total = cfg.epochs * len(batches)
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / cfg.warmup_steps)
                                              * 0.5 * (1 + math.cos(math.pi * min(s, total) / total)))
    head.train()
    epoch_losses = []
    for _ in range(cfg.epochs):
        rng.shuffle(batches)
        losses = []
        for batch in batches:
            with torch.autocast(device.type, dtype=cfg.autocast or torch.bfloat16, enabled=cfg.autocast is not None):
                loss = loss_fn(*_pad(data, batch, device, dtype))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            sched.step()
            losses.append(loss.item())
            progress(1, losses[-1])
        epoch_losses.append(sum(losses) / len(losses))
    head.eval()
    return epoch_losses


def token_loss(features: torch.Tensor, lm_weight: torch.Tensor, classes: torch.Tensor) -> torch.Tensor:
    """Summed cross-entropy of ``features`` [N, H] through ``lm_weight`` [N_vocab, H] against ``classes``
    [N] (places in the trained vocabulary; −1 = a label outside it, which does not count)."""
    known = classes >= 0
    logits = F.linear(features[known], lm_weight)  # [N', N_vocab]
    return F.cross_entropy(logits.float(), classes[known], reduction="sum")


def draft_passes(
    run: RunModule, source: torch.Tensor, num_modules: int, depth: int,
    chain_input: Callable[[torch.Tensor], torch.Tensor] = lambda out: out,
) -> list[tuple[int, torch.Tensor]]:  # per draft pass j: (module, output [B, T, H])
    """The passes of the module docstring over ``source`` [B, T, H] (what module 0 reads at slot q + 1)."""
    t = source.shape[1]
    positions = torch.arange(t, device=source.device)
    causal = positions[None, :] <= positions[:, None]  # [T(query), T(key)]
    lockstep: list[tuple[torch.Tensor, list[KV]]] = []  # per module: (output, K/V per block)
    prev = source
    for m in range(num_modules):
        lockstep.append(run(m, shifted(prev), [], causal))
        prev = lockstep[-1][0]
    passes = [(0, lockstep[0][0])]
    chain_kv: dict[int, list[KV]] = {}  # draft pass i ≥ 1 → its K/V per block
    for j in range(1, depth):
        m = j % num_modules
        earlier = [i for i in range(1, j) if i % num_modules == m]
        masks = [positions[None, :] <= positions[:, None] - j]  # module m's final slots ≤ c = q − j
        masks += [positions[None, :] == positions[:, None] - j + i for i in earlier]  # its own chain slots c + i
        masks.append(positions[None, :] == positions[:, None])  # this slot
        out, kv = run(m, shifted(chain_input(passes[-1][1])), [lockstep[m][1]] + [chain_kv[i] for i in earlier],
                      torch.cat(masks, dim=1))
        chain_kv[j] = kv
        passes.append((m, out))
    return passes


def shifted(x: torch.Tensor) -> torch.Tensor:  # [B, T, H] → row q holds x[q − 1], zeros at q = 0
    return F.pad(x, (0, 0, 1, 0))[:, :-1]


class DenseAttention:
    """Attention for one pass of a module's blocks over whole sequences: block n attends the keys of
    the earlier passes ``extra_kv`` (their block n) and its own, as ``mask`` [T, (len(extra_kv) + 1) · T]
    says; ``kv`` collects this pass's K/V per block."""

    def __init__(self, rope: RotaryEmbedding, b: int, t: int, extra_kv: list[list[KV]], mask: torch.Tensor):
        self.rope, self.b, self.extra_kv, self.mask = rope, b, extra_kv, mask
        self.positions = torch.arange(t, device=mask.device)
        self.kv: list[KV] = []

    def of(self, n: int, attn: Attention) -> Callable[[torch.Tensor], torch.Tensor]:
        """Block n's attention: x [B·T, H_in] → [B·T, H]."""
        return lambda x: self._attend(attn, x, [pass_kv[n] for pass_kv in self.extra_kv])

    def _attend(self, attn: Attention, x: torch.Tensor, earlier: list[KV]) -> torch.Tensor:
        b, t = self.b, self.positions.numel()
        q, k, v = attn.project(x, self.rope, self.positions.repeat(b))
        q = q.view(b, t, attn.num_heads, attn.head_dim).transpose(1, 2)  # [B, heads, T, hd]
        k = k.view(b, t, attn.num_kv_heads, attn.head_dim).transpose(1, 2)  # [B, kv, T, hd]
        v = v.view(b, t, attn.num_kv_heads, attn.head_dim).transpose(1, 2)
        self.kv.append((k, v))
        keys = torch.cat([e[0] for e in earlier] + [k], dim=2)
        values = torch.cat([e[1] for e in earlier] + [v], dim=2)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=self.mask, scale=attn.scale,
                                             enable_gqa=attn.num_heads != attn.num_kv_heads)  # [B, heads, T, hd]
        return attn.o_proj(out.transpose(1, 2).reshape(b * t, -1))


def num_batches(data: Distilled, cfg: TrainConfig) -> int:
    return len(_batches(data, cfg.batch_tokens))


def _batches(data: Distilled, batch_tokens: int) -> list[list[int]]:
    """Sequence indices grouped by similar length, each group padded to at most ``batch_tokens``."""
    order = sorted(range(len(data.token_ids)), key=lambda i: len(data.token_ids[i]))
    batches, current = [], []
    for i in order:
        longest = max([len(data.token_ids[k]) for k in current] + [len(data.token_ids[i])])
        if current and longest * (len(current) + 1) > batch_tokens:
            batches.append(current)
            current = []
        current.append(i)
    if current:
        batches.append(current)
    return batches


def _pad(data: Distilled, batch: list[int], device: torch.device,
         dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tokens [B, T], recorded source [B, T, S], labels [B, T] with −1 as padding) on ``device``."""
    t = max(len(data.token_ids[i]) for i in batch)
    tokens = torch.zeros(len(batch), t, dtype=torch.long)
    source = torch.zeros(len(batch), t, data.source[batch[0]].shape[1])
    labels = torch.full((len(batch), t), -1, dtype=torch.long)
    for r, i in enumerate(batch):
        n = len(data.token_ids[i])
        tokens[r, :n], source[r, :n], labels[r, :n] = data.token_ids[i], data.source[i], data.labels[i]
    return tokens.to(device), source.to(device, dtype), labels.to(device)
