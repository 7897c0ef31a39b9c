"""Speculative-decoding kernels: a Triton kernel and a plain-torch reference of the same signature each.

Terms, used with these meanings everywhere in ``specdecode.kernels`` and by its callers:

- *draft tokens*: the tokens a proposer (n-gram, suffix, draft model, MTP) suggests for the next
  K positions of a sequence, ``draft_token_ids [B, K]``; row b holds ``num_draft_tokens[b]`` of them
  (0..K), the rest is ``PLACEHOLDER_TOKEN_ID``.
- *accepted tokens*: the leading draft tokens the target model agrees with, in order; verification
  stops at the first draft it rejects.
- *recovered token*: the target's replacement, emitted at the first rejected position.
- *bonus token*: the token sampled from the target at position ``num_draft_tokens[b]`` when every
  draft of row b was accepted; a row with 0 drafts emits just this token (plain decoding).

A verify kernel therefore emits, per row, ``num_accepted + 1`` tokens (the accepted tokens, then one
recovered or bonus token) into an output ``[B, K+1]`` padded with ``PLACEHOLDER_TOKEN_ID``:
``num_accepted = (out != PLACEHOLDER_TOKEN_ID).sum(1) - 1``.

The model's fused elementwise kernels live here too (``rmsnorm``, ``rope``, ``activation``): each
reference is what the decoder computed inline before, so the CPU path is unchanged by them.

Dispatch: each public function takes ``use_triton: bool | None``; ``None`` picks the Triton kernel
when every tensor argument is on CUDA and autograd records none of them, and the torch reference
otherwise (the kernels have no backward; the MTP trainer runs the decoder blocks with gradients);
``True`` forces Triton (on CPU tensors that needs ``TRITON_INTERPRET=1`` set before triton is first
imported, as the tests do).

This package imports nothing else of ours.
"""
from __future__ import annotations

import torch

PLACEHOLDER_TOKEN_ID = -1  # pads draft and output token rows; never a real token id


def use_triton_for(use_triton: bool | None, *tensors: torch.Tensor | None) -> bool:
    """The dispatch rule above: an explicit choice wins, else Triton iff all given tensors are on CUDA
    and none needs a gradient."""
    if use_triton is not None:
        return use_triton
    given = [t for t in tensors if t is not None]
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in given)
    return all(t.is_cuda for t in given) and not needs_grad


def check_tensor(t: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype, name: str) -> None:
    """Raise ValueError naming the argument unless t has exactly this shape and dtype."""
    if tuple(t.shape) != tuple(shape) or t.dtype != dtype:
        raise ValueError(f"{name} must be {list(shape)} {dtype}, got {list(t.shape)} {t.dtype}")
