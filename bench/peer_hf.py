"""The peer: Hugging Face transformers ``generate()``, KV cache on, greedy, same token ids.

Run as a subprocess by ``command.py``: ``python -P -m specdecode.bench.peer_hf JOB OUT``.
The job carries our tokenizer's prompt ids, so both systems see identical inputs. EOS is ignored
by removing it from the generation config (``eos_token_id=None``) rather than with
``min_new_tokens``, which would mask EOS out of the logits and change the greedy choice; so both
systems generate exactly ``max_tokens`` tokens. Concurrency 1 runs one prompt at a time;
concurrency c > 1 runs one left-padded batch (with its attention mask) per group of c prompts.
A streamer timestamps each generated token, for TTFT and ITL.

``job.peer_mode`` picks transformers' equivalent of our proposers: ``prompt-lookup``
(``prompt_lookup_num_tokens=K``, ``max_matching_ngram_size`` = our n-gram window's top) or
``assisted`` (``assistant_model=`` the draft, ``num_assistant_tokens=K`` on a constant schedule
with no confidence cut-off: the same fixed-K algorithm as ours). Both are batch-size-1 only.
"""
from __future__ import annotations

import contextlib
import platform
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM, GenerationConfig
from transformers.generation.streamers import BaseStreamer

from specdecode.bench.records import (
    Job, RequestTiming, RunResult, SystemResult, TieCheck, read_job, write_json,
)
from specdecode.bench.schedule import run_schedule
from specdecode.runtime.config import LoadConfig
from specdecode.runtime.models import aliases

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ArrivalStreamer(BaseStreamer):
    """Records when each generation step's tokens arrive, and how many per sequence
    (``generate`` first puts the prompt; a plain step puts ``[B]``, an assisted step ``[1, n]``)."""

    def __init__(self) -> None:
        self.arrivals: list[tuple[float, int]] = []
        self._prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if self._prompt_seen:
            self.arrivals.append((time.perf_counter(), value.shape[-1] if value.dim() == 2 else 1))
        self._prompt_seen = True

    def end(self) -> None:
        pass


@contextlib.contextmanager
def peer_source(model: str) -> Iterator[tuple[Path, str | None]]:
    """(folder, GGUF file name or None) for ``from_pretrained``: an alias, a GGUF file or a HF folder.
    Split aliases are joined into the default weight cache, where our loader joined them too."""
    if aliases.is_alias(model):
        with aliases.alias_gguf(model, LoadConfig().weight_cache_dir) as gguf:
            yield gguf.parent, gguf.name
        return
    path = Path(model).expanduser()
    yield (path, None) if path.is_dir() else (path.parent, path.name)


def load_model(name: str, job: Job) -> AutoModelForCausalLM:
    with peer_source(name) as (folder, gguf_file):
        extra = {"gguf_file": gguf_file} if gguf_file else {}
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=DTYPES[job.dtype], **extra)
    return model.to(job.device).eval()


def load_peer(job: Job) -> tuple[AutoModelForCausalLM, dict]:
    """The target model, and the extra ``generate`` arguments of ``job.peer_mode``."""
    model = load_model(job.model, job)
    pad = model.generation_config.pad_token_id
    # Replace the checkpoint's generation defaults wholesale: greedy, KV cache, no EOS stop.
    model.generation_config = GenerationConfig(
        do_sample=False,
        max_new_tokens=job.max_tokens,
        eos_token_id=None,
        pad_token_id=0 if pad is None else pad,
        use_cache=True,
    )
    if job.peer_mode == "plain":
        return model, {}
    if job.peer_mode == "prompt-lookup":
        return model, {"prompt_lookup_num_tokens": job.num_speculative_tokens, "max_matching_ngram_size": job.prompt_lookup_max}
    if job.peer_mode == "assisted" and job.assistant_model:
        assistant = load_model(job.assistant_model, job)
        assistant.generation_config = GenerationConfig(
            do_sample=False, eos_token_id=None, pad_token_id=model.generation_config.pad_token_id, use_cache=True,
            num_assistant_tokens=job.num_speculative_tokens, num_assistant_tokens_schedule="constant",
            assistant_confidence_threshold=0.0,
        )
        return model, {"assistant_model": assistant}
    raise ValueError(f"unknown peer mode {job.peer_mode!r} (assisted needs an assistant model)")


@torch.inference_mode()
def generate_group(
    model, job: Job, prompts: list[list[int]], extra: dict
) -> tuple[list[list[int]], list[tuple[float, int]]]:
    """One ``generate`` call over a left-padded batch; returns generated ids and token arrivals."""
    width = max(len(p) for p in prompts)
    pad = model.generation_config.pad_token_id
    input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=job.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=job.device)
    streamer = ArrivalStreamer()
    out = model.generate(input_ids, attention_mask=mask, streamer=streamer, **extra)
    generated = out[:, width:].tolist()
    if any(len(g) != job.max_tokens for g in generated):
        raise RuntimeError(f"transformers generated {[len(g) for g in generated]} tokens, not {job.max_tokens}")
    return generated, streamer.arrivals


def run_batched(model, job: Job, extra: dict, prompt_ids: list[list[int]], concurrency: int, warmup: bool) -> RunResult:
    outputs: list[list[int]] = []
    timings: list[RequestTiming] = []
    t0 = time.perf_counter()
    for first in range(0, len(prompt_ids), concurrency):
        start = time.perf_counter()
        generated, arrivals = generate_group(model, job, prompt_ids[first : first + concurrency], extra)
        outputs += generated
        timings += [RequestTiming.from_arrivals(start, arrivals) for _ in generated]
    wall = time.perf_counter() - t0
    return RunResult(concurrency, warmup, wall, sum(len(o) for o in outputs), timings, outputs)


@torch.inference_mode()
def tie_checks(model, job: Job, prompt_ids: list[list[int]], reference: list[list[int]]) -> list[TieCheck]:
    """For each prompt where another system's output (``job.tie_check_outputs``) differs from this
    model's (``reference``), this model's top-2 logits at the first differing position, computed
    over prompt + the common prefix. One check per (prompt, position, other token)."""
    checks: dict[tuple[int, int, int], TieCheck] = {}
    for other_outputs in (job.tie_check_outputs or {}).values():
        for i, (ref, other) in enumerate(zip(reference, other_outputs)):
            pos = next((p for p, (a, b) in enumerate(zip(ref, other)) if a != b), None)
            if pos is None or (i, pos, other[pos]) in checks:
                continue
            ids = torch.tensor([prompt_ids[i] + ref[:pos]], device=job.device)
            logits = model(ids).logits[0, -1].float()  # [vocab]
            top = torch.topk(logits, 2)
            checks[(i, pos, other[pos])] = TieCheck(i, pos, ref[pos], other[pos], top.indices.tolist(), top.values.tolist())
    return list(checks.values())


def run_job(job: Job) -> SystemResult:
    torch.set_num_threads(job.threads)
    start = time.perf_counter()
    model, extra = load_peer(job)
    load_s = time.perf_counter() - start
    prompt_ids = job.prompt_token_ids or []
    runs = run_schedule(
        job.system, job, prompt_ids, lambda ids, c, warmup, tag: run_batched(model, job, extra, ids, c, warmup)
    )
    single = [r for r in runs if r.concurrency == 1 and not r.warmup]
    ties = tie_checks(model, job, prompt_ids, single[0].outputs) if single and job.tie_check_outputs else []
    versions = {"torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version()}
    return SystemResult(job.system, versions, torch.get_num_threads(), load_s, prompt_ids, runs, ties)


def main(argv: list[str]) -> int:
    job_path, out_path = (Path(a) for a in argv)
    write_json(out_path, run_job(read_job(job_path)).to_json())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
