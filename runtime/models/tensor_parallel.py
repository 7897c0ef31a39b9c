"""Megatron-style tensor parallelism of the decoder: which slice of each weight a rank holds.

Every rank holds its share of the attention heads and of the MLP's intermediate size:

- *column-parallel* (output rows split): q/k/v and gate/up. q holds this rank's query heads,
  k and v its KV heads (heads are contiguous row blocks, so a rank's heads are one row slice),
  gate and up its intermediate slice; each is sliced on its own, then fused per rank, so the
  local ``qkv_proj`` is ``[q_local; k_local; v_local]`` and ``gate_up_proj`` ``[gate_local; up_local]``.
- *row-parallel* (input columns split): o_proj and down_proj take the matching columns and are
  followed by an all-reduce (sum) over the group, which restores the full hidden state.
- *replicated*: embeddings, norms and the LM head (simplest correct choice: no gather of
  logits; only rank 0 computes them).

The group is the default (world) process group: a runtime process belongs to exactly one
tensor-parallel group. At size 1 nothing here communicates.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from specdecode.runtime.models.linear import Linear, linear
from specdecode.runtime.models.model_config import ModelConfig

COLUMN_PARALLEL = frozenset({"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"})
ROW_PARALLEL = frozenset({"o_proj", "down_proj"})


@dataclass(frozen=True)
class TensorParallel:
    """This process's place in its tensor-parallel group."""

    rank: int = 0
    size: int = 1

    def check(self, cfg: ModelConfig) -> None:
        """Refuse a model whose heads or MLP cannot be split evenly ``size`` ways."""
        if cfg.num_heads % self.size or cfg.num_kv_heads % self.size or cfg.intermediate_size % self.size:
            raise ValueError(
                f"tensor_parallel_size {self.size} must divide the model's attention heads ({cfg.num_heads}), "
                f"KV heads ({cfg.num_kv_heads}) and MLP intermediate size ({cfg.intermediate_size})"
            )

    def shard(self, hf_name: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's slice of a full checkpoint tensor named the Hugging Face way."""
        if self.size == 1:
            return tensor
        part = hf_name.rsplit(".", 2)[-2]  # "model.layers.0.self_attn.q_proj.weight" → "q_proj"
        if part in COLUMN_PARALLEL:
            return tensor.chunk(self.size, dim=0)[self.rank]  # weight [out, in] or bias [out]
        if part in ROW_PARALLEL:
            return tensor.chunk(self.size, dim=-1)[self.rank]  # weight [out, in]
        return tensor


_TENSOR_GROUP: dist.ProcessGroup | None = None  # None = the default group (no pipeline stages)


def set_tensor_group(group: dist.ProcessGroup | None) -> None:
    """The group this process's row-parallel layers all-reduce over: its stage's tensor-parallel ranks."""
    global _TENSOR_GROUP
    _TENSOR_GROUP = group


class RowParallelLinear(Linear):
    """A bias-free linear over this rank's input columns, summed over the group."""

    def __init__(self, in_features_local: int, out_features: int, tp: TensorParallel):
        super().__init__(in_features_local, out_features, bias=False)
        self.tp_size = tp.size

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [T, in_local] → [T, out]
        out = linear(x, self.weight)
        if self.tp_size > 1:
            dist.all_reduce(out, group=_TENSOR_GROUP)
        return out
