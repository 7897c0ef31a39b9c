"""Resolve the configured device and dtype (``auto`` included) to torch objects, once, at load time."""
from __future__ import annotations

import torch

from specdecode.runtime.config import Device, DType

_DTYPES = {
    DType.FLOAT32: torch.float32,
    DType.BFLOAT16: torch.bfloat16,
    DType.FLOAT16: torch.float16,
}


def resolve_device(device: Device) -> torch.device:
    """``auto`` → the first CUDA device when one is usable, else the CPU."""
    device = Device(device)
    if device is Device.AUTO:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device is Device.CUDA and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was requested but torch sees no CUDA device")
    return torch.device(device.value)


def resolve_dtype(dtype: DType, device: torch.device) -> torch.dtype:
    """``auto`` → float32 on the CPU (exact, and bf16 matmuls are slow there), bfloat16 on a GPU."""
    dtype = DType(dtype)
    if dtype is DType.AUTO:
        return torch.float32 if torch.device(device).type == "cpu" else torch.bfloat16
    return _DTYPES[dtype]


def has_native_bfloat16(device: torch.device) -> bool:
    """Whether ``device`` multiplies bfloat16 in hardware: a CUDA device torch calls bf16-capable (compute
    capability ≥ 8.0), a CPU with AVX512-BF16 or AMX (where oneDNN's bf16 GEMMs run 2–4× float32's; elsewhere
    bf16 is emulated and slower than float32)."""
    if torch.device(device).type == "cuda":
        return torch.cuda.is_bf16_supported()
    return torch.backends.mkldnn.is_available() and (torch.cpu._is_avx512_bf16_supported()
                                                     or torch.cpu._is_amx_tile_supported())
