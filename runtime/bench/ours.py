"""Our system under benchmark: the in-process ``LLMEngine``, driven as a closed loop.

Run as a subprocess by ``command.py``: ``python -P -m specdecode.runtime.bench.ours JOB OUT``.
It applies the chat template and tokenizes the prompts (the peer then reuses these exact ids),
and at each concurrency c keeps c requests in flight, adding the next prompt as soon as one
finishes. Greedy, ``ignore_eos`` so every request generates exactly ``max_tokens`` tokens.
Prefix caching is off: every timed run repeats the same prompts, and the peer has no such cache.
"""
from __future__ import annotations

import platform
import sys
import time
from collections import deque
from pathlib import Path

import torch

from specdecode.runtime.bench.prompts import Messages
from specdecode.runtime.bench.records import Job, RequestTiming, RunResult, SystemResult, read_job, write_json
from specdecode.runtime.bench.schedule import run_schedule
from specdecode.runtime.config import CacheConfig, EngineConfig, LoadConfig, SchedulerConfig
from specdecode.runtime.engine.llm_engine import LLMEngine
from specdecode.runtime.engine.sequence import SamplingParams


def encode_prompts(tokenizer, prompts: list[Messages]) -> list[list[int]]:
    """Chat template, then token ids without extra special tokens (the template already has them)."""
    return [tokenizer.encode(tokenizer.apply_chat_template(m, add_generation_prompt=True), add_special_tokens=False) for m in prompts]


def build_engine(job: Job) -> tuple[LLMEngine, object, float]:
    from specdecode.runtime.models.loader import load_model

    start = time.perf_counter()
    load = LoadConfig(model=job.model, dtype=job.dtype, device=job.device)
    loaded = load_model(load)
    cfg = EngineConfig(
        load=load,
        cache=CacheConfig(enable_prefix_caching=False),
        scheduler=SchedulerConfig(max_num_seqs=max(32, *job.concurrency)),
    )
    engine = LLMEngine(loaded.model, loaded.tokenizer, cfg, loaded.max_model_len, loaded.device, loaded.dtype)
    return engine, loaded.tokenizer, time.perf_counter() - start


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
    return RunResult(concurrency, warmup, wall, sum(len(o) for o in outputs), timings, outputs)


def run_job(job: Job) -> SystemResult:
    torch.set_num_threads(job.threads)
    engine, tokenizer, load_s = build_engine(job)
    prompt_ids = encode_prompts(tokenizer, job.prompts)
    runs = run_schedule(
        "ours", job, prompt_ids,
        lambda ids, c, warmup, tag: run_closed_loop(engine, ids, job.max_tokens, c, warmup, tag),
    )
    versions = {"torch": torch.__version__, "python": platform.python_version()}
    return SystemResult("ours", versions, torch.get_num_threads(), load_s, prompt_ids, runs)


def main(argv: list[str]) -> int:
    job_path, out_path = (Path(a) for a in argv)
    write_json(out_path, run_job(read_job(job_path)).to_json())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
