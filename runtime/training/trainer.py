"""Training an MTP head on self-distillation data, with the slots and chaining the proposer uses.

Every module runs over whole sequences at once with dense attention instead of the paged KV the
proposer uses, and each computes exactly what the proposer computes (``models/mtp.py``):

- *lockstep pass* of module m (its K/V at final slots): input at slot q is tap(h_{q-1}) for m = 0,
  module m − 1's lockstep output at q − 1 for m ≥ 1 (zeros at q = 0); causal attention;
- *draft pass* j (draft j + 1 of a chain that starts at slot c = q − j; pass 0 is module 0's
  lockstep pass): module m = j mod L, input = pass j − 1's output at q − 1, token x_q (the drafts
  before it were right, or it would not count), attending module m's lockstep keys at slots ≤ c and
  the keys of the earlier draft passes that ran module m at their slots c + i, never another module's.

The loss (``head_loss``) is, per slot and draft pass, the cross-entropy of the pass's logits (the
target's frozen LM head over the module's final norm) against the target's greedy next token, plus
a regression of those features onto the target's own hidden state there, over every slot of the
sequences (prompt positions too: more signal per recorded token, measured a little better). With a
``TrainVocabulary`` the logits cover the reduced draft vocabulary only: the LM head is most of a
step's cost at SmolLM2's 49,152 tokens. The target's embedding and LM head stay frozen and are not
part of the head; ``init_head`` says how a head starts.
"""
from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specdecode.runtime.models.decoder import Attention, DecoderLM
from specdecode.runtime.models.mtp import HiddenTap, MtpConfig, MtpHead, MtpModule
from specdecode.runtime.training.distill import Distilled


BLOCK_INIT_STD = 0.02
FINAL_NORM_INIT = 0.1
FEATURE_WEIGHT = 10.0  # weight of the feature regression against the cross-entropy


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


@dataclass(frozen=True)
class TrainConfig:
    epochs: int
    depth: int  # draft passes trained: drafts 1..depth of a chain
    lr: float = 3e-3
    batch_tokens: int = 256
    weight_decay: float = 0.0
    warmup_steps: int = 20
    seed: int = 0


def init_head(target: DecoderLM, cfg: MtpConfig, seed: int) -> MtpHead:
    """A fresh head: small random blocks (std ``BLOCK_INIT_STD``), a projection that adds the normed
    embedding and hidden state, and a final norm at ``FINAL_NORM_INIT`` times the target's, so the
    first logits are soft rather than confidently wrong. (Measured against starting from a copy of
    the target's last layer: that layer expects the target's residual stream, ~30× larger than
    anything the projection gives it, and learned less from the same data.)"""
    torch.manual_seed(seed)
    head = MtpHead(target.config, cfg)
    h = target.config.hidden_size
    with torch.no_grad():
        for module in head.layers:
            for name, param in module.blocks.named_parameters():
                if not name.endswith("norm.weight"):
                    torch.nn.init.normal_(param, std=BLOCK_INIT_STD)
            module.eh_proj.weight.copy_(torch.cat([torch.eye(h), torch.eye(h)], dim=1))
            module.final_norm.weight.copy_(FINAL_NORM_INIT * target.model.norm.weight)
    return head.to(target.model.embed_tokens.weight.device)


def train(
    head: MtpHead, target: DecoderLM, data: Distilled, cfg: TrainConfig, progress: Callable[[int, float], None],
    vocab: TrainVocabulary | None = None,
) -> list[float]:
    """AdamW with warm-up and cosine decay; ``progress(steps, loss)`` after each step. The loss is
    over ``vocab`` (the reduced draft vocabulary: its LM-head rows only, ~V/N times cheaper), or the
    full vocabulary. Returns the mean loss of each epoch."""
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
            loss = head_loss(head, target, *_pad(data, batch, target), cfg.depth, vocab)
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


def head_loss(
    head: MtpHead,
    target: DecoderLM,
    tokens: torch.Tensor,  # [B, T] long
    hidden: torch.Tensor,  # [B, T, H] tapped target hidden states h_q
    labels: torch.Tensor,  # [B, T] long, the target's greedy token after position q; -1 = padding
    depth: int,
    vocab: TrainVocabulary | None = None,
) -> torch.Tensor:
    """Per slot and draft pass: the cross-entropy of the pass's logits against the target's greedy
    token, plus ``FEATURE_WEIGHT`` × the smooth-L1 distance of the features the LM head reads
    (final_norm(out)) from the target's own tapped hidden state at that slot (EAGLE's feature
    regression: an H-dimensional target per token instead of one label). Mean over the slots
    q ≥ j of pass j."""
    outs = draft_passes(head, target, tokens, hidden, depth)
    features_wanted = target.model.norm(hidden) if head.config.hidden_tap is HiddenTap.PRE_NORM else hidden  # what the LM head reads
    lm_weight = target.lm_head_weight if vocab is None else target.lm_head_weight.index_select(0, vocab.ids)
    classes = labels if vocab is None else torch.where(labels >= 0, vocab.index[labels.clamp(min=0)], labels)
    total, count = hidden.new_zeros(()), 0
    for j, (m, out) in enumerate(outs):
        real = labels[:, j:] >= 0  # [B, T − j]
        features = head.layers[m].final_norm(out[:, j:][real])  # [N, H]
        regression = F.smooth_l1_loss(features.float(), features_wanted[:, j:][real].float(), reduction="none").mean(-1)
        total = total + FEATURE_WEIGHT * regression.sum()
        known = classes[:, j:][real] >= 0  # labels inside the vocabulary trained over
        logits = F.linear(features[known], lm_weight)  # [N', V']
        total = total + F.cross_entropy(logits.float(), classes[:, j:][real][known], reduction="sum")
        count += int(real.sum())
    return total / max(count, 1)


def draft_passes(
    head: MtpHead, target: DecoderLM, tokens: torch.Tensor, hidden: torch.Tensor, depth: int
) -> list[tuple[int, torch.Tensor]]:  # per draft pass j: (module, output [B, T, H])
    num_modules = len(head.layers)
    embeds = target.model.embed_tokens(tokens)  # [B, T, H]
    t = tokens.shape[1]
    positions = torch.arange(t, device=tokens.device)
    causal = positions[None, :] <= positions[:, None]  # [T(query), T(key)]
    lockstep: list[tuple[torch.Tensor, list]] = []  # per module: (output, K/V per block)
    prev = hidden
    for module in head.layers:
        lockstep.append(_run_module(module, target, _shifted(prev), embeds, positions, [], causal))
        prev = lockstep[-1][0]
    passes = [(0, lockstep[0][0])]
    chain_kv: dict[int, list] = {}  # draft pass i ≥ 1 → its K/V per block
    for j in range(1, depth):
        m = j % num_modules
        earlier = [i for i in range(1, j) if i % num_modules == m]
        masks = [positions[None, :] <= positions[:, None] - j]  # module m's final slots ≤ c = q − j
        masks += [positions[None, :] == positions[:, None] - j + i for i in earlier]  # its own chain slots c + i
        masks.append(positions[None, :] == positions[:, None])  # this slot
        extra = [lockstep[m][1]] + [chain_kv[i] for i in earlier]
        out, kv = _run_module(head.layers[m], target, _shifted(passes[-1][1]), embeds, positions, extra,
                              torch.cat(masks, dim=1))
        chain_kv[j] = kv
        passes.append((m, out))
    return passes


def _shifted(x: torch.Tensor) -> torch.Tensor:  # [B, T, H] → row q holds x[q − 1], zeros at q = 0
    return F.pad(x, (0, 0, 1, 0))[:, :-1]


def _run_module(
    module: MtpModule,
    target: DecoderLM,
    hidden: torch.Tensor,  # [B, T, H] input hidden states
    embeds: torch.Tensor,  # [B, T, H]
    positions: torch.Tensor,  # [T]
    extra_kv: list[list[tuple[torch.Tensor, torch.Tensor]]],  # per earlier pass: (K, V) [B, kv, T, hd] per block
    mask: torch.Tensor,  # [T, (len(extra_kv) + 1) · T] bool: which keys each query attends
) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
    b, t, h = hidden.shape
    x = module.combine(hidden.reshape(-1, h), embeds.reshape(-1, h))  # [B·T, H]
    kv: list[tuple[torch.Tensor, torch.Tensor]] = []
    for n, block in enumerate(module.blocks):
        earlier = [pass_kv[n] for pass_kv in extra_kv]
        x = block.run(x, lambda z: _dense_attention(block.self_attn, target, z, b, positions, earlier, mask, kv))
    return x.view(b, t, h), kv


def _dense_attention(
    attn: Attention, target: DecoderLM, x: torch.Tensor, b: int, positions: torch.Tensor,
    earlier: list[tuple[torch.Tensor, torch.Tensor]], mask: torch.Tensor, kv_out: list,
) -> torch.Tensor:  # x: [B·T, H] → [B·T, H]
    t = positions.numel()
    q, k, v = attn.project(x, target.rope, positions.repeat(b))
    q = q.view(b, t, attn.num_heads, attn.head_dim).transpose(1, 2)  # [B, heads, T, hd]
    k = k.view(b, t, attn.num_kv_heads, attn.head_dim).transpose(1, 2)  # [B, kv, T, hd]
    v = v.view(b, t, attn.num_kv_heads, attn.head_dim).transpose(1, 2)
    kv_out.append((k, v))
    keys = torch.cat([e[0] for e in earlier] + [k], dim=2)
    values = torch.cat([e[1] for e in earlier] + [v], dim=2)
    out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=attn.scale,
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


def _pad(data: Distilled, batch: list[int], target: DecoderLM) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tokens [B, T], tapped hidden [B, T, H], labels [B, T] with −1 as padding) on the target's device."""
    device = target.model.embed_tokens.weight.device
    t = max(len(data.token_ids[i]) for i in batch)
    tokens = torch.zeros(len(batch), t, dtype=torch.long)
    hidden = torch.zeros(len(batch), t, data.hidden[batch[0]].shape[1])
    labels = torch.full((len(batch), t), -1, dtype=torch.long)
    for r, i in enumerate(batch):
        n = len(data.token_ids[i])
        tokens[r, :n], hidden[r, :n], labels[r, :n] = data.token_ids[i], data.hidden[i], data.labels[i]
    return tokens.to(device), hidden.to(device, target.model.embed_tokens.weight.dtype), labels.to(device)
