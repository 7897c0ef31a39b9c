"""The ``specdecode serve`` flags and what they set: torch-free, one definition for every reader.

The argument groups (model, engine, parallelism, server) are the ``serve`` subcommand's in the
console entry (``runtime/cli.py``, which ``generate`` and ``train-mtp`` share some of), and
``serve_parser(strict=True)`` is how the operator's admission checks ``spec.extraArgs`` against
them. ``engine_config`` / ``server_config`` turn parsed flags into the configs (imported where
they are built: this module imports the standard library only).
"""
from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from typing import Any, NoReturn


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
    g.add_argument("--load-format", choices=["auto", "dummy"], default=None,
                   help="dummy: random weights of the model's config, to time steps without the weights (default auto)")


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
    g.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=None,
                   help="capture each batch bucket's decode/verify forward as a CUDA graph and replay it (CUDA, one "
                        "rank; default off)")
    g.add_argument("--batch-buckets", action=argparse.BooleanOptionalAction, default=None,
                   help="pad decode/verify steps to batch buckets 1, 2, 4, 8, then every 16, drafts to the step's "
                        "most (default: on with --cuda-graphs)")
    g.add_argument("--max-waiting-requests", type=int, default=None,
                   help="a fuller waiting queue answers 503")
    add_speculative_argument(g)


def add_speculative_argument(parser) -> None:
    """``--speculative-config``: the ``SpeculativeConfig`` JSON, its draft model and MTP head paths included."""
    parser.add_argument("--speculative-config", default=None, metavar="JSON",
                        help="speculative decoding, e.g. "
                             '\'{"method":"ngram","num_speculative_tokens":4,"verify":"rejection"}\' '
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
    g.add_argument("--group-heartbeat-timeout", type=float, default=None, metavar="SECONDS",
                   help="a rank of the group silent this long (its pod gone or hung) fails the requests in flight, "
                        "turns /ready 503 and exits the server, so the group re-forms (default 15)")
    g.add_argument("--trace-steps", default=None, metavar="DIR",
                   help="pipeline stages: each rank writes its layers, parameters and, per step, the positions and KV "
                        "slots it ran to DIR/rank<N>.jsonl (debugging)")


def add_server_arguments(parser: argparse.ArgumentParser) -> None:
    """The HTTP server (``ServerConfig`` less the engine)."""
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


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """Every ``specdecode serve`` flag."""
    add_model_arguments(parser)
    add_engine_arguments(parser)
    add_parallel_arguments(parser)
    add_server_arguments(parser)


def _set(**values: Any) -> dict[str, Any]:
    return {k: v for k, v in values.items() if v is not None}


def parallel_config(args: argparse.Namespace, environ: Mapping[str, str]):
    """``ParallelConfig`` from the parallelism flags and, across pods, the rendezvous env the operator sets."""
    from specdecode.runtime.config import ParallelConfig

    return ParallelConfig(**_set(
        tensor_parallel_size=getattr(args, "tensor_parallel_size", None),
        pipeline_parallel_size=getattr(args, "pipeline_parallel_size", None),
        collective_timeout_s=getattr(args, "collective_timeout", None),
        group_heartbeat_timeout_s=getattr(args, "group_heartbeat_timeout", None), trace_dir=getattr(args, "trace_steps", None),
        num_nodes=environ.get("NNODES"),
        node_rank=environ.get("NODE_RANK"), master_addr=environ.get("MASTER_ADDR"),
        master_port=environ.get("MASTER_PORT")))


def engine_config(args: argparse.Namespace, environ: Mapping[str, str] = os.environ):
    """``EngineConfig`` from the model, engine and parallelism argument groups (flags absent from
    ``args`` are unset) and the rendezvous env."""
    from specdecode.runtime.config import (CacheConfig, EngineConfig, GraphConfig, LoadConfig, SchedulerConfig,
                                           SpeculativeConfig)

    get = lambda name: getattr(args, name, None)  # noqa: E731 - a subcommand may lack a group
    load = _set(model=args.model, device=get("device"), dtype=get("dtype"), chat_template=get("chat_template"),
                weight_cache_dir=get("weight_cache_dir"), load_format=get("load_format"))
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
                        speculative=speculative, parallel=parallel_config(args, environ),
                        graphs=GraphConfig(**_set(cuda_graphs=get("cuda_graphs"), batch_buckets=get("batch_buckets"))))


def server_config(args: argparse.Namespace, environ: Mapping[str, str] = os.environ):
    """``ServerConfig`` from the ``serve`` flags and the rendezvous env."""
    from specdecode.runtime.config import ServerConfig

    return ServerConfig(engine=engine_config(args, environ), **_set(
        host=args.host, port=args.port, served_model_name=args.served_model_name, api_key=args.api_key,
        drain_timeout_s=args.drain_timeout, max_request_bytes=args.max_request_bytes))


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


def serve_parser(*, strict: bool = False) -> argparse.ArgumentParser:
    """The ``specdecode serve`` flags alone (no subcommand word); ``strict``: no abbreviations, and
    ``ArgumentsRefused`` instead of an exit, for arguments that another process will parse."""
    parser_class = _StrictParser if strict else argparse.ArgumentParser
    parser = parser_class(prog="specdecode serve")
    add_serve_arguments(parser)
    return parser
