"""Rotary position embedding, non-interleaved (HF ``rotate_half`` / neox layout), torch reference + Triton.

The tables ``cos``/``sin [max_positions, head_dim]`` hold, at position p, ``cos(p * f)``/``sin(p * f)``
for the head's frequencies f laid out as ``[f_0 .. f_{d/2-1}, f_0 .. f_{d/2-1}]``. A head vector
``x = [x1, x2]`` (halves of head_dim/2) at position p becomes ``x * cos[p] + [-x2, x1] * sin[p]``.

Rounding, as the model has always computed it: the fp32 tables are rounded to x's dtype, and each
product and the sum are rounded to x's dtype (torch's elementwise ops). The kernel rounds at the same
points; with correctly rounded products and sums it matches the reference bit for bit, unless the GPU
compiler contracts an fp32 multiply-add into an FMA (then within an ulp).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import use_triton_for

__all__ = ["apply_rope", "apply_rope_reference", "apply_rope_triton"]

MAX_BLOCK = 4096  # (head, dimension pair) entries per program: its heads x head_dim/2 rounded up


def apply_rope(
    x: torch.Tensor,  # [T, heads, head_dim] fp32/bf16/fp16, rows of a wider tensor allowed (q or k of qkv)
    positions: torch.Tensor,  # [T] int32/int64
    cos: torch.Tensor,  # [max_positions, head_dim] fp32
    sin: torch.Tensor,  # [max_positions, head_dim] fp32
    *,
    use_triton: bool | None = None,
) -> torch.Tensor:  # [T, heads, head_dim], x's dtype, contiguous
    """x rotated by the angles of each row's position (module docstring)."""
    if use_triton_for(use_triton, x, positions, cos, sin):
        return apply_rope_triton(x, positions, cos, sin)
    return apply_rope_reference(x, positions, cos, sin)


def apply_rope_reference(
    x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> torch.Tensor:
    # x: [T, heads, head_dim], positions: [T], cos/sin: [max_positions, head_dim] -> [T, heads, head_dim]
    _check(x, positions, cos, sin)
    cos = cos[positions].unsqueeze(1).to(x.dtype)  # [T, 1, head_dim]
    sin = sin[positions].unsqueeze(1).to(x.dtype)
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def apply_rope_triton(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [T, heads, head_dim], positions: [T], cos/sin: [max_positions, head_dim] -> [T, heads, head_dim]
    _check(x, positions, cos, sin)
    T, heads, head_dim = x.shape
    x = x if x.stride(-1) == 1 else x.contiguous()
    cos, sin = cos.contiguous(), sin.contiguous()
    out = torch.empty(T, heads, head_dim, dtype=x.dtype, device=x.device)
    block_half = triton.next_power_of_2(head_dim // 2)
    block_heads = min(triton.next_power_of_2(heads), max(1, MAX_BLOCK // block_half))
    if T and heads:
        grid = (T, triton.cdiv(heads, block_heads))
        _rope_kernel[grid](x, positions.contiguous(), cos, sin, out, x.stride(0), x.stride(1), heads, head_dim // 2,
                           BLOCK_HEADS=block_heads, BLOCK_HALF=block_half)
    return out


def _check(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    if x.dim() != 3 or x.shape[-1] % 2 or not x.dtype.is_floating_point:
        raise ValueError(f"x must be [T, heads, head_dim] floating point, head_dim even, got {list(x.shape)} {x.dtype}")
    if tuple(positions.shape) != (x.shape[0],) or positions.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"positions must be [{x.shape[0]}] int32/int64, got {list(positions.shape)} {positions.dtype}")
    for name, table in (("cos", cos), ("sin", sin)):
        if table.dim() != 2 or table.shape[1] != x.shape[-1] or table.shape != cos.shape:
            raise ValueError(f"{name} must be [max_positions, {x.shape[-1]}] like cos, got {list(table.shape)}")


@triton.jit
def _rope_kernel(
    x_ptr,  # [T, heads, head_dim], rows x_stride_t and heads x_stride_h apart, dimensions contiguous
    positions_ptr,  # [T]
    cos_ptr,  # [max_positions, head_dim] contiguous
    sin_ptr,  # [max_positions, head_dim] contiguous
    out_ptr,  # [T, heads, head_dim] contiguous, x's dtype
    x_stride_t,
    x_stride_h,
    heads,
    half,  # head_dim // 2
    BLOCK_HEADS: tl.constexpr,  # heads per program
    BLOCK_HALF: tl.constexpr,  # half rounded up to a power of 2
):
    tok = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_HEADS + tl.arange(0, BLOCK_HEADS)  # [BLOCK_HEADS]
    d = tl.arange(0, BLOCK_HALF)  # [BLOCK_HALF]: dimension pairs (d, d + half)
    d_ok = d < half
    dtype = out_ptr.dtype.element_ty  # x's; every .to(dtype).to(tl.float32) rounds where torch's ops round
    table = tl.load(positions_ptr + tok).to(tl.int64) * (2 * half)
    c1 = tl.load(cos_ptr + table + d, mask=d_ok, other=0.0).to(dtype).to(tl.float32)[None, :]
    c2 = tl.load(cos_ptr + table + half + d, mask=d_ok, other=0.0).to(dtype).to(tl.float32)[None, :]
    s1 = tl.load(sin_ptr + table + d, mask=d_ok, other=0.0).to(dtype).to(tl.float32)[None, :]
    s2 = tl.load(sin_ptr + table + half + d, mask=d_ok, other=0.0).to(dtype).to(tl.float32)[None, :]
    mask = (h[:, None] < heads) & d_ok[None, :]  # [BLOCK_HEADS, BLOCK_HALF]
    src = x_ptr + tok * x_stride_t + h[:, None].to(tl.int64) * x_stride_h + d[None, :]
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + half, mask=mask, other=0.0).to(tl.float32)
    out1 = (x1 * c1).to(dtype).to(tl.float32) - (x2 * s1).to(dtype).to(tl.float32)  # x1 cos + (-x2) sin
    out2 = (x2 * c2).to(dtype).to(tl.float32) + (x1 * s2).to(dtype).to(tl.float32)  # x2 cos + x1 sin
    dst = out_ptr + tok * heads * (2 * half) + h[:, None].to(tl.int64) * (2 * half) + d[None, :]
    tl.store(dst, out1.to(dtype), mask=mask)
    tl.store(dst + half, out2.to(dtype), mask=mask)

