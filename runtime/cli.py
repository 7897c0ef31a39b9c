"""``specdecode`` console entry: one parser, subcommands imported lazily.

This module imports nothing heavy (no torch, no FastAPI): ``specdecode --help`` and the operator's
torch-free subcommands must work in a slim image. Each subcommand is a ``Subcommand`` row — a name,
a help line, a function adding its arguments, and a function running it that does its own
imports. To add one, write those two functions and append a row to ``SUBCOMMANDS``.
"""
from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NoReturn

if TYPE_CHECKING:
    from pydantic import ValidationError


@dataclass(frozen=True)
class Subcommand:
    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int | None]


# -- shared argument groups ---------------------------------------------------------------------


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """Where the model comes from and how it is loaded (``LoadConfig``)."""
    g = parser.add_argument_group("model")
    g.add_argument("--model", default="smollm2-135m",
                   help="GGUF file, Hugging Face folder, or alias (smollm2-135m, qwen2.5-coder-0.5b, "
                        "qwen2.5-coder-1.5b); default %(default)s")
    g.add_argument("--device", choices=["auto", "cpu", "cuda"], default=None, help="default auto")
    g.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default=None,
                   help="default auto: float32 on CPU, bfloat16 on CUDA")
    g.add_argument("--chat-template", default=None, metavar="FILE", help="Jinja chat template replacing the model's")
    g.add_argument("--weight-cache-dir", default=None, metavar="DIR",
                   help="where dequantized GGUF weights are cached (default ~/.cache/specdecode/weights)")
    g.add_argument("--no-weight-cache", action="store_true", help="do not cache dequantized weights")


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """KV cache and scheduler (``CacheConfig``, ``SchedulerConfig``); unset flags keep the config defaults."""
    g = parser.add_argument_group("engine")
    g.add_argument("--max-model-len", type=int, default=None, help="context length (default: the model's)")
    g.add_argument("--max-num-seqs", type=int, default=None, help="most sequences per step")
    g.add_argument("--max-num-batched-tokens", type=int, default=None, help="per-step token budget")
    g.add_argument("--kv-cache-blocks", type=int, default=None, help="KV pool size in blocks")
    g.add_argument("--kv-cache-memory-gib", type=float, default=None,
                   help="KV pool budget in GiB when --kv-cache-blocks is unset")
    g.add_argument("--block-size", type=int, default=None, help="tokens per KV block")
    g.add_argument("--no-prefix-caching", action="store_true", help="turn automatic prefix caching off")
    add_overlap_argument(g)
    g.add_argument("--max-waiting-requests", type=int, default=None,
                   help="a fuller waiting queue answers 503")
    g.add_argument("--speculative-config", default=None, metavar="JSON",
                   help='speculative decoding, e.g. \'{"method":"ngram","num_speculative_tokens":4,"verify":"rejection"}\' '
                        "(methods: none, ngram, suffix, draft, mtp; verify: greedy, target_match, rejection, "
                        "topp — topp is lossy)")


def add_overlap_argument(parser) -> None:
    parser.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=None,
                        help="overlap scheduling: build the next step while one runs (default: on with pipeline "
                             "stages, off in one process, where it measured slower on CPU); --no-overlap turns it off")


def add_parallel_arguments(parser: argparse.ArgumentParser) -> None:
    """Tensor and pipeline parallelism (``ParallelConfig``); a group spread over pods also reads torchrun's env."""
    g = parser.add_argument_group("parallelism")
    g.add_argument("--tensor-parallel-size", type=int, default=None, metavar="N",
                   help="shard each stage's layers over N ranks (one per GPU, or CPU processes); in one pod the other "
                        "ranks are spawned here, across pods they meet through $NNODES, $NODE_RANK, $MASTER_ADDR and "
                        "$MASTER_PORT (default 1)")
    g.add_argument("--pipeline-parallel-size", type=int, default=None, metavar="P",
                   help="split the decoder layers into P contiguous stages, each a separate process group of "
                        "--tensor-parallel-size ranks; the last stage samples and verifies (default 1)")
    g.add_argument("--collective-timeout", type=float, default=None, metavar="SECONDS",
                   help="a step waiting longer than this for another rank fails, and every rank exits (default 300)")
    g.add_argument("--trace-steps", default=None, metavar="DIR",
                   help="pipeline stages: each rank writes its layers, parameters and, per step, the positions and KV "
                        "slots it ran to DIR/rank<N>.jsonl (debugging)")


def _set(**values: Any) -> dict[str, Any]:
    return {k: v for k, v in values.items() if v is not None}


def parallel_config(args: argparse.Namespace, environ: Mapping[str, str]):
    """``ParallelConfig`` from the parallelism flags and, across pods, the rendezvous env the operator sets."""
    from specdecode.runtime.config import ParallelConfig

    return ParallelConfig(**_set(
        tensor_parallel_size=getattr(args, "tensor_parallel_size", None),
        pipeline_parallel_size=getattr(args, "pipeline_parallel_size", None),
        collective_timeout_s=getattr(args, "collective_timeout", None), trace_dir=getattr(args, "trace_steps", None),
        num_nodes=environ.get("NNODES"),
        node_rank=environ.get("NODE_RANK"), master_addr=environ.get("MASTER_ADDR"),
        master_port=environ.get("MASTER_PORT")))


def engine_config(args: argparse.Namespace, environ: Mapping[str, str] = os.environ):
    """``EngineConfig`` from the model, engine and parallelism argument groups (flags absent from
    ``args`` are unset) and the rendezvous env."""
    from specdecode.runtime.config import CacheConfig, EngineConfig, LoadConfig, SchedulerConfig, SpeculativeConfig

    get = lambda name: getattr(args, name, None)  # noqa: E731 - a subcommand may lack a group
    load = _set(model=args.model, device=get("device"), dtype=get("dtype"), chat_template=get("chat_template"),
                weight_cache_dir=get("weight_cache_dir"))
    if get("no_weight_cache"):
        load["weight_cache_dir"] = None
    cache = _set(num_blocks=get("kv_cache_blocks"), memory_gib=get("kv_cache_memory_gib"),
                 block_size=get("block_size"))
    if get("no_prefix_caching"):
        cache["enable_prefix_caching"] = False
    scheduler = _set(max_model_len=get("max_model_len"), max_num_seqs=get("max_num_seqs"),
                     max_num_batched_tokens=get("max_num_batched_tokens"),
                     max_waiting_requests=get("max_waiting_requests"), overlap=get("overlap"))
    spec_json = get("speculative_config")
    speculative = SpeculativeConfig.model_validate_json(spec_json) if spec_json else SpeculativeConfig()
    return EngineConfig(load=LoadConfig(**load), cache=CacheConfig(**cache), scheduler=SchedulerConfig(**scheduler),
                        speculative=speculative, parallel=parallel_config(args, environ))


# -- serve --------------------------------------------------------------------------------------


def _add_serve(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    add_engine_arguments(parser)
    add_parallel_arguments(parser)
    g = parser.add_argument_group("server")
    g.add_argument("--host", default=None, help="default 127.0.0.1")
    g.add_argument("--port", type=int, default=None, help="default 8000")
    g.add_argument("--served-model-name", default=None, help="the model name clients send (default: the model's)")
    g.add_argument("--api-key", default=os.environ.get("SPECDECODE_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1/* (default $SPECDECODE_API_KEY)")
    g.add_argument("--drain-timeout", type=float, default=None, metavar="SECONDS",
                   help="on SIGTERM, wait this long for requests in flight, then cut them and exit 1 (default 600)")
    g.add_argument("--max-request-bytes", type=int, default=None, metavar="BYTES",
                   help="refuse a larger request body with 413 (default: 64 bytes per token of context, "
                        "at least 1 MiB)")
    g.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    g.add_argument("--termination-message-path", default="/dev/termination-log", metavar="FILE",
                   help="a refusal to start (invalid configuration, a model that cannot be served) is also written "
                        "here if its folder exists, where Kubernetes reads a container's termination message; "
                        "'' = nowhere (default %(default)s)")


def _run_serve(args: argparse.Namespace) -> int:
    import logging
    from pathlib import Path

    from pydantic import ValidationError

    from specdecode.runtime.config import ServerConfig
    from specdecode.runtime.server.serve import refuse, run_server

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    termination = Path(args.termination_message_path) if args.termination_message_path else None
    try:
        cfg = ServerConfig(engine=engine_config(args), **_set(
            host=args.host, port=args.port, served_model_name=args.served_model_name, api_key=args.api_key,
            drain_timeout_s=args.drain_timeout, max_request_bytes=args.max_request_bytes))
    except ValidationError as exc:
        refuse(f"specdecode serve: invalid configuration: {_errors_line(exc)}", termination)
        return 2
    return run_server(cfg, log_level=args.log_level, termination_message_path=termination)


def _errors_line(exc: ValidationError) -> str:
    """A pydantic ``ValidationError`` as one line: ``field: message; …``."""
    return "; ".join(": ".join(filter(None, (".".join(map(str, e["loc"])), e["msg"].removeprefix("Value error, "))))
                     for e in exc.errors())


# -- generate -----------------------------------------------------------------------------------


def _add_generate(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    add_parallel_arguments(parser)
    parser.add_argument("--max-model-len", type=int, default=None, help="context length (default: the model's)")
    add_overlap_argument(parser)
    parser.add_argument("--prompt", required=True, help="the prompt text")
    parser.add_argument("--chat", action="store_true", help="wrap the prompt as one user message (chat template)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--seed", type=int, default=None)


def _run_generate(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from specdecode.runtime.engine.async_engine import AsyncEngine

    try:
        cfg = engine_config(args)
    except ValidationError as exc:
        print(f"specdecode generate: invalid configuration:\n{exc}", file=sys.stderr)
        return 2
    async_engine = AsyncEngine.from_config(cfg)
    try:
        _generate(async_engine.engine, args)  # the synchronous LLMEngine, no thread
    finally:
        async_engine.shutdown()  # stops tensor-parallel workers
    return 0


def _generate(engine, args: argparse.Namespace) -> None:
    from specdecode.runtime.engine.sequence import SamplingParams

    tokenizer = engine.tokenizer
    if args.chat:
        text = tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}], add_generation_prompt=True)
        prompt_ids = tokenizer.encode(text, add_special_tokens=False)
    else:
        prompt_ids = tokenizer.encode(args.prompt, add_special_tokens=True)
    max_tokens = min(args.max_tokens, engine.max_model_len - len(prompt_ids))
    params = SamplingParams(max_tokens=max(1, max_tokens), temperature=args.temperature, seed=args.seed)
    engine.add_request("generate", prompt_ids, params)
    while engine.has_unfinished():
        for out in engine.step():
            for delta in out.deltas:
                sys.stdout.write(delta.text)
            sys.stdout.flush()
    sys.stdout.write("\n")


# -- validate / render (the operator's pure core; torch-free) -----------------------------------


def _add_validate(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", metavar="FILE", help="YAML with SpecDecodeDeployment documents ('-' = stdin)")
    parser.add_argument("--old", metavar="FILE", default=None,
                        help="the stored resources: check FILE as an update of them (immutable fields)")
    parser.add_argument("-o", "--output", choices=["text", "json"], default="text",
                        help="text, or the AdmissionReview responses as JSON")


def _run_validate(args: argparse.Namespace) -> int:
    from specdecode.operator.commands import validate

    return validate(args.file, old_path=args.old, output=args.output)


def _add_render(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", metavar="FILE", help="YAML with SpecDecodeDeployment documents ('-' = stdin)")
    parser.add_argument("--replicas", type=int, default=None, help="render this many replicas (default: spec.replicas)")
    parser.add_argument("--leader-worker-set", action="store_true",
                        help="the cluster serves LeaderWorkerSet: use it for multi-pod replicas")


def _run_render(args: argparse.Namespace) -> int:
    from specdecode.operator.commands import render_command

    return render_command(args.file, replicas=args.replicas, leader_worker_set=args.leader_worker_set)


def _add_bench(parser: argparse.ArgumentParser) -> None:
    from specdecode.bench.command import add_arguments

    add_arguments(parser)


def _run_bench(args: argparse.Namespace) -> int:
    from specdecode.bench.command import run

    return run(args)


def _add_bench_kernels(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="cuda", help="device to run both paths on (default cuda)")
    parser.add_argument("--repeats", type=int, default=50, help="timed launches per path and case")
    parser.add_argument("--output-dir", default="bench-results")
    parser.add_argument("--quick", action="store_true", help="small sizes only (a plumbing check)")


def _run_bench_kernels(args: argparse.Namespace) -> int:
    from specdecode.bench.kernels import run

    return run(args)


def _add_train_mtp(parser: argparse.ArgumentParser) -> None:
    from specdecode.runtime.training.command import add_arguments

    add_arguments(parser)


def _run_train_mtp(args: argparse.Namespace) -> int:
    from specdecode.runtime.training.command import run

    return run(args)


SUBCOMMANDS: list[Subcommand] = [
    Subcommand("serve", "serve a model over an OpenAI-compatible HTTP API", _add_serve, _run_serve),
    Subcommand("generate", "generate one completion and print it", _add_generate, _run_generate),
    Subcommand("validate", "check SpecDecodeDeployments as admission would (exit 1 on refusal)", _add_validate,
               _run_validate),
    Subcommand("render", "print the Kubernetes objects the operator would create", _add_render, _run_render),
    Subcommand("bench", "benchmark against Hugging Face transformers (table, JSON, plot)", _add_bench, _run_bench),
    Subcommand("train-mtp", "train MTP head(s) for a model that has none, then measure their acceptance",
               _add_train_mtp, _run_train_mtp),
    Subcommand("bench-kernels", "time each Triton kernel against its torch reference (table, JSON, plot)",
               _add_bench_kernels, _run_bench_kernels),
]


class ArgumentsRefused(ValueError):
    """What a ``strict`` parser refuses, as argparse would have printed it before exiting."""


class _StrictParser(argparse.ArgumentParser):
    """Flags only as written in full, and a refusal raised instead of printed with an exit: for
    checking arguments that another process will parse (the operator's ``spec.extraArgs``). An
    abbreviation unambiguous today is ambiguous once a longer flag is added, and there the two
    processes could disagree on what it means."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **{**kwargs, "allow_abbrev": False})

    def error(self, message: str) -> NoReturn:
        raise ArgumentsRefused(message)

    def print_help(self, file: Any = None) -> NoReturn:
        raise ArgumentsRefused("--help prints help instead of running")


def build_parser(*, strict: bool = False) -> argparse.ArgumentParser:
    """The ``specdecode`` parser; ``strict`` (every subcommand's too): no abbreviations, and
    ``ArgumentsRefused`` instead of an exit. Users' command lines keep argparse's defaults."""
    parser_class = _StrictParser if strict else argparse.ArgumentParser
    parser = parser_class(prog="specdecode", description="Speculative-decoding LLM serving.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)  # subparsers: parser_class too
    for command in SUBCOMMANDS:
        command_parser = sub.add_parser(command.name, help=command.help, description=command.help)
        command.add_arguments(command_parser)
        command_parser.set_defaults(run=command.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
