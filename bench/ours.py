"""Our system under benchmark: the in-process ``LLMEngine``, driven as a closed loop.

Run as a subprocess by ``command.py``: ``python -P -m specdecode.bench.ours JOB OUT``.
It applies the chat template and tokenizes the prompts (the peer then reuses these exact ids),
and at each concurrency c keeps c requests in flight, adding the next prompt as soon as one
finishes. Greedy, ``ignore_eos`` so every request generates exactly ``max_tokens`` tokens.
Every run (warm-up or timed) gets a fresh engine over the one loaded model: the runs repeat the
same prompts, so nothing may carry over from one to the next — not the prefix cache (off), not
the suffix proposer's cache of earlier outputs (which would otherwise hold the very answers),
not load control's rolling acceptance. The peer has none of these either.

Pipeline systems (``Job.pipeline_parallel_size`` > 1) are the exception: their engine is rank 0
of a process group whose start (spawning the other stages, each loading its layers, the
rendezvous) costs seconds, so this process starts the group once and every run reuses its
engine (``engine.step()`` directly, as ``AsyncEngine`` would). That is safe only because nothing
above carries over there: prefix caching is off, ``systems.py`` refuses the suffix proposer with
stages and gives them no load control, the other proposers keep state per sequence only, and
the counters read per run (acceptance, pipeline stats) are differences. Each rank runs
cores ÷ P torch threads (the runtime's rule), whatever ``--threads`` says.

Prompts longer than max-model-len − max-tokens keep their last tokens (``Truncation``). With
speculation, each run records the engine's own acceptance counters (the ``/metrics`` ones); with
stages, the pipeline's cost per step (``PipelineSteps``).
The KV pool is sized so the largest concurrency never preempts.
"""
from __future__ import annotations

import platform
import sys
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import torch

from specdecode.runtime.prompt_sets import Messages
from specdecode.bench.records import (
    Job, PipelineSteps, RequestTiming, RunResult, SystemResult, Truncation, read_job, write_json,
)
from specdecode.bench.schedule import run_schedule
from specdecode.runtime.config import (
    CacheConfig, EngineConfig, LoadConfig, ParallelConfig, SchedulerConfig, SpeculativeConfig,
)
from specdecode.runtime.engine.async_engine import AsyncEngine
from specdecode.runtime.engine.llm_engine import LLMEngine
from specdecode.runtime.engine.sequence import SamplingParams, SpecCounts
from specdecode.runtime.models.loader import LoadedModel, load_model
from specdecode.runtime.parallel.pipeline import PipelineExecution, PipelineStats

BLOCK_SIZE = 16


def encode_prompts(tokenizer, prompts: list[Messages]) -> list[list[int]]:
    """Chat template, then token ids without extra special tokens (the template already has them)."""
    return [tokenizer.encode(tokenizer.apply_chat_template(m, add_generation_prompt=True), add_special_tokens=False) for m in prompts]


def truncate(prompt_ids: list[list[int]], max_model_len: int, max_tokens: int) -> tuple[list[list[int]], Truncation]:
    """Keep each prompt's last (max_model_len − max_tokens) token ids."""
    keep = max_model_len - max_tokens
    if keep < 1:
        raise ValueError(f"max-tokens ({max_tokens}) must be below max-model-len ({max_model_len})")
    return [ids[-keep:] for ids in prompt_ids], Truncation(max_model_len, keep, [len(ids) for ids in prompt_ids])


def load(job: Job) -> tuple[LoadedModel, int, list[list[int]], Truncation, float]:
    """Load the model, tokenize and truncate the prompts: (model, max-model-len, prompt ids,
    truncation, seconds)."""
    start = time.perf_counter()
    loaded = load_model(LoadConfig(model=job.model, dtype=job.dtype, device=job.device))
    max_model_len = min(job.max_model_len or loaded.max_model_len, loaded.config.max_position_embeddings)
    prompt_ids, truncation = truncate(encode_prompts(loaded.tokenizer, job.prompts), max_model_len, job.max_tokens)
    return loaded, max_model_len, prompt_ids, truncation, time.perf_counter() - start


def engine_config(job: Job, max_model_len: int, prompt_ids: list[list[int]]) -> EngineConfig:
    """The job's engine config, its KV pool sized for the prompts at the largest concurrency."""
    longest = max(len(p) for p in prompt_ids) + job.max_tokens + 1
    return EngineConfig(
        load=LoadConfig(model=job.model, dtype=job.dtype, device=job.device),
        cache=CacheConfig(
            block_size=BLOCK_SIZE, enable_prefix_caching=False,
            num_blocks=max(job.concurrency) * -(-longest // BLOCK_SIZE) + 1,
        ),
        scheduler=SchedulerConfig(max_num_seqs=max(32, *job.concurrency), max_model_len=max_model_len,
                                  overlap=job.overlap),
        speculative=SpeculativeConfig.model_validate(job.speculative or {}),
        parallel=ParallelConfig(pipeline_parallel_size=job.pipeline_parallel_size),
    )


def run_fresh(
    cfg: EngineConfig, loaded: LoadedModel, prompt_ids: list[list[int]], max_tokens: int, concurrency: int,
    warmup: bool, tag: str,
) -> RunResult:
    """One run on a fresh engine over ``loaded`` (the draft model, if any, is loaded again)."""
    engine = LLMEngine(loaded.model, loaded.tokenizer, cfg, loaded.max_model_len, loaded.device, loaded.dtype)
    try:
        return run_closed_loop(engine, prompt_ids, max_tokens, concurrency, warmup, tag)
    finally:
        engine.shutdown()


@contextmanager
def pipeline_group(cfg: EngineConfig) -> Iterator[LLMEngine]:
    """Rank 0's engine of a group started for ``cfg``; its worker processes stop on exit."""
    group = AsyncEngine.from_config(cfg)
    try:
        yield group.engine
    finally:
        group.shutdown()


def spec_counts(engine: LLMEngine) -> SpecCounts:
    """The engine's cumulative acceptance counters (what ``/metrics`` exports)."""
    s = engine.stats()
    return SpecCounts(s.spec_decode_num_drafts, s.spec_decode_num_draft_tokens, s.spec_decode_num_accepted_tokens,
                      list(s.spec_decode_num_accepted_tokens_per_pos))


def counts_since(before: SpecCounts, after: SpecCounts) -> SpecCounts:
    per_pos = [n - (before.accepted_per_position[i] if i < len(before.accepted_per_position) else 0)
               for i, n in enumerate(after.accepted_per_position)]
    return SpecCounts(after.num_drafts - before.num_drafts, after.num_draft_tokens - before.num_draft_tokens,
                      after.num_accepted_tokens - before.num_accepted_tokens, per_pos)


def pipeline_stats(engine: LLMEngine) -> PipelineStats | None:
    """A copy of the engine's pipeline counters (cumulative); None for an engine in one process."""
    return replace(engine.execution.stats) if isinstance(engine.execution, PipelineExecution) else None


def pipeline_since(before: PipelineStats, after: PipelineStats) -> PipelineSteps:
    steps = after.steps - before.steps

    def per_step(metric: str) -> float:
        return (getattr(after, metric) - getattr(before, metric)) / steps if steps else 0.0

    return PipelineSteps(steps, per_step("verdict_bytes"), per_step("verdict_budget_bytes"),
                         per_step("first_stage_s"), per_step("waiting_s"))


def run_closed_loop(
    engine: LLMEngine, prompt_ids: list[list[int]], max_tokens: int, concurrency: int, warmup: bool, tag: str
) -> RunResult:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    pending = deque(range(len(prompt_ids)))
    index_of: dict[str, int] = {}
    started: dict[int, float] = {}
    arrivals: list[list[tuple[float, int]]] = [[] for _ in prompt_ids]
    outputs: list[list[int]] = [[] for _ in prompt_ids]

    def admit() -> None:
        i = pending.popleft()
        request_id = f"{tag}-{i}"
        index_of[request_id] = i
        started[i] = time.perf_counter()
        engine.add_request(request_id, prompt_ids[i], params)

    spec_before, pipeline_before = spec_counts(engine), pipeline_stats(engine)
    t0 = time.perf_counter()
    while pending and len(engine.requests) < concurrency:
        admit()
    while engine.has_unfinished():
        step_outputs = engine.step()
        now = time.perf_counter()
        for out in step_outputs:
            i = index_of[out.request_id]
            for delta in out.deltas:
                if delta.token_ids:
                    arrivals[i].append((now, len(delta.token_ids)))
                    outputs[i].extend(delta.token_ids)
        while pending and len(engine.requests) < concurrency:
            admit()
    wall = time.perf_counter() - t0
    timings = [RequestTiming.from_arrivals(started[i], arrivals[i]) for i in range(len(prompt_ids))]
    spec = counts_since(spec_before, spec_counts(engine)) if engine.proposes else None
    pipeline = pipeline_since(pipeline_before, pipeline_stats(engine)) if pipeline_before is not None else None
    return RunResult(concurrency, warmup, wall, sum(len(o) for o in outputs), timings, outputs, spec=spec,
                     pipeline=pipeline)


def run_job(job: Job) -> SystemResult:
    torch.set_num_threads(job.threads)
    loaded, max_model_len, prompt_ids, truncation, load_s = load(job)
    cfg = engine_config(job, max_model_len, prompt_ids)
    if job.pipeline_parallel_size == 1:
        runs = run_schedule(job.system, job, prompt_ids, lambda ids, c, warmup, tag: run_fresh(
            cfg, loaded, ids, job.max_tokens, c, warmup, tag))
    else:
        del loaded  # each stage loads its own layers
        with pipeline_group(cfg) as engine:
            runs = run_schedule(job.system, job, prompt_ids, lambda ids, c, warmup, tag: run_closed_loop(
                engine, ids, job.max_tokens, c, warmup, tag))
    versions = {"torch": torch.__version__, "python": platform.python_version()}
    return SystemResult(job.system, versions, torch.get_num_threads(), load_s, prompt_ids, runs, truncation=truncation)


def main(argv: list[str]) -> int:
    job_path, out_path = (Path(a) for a in argv)
    write_json(out_path, run_job(read_job(job_path)).to_json())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
