"""Training an MTP head (``models/mtp.py``): how one starts, and its loss over the chained passes.

The passes are ``trainer.draft_passes`` over the tapped target hidden states, one dense run of a
module per pass (``models/mtp.py``'s slots). The loss (``head_loss``) is, per slot and draft pass,
the cross-entropy of the pass's logits (the target's frozen LM head over the module's final norm)
against the target's greedy next token, plus a regression of those features onto the target's own
hidden state there, over every slot of the sequences (prompt positions too: more signal per
recorded token, measured a little better). With a ``TrainVocabulary`` the logits cover the reduced
draft vocabulary only: the LM head is most of a step's cost at SmolLM2's 49,152 tokens. The
target's embedding and LM head stay frozen and are not part of the head.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from specdecode.runtime.models.decoder import DecoderLM
from specdecode.runtime.models.mtp import HiddenTap, MtpConfig, MtpHead
from specdecode.runtime.training.trainer import KV, BatchLoss, DenseAttention, TrainVocabulary, draft_passes, token_loss

BLOCK_INIT_STD = 0.02
FINAL_NORM_INIT = 0.1
FEATURE_WEIGHT = 10.0  # weight of the feature regression against the cross-entropy


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


def loss_of(head: MtpHead, target: DecoderLM, depth: int, vocab: TrainVocabulary | None = None) -> BatchLoss:
    return lambda tokens, hidden, labels: head_loss(head, target, tokens, hidden, labels, depth, vocab)


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
    outs = draft_passes(_runner(head, target, tokens), hidden, len(head.layers), depth)
    features_wanted = target.model.norm(hidden) if head.config.hidden_tap is HiddenTap.PRE_NORM else hidden  # what the LM head reads
    lm_weight = target.lm_head_weight if vocab is None else target.lm_head_weight.index_select(0, vocab.ids)
    classes = labels if vocab is None else vocab.classes(labels)
    total, count = hidden.new_zeros(()), 0
    for j, (m, out) in enumerate(outs):
        real = labels[:, j:] >= 0  # [B, T − j]
        features = head.layers[m].final_norm(out[:, j:][real])  # [N, H]
        regression = F.smooth_l1_loss(features.float(), features_wanted[:, j:][real].float(), reduction="none").mean(-1)
        total = total + FEATURE_WEIGHT * regression.sum() + token_loss(features, lm_weight, classes[:, j:][real])
        count += int(real.sum())
    return total / max(count, 1)


def _runner(head: MtpHead, target: DecoderLM, tokens: torch.Tensor):
    """``trainer.RunModule`` for this head's modules over ``tokens`` [B, T] (the target's embedding and RoPE)."""
    embeds = target.model.embed_tokens(tokens)  # [B, T, H]
    b, t, h = embeds.shape

    def run(m: int, hidden: torch.Tensor, extra_kv: list[list[KV]], mask: torch.Tensor):
        module, attention = head.layers[m], DenseAttention(target.rope, b, t, extra_kv, mask)
        x = module.combine(hidden.reshape(-1, h), embeds.reshape(-1, h))  # [B·T, H]
        for n, block in enumerate(module.blocks):
            x = block.run(x, attention.of(n, block.self_attn))
        return x.view(b, t, h), attention.kv

    return run
