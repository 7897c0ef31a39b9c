"""``specdecode bench``: run our engine (without and with speculation), then transformers, each
system in its own subprocess (``systems.py``), round by round (every system once per timed run);
check that their outputs agree, print a table, write JSON and plots under ``--output-dir``.

Exit status: 0 when every output check passes, 1 when one fails, 2 when a system fails to run or
its data or model is not installed.
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

from pydantic import BaseModel

from specdecode.bench import acceptance, correctness, report
from specdecode.runtime.prompt_sets import PROMPT_SET_NAMES, load_prompts
from specdecode.bench.records import Job, SystemResult, Truncation, write_json
from specdecode.bench.schedule import BUSY_CORES
from specdecode.bench.systems import LOAD_CONTROL_ON, METHODS, NOSPEC, PEER_PLAIN, System, build_systems
from specdecode.runtime.config import LoadConfig, LoadControl, SpeculativeConfig
from specdecode.runtime.models import aliases

REPO_ROOT = Path(__file__).resolve().parents[1]


class BenchError(RuntimeError):
    pass


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2-135m", help="alias (smollm2-135m, qwen2.5-coder-1.5b), GGUF file or HF folder")
    parser.add_argument("--prompts", default="builtin",
                        help=f"{' | '.join(PROMPT_SET_NAMES)} (fixed subsets, see runtime/prompt_sets.py) "
                             "or a JSON/JSONL file")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64, help="generated per request (EOS ignored by every system)")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="context length [the model's]; longer prompts keep their last (max-model-len − max-tokens) tokens")
    parser.add_argument("--method", nargs="+", default=["none"], choices=METHODS,
                        help="speculative methods to measure against ours-nospec and transformers (several allowed)")
    parser.add_argument("--num-speculative-tokens", type=int, default=4, help="K for every method and peer")
    parser.add_argument("--draft-model", default=None, help="draft: alias, GGUF file or HF folder (e.g. qwen2.5-coder-0.5b)")
    parser.add_argument("--mtp-path", default=None,
                        help="mtp: folder of the MTP head(s) (specdecode train-mtp --out DIR); unset = the model's own")
    parser.add_argument("--eagle3-path", default=None,
                        help="eagle3: folder of the EAGLE-3 head (specdecode train-eagle3 --out DIR, or a published one)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8], help="requests in flight")
    parser.add_argument("--runs", type=int, default=3,
                        help="rounds: each runs every system once (a warm-up, then one timed run per concurrency); "
                             "speedups are the median over rounds of the ratio within a round")
    parser.add_argument("--busy-retries", type=int, default=3,
                        help="repeat a timed run disturbed by other processes (> %.2f cores) up to this many times" % BUSY_CORES)
    parser.add_argument("--quiet-wait", type=float, default=120.0,
                        help="seconds to wait, before each timed run, for other processes to go quiet")
    parser.add_argument("--threads", type=int, default=None, help="torch threads for both systems [torch.get_num_threads()]")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--output-dir", type=Path, default=Path("bench-results"))
    parser.add_argument("--skip-peer", action="store_true", help="run ours only (no transformers, no cross-check)")
    parser.add_argument("--pipeline-parallel-size", type=int, default=1,
                        help="P > 1: also run ours-nospec and each ours-METHOD as P pipeline stages (<name>-pp<P>), "
                             "each rank with cores ÷ P threads; speedups stay vs ours-nospec (P = 1)")
    parser.add_argument("--compare-overlap", action="store_true",
                        help="also run each of our systems with overlap scheduling flipped from the runtime's default "
                             "(<name>-overlap in one process, <name>-no-overlap with pipeline stages)")
    parser.add_argument("--load-control", type=_load_control, default=LOAD_CONTROL_ON,
                        help="the +lc systems' load_control JSON, e.g. '{\"goodput\": true, \"batch_size_table\": "
                             "[{\"max_batch_size\": 8, \"num_speculative_tokens\": 4}]}' [%s]"
                             % LOAD_CONTROL_ON.model_dump_json(exclude_defaults=True))


def _load_control(text: str) -> LoadControl:
    try:
        return LoadControl.model_validate_json(text)
    except ValueError as exc:  # pydantic's ValidationError names the field and what it must be
        raise argparse.ArgumentTypeError(str(exc)) from None


def run(args: argparse.Namespace) -> int:
    if (args.runs < 1 or args.max_tokens < 1 or min(args.concurrency) < 1 or args.pipeline_parallel_size < 1
            or args.busy_retries < 0 or args.quiet_wait < 0):
        print("bench: --runs, --max-tokens, --concurrency and --pipeline-parallel-size must be >= 1; --busy-retries, "
              "--quiet-wait >= 0", file=sys.stderr)
        return 2
    try:
        systems = build_systems(args.method, args.num_speculative_tokens, args.draft_model, args.concurrency,
                                not args.skip_peer, args.load_control, args.mtp_path, args.pipeline_parallel_size,
                                args.compare_overlap, eagle3_path=args.eagle3_path)
        job = _base_job(args)
        _check_models_installed(args.model, args.draft_model if "draft" in args.method else None)
    except (FileNotFoundError, ValueError) as exc:  # MissingData is a FileNotFoundError
        print(f"bench: {exc}", file=sys.stderr)
        return 2
    try:
        results = _run_systems(systems, job)
    except BenchError as exc:
        print(f"bench: {exc}", file=sys.stderr)
        return 2
    checked = correctness.check(systems, results)
    rows = report.build_summaries(systems, results, checked)
    truncation = results[NOSPEC].truncation
    print(report.format_table(rows, args.num_speculative_tokens))
    pipeline_table = report.format_pipeline_table(rows)
    if pipeline_table:
        print(f"\npipeline stages, per engine step (rank 0's view):\n{pipeline_table}")
    if truncation is not None:
        print(f"\nprompts ({args.prompts}): {truncation.note()}")
    _print_correctness(checked)
    _warn_if_busy(results.values())
    paths = _write_outputs(args, job, systems, results, rows, checked, truncation)
    print(f"\nwrote {', '.join(str(p) for p in paths)}")
    return 0 if checked.ok else 1


def _base_job(args: argparse.Namespace) -> Job:
    return Job(
        system="",
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        threads=args.threads or _default_threads(),
        max_tokens=args.max_tokens,
        concurrency=[],
        runs=args.runs,
        busy_retries=args.busy_retries,
        quiet_wait_s=args.quiet_wait,
        prompts=load_prompts(args.prompts, args.num_prompts),
        max_model_len=args.max_model_len,
        num_speculative_tokens=args.num_speculative_tokens,
        prompt_lookup_max=SpeculativeConfig().prompt_lookup_max,
        assistant_model=args.draft_model,
    )


def _check_models_installed(*models: str | None) -> None:
    """Fail before any subprocess starts when an alias's packages are missing (and join split
    GGUFs once, where every system will look for them)."""
    for model in models:
        if model is None or not aliases.is_alias(model):
            continue
        try:
            with aliases.alias_gguf(model, LoadConfig().weight_cache_dir):
                pass
        except FileNotFoundError as exc:
            hint = "scripts/bench_data.sh --qwen" if model.startswith("qwen") else "scripts/bootstrap.sh"
            raise FileNotFoundError(f"{exc}; or run {hint}") from None


def _default_threads() -> int:
    import torch

    return torch.get_num_threads()


def _run_systems(systems: list[System], base: Job) -> dict[str, SystemResult]:
    """``base.runs`` rounds; each round runs every system once, in a subprocess of its own (its
    warm-up, then one timed run per concurrency), so a drift in the machine's speed over the
    minutes a benchmark takes hits every system alike rather than whichever ran last; ratios are
    then taken within a round (``report.paired_ratio``). Round 1 runs in the plan's order:
    ``ours-nospec`` tokenizes first and every later system gets its token ids, and
    ``transformers-plain`` (last) gets every other system's concurrency-1 outputs to tie-check.
    Later rounds rotate that order, so no system always runs right after the same one."""
    rounds: dict[str, list[SystemResult]] = {s.name: [] for s in systems}
    with tempfile.TemporaryDirectory(prefix="specdecode-bench-") as tmp:
        for number in range(1, base.runs + 1):
            for system in round_order(systems, number):
                first = {name: results[0] for name, results in rounds.items() if results}
                job = replace(
                    base, system=system.name, concurrency=list(system.concurrency), runs=1,
                    speculative=system.speculative, peer_mode=system.peer_mode,
                    pipeline_parallel_size=system.pipeline_parallel_size, overlap=system.overlap,
                    prompt_token_ids=first[NOSPEC].prompt_token_ids if NOSPEC in first else None,
                    tie_check_outputs=_single_outputs(first) if system.name == PEER_PLAIN and number == 1 else None,
                )
                print(f"bench: round {number}/{base.runs}, {system.name}", file=sys.stderr, flush=True)
                rounds[system.name].append(_run_subprocess(system.runner, job, Path(tmp) / f"round{number}"))
    return {name: merge_rounds(results) for name, results in rounds.items()}


def round_order(systems: list[System], number: int) -> list[System]:
    """Round 1: the plan's order; round r: rotated left by r − 1."""
    shift = (number - 1) % len(systems)
    return systems[shift:] + systems[:shift]


def merge_rounds(results: list[SystemResult]) -> SystemResult:
    """One system's per-round results as one: runs tagged with their round, in round order;
    load time, token ids and truncation from round 1; tie checks from every round."""
    runs = [replace(run, round=number) for number, result in enumerate(results, 1) for run in result.runs]
    return replace(results[0], runs=runs, tie_checks=[t for r in results for t in r.tie_checks])


def _single_outputs(results: dict[str, SystemResult]) -> dict[str, list[list[int]]]:
    return {name: runs[0].outputs for name, r in results.items() if (runs := r.timed(1))}


def _run_subprocess(module: str, job: Job, tmp: Path) -> SystemResult:
    """One system in a fresh interpreter, so only one model is in memory at a time."""
    tmp.mkdir(exist_ok=True)
    job_path, out_path = tmp / f"{job.system}-job.json", tmp / f"{job.system}-result.json"
    write_json(job_path, asdict(job))
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, "-P", "-m", f"specdecode.bench.{module}", str(job_path), str(out_path)]
    proc = subprocess.run(cmd, env=env, check=False)
    if proc.returncode != 0 or not out_path.exists():
        raise BenchError(f"{job.system} exited with status {proc.returncode} (its error is above)")
    return SystemResult.from_json(json.loads(out_path.read_text(encoding="utf-8")))


def _print_correctness(c: correctness.Correctness) -> None:
    print()
    for m in c.mismatches:
        gap = f"{m.relative_gap:.2e}" if m.relative_gap is not None else "n/a"
        verdict = "near-tie" if m.near_tie else "MISMATCH"
        print(f"{m.system} c={m.concurrency} prompt {m.prompt_index} token {m.position}: {m.token}, {m.reference} "
              f"{m.reference_token}, top-2 relative gap {gap} → {verdict}")
    for conc, prompts in c.peer_batch_differs.items():
        print(f"(info) transformers' left-padded batch at c={conc} differs from its own c=1 on prompts {prompts}")
    for failure in c.failures:
        print(f"FAILURE: {failure}")
    if c.ok:
        print(f"outputs: every check passed ({len(c.mismatches)} proven near-ties)")


def _warn_if_busy(systems) -> None:
    for system in systems:
        cores = system.max_competing_cpu_cores
        if cores is not None and cores > BUSY_CORES:
            print(f"WARNING: other processes (or CPU steal) kept {cores:.2f} cores busy during a reported run of "
                  f"{system.system}: its timings are inflated; rerun on a quiet machine")


def _write_outputs(
    args: argparse.Namespace, job: Job, systems: list[System], results: dict[str, SystemResult],
    rows: list[report.Summary], checked: correctness.Correctness, truncation: Truncation | None,
) -> tuple[Path, ...]:
    out_dir: Path = args.output_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    parts = [Path(args.model).name or args.model, Path(args.prompts).stem, *[m for m in args.method if m != "none"]]
    slug = re.sub(r"[^A-Za-z0-9._-]+", "_", "-".join(parts))
    json_path, png_path = out_dir / f"bench-{slug}.json", out_dir / f"bench-{slug}.png"
    data = {
        "created": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "versions": _versions(results.values()),
        "machine": _machine(job.threads),
        "config": {k: _jsonable(v) for k, v in vars(args).items() if not callable(v)},
        "method": {
            "ours": "in-process LLMEngine, closed loop (c requests in flight), greedy, ignore_eos, prefix caching off",
            "ours_layouts": "<name>-pp<P>: rank 0 of P pipeline stages (one process each, cores ÷ P threads each, on "
                            "this one machine), its group started once per round and its engine reused across runs; "
                            "<name>-overlap / -no-overlap: overlap scheduling flipped from the default for the "
                            "layout (off in one process, on with stages); pipeline: per engine step, the verdict "
                            "message's bytes vs its budget, rank 0's wait for the verdicts (the bubble) and its own "
                            "stage forward",
            "transformers": "generate(): c=1 one prompt at a time; c>1 one left-padded batch per group of c; "
                            "greedy, KV cache on, eos_token_id=None; prompt-lookup and assisted at c=1 only "
                            "(transformers supports batch size 1 only there), same K, constant schedule",
            "tokens_per_s": "generated tokens / wall time of the run (prefill included)",
            "statistics": f"{job.runs} rounds, each running every system once (a fresh subprocess: one warm-up "
                          f"run, then one timed run per concurrency); absolute figures are the median over rounds of "
                          f"each run's p50, speedups the median over rounds of the ratio of tokens/s within the "
                          f"round; a timed run during which other processes used > {BUSY_CORES} cores is "
                          f"discarded and repeated (up to {job.busy_retries} times)",
            "acceptance": acceptance.__doc__.strip(),
            "load_control_on": args.load_control.model_dump(mode="json"),
        },
        "truncation": {**asdict(truncation), "note": truncation.note()} if truncation else None,
        "prompts": job.prompts,
        "plan": [asdict(s) for s in systems],
        "summary": [asdict(r) for r in rows],
        "correctness": checked.to_json(),
        "systems": {name: r.to_json() for name, r in results.items()},
    }
    write_json(json_path, data)
    title = f"{args.model}, {args.prompts}, {len(job.prompts)} prompts × {job.max_tokens} tokens, {job.threads} threads"
    report.plot_throughput(rows, png_path, title)
    curves = {f"{r.system} c={r.concurrency}": r.acceptance.per_position for r in rows if r.acceptance}
    if not curves:
        return json_path, png_path
    acc_path = out_dir / f"bench-{slug}-acceptance.png"
    acceptance.plot_per_position(curves, args.num_speculative_tokens, acc_path, title)
    return json_path, png_path, acc_path


def _jsonable(value: object) -> object:
    """An argument as the output JSON records it: paths as text, parsed configs as their JSON."""
    if isinstance(value, Path):
        return str(value)
    return value.model_dump(mode="json") if isinstance(value, BaseModel) else value


def _versions(results) -> dict[str, object]:
    versions: dict[str, object] = {k: v for r in results for k, v in r.versions.items()}
    try:
        versions["specdecode"] = metadata.version("specdecode")
    except metadata.PackageNotFoundError:  # run from source (scripts/gpu_check.sh): the commit below says which
        versions["specdecode"] = None
    versions["git_commit"] = git_output("rev-parse", "HEAD")
    status = git_output("status", "--porcelain")
    versions["git_dirty"] = None if status is None else bool(status)
    return versions


def git_output(*argv: str, root: Path = REPO_ROOT) -> str | None:
    """What ``git -C root ARGV`` prints; None where git is missing or fails."""
    try:
        proc = subprocess.run(["git", "-C", str(root), *argv], capture_output=True, text=True, check=False)
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
