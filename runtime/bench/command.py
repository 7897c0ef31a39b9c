"""``specdecode bench``: run our engine, then transformers, each in its own subprocess; check that
their outputs agree, print a table, write JSON and a plot under ``--output-dir``.

Exit status: 0 when every output check passes, 1 when one fails, 2 when a system fails to run.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
from dataclasses import asdict, replace
from importlib import metadata
from pathlib import Path

from specdecode.runtime.bench import report
from specdecode.runtime.bench.prompts import load_prompts
from specdecode.runtime.bench.records import Job, SystemResult, write_json
from specdecode.runtime.bench.schedule import BUSY_CORES

REPO_ROOT = Path(__file__).resolve().parents[2]


class BenchError(RuntimeError):
    pass


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2-135m", help="alias (smollm2-135m, qwen2.5-coder-1.5b), GGUF file or HF folder")
    parser.add_argument("--prompts", default="builtin", help="'builtin' (16 chat/code prompts) or a JSON/JSONL file")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64, help="generated per request (EOS ignored by both systems)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8], help="requests in flight")
    parser.add_argument("--runs", type=int, default=3, help="timed runs per concurrency, after one warm-up")
    parser.add_argument("--busy-retries", type=int, default=3,
                        help="repeat a timed run disturbed by other processes (> %.2f cores) up to this many times" % BUSY_CORES)
    parser.add_argument("--quiet-wait", type=float, default=120.0,
                        help="seconds to wait, before each timed run, for other processes to go quiet")
    parser.add_argument("--threads", type=int, default=None, help="torch threads for both systems [torch.get_num_threads()]")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--output-dir", type=Path, default=Path("bench-results"))
    parser.add_argument("--skip-peer", action="store_true", help="run ours only (no transformers, no cross-check)")


def run(args: argparse.Namespace) -> int:
    if args.runs < 1 or args.max_tokens < 1 or min(args.concurrency) < 1 or args.busy_retries < 0 or args.quiet_wait < 0:
        print("bench: --runs, --max-tokens and --concurrency must be >= 1; --busy-retries, --quiet-wait >= 0", file=sys.stderr)
        return 2
    concurrency = sorted(set(args.concurrency))
    job = Job(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        threads=args.threads or _default_threads(),
        max_tokens=args.max_tokens,
        concurrency=concurrency,
        runs=args.runs,
        busy_retries=args.busy_retries,
        quiet_wait_s=args.quiet_wait,
        prompts=load_prompts(args.prompts, args.num_prompts),
    )
    try:
        ours, peer = _run_systems(job, args.skip_peer)
    except BenchError as exc:
        print(f"bench: {exc}", file=sys.stderr)
        return 2
    correctness = report.check_correctness(ours, peer, concurrency)
    rows = report.build_summaries(ours, peer, concurrency, correctness)
    print(report.format_table(rows))
    _print_correctness(correctness, concurrency)
    _warn_if_busy(s for s in (ours, peer) if s is not None)
    json_path, png_path = _write_outputs(args, job, ours, peer, rows, correctness)
    print(f"\nwrote {json_path} and {png_path}")
    return 0 if correctness.ok else 1


def _default_threads() -> int:
    import torch

    return torch.get_num_threads()


def _run_systems(job: Job, skip_peer: bool) -> tuple[SystemResult, SystemResult | None]:
    with tempfile.TemporaryDirectory(prefix="specdecode-bench-") as tmp:
        ours = _run_subprocess("ours", job, Path(tmp))
        if skip_peer:
            return ours, None
        single = ours.timed(1)
        peer_job = replace(
            job, prompt_token_ids=ours.prompt_token_ids, tie_check_outputs=single[0].outputs if single else None
        )
        return ours, _run_subprocess("peer_hf", peer_job, Path(tmp))


def _run_subprocess(module: str, job: Job, tmp: Path) -> SystemResult:
    """One system in a fresh interpreter, so only one model is in memory at a time."""
    job_path, out_path = tmp / f"{module}-job.json", tmp / f"{module}-result.json"
    write_json(job_path, asdict(job))
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, "-P", "-m", f"specdecode.runtime.bench.{module}", str(job_path), str(out_path)]
    proc = subprocess.run(cmd, env=env, check=False)
    if proc.returncode != 0 or not out_path.exists():
        raise BenchError(f"{module} exited with status {proc.returncode} (its error is above)")
    return SystemResult.from_json(json.loads(out_path.read_text(encoding="utf-8")))


def _print_correctness(c: report.Correctness, concurrency: list[int]) -> None:
    print()
    if c.self_checked:
        for conc in (x for x in concurrency if x != 1):
            bad = c.self_mismatches.get(conc, [])
            print(f"concurrency {conc}, ours vs ours at concurrency 1: {len(bad)} prompt(s) differ {bad or ''}")
    if c.peer_checked:
        print(f"concurrency 1, ours vs transformers: {len(c.peer_mismatches)} prompt(s) differ")
        for m in c.peer_mismatches:
            gap = f"{m.relative_gap:.2e}" if m.relative_gap is not None else "n/a"
            verdict = "near-tie" if m.near_tie else "FAILURE"
            print(f"  prompt {m.prompt_index} token {m.position}: ours {m.ours_token}, transformers {m.peer_token}, "
                  f"top-2 relative gap {gap} → {verdict}")
    for conc, prompts in c.peer_batch_differs.items():
        print(f"(info) transformers' left-padded batch at c={conc} differs from its own c=1 on prompts {prompts}")
    for failure in c.failures:
        print(f"FAILURE: {failure}")


def _warn_if_busy(systems) -> None:
    for system in systems:
        cores = system.max_competing_cpu_cores
        if cores is not None and cores > BUSY_CORES:
            print(f"WARNING: other processes (or CPU steal) kept {cores:.2f} cores busy during a reported run of "
                  f"{system.system}: its timings are inflated; rerun on a quiet machine")


def _write_outputs(
    args: argparse.Namespace, job: Job, ours: SystemResult, peer: SystemResult | None,
    rows: list[report.Summary], correctness: report.Correctness,
) -> tuple[Path, Path]:
    out_dir: Path = args.output_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    slug = re.sub(r"[^A-Za-z0-9._-]+", "_", Path(args.model).name or args.model)
    json_path, png_path = out_dir / f"bench-{slug}.json", out_dir / f"bench-{slug}.png"
    data = {
        "created": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "versions": _versions(ours, peer),
        "machine": _machine(job.threads),
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if not callable(v)},
        "method": {
            "ours": "in-process LLMEngine, closed loop (c requests in flight), greedy, ignore_eos, prefix caching off",
            "transformers": "generate(): c=1 one prompt at a time; c>1 one left-padded batch per group of c; "
                            "greedy, KV cache on, eos_token_id=None",
            "tokens_per_s": "generated tokens / wall time of the run (prefill included)",
            "statistics": f"one warm-up run, then median over {job.runs} timed runs of each run's p50; a timed run "
                          f"during which other processes used > {BUSY_CORES} cores is discarded and repeated "
                          f"(up to {job.busy_retries} times)",
        },
        "prompts": job.prompts,
        "summary": [asdict(r) for r in rows],
        "correctness": report.correctness_json(correctness),
        "systems": {s.system: s.to_json() for s in (ours, peer) if s is not None},
    }
    write_json(json_path, data)
    title = f"{args.model}, {args.dtype}, {job.threads} threads, {len(job.prompts)} prompts × {job.max_tokens} tokens"
    report.plot_throughput(rows, png_path, title)
    return json_path, png_path


def _versions(ours: SystemResult, peer: SystemResult | None) -> dict[str, object]:
    versions: dict[str, object] = {**ours.versions, **(peer.versions if peer else {})}
    versions["specdecode"] = metadata.version("specdecode")
    versions["git_commit"] = _git("rev-parse", "HEAD")
    status = _git("status", "--porcelain")
    versions["git_dirty"] = None if status is None else bool(status)
    return versions


def _git(*argv: str) -> str | None:
    try:
        proc = subprocess.run(["git", "-C", str(REPO_ROOT), *argv], capture_output=True, text=True, check=False)
    except FileNotFoundError:
        return None
    return proc.stdout.strip() if proc.returncode == 0 else None


def _machine(threads: int) -> dict[str, object]:
    cpu_model = None
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        cpu_model = next((line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines() if line.startswith("model name")), None)
    return {
        "cpu_count": os.cpu_count(),
        "usable_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "threads": threads,
        "cpu_model": cpu_model,
        "platform": platform.platform(),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="specdecode bench", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
