"""``specdecode bench-step``: the engine's decode and verify steps, this checkout against a baseline.

A *case* is a batch size B, a context length L and K, the speculative tokens verified per sequence
per step: K = 0 is plain decode (one row per sequence per step); K = 4 is the n-gram proposer on
prompts that repeat a random pattern, so drafts exist and a step verifies up to 5 rows per
sequence (the rows actually verified are reported). Per case the *worker* (``worker_main``, this
file run as a script) prefills B prompts of L tokens, steps a few times to warm up, then times
``--steps`` steps (ms per step, tokens emitted per second) and profiles two more: the bytes that
copying ops (``COPY_OPS``) called inside ``paged_attention`` allocate per step, found through the
profiler's Python stacks, so neither version is patched. Two more steps are counted under torch's
function and dispatch modes: *syncs*, the Tensor→Python conversions (``SYNCS``) and the aten ops
whose output size depends on data (``SYNCING_OPS``, boolean-mask indexing) — each a host↔device
sync on an accelerator, counted on the CPU by the same calls (host-built tensors read back count
too) —, *uploads*, the host→device copies (``torch.tensor``/``as_tensor`` given a device, a
non-blocking ``.to``), and *ops*, the aten ops dispatched (each a kernel launch or more on an
accelerator). A step whose syncs or ops grow with the batch loops per
sequence in Python.

The worker imports nothing of the bench package and only engine APIs older checkouts have too, so
the same file runs under the baseline's interpreter (``--baseline DIR``: ``DIR/.venv/bin/python``)
against the baseline's code. Each worker run loads the model once and runs every case. The two
checkouts alternate, round by round (this first in odd rounds); a case's ratio is the median of its
per-round ratios this ÷ baseline of ms per step, so a drift in the machine's speed hits both alike.
Prints a Markdown table, writes JSON and a bar plot under ``--output-dir``.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

THIS, BASELINE = "this", "baseline"
WARMUP_STEPS = 2  # untimed steps after the prefill
PROFILE_STEPS = 2  # profiled after the timed steps
PATTERN = 64  # prompt tokens repeated (at most), so n-gram drafts exist and are accepted
PREFILL_BUDGET = 8192  # tokens per step while prefilling (fewer prefill steps: less drift in context)
SCOPE = "paged_attention"  # the function whose copies are counted
COPY_OPS = frozenset({"aten::index_select", "aten::index", "aten::gather", "aten::cat", "aten::stack",
                      "aten::contiguous", "aten::clone", "aten::copy_", "aten::_to_copy", "aten::repeat"})
SYNCS = frozenset({"item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__"})  # and .to(cpu)
SYNCING_OPS = frozenset({"aten::nonzero", "aten::masked_select", "aten::unique_dim", "aten::_unique2"})
COUNTED = (f"bytes allocated per step by {', '.join(sorted(op.removeprefix('aten::') for op in COPY_OPS))} "
           f"called inside {SCOPE} (each op with what it calls; profiler, {PROFILE_STEPS} steps)")


@dataclass(frozen=True)
class Case:
    batch: int
    context: int
    k: int

    @property
    def label(self) -> str:
        return f"B={self.batch} L={self.context} K={self.k}"


@dataclass(frozen=True)
class Checkout:
    name: str  # THIS or BASELINE
    python: str
    root: Path


# -- the parent: rounds of workers, the summary --------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--baseline", metavar="DIR", default=None,
                        help="a worktree of the repo with its own DIR/.venv: time it too, round by round")
    parser.add_argument("--model", default="smollm2-135m", help="GGUF file, Hugging Face folder or alias")
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda")
    parser.add_argument("--dtype", default="auto", help="auto, float32, bfloat16 or float16")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--context", type=int, nargs="+", default=[256, 1024, 4096], help="prompt tokens per sequence")
    parser.add_argument("--k", type=int, nargs="+", default=[0, 4], help="speculative tokens per sequence (0: decode)")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per case")
    parser.add_argument("--rounds", type=int, default=3, help="worker runs per checkout, interleaved")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads per worker (default 1: on a shared CPU, threads wait for each other)")
    parser.add_argument("--weight-cache-dir", default=None, help="dequantized weights cache (default: the runtime's)")
    parser.add_argument("--load-format", choices=["auto", "dummy"], default="auto",
                        help="dummy: random weights of the model's config (a baseline must know the flag too)")
    parser.add_argument("--graphs", choices=["off", "buckets", "cuda"], default="off",
                        help="buckets: decode/verify steps padded to batch buckets; cuda: and replayed as CUDA graphs "
                             "(a baseline must know the flag too)")
    parser.add_argument("--output-dir", default="bench-results")


def run(args: argparse.Namespace) -> int:
    checkouts = [Checkout(THIS, sys.executable, Path(__file__).resolve().parents[1])]
    if args.baseline is not None:
        checkouts.insert(0, _baseline(Path(args.baseline)))
    cases = _cases(args)
    rounds: dict[str, list[dict]] = {c.name: [] for c in checkouts}
    with tempfile.TemporaryDirectory(prefix="specdecode-bench-step-") as tmp:
        for number in range(1, args.rounds + 1):
            for checkout in checkouts[::-1] if number % 2 else checkouts:  # this first in odd rounds
                print(f"bench-step: round {number}/{args.rounds}, {checkout.name} ({checkout.root})",
                      file=sys.stderr, flush=True)
                result = Path(tmp) / f"{checkout.name}-{number}.json"
                rounds[checkout.name].append(_run_worker(checkout, cases, args, result))
    report = build_report(args, checkouts, cases, rounds)
    print(format_table(report))
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    json_path, png_path = out / f"step-{stamp}.json", out / f"step-{stamp}.png"
    json_path.write_text(json.dumps(report, indent=2))
    plot_steps(report, png_path)
    print(f"wrote {json_path} and {png_path}")
    return 0


def _baseline(root: Path) -> Checkout:
    python = root / ".venv" / "bin" / "python"
    if not python.exists():
        raise SystemExit(f"bench-step: --baseline {root}: no {python} (a worktree with its own virtual environment)")
    return Checkout(BASELINE, str(python), root.resolve())


def _cases(args: argparse.Namespace) -> list[Case]:
    checks = {"--batch": all(b >= 1 for b in args.batch), "--context": all(c >= 2 for c in args.context),
              "--k": all(0 <= k <= 16 for k in args.k), "--steps": args.steps >= 1, "--rounds": args.rounds >= 1,
              "--threads": args.threads >= 1}
    bad = [flag for flag, ok in checks.items() if not ok]
    if bad:
        raise SystemExit(f"bench-step: {bad[0]} out of range "
                         "(batch ≥ 1, context ≥ 2, 0 ≤ k ≤ 16, steps, rounds and threads ≥ 1)")
    return [Case(b, c, k) for b in args.batch for c in args.context for k in args.k]


def _run_worker(checkout: Checkout, cases: list[Case], args: argparse.Namespace, out: Path) -> dict:
    """Every case in one fresh interpreter of ``checkout`` (one model load); its result JSON."""
    argv = [checkout.python, "-P", __file__, "--out", str(out), "--model", args.model, "--device", args.device,
            "--dtype", args.dtype, "--steps", str(args.steps), "--threads", str(args.threads),
            "--cases", json.dumps([c.__dict__ for c in cases])]
    argv += ["--weight-cache-dir", args.weight_cache_dir] if args.weight_cache_dir else []
    argv += ["--load-format", args.load_format] if args.load_format != "auto" else []
    argv += ["--graphs", args.graphs] if args.graphs != "off" else []
    proc = subprocess.run(argv, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"}, check=False)
    if proc.returncode != 0 or not out.exists():
        raise SystemExit(f"bench-step: the {checkout.name} worker exited with status {proc.returncode} "
                         "(its error is above)")
    return json.loads(out.read_text())


def build_report(args: argparse.Namespace, checkouts: list[Checkout], cases: list[Case],
                 rounds: dict[str, list[dict]]) -> dict:
    """Per case and checkout the medians over rounds and every round; with a baseline, the median
    of the per-round ratios this ÷ baseline of ms per step."""
    first = {name: runs[0] for name, runs in rounds.items()}
    rows = []
    for i, case in enumerate(cases):
        row: dict = {"case": case.label, **case.__dict__}
        for name, runs in rounds.items():
            per_round = [run["cases"][i] for run in runs]  # the worker keeps the order of the cases
            row[name] = {metric: statistics.median(r[metric] for r in per_round) for metric in MEDIANS}
            row[name]["rounds"] = per_round
        if BASELINE in rounds:
            ratios = [t["ms_per_step"] / b["ms_per_step"] for t, b in zip(row[THIS]["rounds"], row[BASELINE]["rounds"])]
            row["ratio_ms_per_step"] = statistics.median(ratios)
        rows.append(row)
    return {
        "model": args.model, "load_format": args.load_format, "graphs": args.graphs, "steps": args.steps,
        "rounds": args.rounds, "threads": args.threads, "device": first[THIS]["device"], "device_name": first[THIS]["device_name"], "dtype": first[THIS]["dtype"],
        "attention_bytes_counted": COUNTED,
        "checkouts": {c.name: {"root": str(c.root), "python": c.python, **_git_state(c.root),
                               **{k: first[c.name][k] for k in ("torch", "attention_module", "device", "dtype")}}
                      for c in checkouts},
        "cases": rows,
    }


COUNTS = ("syncs", "uploads", "ops")  # per step, by _step_counts
MEDIANS = ("ms_per_step", "tokens_per_s", "rows_per_step", "attention_copied_bytes_per_step",
           "attention_largest_copy_bytes", "syncs_per_step", "uploads_per_step", "ops_per_step")


def _git_state(root: Path) -> dict[str, object]:
    """The checkout's commit and whether its work tree differs from it (None: not known)."""
    from specdecode.bench.command import git_output

    status = git_output("status", "--porcelain", root=root)
    return {"git_commit": git_output("rev-parse", "HEAD", root=root),
            "git_dirty": None if status is None else bool(status)}


def format_table(report: dict) -> str:
    names = list(report["checkouts"])  # baseline first, when there is one
    both = len(names) == 2
    weights = " (dummy weights)" if report.get("load_format") == "dummy" else ""
    weights += {"buckets": ", batch buckets", "cuda": ", CUDA graphs"}.get(report.get("graphs", "off"), "")
    head = [f"bench-step: {report['model']}{weights} on {report['device_name']} ({report['dtype']}, {report['threads']} "
            f"thread(s)), {report['steps']} timed steps, medians over {report['rounds']} round(s)"
            + ("; ratio = median of per-round this ÷ baseline ms/step" if both else ""),
            f"attention bytes copied = {report['attention_bytes_counted']}"]
    cols = ["case", "rows/step"] + [f"{n} ms/step" for n in names] + (["ratio"] if both else []) \
        + [f"{n} tok/s" for n in names] + [f"{n} attn copied/step" for n in names] \
        + [f"{n} largest copy" for n in names] + [f"{n} {what}/step" for what in COUNTS for n in names]
    lines = head + ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for row in report["cases"]:
        cells = [row["case"], " / ".join(f"{row[n]['rows_per_step']:.1f}" for n in names)]
        cells += [f"{row[n]['ms_per_step']:.1f}" for n in names]
        cells += [f"{row['ratio_ms_per_step']:.2f}×"] if both else []
        cells += [f"{row[n]['tokens_per_s']:.1f}" for n in names]
        cells += [_bytes(row[n]["attention_copied_bytes_per_step"]) for n in names]
        cells += [_bytes(row[n]["attention_largest_copy_bytes"]) for n in names]
        cells += [f"{row[n][f'{what}_per_step']:.0f}" for what in COUNTS for n in names]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _bytes(n: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"


def plot_steps(report: dict, path: Path) -> None:
    """Per case, one bar per checkout: ms per step (left) and attention MB copied per step (right)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    rows, names = report["cases"], list(report["checkouts"])
    fig = Figure(figsize=(11, 0.35 * len(rows) * len(names) + 1.5), dpi=120)
    FigureCanvasAgg(fig)
    height = 0.8 / len(names)
    panels = (("ms_per_step", 1.0, "ms per step"),
              ("attention_copied_bytes_per_step", 1e-6, "attention MB copied per step"))
    for ax, (metric, scale, label) in zip(fig.subplots(1, 2, sharey=True), panels):
        for j, name in enumerate(names):
            bars = ax.barh([i + j * height for i in range(len(rows))], [r[name][metric] * scale for r in rows],
                           height, label=name)
            ax.bar_label(bars, fmt="%.1f", fontsize=6)
        ax.set_xlabel(label)
    ax0 = fig.axes[0]
    ax0.set_yticks([i + height * (len(names) - 1) / 2 for i in range(len(rows))], [r["case"] for r in rows], fontsize=7)
    ax0.invert_yaxis()
    ax0.legend(fontsize=7)
    fig.suptitle(f"engine steps: {report['model']} on {report['device_name']} ({report['dtype']})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path)


# -- the worker: this file run as a script, by either checkout's interpreter ---------------------


def worker_main(argv: list[str]) -> int:
    import torch

    from specdecode.runtime.config import LoadConfig
    from specdecode.runtime.models import attention
    from specdecode.runtime.models.loader import load_model

    parser = argparse.ArgumentParser(prog="bench-step worker")
    for flag in ("--out", "--model", "--device", "--dtype", "--cases"):
        parser.add_argument(flag, required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--threads", type=int, required=True)
    parser.add_argument("--weight-cache-dir", default=None)
    parser.add_argument("--load-format", default=None)
    parser.add_argument("--graphs", default="off")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    load = {"weight_cache_dir": args.weight_cache_dir} if args.weight_cache_dir else {}
    load |= {"load_format": args.load_format} if args.load_format else {}
    loaded = load_model(LoadConfig(model=args.model, device=args.device, dtype=args.dtype, **load))
    cases = [Case(**c) for c in json.loads(args.cases)]
    results = [measure_case(loaded, case, args.steps, args.graphs) for case in cases]
    device = loaded.device
    Path(args.out).write_text(json.dumps({
        "device": str(device), "dtype": str(loaded.dtype).removeprefix("torch."), "torch": torch.__version__,
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU",
        "attention_module": attention.__file__, "cases": results,
    }))
    return 0


def measure_case(loaded, case: Case, steps: int, graphs: str = "off") -> dict:
    """Prefill ``case.batch`` prompts, warm up, time ``steps`` steps, profile ``PROFILE_STEPS`` more."""
    import gc

    import torch

    engine, max_tokens = _engine(loaded, case, steps, graphs)
    running = engine.scheduler.running
    for _ in range(math.ceil(case.batch * case.context / PREFILL_BUDGET) + case.batch + 1):
        if len(running) == case.batch and all(s.num_output_tokens >= 1 for s in running):
            break
        engine.step()
    else:
        raise RuntimeError(f"{case.label}: the prompts were not all prefilled (preempted? too few KV blocks?)")
    for _ in range(WARMUP_STEPS):
        engine.step()
    context_at_start = statistics.mean(len(s) for s in running)
    emitted, drafts = sum(s.num_output_tokens for s in running), _draft_tokens(engine)
    _sync(loaded.device)
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    _sync(loaded.device)
    seconds = time.perf_counter() - start
    emitted, drafts = sum(s.num_output_tokens for s in running) - emitted, _draft_tokens(engine) - drafts
    copied, largest, by_op = _attention_copies(engine)
    counts = _step_counts(engine)
    if len(running) != case.batch or any(s.num_output_tokens >= max_tokens for s in running):
        raise RuntimeError(f"{case.label}: a sequence stopped while measured")
    del engine
    gc.collect()
    if loaded.device.type == "cuda":
        torch.cuda.empty_cache()
    return {**case.__dict__, "ms_per_step": 1000 * seconds / steps, "tokens_per_s": emitted / seconds,
            "rows_per_step": case.batch + drafts / steps, "context_at_start": context_at_start,
            "attention_copied_bytes_per_step": copied, "attention_largest_copy_bytes": largest,
            "attention_copied_bytes_by_op": by_op, **counts}


def _engine(loaded, case: Case, steps: int, graphs: str = "off"):
    """An engine with ``case.batch`` greedy requests added: prompts repeating a random pattern, room
    for every token the prefill, warm-up, timed and profiled steps can emit (K + 1 a step)."""
    import torch

    from specdecode.runtime.config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig
    from specdecode.runtime.engine.llm_engine import LLMEngine
    from specdecode.runtime.engine.sequence import SamplingParams

    prefill_steps = math.ceil(case.batch * case.context / PREFILL_BUDGET) + 1
    max_tokens = (prefill_steps + WARMUP_STEPS + steps + 2 * PROFILE_STEPS + 2) * (case.k + 1)
    max_model_len = case.context + max_tokens + case.k + 2
    if max_model_len > loaded.max_model_len:
        raise SystemExit(f"bench-step: {case.label} needs {max_model_len} positions; "
                         f"the model has {loaded.max_model_len}")
    block_size = 16
    blocks = case.batch * (math.ceil(max_model_len / block_size) + 1) + 4
    speculative = SpeculativeConfig(method="ngram", num_speculative_tokens=case.k) if case.k else SpeculativeConfig()
    shapes = {}
    if graphs != "off":  # only then: a baseline from before batch buckets has no GraphConfig
        from specdecode.runtime.config import GraphConfig

        shapes["graphs"] = GraphConfig(cuda_graphs=graphs == "cuda", batch_buckets=True)
    cfg = EngineConfig(cache=CacheConfig(block_size=block_size, num_blocks=blocks, enable_prefix_caching=False),
                       scheduler=SchedulerConfig(max_num_seqs=case.batch, max_num_batched_tokens=PREFILL_BUDGET),
                       speculative=speculative, **shapes)
    engine = LLMEngine(loaded.model, loaded.tokenizer, cfg, max_model_len, loaded.device, loaded.dtype)
    gen = torch.Generator().manual_seed(case.batch * 100_003 + case.context)
    period = max(1, min(PATTERN, case.context // 4))  # four repeats or more: the model copies them
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i in range(case.batch):
        pattern = torch.randint(0, loaded.config.vocab_size, (period,), generator=gen).tolist()
        engine.add_request(f"step-{i}", (pattern * math.ceil(case.context / period))[: case.context], params)
    return engine, max_tokens


def _draft_tokens(engine) -> int:
    return engine.stats().spec_decode_num_draft_tokens


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _attention_copies(engine) -> tuple[float, float, dict[str, float]]:
    """Bytes per step that ``COPY_OPS`` allocate (net of what they free, host and device) when
    called inside ``paged_attention``, over ``PROFILE_STEPS`` steps; the most one call allocated
    (a whole batch's KV gathered at once, or a buffer that stays in cache); by op name."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, with_stack=True) as prof:
        for _ in range(PROFILE_STEPS):
            engine.step()
    scopes = [e for e in prof.events() if e.name.endswith(f": {SCOPE}") and "attention.py(" in e.name]
    if not scopes:
        raise RuntimeError(f"the profiler saw no call of {SCOPE} in models/attention.py")
    by_op: dict[str, float] = {}
    largest = 0.0
    stack = [child for scope in scopes for child in scope.cpu_children]
    while stack:
        event = stack.pop()
        if event.name in COPY_OPS:
            allocated = event.cpu_memory_usage + getattr(event, "device_memory_usage", 0)
            by_op[event.name] = by_op.get(event.name, 0.0) + max(0, allocated) / PROFILE_STEPS
            largest = max(largest, allocated)
        else:
            stack.extend(event.cpu_children)
    return sum(by_op.values()), largest, by_op



def _step_counts(engine) -> dict[str, float]:
    """``counting``'s counts per step, over ``PROFILE_STEPS`` steps."""
    with counting() as counts:
        for _ in range(PROFILE_STEPS):
            engine.step()
    return {f"{name}_per_step": count / PROFILE_STEPS for name, count in counts.items()}


@contextlib.contextmanager
def counting() -> Iterator[dict[str, int]]:
    """Count what the block does (module docstring): syncs (``SYNCS``, a blocking ``.to`` a CPU
    device, ``SYNCING_OPS``, indexing by a boolean mask), uploads and aten ops dispatched. Blocks
    nest, each counting what runs inside it. The tests count steps with it too."""
    import torch
    from torch.overrides import TorchFunctionMode
    from torch.utils._python_dispatch import TorchDispatchMode

    counts = {"syncs": 0, "uploads": 0, "ops": 0}

    class Calls(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            name = getattr(func, "__name__", "")
            blocking_to_cpu = name == "to" and not kwargs.get("non_blocking") and any(
                str(a).startswith("cpu") for a in (*args[1:], kwargs.get("device")))
            counts["syncs"] += name in SYNCS or blocking_to_cpu
            counts["uploads"] += (name in ("tensor", "as_tensor") and "device" in kwargs) or (
                name == "to" and bool(kwargs.get("non_blocking")))
            return func(*args, **kwargs)

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            counts["ops"] += 1
            masked = func.name() == "aten::index.Tensor" and any(
                getattr(i, "dtype", None) == torch.bool for i in args[1])
            counts["syncs"] += masked or func._schema.name in SYNCING_OPS
            return func(*args, **(kwargs or {}))

    with Calls(), Ops():
        yield counts


if __name__ == "__main__":
    sys.exit(worker_main(sys.argv[1:]))
