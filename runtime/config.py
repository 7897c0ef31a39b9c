"""Torch-free configuration models shared by the runtime CLI, the server and the operator.

Every knob is validated once here and passed down; nothing deeper reads the environment.
"""
from __future__ import annotations

from collections.abc import Iterable
from enum import Enum
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic.alias_generators import to_camel


class Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Shared(Frozen):
    """A model shared with the operator: snake_case in the runtime's JSON (vLLM convention),
    camelCase in the CRD (Kubernetes convention) — one model, two spellings."""

    model_config = ConfigDict(frozen=True, extra="forbid", alias_generator=to_camel, populate_by_name=True)


class SpeculativeMethod(str, Enum):
    NONE = "none"
    NGRAM = "ngram"
    SUFFIX = "suffix"
    DRAFT = "draft"
    MTP = "mtp"
    EAGLE3 = "eagle3"


class VerifyStrategy(str, Enum):
    """How drafts are checked against the target. ``topp`` is lossy; the others are lossless."""

    GREEDY = "greedy"
    TARGET_MATCH = "target_match"
    REJECTION = "rejection"
    TOPP = "topp"

    @property
    def lossless(self) -> bool:
        return self is not VerifyStrategy.TOPP


MTP_PIPELINE_GATE = "mtp-pipeline-parallel"
KNOWN_GATES = frozenset({MTP_PIPELINE_GATE})
# heads drafting from the target's own states: under pipeline parallelism they sit on the last stage
HEAD_METHODS = (SpeculativeMethod.MTP, SpeculativeMethod.EAGLE3)


def mtp_pipeline_gate_refusal(method: str, pipeline_parallel_size: int, gates: Iterable[str]) -> str | None:
    """The one rule for heads on the target's states under pipeline parallelism (the runtime,
    ``specdecode validate`` and the admission webhook all say this): MTP and EAGLE-3 heads on the
    last stage are experimental, so either needs the gate. None = allowed."""
    if (method in {m.value for m in HEAD_METHODS} and pipeline_parallel_size > 1
            and MTP_PIPELINE_GATE not in set(gates)):
        return (f"method '{method}' with pipeline parallelism (size {pipeline_parallel_size}) is experimental: add "
                f"the gate '{MTP_PIPELINE_GATE}' to the speculative config's gates (spec.gates of a "
                "SpecDecodeDeployment) or use one pipeline stage")
    return None


MTP_PIPELINE_WARNING = (f"heads (method 'mtp' or 'eagle3') with pipeline parallelism are EXPERIMENTAL (gate "
                        f"'{MTP_PIPELINE_GATE}'): the heads run on the last stage, which sends their drafts to the "
                        "scheduler with each step's verdicts")


class BatchSizeRule(Shared):
    """Up to ``max_batch_size`` running sequences, propose at most ``num_speculative_tokens``."""

    max_batch_size: int = Field(ge=1)
    num_speculative_tokens: int = Field(ge=0, le=16)


class LoadControl(Shared):
    """Speculation that pays under light load costs under heavy load: turn it down with the batch
    size, and off while measured acceptance stays under a floor."""

    batch_size_table: tuple[BatchSizeRule, ...] = Field(
        (), description="the first rule whose max_batch_size ≥ the running batch applies; past the last rule speculation is off; empty = K at every batch size"
    )
    acceptance_floor: float = Field(0.0, ge=0.0, le=1.0, description="0 turns the floor off")
    window_draft_tokens: int = Field(256, ge=8, description="acceptance is measured over this many draft tokens")
    reprobe_steps: int = Field(64, ge=1, description="steps spent off before speculation is probed again")
    goodput: bool = Field(
        False, description="each step, ask for the K (at most the table's) that maximises expected emitted tokens per "
        "second: per-position acceptance and draft availability measured on this server, and the measured seconds "
        "per sequence of this machine's decode steps at each K and batch size; K = 0 where speculation does not pay, "
        "then the best K > 0 is probed every reprobe_steps steps, the interval doubling while K = 0 keeps winning"
    )

    @field_validator("batch_size_table")
    @classmethod
    def _sorted(cls, rules: tuple[BatchSizeRule, ...]) -> tuple[BatchSizeRule, ...]:
        sizes = [r.max_batch_size for r in rules]
        if sizes != sorted(set(sizes)):
            raise ValueError("batch_size_table: max_batch_size must be strictly increasing")
        return rules


class SpeculativeConfig(Shared):
    """The one speculative-decoding config: runtime flag, CRD schema and operator rendering."""

    method: SpeculativeMethod = SpeculativeMethod.NONE
    num_speculative_tokens: int = Field(4, ge=1, le=16)
    verify: VerifyStrategy = VerifyStrategy.REJECTION
    prompt_lookup_min: int = Field(1, ge=1, le=16, description="ngram: shortest suffix n-gram matched")
    prompt_lookup_max: int = Field(4, ge=1, le=16, description="ngram: longest suffix n-gram matched")
    draft_model: str | None = Field(None, description="draft: GGUF file, HF folder or alias")
    draft_kv_cache_blocks: int | None = Field(
        None, ge=2, description="draft: blocks (of the target's block size) in the draft model's own KV pool; default = the target pool's count"
    )
    mtp_path: str | None = Field(
        None, description="mtp: folder of MTP head(s) written by `specdecode train-mtp` (safetensors + config); in a "
        "SpecDecodeDeployment a pvc://, file:// or hf:// URI of it; unset = the MTP layers of the target's own checkpoint"
    )
    eagle3_path: str | None = Field(
        None, description="eagle3: folder of an EAGLE-3 head (the original release's layout or speculators' format: "
        "config.json + weights); in a SpecDecodeDeployment a pvc://, file:// or hf:// URI of it"
    )
    draft_vocab_size: int | None = Field(
        None, ge=0, description="mtp: draft only among the N tokens most frequent in the head's training data "
        "(EAGLE-3 style; a draft outside them is never proposed); 0 = the full vocabulary; unset = the head's default"
    )
    verify_top_p: float = Field(0.9, gt=0.0, le=1.0, description="topp: a draft inside this much target mass is accepted")
    suffix_max_depth: int = Field(
        24, ge=2, le=256, description="suffix: longest substring indexed (matched context + drafts); bounds memory per token"
    )
    suffix_max_cached_requests: int = Field(
        1000, ge=0, description="suffix: finished outputs kept in the global cache, oldest evicted first; 0 = no global cache"
    )
    suffix_min_token_prob: float = Field(
        0.1, ge=0.0, le=1.0, description="suffix: a draft stops where the product of its tokens' empirical probabilities falls below this"
    )
    grammar_drafts: bool = Field(
        True, description="constrained requests draft the tokens their grammar forces next before the proposer's own, "
        "and a draft model or MTP head drafts under the grammar's mask; with method 'none', forced tokens alone"
    )
    max_grammar_drafts: int = Field(
        8, ge=1, le=16, description="grammar_drafts: the most forced tokens drafted per sequence and step (with method "
        "'none' this is K; otherwise forced and proposed drafts share num_speculative_tokens)"
    )
    load_control: LoadControl = LoadControl()
    gates: tuple[str, ...] = ()

    @model_validator(mode="after")
    def _consistent(self) -> "SpeculativeConfig":
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"prompt_lookup_min ({self.prompt_lookup_min}) must not exceed prompt_lookup_max ({self.prompt_lookup_max})"
            )
        if self.method is SpeculativeMethod.SUFFIX and self.suffix_max_depth <= self.num_speculative_tokens:
            raise ValueError(
                f"suffix_max_depth ({self.suffix_max_depth}) must exceed num_speculative_tokens "
                f"({self.num_speculative_tokens}): a draft and at least one matched token must fit under it"
            )
        if self.method is SpeculativeMethod.DRAFT and not self.draft_model:
            raise ValueError("method 'draft' needs draft_model (a GGUF file, HF folder or alias)")
        if (self.draft_model or self.draft_kv_cache_blocks) and self.method is not SpeculativeMethod.DRAFT:
            raise ValueError(f"draft_model and draft_kv_cache_blocks are only used by method 'draft', not {self.method.value!r}")
        if (self.mtp_path or self.draft_vocab_size is not None) and self.method is not SpeculativeMethod.MTP:
            raise ValueError(f"mtp_path and draft_vocab_size are only used by method 'mtp', not {self.method.value!r}")
        if self.method is SpeculativeMethod.EAGLE3 and not self.eagle3_path:
            raise ValueError("method 'eagle3' needs eagle3_path (the folder of an EAGLE-3 head: config.json and its "
                             "weights, in the original release's layout or speculators' format)")
        if self.eagle3_path and self.method is not SpeculativeMethod.EAGLE3:
            raise ValueError(f"eagle3_path is only used by method 'eagle3', not {self.method.value!r}")
        unknown = sorted(set(self.gates) - KNOWN_GATES)
        if unknown:
            raise ValueError(f"unknown gates {unknown}; known: {sorted(KNOWN_GATES)}")
        return self

    @property
    def enabled(self) -> bool:
        return self.method is not SpeculativeMethod.NONE

    @property
    def max_drafts(self) -> int:
        """K: drafts per sequence and step (forced ones only, with method 'none')."""
        return self.num_speculative_tokens if self.enabled else self.max_grammar_drafts if self.grammar_drafts else 0


class Device(str, Enum):
    AUTO = "auto"
    CPU = "cpu"
    CUDA = "cuda"


class DType(str, Enum):
    AUTO = "auto"
    FLOAT32 = "float32"
    BFLOAT16 = "bfloat16"
    FLOAT16 = "float16"


class LoadFormat(str, Enum):
    AUTO = "auto"  # the weights of the GGUF file or Hugging Face folder
    DUMMY = "dummy"  # random weights of the model's shape (models/dummy.py): for timing only


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
    load_format: LoadFormat = Field(
        LoadFormat.AUTO, description="dummy: random weights of the model's config (a folder with config.json and "
        "the tokenizer is enough), to time steps where the weights are not")


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
    overlap: bool | None = Field(
        None, description="overlap scheduling: while a step runs, schedule the next one and build its prompt chunks' "
        "inputs (decode rows follow the step's verdicts); None = on with pipeline stages, where it measured no slower, "
        "off in one process, where it measured 7-30% slower on a 2-core CPU (docs/benchmarks.md)"
    )


class ParallelConfig(Frozen):
    """Tensor and pipeline parallelism: ``pipeline_parallel_size`` stages of ``tensor_parallel_size``
    ranks each, ``world_size`` ranks spread evenly over ``num_nodes`` pods.

    Global rank ``stage * tensor_parallel_size + tp_rank``; a pod runs the consecutive global ranks
    ``node_rank * ranks_per_node …`` on its devices ``0 …``. Global rank 0 (first stage, pod 0)
    schedules and serves the API; the last stage's first rank samples and verifies. One pod
    (``num_nodes`` 1) meets on a port the OS picks; several meet at ``master_addr:master_port``
    (torchrun's MASTER_ADDR/MASTER_PORT, set by the operator). Whether the model's heads split
    ``tensor_parallel_size`` ways and its layers ``pipeline_parallel_size`` ways is checked at load.
    """

    tensor_parallel_size: int = Field(1, ge=1)
    pipeline_parallel_size: int = Field(1, ge=1, description="contiguous runs of decoder layers, one per stage")
    num_nodes: int = Field(1, ge=1, description="pods the group spans (NNODES)")
    node_rank: int = Field(0, ge=0, description="this pod's index in the group (NODE_RANK); 0 serves the API")
    master_addr: str | None = Field(None, description="node 0's address for the rendezvous (MASTER_ADDR); across pods")
    master_port: int | None = Field(None, ge=1, le=65535, description="node 0's rendezvous port (MASTER_PORT); across pods")
    rendezvous_timeout_s: float = Field(600.0, gt=0, description="every rank must have loaded its shard by then")
    collective_timeout_s: float = Field(
        300.0, gt=0, description="a collective waiting longer for a peer fails, and the group stops (workers wait for "
        "the next step without limit while rank 0 lives)"
    )
    group_heartbeat_timeout_s: float = Field(
        15.0, gt=0, description="a rank whose heartbeat rank 0 misses this long is lost: rank 0 fails its requests, "
        "turns not ready and exits (and a worker that cannot reach rank 0 this long exits)"
    )
    trace_dir: Path | None = Field(
        None, description="pipeline stages: every rank writes what it holds and, per step, the positions and KV "
        "slots it ran (rank 0 also the items and verdicts) to rank<N>.jsonl here; for debugging"
    )

    @model_validator(mode="after")
    def _consistent(self) -> "ParallelConfig":
        if self.world_size % self.num_nodes:
            raise ValueError(f"tensor_parallel_size × pipeline_parallel_size ({self.world_size}) must be a multiple of "
                             f"the number of pods NNODES ({self.num_nodes})")
        if self.node_rank >= self.num_nodes:
            raise ValueError(f"NODE_RANK ({self.node_rank}) must be below NNODES ({self.num_nodes})")
        if self.num_nodes > 1 and (self.master_addr is None or self.master_port is None):
            raise ValueError("a group spread over several pods needs MASTER_ADDR and MASTER_PORT")
        return self

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def ranks_per_node(self) -> int:
        return self.world_size // self.num_nodes

    @property
    def local_ranks(self) -> range:
        """The global ranks this pod runs, its local rank 0 first."""
        first = self.node_rank * self.ranks_per_node
        return range(first, first + self.ranks_per_node)

    def stage_of(self, rank: int) -> int:
        return rank // self.tensor_parallel_size

    def tp_rank_of(self, rank: int) -> int:
        return rank % self.tensor_parallel_size

    @property
    def verifier_rank(self) -> int:
        """The last stage's first rank: it samples, verifies and holds the draft model / MTP heads."""
        return (self.pipeline_parallel_size - 1) * self.tensor_parallel_size


class GraphConfig(Frozen):
    """Decode and verify steps padded to batch buckets (``engine/buckets.py``), and each bucket's
    forward captured once as a CUDA graph and replayed (``engine/cuda_graphs.py``)."""

    cuda_graphs: bool = Field(
        False, description="capture each bucket's decode/verify forward as a CUDA graph and replay it (CUDA, one "
        "rank); off by default until the gpu tier has shown replay equal to eager on a GPU"
    )
    batch_buckets: bool | None = Field(
        None, description="pad decode/verify steps to batch buckets (1, 2, 4, 8, then every 16), drafts to the "
        "step's most; None = on with cuda_graphs"
    )

    @property
    def buckets(self) -> bool:
        return self.cuda_graphs if self.batch_buckets is None else self.batch_buckets


class EngineConfig(Frozen):
    load: LoadConfig = LoadConfig()
    cache: CacheConfig = CacheConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    speculative: SpeculativeConfig = SpeculativeConfig()
    parallel: ParallelConfig = ParallelConfig()
    graphs: GraphConfig = GraphConfig()

    @model_validator(mode="after")
    def _gated(self) -> "EngineConfig":
        refusal = mtp_pipeline_gate_refusal(self.speculative.method.value, self.parallel.pipeline_parallel_size,
                                            self.speculative.gates)
        if refusal:
            raise ValueError(refusal)
        return self

    @model_validator(mode="after")
    def _graphs_in_one_process(self) -> "EngineConfig":
        if self.graphs.cuda_graphs and self.graphs.batch_buckets is False:
            raise ValueError("cuda_graphs replays one graph per batch bucket: it needs batch_buckets")
        if self.graphs.buckets and self.parallel.world_size > 1:
            raise ValueError("cuda_graphs and batch_buckets run in one process only (not yet with tensor or "
                             "pipeline parallelism)")
        return self


class ServerConfig(Frozen):
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    served_model_name: str | None = None
    api_key: str | None = None
    drain_timeout_s: float = Field(600.0, gt=0, description="SIGTERM waits this long for requests in flight")
    max_request_bytes: int | None = Field(
        None, ge=1, description="a larger request body is refused with 413; default: sized from the context "
                                "length, at least 1 MiB")
    engine: EngineConfig = EngineConfig()
