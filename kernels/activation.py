"""SwiGLU's gate: ``silu(gate) * up`` from the fused gate/up projection, torch reference + Triton.

The MLP's ``gate_up_proj`` writes ``[gate | up]`` side by side in one ``[T, 2I]`` row; one launch
reads both halves and writes ``silu(gate) * up [T, I]`` (torch spends two, plus the split).

Rounding, as the model has always computed it: ``silu`` in fp32 rounded to the input's dtype, then the
product rounded to it. The kernel rounds at the same points; its ``exp`` may differ from torch's in
the last fp32 bits, so a low-precision result can differ by one unit in its last place.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from . import use_triton_for

__all__ = ["silu_and_mul", "silu_and_mul_reference", "silu_and_mul_triton"]

MAX_BLOCK_I = 1024  # output columns per program


def silu_and_mul(
    gate_up: torch.Tensor,  # [T, 2I] fp32/bf16/fp16: gate in columns :I, up in I:
    *,
    use_triton: bool | None = None,
) -> torch.Tensor:  # [T, I], gate_up's dtype
    """``silu(gate) * up``, each rounded to gate_up's dtype."""
    if use_triton_for(use_triton, gate_up):
        return silu_and_mul_triton(gate_up)
    return silu_and_mul_reference(gate_up)


def silu_and_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:  # [T, 2I] -> [T, I]
    _check(gate_up)
    gate, up = gate_up.split(gate_up.shape[-1] // 2, dim=-1)
    return F.silu(gate) * up


def silu_and_mul_triton(gate_up: torch.Tensor) -> torch.Tensor:  # [T, 2I] -> [T, I]
    _check(gate_up)
    T, I = gate_up.shape[0], gate_up.shape[1] // 2
    gate_up = gate_up if gate_up.stride(-1) == 1 else gate_up.contiguous()
    out = torch.empty(T, I, dtype=gate_up.dtype, device=gate_up.device)
    block_i = min(triton.next_power_of_2(max(I, 1)), MAX_BLOCK_I)
    if T and I:
        _silu_and_mul_kernel[(T, triton.cdiv(I, block_i))](gate_up, out, gate_up.stride(0), I, BLOCK_I=block_i)
    return out


def _check(gate_up: torch.Tensor) -> None:
    if gate_up.dim() != 2 or gate_up.shape[1] % 2 or not gate_up.dtype.is_floating_point:
        raise ValueError(f"gate_up must be [T, 2I] floating point, got {list(gate_up.shape)} {gate_up.dtype}")


@triton.jit
def _silu_and_mul_kernel(
    gate_up_ptr,  # [T, 2I], rows stride apart, columns contiguous
    out_ptr,  # [T, I] contiguous, gate_up's dtype
    stride,
    I,
    BLOCK_I: tl.constexpr,  # output columns per program
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    mask = cols < I
    dtype = out_ptr.dtype.element_ty
    gate = tl.load(gate_up_ptr + row * stride + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * stride + I + cols, mask=mask, other=0.0).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)  # torch's formula, rounded as F.silu is
    tl.store(out_ptr + row * I + cols, (silu * up).to(dtype), mask=mask)
