"""Pipeline parallelism of the decoder: which contiguous run of layers, and which of the other
weights, one stage holds.

The ``num_layers`` decoder layers split into ``size`` contiguous stages as evenly as they go; the
first ``num_layers % size`` stages take one layer more, so the last stage, which also runs the LM
head (a quarter of SmolLM2's weights) and verifies, never gets an extra layer. The first stage holds the token embedding, the last the final norm and
the LM head (and, for a model with tied embeddings, the embedding it is tied to). Every stage holds
only its own weights and allocates KV pools only for its own layers.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from specdecode.runtime.models.model_config import ModelConfig

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


@dataclass(frozen=True)
class PipelineStage:
    """This process's stage of a pipeline-parallel model."""

    rank: int = 0
    size: int = 1
    embedding_on_last: bool = False  # the last stage keeps a copy of the embedding (its heads embed their inputs)

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        return self.rank == self.size - 1

    def check(self, cfg: ModelConfig) -> None:
        """Refuse more stages than decoder layers (a stage without a layer would only relay)."""
        if self.size > cfg.num_layers:
            raise ValueError(f"pipeline_parallel_size {self.size} exceeds the model's {cfg.num_layers} decoder "
                             f"layers: every stage needs at least one")

    def layers(self, num_layers: int) -> range:
        """The global indices of this stage's decoder layers."""
        base, extra = divmod(num_layers, self.size)
        start = self.rank * base + min(self.rank, extra)
        return range(start, start + base + (self.rank < extra))

    def aux_handed_in(self, aux_layers: tuple[int, ...], num_layers: int) -> int:
        """How many of the residual streams entering ``aux_layers`` (global ids) the stages before
        this one hand it: those entering their layers."""
        first = self.layers(num_layers).start
        return sum(i < first for i in aux_layers)

    def holds_embedding(self, cfg: ModelConfig) -> bool:
        return self.is_first or (self.is_last and (cfg.tie_word_embeddings or self.embedding_on_last))

    def local_name(self, hf_name: str, cfg: ModelConfig) -> str | None:
        """``hf_name`` as this stage's model names it (layer indices counted from the stage's
        first layer), or None if another stage holds that weight."""
        match = _LAYER.match(hf_name)
        if match:
            mine = self.layers(cfg.num_layers)
            index = int(match.group(1))
            return f"model.layers.{index - mine.start}.{hf_name[match.end():]}" if index in mine else None
        if hf_name.startswith("model.embed_tokens."):
            return hf_name if self.holds_embedding(cfg) else None
        if hf_name.startswith(("model.norm.", "lm_head.")):
            return hf_name if self.is_last else None
        return hf_name
