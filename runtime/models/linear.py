"""Linear layers that stay fast for the few-row batches decoding and verification produce.

``F.linear(x, W)`` computes ``x @ Wᵀ``. With MKL on a CPU, for 2 to ~128 rows that call is up to
2× slower than the same product computed as ``(W @ xᵀ)ᵀ`` — one GEMM either way, same weight
memory, only the operand order differs (measured on the 2-core machine, torch 2.13 + MKL 2024.2:
Qwen2.5-1.5B's LM head, 5 rows: 162 → 78 ms; its MLP up-projection, 5 rows: 6.8 → 4.5 ms; a
Qwen 1.5B verify step of 5 tokens: 876 → 573 ms). Speculative verification lives in exactly
that range (B·(K+1) rows), so it pays twice. Long prefill chunks keep ``F.linear``; other devices
always do (cuBLAS picks its own kernel for either order).

One row is padded to two: MKL's one-row product (a GEMV, either order) is the slowest of all here —
SmolLM2-135M's LM head, 1 row 7.0 ms, 2 rows 2.6 ms — and a plain decode step of SmolLM2 at batch 1
took 40.5 ms unpadded, 24.8 ms padded to two rows (2026-11-28, 2-core machine).

``W @ xᵀ`` is fast only when xᵀ's column count is a multiple of 8 (MKL's kernel width): from 8
rows up, a ragged count costs up to twice the next multiple (all SmolLM2-135M projections of one
step, summed: 15 rows 103 ms, the same 15 padded to 16: 44 ms; 31 rows 131 → 83 ms). A
verification batch is ragged whenever a sequence gets fewer drafts than asked, so from
``ROW_MULTIPLE`` rows up x is padded with zero rows, whose outputs are dropped. Under 8 rows the
product is cheaper unpadded (2 rows: 16 ms, padded to 8: 39 ms), one row excepted (above).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

SMALL_BATCH_ROWS = 128  # above this, F.linear was as fast or faster on the CPU
ROW_MULTIPLE = 8  # from this many rows, pad the row count up to a multiple of it
LEAST_ROWS = 2  # one row is padded to this many (module docstring)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x: [T, in], weight: [out, in], bias: [out] → [T, out] (contiguous)."""
    rows = x.shape[0] if x.dim() == 2 else 0
    if x.device.type != "cpu" or not 0 < rows <= SMALL_BATCH_ROWS:
        return F.linear(x, weight, bias)
    padded = -(-rows // ROW_MULTIPLE) * ROW_MULTIPLE if rows >= ROW_MULTIPLE else max(rows, LEAST_ROWS)
    if padded != rows:
        x = F.pad(x, (0, 0, 0, padded - rows))  # [padded, in]
    out = torch.mm(weight, x.t()).t()[:rows].contiguous()
    return out if bias is None else out.add_(bias)


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters and names) computed by ``linear``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] → [T, out]
        return linear(x, self.weight, self.bias)
