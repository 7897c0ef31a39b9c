"""The records the benchmark's processes exchange as JSON: the job, and each system's results.

Torch-free, so the driving process stays light while the systems run in their subprocesses.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from specdecode.runtime.prompt_sets import Messages
from specdecode.runtime.engine.sequence import SpecCounts


@dataclass
class Job:
    """What one system's subprocess must run."""

    system: str  # its name in the results (systems.py)
    model: str
    dtype: str
    device: str
    threads: int
    max_tokens: int
    concurrency: list[int]
    runs: int  # timed runs per concurrency after one warm-up (the whole benchmark: rounds; a round: 1)
    busy_retries: int  # a timed run disturbed by other processes is repeated up to this many times
    quiet_wait_s: float  # before a timed run, wait up to this long for the machine to go quiet
    prompts: list[Messages]
    max_model_len: int | None = None  # None = the model's; longer prompts keep their last tokens
    speculative: dict | None = None  # ours: SpeculativeConfig JSON
    peer_mode: str = "plain"  # transformers: "plain" | "prompt-lookup" | "assisted"
    num_speculative_tokens: int = 4  # transformers' prompt_lookup_num_tokens / num_assistant_tokens
    prompt_lookup_max: int = 4  # transformers' max_matching_ngram_size = our n-gram window's top
    assistant_model: str | None = None  # transformers-assisted: the draft model
    prompt_token_ids: list[list[int]] | None = None  # ours tokenizes (and truncates); peers reuse its ids
    pipeline_parallel_size: int = 1  # ours: pipeline stages
    overlap: bool | None = None  # ours: overlap scheduling (None: the runtime's default for the layout)
    # other systems' outputs at c=1, by system: where one differs from this system's, check ties
    tie_check_outputs: dict[str, list[list[int]]] | None = None


@dataclass
class RequestTiming:
    ttft_s: float  # request start → first token
    itl_s: float  # mean gap per token after the first (0.0 for a one-token request)
    e2e_s: float  # request start → last token
    num_tokens: int

    @classmethod
    def from_arrivals(cls, start: float, arrivals: list[tuple[float, int]]) -> "RequestTiming":
        """``arrivals``: (time, number of tokens that arrived then), in order."""
        first, last = arrivals[0][0], arrivals[-1][0]
        num_tokens = sum(n for _, n in arrivals)
        itl = (last - first) / (num_tokens - 1) if num_tokens > 1 else 0.0
        return cls(first - start, itl, last - start, num_tokens)


@dataclass
class PipelineSteps:
    """A pipeline system's cost per engine step over one run (or pooled over runs), as rank 0 sees
    it (``PipelineStats``): the verdict message's bytes and their budget R·(K+1) tokens + 2R counts
    (+ R·K drafts), rank 0's own stage forward, and its wait from handing the hidden states on
    until the verdicts arrive — the pipeline bubble on rank 0."""

    steps: int
    verdict_bytes_per_step: float
    verdict_budget_bytes_per_step: float
    first_stage_s_per_step: float
    waiting_s_per_step: float

    @classmethod
    def pool(cls, runs: list["PipelineSteps"]) -> "PipelineSteps | None":
        """Several runs as one: per-step figures weighted by steps (None without steps)."""
        steps = sum(r.steps for r in runs)
        if not steps:
            return None

        def mean(metric: str) -> float:
            return sum(getattr(r, metric) * r.steps for r in runs) / steps

        return cls(steps, mean("verdict_bytes_per_step"), mean("verdict_budget_bytes_per_step"),
                   mean("first_stage_s_per_step"), mean("waiting_s_per_step"))


@dataclass
class RunResult:
    concurrency: int
    warmup: bool
    wall_s: float
    num_tokens: int  # generated tokens over all requests
    requests: list[RequestTiming]
    outputs: list[list[int]]  # generated token ids, in prompt order
    competing_cpu_cores: float | None = None  # cores other processes kept busy meanwhile (schedule.py)
    discarded: bool = False  # too much competing CPU: repeated, kept for the record, not reported
    spec: SpecCounts | None = None  # ours with speculation: the engine's counters over this run
    round: int = 1  # the benchmark round this run belongs to (command.py interleaves systems by round)
    pipeline: PipelineSteps | None = None  # ours with pipeline stages: their cost over this run

    @property
    def tokens_per_s(self) -> float:
        return self.num_tokens / self.wall_s


@dataclass
class TieCheck:
    """Where a system's greedy output first differs from the reference's, the reference's top-2."""

    prompt_index: int
    position: int  # index into the generated tokens
    reference_token: int
    other_token: int
    top2_ids: list[int]
    top2_logits: list[float]

    @property
    def relative_gap(self) -> float:
        a, b = self.top2_logits
        return abs(a - b) / max(abs(a), abs(b), 1e-30)

    def is_near_tie(self, rtol: float) -> bool:
        """A benign mismatch: both tokens are the reference's top-2 and their logits are within rtol."""
        return set(self.top2_ids) == {self.reference_token, self.other_token} and self.relative_gap <= rtol


@dataclass
class Truncation:
    """Prompts longer than ``keep_tokens`` (= max-model-len − max-tokens) keep their last
    ``keep_tokens`` token ids (chat template applied first, so the generation prompt survives)."""

    max_model_len: int
    keep_tokens: int
    original_lengths: list[int]  # prompt token counts before truncation, in prompt order

    @property
    def num_truncated(self) -> int:
        return sum(n > self.keep_tokens for n in self.original_lengths)

    def note(self) -> str:
        return (f"{self.num_truncated} of {len(self.original_lengths)} prompts were longer than {self.keep_tokens} tokens "
                f"and kept their last {self.keep_tokens} (max-model-len {self.max_model_len} − max-tokens "
                f"{self.max_model_len - self.keep_tokens}); longest was {max(self.original_lengths, default=0)}")


@dataclass
class SystemResult:
    system: str  # its name (systems.py)
    versions: dict[str, str]
    threads: int
    load_s: float
    prompt_token_ids: list[list[int]]
    runs: list[RunResult]
    tie_checks: list[TieCheck] = field(default_factory=list)
    truncation: Truncation | None = None  # ours: how prompts were fitted into the context

    @property
    def max_competing_cpu_cores(self) -> float | None:
        values = [r.competing_cpu_cores for c in {r.concurrency for r in self.runs} for r in self.timed(c)
                  if r.competing_cpu_cores is not None]
        return max(values, default=None)

    def timed(self, concurrency: int) -> list[RunResult]:
        return [r for r in self.runs if r.concurrency == concurrency and not r.warmup and not r.discarded]

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "SystemResult":
        runs = [
            RunResult(**{
                **r, "requests": [RequestTiming(**t) for t in r["requests"]],
                "spec": SpecCounts(**r["spec"]) if r.get("spec") else None,
                "pipeline": PipelineSteps(**r["pipeline"]) if r.get("pipeline") else None,
            })
            for r in data["runs"]
        ]
        ties = [TieCheck(**t) for t in data["tie_checks"]]
        truncation = Truncation(**data["truncation"]) if data.get("truncation") else None
        return cls(**{**data, "runs": runs, "tie_checks": ties, "truncation": truncation})


def write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=1), encoding="utf-8")


def read_job(path: Path) -> Job:
    return Job(**json.loads(path.read_text(encoding="utf-8")))
