"""Host↔device traffic in bulk: many host lists to the device in one copy, and fp32 values carried
exactly through long lists (as their bits), so that one copy holds a step's floats too."""
from __future__ import annotations

from array import array

import torch


def upload(parts: list[list[int]], device: torch.device) -> list[torch.Tensor]:
    """Long lists to ``device`` in one copy: one host tensor (pinned on CUDA, so the copy runs
    asynchronously and the host goes on building), one non-blocking transfer, a view per list."""
    host = torch.tensor([x for part in parts for x in part], dtype=torch.long, pin_memory=device.type == "cuda")
    return list(host.to(device, non_blocking=True).split([len(part) for part in parts]))


def upload_groups(groups: list[list[list[int]]], device: torch.device) -> list[list[torch.Tensor]]:
    """Several consumers' lists in one ``upload`` (a step's model inputs, its verifier's, its
    proposer's), handed back grouped as given."""
    flat = upload([part for group in groups for part in group], device)
    out, at = [], 0
    for group in groups:
        out.append(flat[at : at + len(group)])
        at += len(group)
    return out


def float_bits(values: list[float]) -> list[int]:
    """Each value rounded to fp32 (as ``torch.tensor(values, dtype=float32)`` rounds) and read as its
    int32 bits: a long list that ``as_floats`` turns back into exactly those fp32 values."""
    return array("i", array("f", values).tobytes()).tolist()


def as_floats(bits: torch.Tensor) -> torch.Tensor:  # bits: [N] long from float_bits → [N] fp32
    return bits.to(torch.int32).view(torch.float32)


def bits_floats(bits: list[int]) -> list[float]:
    """The fp32 values whose int32 bits these are (``float_bits``'s inverse, for values read back)."""
    return array("f", array("i", bits).tobytes()).tolist()


def as_bits(values: torch.Tensor) -> torch.Tensor:  # values: [...] fp32 → [...] long, read back by bits_floats
    return values.view(torch.int32).long()
