"""Training an EAGLE-3 head (``models/eagle3.py``) for a target that has none: how one starts, and
its loss under the training-time test.

*Training-time test* (EAGLE-3's): the head's chain is unrolled for ``depth`` passes over whole
sequences (``trainer.draft_passes``, one module): pass 0 runs every slot q fed fc(aux(q − 1)) and
token x_q, as the proposer's final slots; pass j ≥ 1 is fed the head's own ``chain_hidden`` output
of pass j − 1 at q − 1, never the target's, and attends the final slots ≤ q − j and its chain's
earlier slots, as the proposer's chain slot q of a chain started at q − j. Each pass's logits (the
head's own LM head over its draft vocabulary) are scored against the target's greedy next token;
labels outside the draft vocabulary do not count. No feature regression: EAGLE-3 dropped it, and
the head's output is not meant to be the target's hidden state.

*Start* (``init_head``): the head's blocks have the target's shapes (speculators builds its
``transformer_layer_config`` from the target's the same way); fc passes the highest aux state
through, the midlayer's residual is g itself (``norm_before_residual`` false) and its attention and
MLP start small, the final norm and the LM head rows are the target's: a fresh head drafts the
target's "logit lens" at its highest aux layer, which already agrees with the target often; the
training learns the rest. The LM head rows stay frozen, as the MTP head's shared LM head: from half
a million tokens a trained one generalised worse (held-out position 1 0.33 against 0.35,
docs/mtp.md). The embedding is the target's (not saved: the loader shares it).
"""
from __future__ import annotations

import torch

from specdecode.runtime.models.decoder import DecoderLM
from specdecode.runtime.models.eagle3 import Eagle3Config, Eagle3Head
from specdecode.runtime.training.trainer import KV, BatchLoss, DenseAttention, TrainVocabulary, draft_passes, token_loss

BLOCK_INIT_STD = 0.02


def head_config(target: DecoderLM, aux_layer_ids: tuple[int, int, int], draft_vocab_size: int) -> Eagle3Config:
    """One llama block of the target's shapes over ``aux_layer_ids``, chained on its output before the
    final norm (vLLM's default)."""
    c = target.config
    return Eagle3Config(hidden_size=c.hidden_size, target_hidden_size=c.hidden_size,
                        intermediate_size=c.intermediate_size, num_layers=1, num_heads=c.num_heads,
                        num_kv_heads=c.num_kv_heads, head_dim=c.head_dim,
                        rms_norm_eps=c.rms_norm_eps, rope_theta=c.rope_theta,
                        max_position_embeddings=c.max_position_embeddings, vocab_size=c.vocab_size,
                        draft_vocab_size=draft_vocab_size, aux_layer_ids=aux_layer_ids)


def init_head(target: DecoderLM, cfg: Eagle3Config, draft_ids: torch.Tensor, seed: int) -> Eagle3Head:
    """A fresh head over the draft vocabulary ``draft_ids`` [N] (ascending target ids): the module
    docstring's start."""
    torch.manual_seed(seed)
    head = Eagle3Head(cfg)
    h = cfg.hidden_size
    with torch.no_grad():
        for name, param in head.layers.named_parameters():
            if not name.endswith("norm.weight"):
                torch.nn.init.normal_(param, std=BLOCK_INIT_STD)
        head.fc.weight.zero_()
        head.fc.weight[:, -h:] = torch.eye(h)  # g = the highest aux state
        head.norm.weight.copy_(target.model.norm.weight)
        head.lm_head.weight.copy_(target.lm_head_weight[draft_ids.to(target.lm_head_weight.device)])
        head.d2t.copy_(draft_ids - torch.arange(len(draft_ids)))
    head.lm_head.weight.requires_grad_(False)  # the target's rows, as the MTP head's shared LM head
    return head.to(target.model.embed_tokens.weight.device)


def loss_of(head: Eagle3Head, target: DecoderLM, depth: int, vocab: TrainVocabulary) -> BatchLoss:
    return lambda tokens, aux, labels: head_loss(head, target, tokens, aux, labels, depth, vocab)


def head_loss(
    head: Eagle3Head,
    target: DecoderLM,
    tokens: torch.Tensor,  # [B, T] long
    aux: torch.Tensor,  # [B, T, 3·H_t] the target's residual streams entering the aux layers at q
    labels: torch.Tensor,  # [B, T] long, the target's greedy token after position q; -1 = padding
    depth: int,
    vocab: TrainVocabulary,  # the head's draft vocabulary, in its lm_head's row order
) -> torch.Tensor:
    """Per slot and pass of the training-time test, the cross-entropy of the head's draft logits
    against the target's greedy token; mean over the slots q ≥ j of pass j."""
    outs = passes(head, target, tokens, aux, depth)
    classes = vocab.classes(labels)
    total, count = aux.new_zeros(()), 0
    for j, out in enumerate(outs):
        real = labels[:, j:] >= 0  # [B, T − j]
        total = total + token_loss(head.norm(out[:, j:][real]), head.lm_head.weight, classes[:, j:][real])
        count += int(real.sum())
    return total / max(count, 1)


def passes(head: Eagle3Head, target: DecoderLM, tokens: torch.Tensor, aux: torch.Tensor,
           depth: int) -> list[torch.Tensor]:  # tokens [B, T], aux [B, T, 3·H_t] → per pass j: out [B, T, H]
    """The training-time test's passes 0..depth − 1 (module docstring): pass j at slot q is the chain
    slot q of a chain started at q − j, fed the tokens up to x_q."""
    run = _runner(head, target, tokens)
    return [out for _, out in draft_passes(run, head.fuse(aux), 1, depth, head.chain_hidden)]


def _runner(head: Eagle3Head, target: DecoderLM, tokens: torch.Tensor):
    """``trainer.RunModule`` for the head (its only module) over ``tokens`` [B, T], with its own RoPE."""
    embeds = head.embed(target, tokens)  # [B, T, H]
    b, t, h = embeds.shape

    def run(m: int, hidden: torch.Tensor, extra_kv: list[list[KV]], mask: torch.Tensor):
        attention = DenseAttention(head.rope, b, t, extra_kv, mask)
        mid = head.layers[0]
        x = mid.run(hidden.reshape(-1, h), embeds.reshape(-1, h), attention.of(0, mid.self_attn))  # [B·T, H]
        for n, block in enumerate(head.layers[1:], start=1):
            x = block.run(x, attention.of(n, block.self_attn))
        return x.view(b, t, h), attention.kv

    return run
