"""``specdecode bench-grammar``: grammar-aware drafting on schema-shaped requests, off against on.

A *request* is one of the built-in chat prompts asking for JSON (``data/schema_requests.json``:
long keys, enums, nested objects, arrays of objects, forced tool calls), constrained by its JSON
schema or lark grammar. A *configuration* is a speculative method with grammar drafting off or on
(``SpeculativeConfig.grammar_drafts``: the tokens the grammar forces next are drafted before the
proposer's own; with method none they alone are). One process loads the model once and builds one
engine per configuration (prefix caching off, so a round never reuses an earlier round's prompt
KV); each *round* runs every configuration over the set, one request at a time (concurrency 1),
greedy, the configurations' order rotated per round so a drift in the machine's speed hits all
alike. Each engine first compiles every constraint and runs one short untimed request.

Per configuration and round: *tokens/s* = emitted tokens ÷ wall time (prefill included),
*tokens/step* = emitted tokens ÷ target steps (engine steps while a request ran: each runs the
target once), *acceptance* = accepted ÷ draft tokens (``acceptance.py``, pooled over rounds). The
key figure per method, *on/off*, is the median over rounds of the per-round ratio of tokens/s with
grammar drafting to without. Greedy outputs must equal, in every configuration and round, the
reference's (the first configuration: method none without grammar drafting by default); a
mismatch is printed and the exit status is 1 (2: bad arguments or a model that cannot be loaded).
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import re
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from specdecode.bench import acceptance
from specdecode.bench.command import git_output
from specdecode.bench.ours import encode_prompts
from specdecode.bench.records import write_json
from specdecode.runtime.config import CacheConfig, EngineConfig, LoadConfig, SchedulerConfig, SpeculativeConfig
from specdecode.runtime.engine.grammar import StructuredKind, StructuredOutput
from specdecode.runtime.engine.llm_engine import LLMEngine
from specdecode.runtime.engine.sequence import SamplingParams, SpecCounts
from specdecode.runtime.models.loader import LoadedModel, load_model

REQUESTS_FILE = Path(__file__).resolve().parent / "data" / "schema_requests.json"
METHODS = ("none", "ngram", "draft", "mtp")  # not suffix: its cache would carry one round's outputs into the next
QUICK = {"num_requests": 2, "rounds": 1, "max_tokens": 16}
WARMUP_TOKENS = 8
BLOCK_SIZE = 16


@dataclass(frozen=True)
class SchemaRequest:
    name: str
    prompt: str  # one user message
    structured: StructuredOutput


@dataclass(frozen=True)
class Setting:
    """One configuration: a method, grammar drafting off or on."""

    method: str
    grammar_drafts: bool

    @property
    def label(self) -> str:
        return self.method + ("+grammar" if self.grammar_drafts else "")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2-135m", help="alias, GGUF file or HF folder")
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=None,
                        help="each runs with grammar drafting off and on [none ngram, and draft with --draft-model]; "
                             "outputs are checked against the first one's without grammar drafting")
    parser.add_argument("--draft-model", default=None, help="draft: alias, GGUF file or HF folder")
    parser.add_argument("--mtp-path", default=None, help="mtp: folder of the MTP head(s); unset = the model's own")
    parser.add_argument("--num-speculative-tokens", type=int, default=4, help="K of every method but none")
    parser.add_argument("--max-grammar-drafts", type=int, default=SpeculativeConfig().max_grammar_drafts,
                        help="forced drafts per step at most (method none's K)")
    parser.add_argument("--rounds", type=int, default=3, help="each runs every configuration over the set, interleaved")
    parser.add_argument("--max-tokens", type=int, default=96, help="per request (the grammar may end it sooner)")
    parser.add_argument("--num-requests", type=int, default=None, help="the first N built-in requests [all]")
    parser.add_argument("--quick", action="store_true",
                        help=f"a plumbing check: {QUICK['num_requests']} requests, {QUICK['rounds']} round, "
                             f"{QUICK['max_tokens']} tokens")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (default 1: on a shared CPU, threads wait for each other)")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    parser.add_argument("--output-dir", type=Path, default=Path("bench-results"))


def run(args: argparse.Namespace) -> int:
    if args.quick:  # overrides the three flags, and the report records the values that ran
        args.num_requests, args.rounds, args.max_tokens = QUICK["num_requests"], QUICK["rounds"], QUICK["max_tokens"]
    if min(args.rounds, args.max_tokens, args.threads, 1 if args.num_requests is None else args.num_requests) < 1:
        print("bench-grammar: --rounds, --max-tokens, --threads and --num-requests must be >= 1", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    try:
        methods = args.methods or ["none", "ngram", *(["draft"] if args.draft_model else [])]
        speculative = {s: speculative_config(s, args) for s in build_settings(methods)}
        requests = load_requests(args.num_requests)
        load = LoadConfig(model=args.model, device=args.device, dtype=args.dtype)
        loaded = load_model(load)
    except (FileNotFoundError, ValueError) as exc:  # a missing model; pydantic's ValidationError is a ValueError
        print(f"bench-grammar: {exc}", file=sys.stderr)
        return 2
    runs = measure(loaded, load, requests, speculative, args.rounds, args.max_tokens)
    report = build_report(args, loaded, requests, speculative, runs)
    print(format_table(report))
    for m in report["mismatches"]:
        print(f"MISMATCH: {m['config']} round {m['round']} {m['request']} token {m['position']}: "
              f"{m['token']}, reference {m['reference_token']}")
    if not report["mismatches"]:
        print(f"\noutputs: every configuration's equal the reference's ({report['reference']}) in every round")
    paths = write_outputs(report, args.output_dir)
    print(f"wrote {', '.join(map(str, paths))}")
    return 0 if not report["mismatches"] else 1


def build_settings(methods: list[str]) -> list[Setting]:
    """Each method (once, in order) off then on: the first is the outputs' reference."""
    return [Setting(m, on) for m in dict.fromkeys(methods) for on in (False, True)]


def speculative_config(setting: Setting, args: argparse.Namespace) -> SpeculativeConfig:
    extra = {"draft": {"draft_model": args.draft_model}, "mtp": {"mtp_path": args.mtp_path}}.get(setting.method, {})
    return SpeculativeConfig(method=setting.method, num_speculative_tokens=args.num_speculative_tokens,
                             grammar_drafts=setting.grammar_drafts, max_grammar_drafts=args.max_grammar_drafts, **extra)


def load_requests(limit: int | None = None) -> list[SchemaRequest]:
    """The built-in requests (the first ``limit``): a JSON schema (``json_schema``) or lark grammar each."""
    rows = json.loads(REQUESTS_FILE.read_text(encoding="utf-8"))[:limit]
    return [SchemaRequest(r["name"], r["prompt"],
                          StructuredOutput(StructuredKind.JSON, json.dumps(r["json_schema"])) if "json_schema" in r
                          else StructuredOutput(StructuredKind.LARK, r["lark"]))
            for r in rows]


# -- measuring: one model, one engine per configuration, rounds interleaved ----------------------


def measure(loaded: LoadedModel, load: LoadConfig, requests: list[SchemaRequest],
            speculative: dict[Setting, SpeculativeConfig], rounds: int, max_tokens: int) -> dict[Setting, list[dict]]:
    """Per configuration, one record per round (``run_set``), in round order."""
    prompts = encode_prompts(loaded.tokenizer, [[{"role": "user", "content": r.prompt}] for r in requests])
    params = [SamplingParams(max_tokens=max_tokens, temperature=0.0, structured=r.structured) for r in requests]
    longest = max(map(len, prompts)) + max_tokens
    engines = {s: _warm_engine(loaded, load, cfg, longest, prompts, params) for s, cfg in speculative.items()}
    runs: dict[Setting, list[dict]] = {s: [] for s in speculative}
    settings = list(speculative)
    for number in range(1, rounds + 1):
        shift = (number - 1) % len(settings)
        for setting in settings[shift:] + settings[:shift]:
            print(f"bench-grammar: round {number}/{rounds}, {setting.label}", file=sys.stderr, flush=True)
            runs[setting].append({"round": number, **run_set(engines[setting], [r.name for r in requests], prompts,
                                                             params)})
    return runs


def _warm_engine(loaded: LoadedModel, load: LoadConfig, speculative: SpeculativeConfig, longest: int,
                 prompts: list[list[int]], params: list[SamplingParams]) -> LLMEngine:
    """An engine with room for one request (the longest prompt, max-tokens and K + 1 more), every
    constraint compiled and one short request run, so round 1 times no start-up work."""
    max_model_len = min(longest + speculative.max_drafts + 1, loaded.max_model_len)
    cfg = EngineConfig(load=load, speculative=speculative,
                       cache=CacheConfig(block_size=BLOCK_SIZE, num_blocks=math.ceil(max_model_len / BLOCK_SIZE) + 1,
                                         enable_prefix_caching=False),
                       scheduler=SchedulerConfig(max_num_seqs=1))
    engine = LLMEngine(loaded.model, loaded.tokenizer, cfg, max_model_len, loaded.device, loaded.dtype)
    for p in params:
        engine.grammars.compile(p.structured)
    warm = SamplingParams(max_tokens=WARMUP_TOKENS, temperature=0.0, structured=params[0].structured)
    _run_request(engine, "warm-up", prompts[0], warm)
    return engine


def run_set(engine: LLMEngine, names: list[str], prompts: list[list[int]], params: list[SamplingParams]) -> dict:
    """The requests one at a time: totals, and per request its tokens, finish reason, steps and time."""
    per_request = [{"name": name, **_run_request(engine, name, prompt, p)}
                   for name, prompt, p in zip(names, prompts, params)]
    spec = SpecCounts()
    for r in per_request:
        spec.record_counts(SpecCounts(**r["spec"]))
    tokens, steps = sum(len(r["token_ids"]) for r in per_request), sum(r["steps"] for r in per_request)
    wall = sum(r["wall_s"] for r in per_request)
    return {"wall_s": wall, "tokens": tokens, "steps": steps, "tokens_per_s": tokens / wall,
            "tokens_per_step": tokens / steps, "spec": asdict(spec), "requests": per_request}


def _run_request(engine: LLMEngine, request_id: str, prompt: list[int], params: SamplingParams) -> dict:
    """One request to its end: its tokens, finish reason ("stop": the grammar completed), target
    steps (every ``step()`` runs the target once: the request is alone), wall time and counts."""
    token_ids: list[int] = []
    finish, steps, spec = None, 0, SpecCounts()
    start = time.perf_counter()
    engine.add_request(request_id, prompt, params)
    while engine.has_unfinished():
        steps += 1
        for out in engine.step():
            spec = out.spec
            for delta in out.deltas:
                token_ids += delta.token_ids
                finish = delta.finish_reason or finish
    wall = time.perf_counter() - start
    return {"token_ids": token_ids, "finish_reason": finish and finish.value, "steps": steps, "wall_s": wall,
            "spec": asdict(spec)}


# -- the report: summary, identity check, table, files -------------------------------------------


def check_outputs(configs: list[dict]) -> list[dict]:
    """Where a configuration's greedy output (any round) differs from the reference's (the first
    configuration, round 1): the first differing token of each such request; ``token`` or
    ``reference_token`` is None where one output is a prefix of the other."""
    reference = [r["token_ids"] for r in configs[0]["rounds"][0]["requests"]]
    mismatches = []
    for config in configs:
        for round_ in config["rounds"]:
            for ref, req in zip(reference, round_["requests"]):
                got = req["token_ids"]
                if got != ref:
                    at = next((i for i, (a, b) in enumerate(zip(ref, got)) if a != b), min(len(ref), len(got)))
                    mismatches.append({"config": config["label"], "round": round_["round"], "request": req["name"],
                                       "position": at, "reference_token": ref[at] if at < len(ref) else None,
                                       "token": got[at] if at < len(got) else None})
    return mismatches


def build_report(args: argparse.Namespace, loaded: LoadedModel, requests: list[SchemaRequest],
                 speculative: dict[Setting, SpeculativeConfig], runs: dict[Setting, list[dict]]) -> dict:
    configs = [_summarize(s, cfg.max_drafts, runs[s]) for s, cfg in speculative.items()]
    return {
        "created": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "git_commit": git_output("rev-parse", "HEAD"), "torch": torch.__version__,
        "model": args.model, "device": str(loaded.device), "dtype": str(loaded.dtype).removeprefix("torch."),
        "threads": torch.get_num_threads(), "max_tokens": args.max_tokens, "rounds": args.rounds,
        "num_speculative_tokens": args.num_speculative_tokens, "max_grammar_drafts": args.max_grammar_drafts,
        "method": __doc__.strip(),
        "requests": [{"name": r.name, "prompt": r.prompt, "kind": r.structured.kind.value} for r in requests],
        "reference": configs[0]["label"],
        "configs": configs,
        "on_off": [_on_off(configs, method) for method in dict.fromkeys(c["method"] for c in configs)],
        "mismatches": check_outputs(configs),
    }


def _summarize(setting: Setting, k: int, rounds: list[dict]) -> dict:
    """Medians over rounds; acceptance pooled over them; outputs the grammar completed (finish "stop")."""
    pooled = acceptance.summarize([SpecCounts(**r["spec"]) for r in rounds])
    return {"label": setting.label, "method": setting.method, "grammar_drafts": setting.grammar_drafts, "k": k,
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in rounds),
            "tokens_per_step": statistics.median(r["tokens_per_step"] for r in rounds),
            "acceptance": asdict(pooled),
            "complete": sum(q["finish_reason"] == "stop" for q in rounds[0]["requests"]),
            "rounds": rounds}


def _on_off(configs: list[dict], method: str) -> dict:
    """Per round, tokens/s and tokens/step with grammar drafting ÷ without; their medians."""
    off, on = (next(c for c in configs if c["method"] == method and c["grammar_drafts"] is g) for g in (False, True))
    ratios = {metric: [b[metric] / a[metric] for a, b in zip(off["rounds"], on["rounds"])]
              for metric in ("tokens_per_s", "tokens_per_step")}
    return {"method": method, "tokens_per_s": statistics.median(ratios["tokens_per_s"]),
            "tokens_per_step": statistics.median(ratios["tokens_per_step"]), "rounds": ratios}


def format_table(report: dict) -> str:
    """A Markdown table: one row per configuration; on/off (the key column) on each method's "on" row."""
    on_off = {o["method"]: o for o in report["on_off"]}
    head = [f"bench-grammar: {report['model']} on {report['device']} ({report['dtype']}, {report['threads']} "
            f"thread(s)), {len(report['requests'])} requests × ≤ {report['max_tokens']} tokens, concurrency 1, "
            f"greedy; medians over {report['rounds']} round(s); on/off = median of per-round tokens/s ratios",
            "", "| method | grammar drafts | tokens/s | tokens/step | accept rate | accepted at position 1.. | "
                "complete | on/off tokens/s |", "|---|---|---|---|---|---|---|---|"]
    for c in report["configs"]:
        acc, ratio = c["acceptance"], on_off[c["method"]]["rounds"]["tokens_per_s"]
        key = ""
        if c["grammar_drafts"]:
            key = f"**{on_off[c['method']]['tokens_per_s']:.2f}×**"
            key += f" ({min(ratio):.2f}–{max(ratio):.2f})" if len(ratio) > 1 else ""
        cells = [c["method"], "on" if c["grammar_drafts"] else "off", f"{c['tokens_per_s']:.1f}",
                 f"{c['tokens_per_step']:.2f}", "" if acc["rate"] is None else f"{acc['rate']:.2f}",
                 acceptance.format_per_position(acc["per_position"], c["k"]) if acc["num_drafts"] else "",
                 f"{c['complete']}/{len(report['requests'])}", key]
        head.append("| " + " | ".join(cells) + " |")
    return "\n".join(head)


def write_outputs(report: dict, out_dir: Path) -> tuple[Path, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    slug = re.sub(r"[^A-Za-z0-9._-]+", "_", Path(report["model"]).name or report["model"])
    stem = out_dir / f"grammar-{slug}-{time.strftime('%Y%m%d-%H%M%S')}"
    json_path, png_path = stem.with_suffix(".json"), stem.with_suffix(".png")
    write_json(json_path, report)
    plot(report, png_path)
    return json_path, png_path


def plot(report: dict, path: Path) -> None:
    """Per method, grammar drafting off and on: tokens/s (left) and tokens per target step (right)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    methods = [o["method"] for o in report["on_off"]]
    fig = Figure(figsize=(10, 4), dpi=120)
    FigureCanvasAgg(fig)
    for ax, (metric, label) in zip(fig.subplots(1, 2), (("tokens_per_s", "tokens/s"),
                                                         ("tokens_per_step", "tokens per target step"))):
        for j, on in enumerate((False, True)):
            values = [next(c[metric] for c in report["configs"] if c["method"] == m and c["grammar_drafts"] is on)
                      for m in methods]
            bars = ax.bar([i + (j - 0.5) * 0.4 for i in range(len(methods))], values, 0.4,
                          label=f"grammar drafts {'on' if on else 'off'}")
            ax.bar_label(bars, fmt="%.2f", fontsize=7)
        ax.set_xticks(range(len(methods)), methods)
        ax.set_ylabel(label)
        ax.margins(y=0.2)  # room above the bars for the legend
        ax.legend(fontsize=7)
    fig.suptitle(f"grammar-aware drafting: {report['model']}, {len(report['requests'])} schema requests, "
                 f"{report['rounds']} round(s), {report['device']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
