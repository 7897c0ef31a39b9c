"""``specdecode bench-kernels``: each Triton kernel against its torch reference on one device.

For every case (a kernel at a batch size, K and vocabulary or row length) both paths run on the
same inputs; their outputs must be equal (probabilities are multiples of 2**-20, so no sum can
round differently on the two paths) and the time of each is the median of ``--repeats`` launches
after warm-up, synchronised. Prints a Markdown table, writes JSON and a bar plot of the speedups.
Triton compiles only for GPUs: on a CPU the command refuses unless ``TRITON_INTERPRET=1`` is set,
which checks the plumbing (the tests do) and times nothing worth reading.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from specdecode.kernels import ngram as kn
from specdecode.kernels import verify as kv

K = 4  # draft tokens per row, the benchmarks' default
VOCABS = {"smollm2": 49_152, "qwen2.5": 151_936}
BATCHES = (1, 8, 32, 128)
NGRAM_CASES = ((8, 1024), (32, 4096), (128, 8192))  # (rows, tokens per row)


@dataclass
class KernelTiming:
    kernel: str
    case: str  # e.g. "B=8 K=4 V=151936"
    triton_us: float
    reference_us: float

    @property
    def speedup(self) -> float:
        return self.reference_us / self.triton_us


def run(args: argparse.Namespace) -> int:
    device = _checked_device(args.device)
    if args.repeats < 1:
        raise SystemExit(f"bench-kernels: --repeats must be >= 1, got {args.repeats}")
    timings = measure(device, args.repeats, args.quick)
    print(format_table(timings, device))
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    json_path, png_path = out / f"kernels-{stamp}.json", out / f"kernels-{stamp}.png"
    json_path.write_text(json.dumps({"device": _device_name(device), "torch": torch.__version__,
                                     "triton": _triton_version(), "repeats": args.repeats,
                                     "timings": [asdict(t) | {"speedup": t.speedup} for t in timings]}, indent=2))
    plot_speedups(timings, png_path, f"Triton vs torch reference on {_device_name(device)}")
    print(f"wrote {json_path} and {png_path}")
    return 0


def _checked_device(name: str) -> torch.device:
    """The device to time on, or a one-line reason to stop (not a traceback from deep inside torch)."""
    try:
        device = torch.device(name)
    except RuntimeError:
        raise SystemExit(f"bench-kernels: --device {name!r} is not a device (e.g. cuda, cuda:1)") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench-kernels: no CUDA device here; the Triton kernels compile only for a GPU "
                         "(TRITON_INTERPRET=1 with --device cpu checks the plumbing)")
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("bench-kernels: Triton kernels compile only for a GPU; use --device cuda "
                         "(or TRITON_INTERPRET=1 to check the plumbing on a CPU)")
    if device.type not in ("cpu", "cuda"):
        raise SystemExit(f"bench-kernels: --device {name!r}: only cuda (or cpu under the interpreter)")
    return device


def measure(device: torch.device, repeats: int, quick: bool) -> list[KernelTiming]:
    vocabs = {"tiny": 64} if quick else VOCABS
    batches = (1, 4) if quick else BATCHES
    timings = []
    for name, vocab in vocabs.items():
        for batch in batches:
            case = f"B={batch} K={K} V={vocab} ({name})"
            for kernel, args in _verify_args(batch, vocab, device).items():
                timings.append(_time_both(kernel, case, getattr(kv, f"{_fn(kernel)}_triton"),
                                          getattr(kv, f"{_fn(kernel)}_reference"), args, device, repeats))
    for rows, length in ((2, 64),) if quick else NGRAM_CASES:
        tokens, lengths = _ngram_args(rows, length, device)
        timings.append(_time_both("ngram_propose", f"B={rows} L={length} n=1..4 k={K}", kn.ngram_propose_triton,
                                  kn.ngram_propose_reference, (tokens, lengths, 1, 4, K), device, repeats))
    return timings


def dyadic(probs: torch.Tensor) -> torch.Tensor:
    """Probabilities rounded to multiples of 2**-20: while a row sums to about 1, every partial sum
    is exact in fp32, so Triton and the reference cannot round a cumulative sum differently."""
    return (probs * 2.0**20).round() / 2.0**20


def _fn(kernel: str) -> str:
    return kernel.removesuffix("_one_hot")


def _verify_args(B: int, V: int, device: torch.device) -> dict[str, tuple]:
    """Inputs as the engine builds them: peaked target probabilities [B, K+1, V], drafts that are
    often the target's likeliest token, every row with K drafts."""
    gen = torch.Generator(device=device).manual_seed(B * 7919 + V)
    p = dyadic((4 * torch.randn(B, K + 1, V, generator=gen, device=device)).softmax(-1))
    q = dyadic((4 * torch.randn(B, K, V, generator=gen, device=device)).softmax(-1))
    argmax = p.argmax(-1)  # [B, K+1]
    wrong = torch.rand(B, K, generator=gen, device=device) < 0.3
    drafts = torch.where(wrong, (argmax[:, :K] + 1) % V, argmax[:, :K])  # [B, K]
    num = torch.full((B,), K, dtype=torch.long, device=device)
    sample_u = torch.rand(B, K + 1, generator=gen, device=device)
    accept_u = torch.rand(B, K, generator=gen, device=device)
    top_p = torch.full((B,), 0.9, device=device)
    return {
        "greedy_verify": (drafts, num, argmax),
        "target_match_verify": (drafts, num, p, sample_u),
        "rejection_verify": (drafts, num, p, q, accept_u, sample_u),
        "rejection_verify_one_hot": (drafts, num, p, None, accept_u, sample_u),
        "topp_verify": (drafts, num, p, top_p, sample_u),
    }


def _ngram_args(rows: int, length: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device=device).manual_seed(rows + length)
    tokens = torch.randint(0, 64, (rows, length), generator=gen, device=device)  # [B, L]: matches of every n
    return tokens, torch.full((rows,), length, dtype=torch.long, device=device)


def _time_both(kernel: str, case: str, triton_fn: Callable, reference_fn: Callable, args: tuple,
               device: torch.device, repeats: int) -> KernelTiming:
    got, want = triton_fn(*args), reference_fn(*args)
    for a, b in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
        if not torch.equal(a, b):
            raise AssertionError(f"{kernel} {case}: Triton and reference outputs differ")
    return KernelTiming(kernel, case, _median_us(triton_fn, args, device, repeats),
                        _median_us(reference_fn, args, device, repeats))


def _median_us(fn: Callable, args: tuple, device: torch.device, repeats: int) -> float:
    for _ in range(3):
        fn(*args)
    samples = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        fn(*args)
        _sync(device)
        samples.append((time.perf_counter() - start) * 1e6)
    return statistics.median(samples)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def format_table(timings: list[KernelTiming], device: torch.device) -> str:
    lines = [f"kernels on {_device_name(device)} (median µs per call, host to synchronised result)",
             "| kernel | case | Triton µs | torch reference µs | speedup |", "|---|---|---|---|---|"]
    lines += [f"| {t.kernel} | {t.case} | {t.triton_us:.1f} | {t.reference_us:.1f} | {t.speedup:.2f}× |"
              for t in timings]
    return "\n".join(lines)


def plot_speedups(timings: list[KernelTiming], path: Path, title: str) -> None:
    """One horizontal bar per (kernel, case): reference time ÷ Triton time, log scale."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9, 0.22 * len(timings) + 1.2), dpi=120)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    labels = [f"{t.kernel} {t.case}" for t in timings]
    bars = ax.barh(range(len(timings)), [t.speedup for t in timings])
    ax.bar_label(bars, fmt="%.1f×", fontsize=6)
    ax.set_yticks(range(len(timings)), labels, fontsize=6)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_xlabel("speedup of Triton over the torch reference (×)")
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path)


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (Triton interpreter)"


def _triton_version() -> str:
    import triton

    return triton.__version__
