"""RMSNorm with the residual add fused in front of it (vLLM's ``fused_add_rms_norm``), torch reference + Triton.

A decoder block keeps a *residual stream* ``r`` and adds each sublayer's output ``x`` to it before the
next norm: ``r' = r + x``, ``normed = weight * rmsnorm(r')``. One launch reads ``x`` and ``r`` once and
writes both ``r'`` and ``normed``; without a residual it is the plain norm of ``x`` (and ``r' = x``).

Rounding, as the model has always computed it: the add happens in the stream's dtype (rounded there);
the mean of squares, the rsqrt and the scaling are fp32; the normalised row is rounded back to the
stream's dtype *before* the weight multiplies it (HF Llama's order), and that product has the dtype
torch promotes ``weight`` and the stream to. The kernel rounds at the same points, so it differs from
the reference only by the order of the fp32 sum of squares and the rsqrt's last bits.

Neither path writes into its inputs: the caller's stream tensor may still be read (pipeline stages,
the MTP trainer).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import use_triton_for

__all__ = ["fused_add_rms_norm", "fused_add_rms_norm_reference", "fused_add_rms_norm_triton"]

MAX_BLOCK_H = 65_536  # one program holds a whole row in registers


def fused_add_rms_norm(
    x: torch.Tensor,  # [T, H] fp32/bf16/fp16
    residual: torch.Tensor | None,  # [T, H], x's dtype, or None
    weight: torch.Tensor,  # [H]
    eps: float,
    *,
    use_triton: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # normed [T, H], new residual [T, H] (x itself when residual is None)
    """``r' = residual + x`` (or ``x``), then ``weight * rmsnorm(r')``: the module docstring's rounding."""
    if use_triton_for(use_triton, x, residual, weight):
        return fused_add_rms_norm_triton(x, residual, weight, eps)
    return fused_add_rms_norm_reference(x, residual, weight, eps)


def fused_add_rms_norm_reference(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    # x, residual: [T, H], weight: [H] -> normed [T, H], new residual [T, H]
    _check(x, residual, weight)
    if residual is not None:
        x = residual + x
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype), x


def fused_add_rms_norm_triton(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    # x, residual: [T, H], weight: [H] -> normed [T, H], new residual [T, H]
    _check(x, residual, weight)
    T, H = x.shape
    block_h = triton.next_power_of_2(H)
    if block_h > MAX_BLOCK_H:
        raise ValueError(f"fused_add_rms_norm_triton holds a row in one program: H <= {MAX_BLOCK_H}, got {H}")
    has_residual = residual is not None
    x, weight = _rows(x), weight.contiguous()
    residual = _rows(residual) if has_residual else x  # x: a pointer the kernel never reads
    out = torch.empty(T, H, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    new_residual = torch.empty(T, H, dtype=x.dtype, device=x.device) if has_residual else x
    if T:
        _add_rms_norm_kernel[(T,)](
            x, residual, weight, out, new_residual, x.stride(0), residual.stride(0), H, eps,
            HAS_RESIDUAL=has_residual, BLOCK_H=block_h, num_warps=_num_warps(block_h),
        )
    return out, new_residual


def _check(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor) -> None:
    if x.dim() != 2 or not x.dtype.is_floating_point:
        raise ValueError(f"x must be [T, H] floating point, got {list(x.shape)} {x.dtype}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(f"residual must be {list(x.shape)} {x.dtype}, got {list(residual.shape)} {residual.dtype}")
    if tuple(weight.shape) != (x.shape[1],):
        raise ValueError(f"weight must be [{x.shape[1]}], got {list(weight.shape)}")


def _rows(t: torch.Tensor) -> torch.Tensor:
    """t itself when its rows are contiguous (any row stride), else a contiguous copy."""
    return t if t.stride(-1) == 1 else t.contiguous()


def _num_warps(block: int) -> int:
    return 4 if block <= 2048 else 8 if block <= 8192 else 16


@triton.jit
def _add_rms_norm_kernel(
    x_ptr,  # [T, H] rows x_stride apart
    res_ptr,  # [T, H] rows res_stride apart (read only when HAS_RESIDUAL)
    w_ptr,  # [H]
    out_ptr,  # [T, H] contiguous, dtype promote(weight, x)
    res_out_ptr,  # [T, H] contiguous, x's dtype (written only when HAS_RESIDUAL)
    x_stride,
    res_stride,
    H,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_H: tl.constexpr,  # H rounded up to a power of 2
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    mask = cols < H
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * res_stride + cols, mask=mask, other=0.0)
        x = (r.to(tl.float32) + x.to(tl.float32)).to(x_ptr.dtype.element_ty)  # rounded as torch's add is
        tl.store(res_out_ptr + row * H + cols, x, mask=mask)
    x32 = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x32 * x32, axis=0) / H + eps)
    normed = (x32 * rstd).to(x_ptr.dtype.element_ty).to(tl.float32)  # rounded to x's dtype before the weight
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * H + cols, (w * normed).to(out_ptr.dtype.element_ty), mask=mask)
