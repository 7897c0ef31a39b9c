"""Torch-free configuration models shared by the runtime CLI, the server and the operator.

Every knob is validated once here and passed down; nothing deeper reads the environment.
"""
from __future__ import annotations

from enum import Enum
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, model_validator


class Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Device(str, Enum):
    AUTO = "auto"
    CPU = "cpu"
    CUDA = "cuda"


class DType(str, Enum):
    AUTO = "auto"
    FLOAT32 = "float32"
    BFLOAT16 = "bfloat16"
    FLOAT16 = "float16"


def default_weight_cache_dir() -> Path:
    return Path.home() / ".cache" / "specdecode" / "weights"


class LoadConfig(Frozen):
    """Where the weights come from and how they are materialised."""

    model: str = Field("smollm2-135m", description="GGUF file, Hugging Face folder or alias")
    device: Device = Device.AUTO
    dtype: DType = DType.AUTO
    weight_cache_dir: Path | None = Field(
        default_factory=default_weight_cache_dir,
        description="dequantized GGUF weights are cached here as safetensors; None turns it off",
    )
    chat_template: str | None = Field(None, description="path to a Jinja chat template file")


class CacheConfig(Frozen):
    """Paged KV cache: a preallocated pool of fixed-size blocks per layer."""

    block_size: int = Field(16, ge=1, le=256)
    num_blocks: int | None = Field(None, ge=2, description="pool size; derived from memory_gib when unset")
    memory_gib: float = Field(1.0, gt=0, description="KV pool budget when num_blocks is unset")
    enable_prefix_caching: bool = True


class SchedulerConfig(Frozen):
    max_num_seqs: int = Field(32, ge=1)
    max_num_batched_tokens: int = Field(512, ge=1, description="per-step token budget (chunked prefill)")
    max_model_len: int | None = Field(None, ge=2, description="defaults to the model's context length")
    max_waiting_requests: int = Field(256, ge=1, description="a fuller queue answers 503")


class EngineConfig(Frozen):
    load: LoadConfig = LoadConfig()
    cache: CacheConfig = CacheConfig()
    scheduler: SchedulerConfig = SchedulerConfig()

    @model_validator(mode="after")
    def _budget_fits_one_decode_per_seq(self) -> "EngineConfig":
        if self.scheduler.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be >= 1")
        return self


class ServerConfig(Frozen):
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    served_model_name: str | None = None
    api_key: str | None = None
    drain_timeout_s: float = Field(600.0, gt=0, description="SIGTERM waits this long for requests in flight")
    engine: EngineConfig = EngineConfig()
