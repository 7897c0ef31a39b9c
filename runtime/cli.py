"""``specdecode`` console entry: one parser, subcommands imported lazily. Nothing imports it.

This module imports nothing heavy (no torch, no FastAPI): ``specdecode --help`` and the operator's
torch-free subcommands must work in a slim image. Each subcommand is a ``Subcommand`` row — a name,
a help line, a function adding its arguments, and a function running it that does its own
imports. To add one, write those two functions and append a row to ``SUBCOMMANDS``. The ``serve``
flags live in ``serve_flags`` (``generate`` and ``train-mtp`` take some of them), where the
operator's admission reads them too.
"""
from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from specdecode.runtime import serve_flags

if TYPE_CHECKING:
    from pydantic import ValidationError

    from specdecode.runtime.config import SpeculativeConfig
    from specdecode.runtime.engine.grammar import StructuredOutput
    from specdecode.runtime.engine.sequence import SpecCounts


@dataclass(frozen=True)
class Subcommand:
    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int | None]


# -- serve --------------------------------------------------------------------------------------


def _run_serve(args: argparse.Namespace) -> int:
    import logging
    from pathlib import Path

    from pydantic import ValidationError

    from specdecode.runtime.server.serve import refuse, run_server

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    termination = Path(args.termination_message_path) if args.termination_message_path else None
    try:
        cfg = serve_flags.server_config(args)
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
    serve_flags.add_model_arguments(parser)
    serve_flags.add_parallel_arguments(parser)
    parser.add_argument("--max-model-len", type=int, default=None, help="context length (default: the model's)")
    serve_flags.add_overlap_argument(parser)
    serve_flags.add_speculative_argument(parser)
    parser.add_argument("--prompt", required=True, help="the prompt text")
    parser.add_argument("--chat", action="store_true", help="wrap the prompt as one user message (chat template)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--seed", type=int, default=None)
    one_of = parser.add_argument_group("structured output (at most one)").add_mutually_exclusive_group()
    one_of.add_argument("--json-schema", metavar="JSON|@FILE",
                        help="the output is JSON valid against this schema (the text, or @ and a file holding it)")
    one_of.add_argument("--regex", help="the output matches this regular expression")
    one_of.add_argument("--choice", metavar="JSON", help='the output is one of these strings: \'["yes", "no"]\'')


def _run_generate(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from specdecode.runtime.engine.async_engine import AsyncEngine

    try:
        cfg = serve_flags.engine_config(args)
        structured = _structured_output(args)
    except ValidationError as exc:
        print(f"specdecode generate: invalid configuration:\n{exc}", file=sys.stderr)
        return 2
    except (OSError, ValueError) as exc:  # the constraint's file or JSON, checked before the model loads
        print(f"specdecode generate: {exc}", file=sys.stderr)
        return 2
    async_engine = AsyncEngine.from_config(cfg)
    try:
        return _generate(async_engine.engine, args, structured, cfg.speculative)  # the synchronous LLMEngine
    finally:
        async_engine.shutdown()  # stops tensor-parallel workers


def _structured_output(args: argparse.Namespace) -> StructuredOutput | None:
    """The ``StructuredOutput`` the flags ask for, or None. Its JSON is parsed here, so a quoting
    slip fails before the model loads; what llguidance refuses fails when the request is added."""
    from specdecode.runtime.engine.grammar import StructuredKind, StructuredOutput

    if args.json_schema is not None:
        text = args.json_schema
        if text.startswith("@"):
            text = Path(text[1:]).read_text(encoding="utf-8")
        _parse_json("--json-schema", text)
        return StructuredOutput(StructuredKind.JSON, text)
    if args.regex is not None:
        return StructuredOutput(StructuredKind.REGEX, args.regex)
    if args.choice is not None:
        _parse_json("--choice", args.choice)
        return StructuredOutput(StructuredKind.CHOICE, args.choice)
    return None


def _parse_json(flag: str, text: str) -> None:
    try:
        json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{flag} is not JSON: {exc}") from None


def _generate(engine, args: argparse.Namespace, structured: StructuredOutput | None,
              speculative: SpeculativeConfig) -> int:
    """Stream the completion to stdout, then, where the request could be given drafts, its
    acceptance; 2 when the engine refuses the request (a constraint llguidance cannot compile)."""
    from specdecode.runtime.engine.sequence import SamplingParams, SpecCounts

    prompt_ids = _prompt_ids(engine.tokenizer, args)
    max_tokens = min(args.max_tokens, engine.max_model_len - len(prompt_ids))
    params = SamplingParams(max_tokens=max(1, max_tokens), temperature=args.temperature, seed=args.seed,
                            structured=structured)
    try:
        engine.add_request("generate", prompt_ids, params)
    except ValueError as exc:
        print(f"specdecode generate: {exc}", file=sys.stderr)
        return 2
    spec = SpecCounts()
    while engine.has_unfinished():
        for out in engine.step():
            for delta in out.deltas:
                sys.stdout.write(delta.text)
            sys.stdout.flush()
            spec = out.spec  # the request's counts so far
    sys.stdout.write("\n")
    if speculative.enabled or (structured is not None and speculative.grammar_drafts):
        print(f"\n{_acceptance_block(spec)}")
    return 0


def _prompt_ids(tokenizer, args: argparse.Namespace) -> list[int]:
    if not args.chat:
        return tokenizer.encode(args.prompt, add_special_tokens=True)
    text = tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}], add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


def _acceptance_block(spec: SpecCounts) -> str:
    """A request's ``SpecCounts`` as ``generate`` prints them: the verify steps that scored drafts,
    draft tokens, accepted tokens, acceptance rate (accepted ÷ draft tokens), and per draft
    position the steps whose draft at that position was accepted."""
    rate = f"{spec.num_accepted_tokens / spec.num_draft_tokens:.2f}" if spec.num_draft_tokens else "n/a"
    rows = [("drafts scored (steps)", spec.num_drafts), ("draft tokens", spec.num_draft_tokens),
            ("accepted tokens", spec.num_accepted_tokens), ("acceptance rate", rate),
            ("accepted per position", " ".join(map(str, spec.accepted_per_position)) or "-")]
    return "\n".join(f"{name + ':':<23}{value}" for name, value in rows)


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


def _add_bench_step(parser: argparse.ArgumentParser) -> None:
    from specdecode.bench.step import add_arguments

    add_arguments(parser)


def _run_bench_step(args: argparse.Namespace) -> int:
    from specdecode.bench.step import run

    return run(args)


def _add_bench_grammar(parser: argparse.ArgumentParser) -> None:
    from specdecode.bench.grammar import add_arguments

    add_arguments(parser)


def _run_bench_grammar(args: argparse.Namespace) -> int:
    from specdecode.bench.grammar import run

    return run(args)


def _add_train_mtp(parser: argparse.ArgumentParser) -> None:
    from specdecode.runtime.training.command import add_arguments

    add_arguments(parser)


def _run_train_mtp(args: argparse.Namespace) -> int:
    from specdecode.runtime.training.command import run

    return run(args)


def _add_train_eagle3(parser: argparse.ArgumentParser) -> None:
    from specdecode.runtime.training.command import add_eagle3_arguments

    add_eagle3_arguments(parser)


def _run_train_eagle3(args: argparse.Namespace) -> int:
    from specdecode.runtime.training.command import run_eagle3

    return run_eagle3(args)


def _local(name: str) -> tuple[Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]:
    """The arguments and the run of one of ``specdecode up``'s family (operator/local/command.py)."""
    def add(parser: argparse.ArgumentParser) -> None:
        from specdecode.operator.local import command

        command.add_arguments(name, parser)

    def run(args: argparse.Namespace) -> int:
        from specdecode.operator.local import command

        return command.run(name, args)

    return add, run


LOCAL = ("up", "apply", "status", "down", "promote", "abort", "pause", "resume", "retry", "traffic")
LOCAL_HELP = {
    "up": "run a SpecDecodeDeployment on this machine: replicas as processes, a router, live rollouts",
    "apply": "apply a changed SpecDecodeDeployment to its running `up` (a new revision rolls out)",
    "status": "the status of deployments run by `up` (a table, or -o json)",
    "down": "stop a deployment run by `up` (every replica drained first)",
    "traffic": "replay a prompt set at a bounded rate against an OpenAI-compatible server (a summary as it runs)",
}

SUBCOMMANDS: list[Subcommand] = [
    Subcommand("serve", "serve a model over an OpenAI-compatible HTTP API", serve_flags.add_serve_arguments,
               _run_serve),
    Subcommand("generate", "generate one completion and print it", _add_generate, _run_generate),
    Subcommand("validate", "check SpecDecodeDeployments as admission would (exit 1 on refusal)", _add_validate,
               _run_validate),
    Subcommand("render", "print the Kubernetes objects the operator would create", _add_render, _run_render),
    Subcommand("bench", "benchmark against Hugging Face transformers (table, JSON, plot)", _add_bench, _run_bench),
    Subcommand("train-mtp", "train MTP head(s) for a model that has none, then measure their acceptance",
               _add_train_mtp, _run_train_mtp),
    Subcommand("train-eagle3", "train an EAGLE-3 head for a model that has none, then measure its acceptance",
               _add_train_eagle3, _run_train_eagle3),
    Subcommand("bench-kernels", "time each Triton kernel against its torch reference (table, JSON, plot)",
               _add_bench_kernels, _run_bench_kernels),
    Subcommand("bench-step", "time the engine's decode/verify steps against a baseline checkout (table, JSON, plot)",
               _add_bench_step, _run_bench_step),
    Subcommand("bench-grammar", "grammar-aware drafting off against on, over schema-shaped requests (table, JSON, "
               "plot)", _add_bench_grammar, _run_bench_grammar),
    *(Subcommand(name, LOCAL_HELP.get(name, f"{name} the rollout of a deployment run by `up` (once per value)"),
                 *_local(name)) for name in LOCAL),
]


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The ``specdecode`` parser: one subparser per ``SUBCOMMANDS`` row. With ``only``, that
    subcommand alone gets its arguments: adding ``bench``'s or ``train-mtp``'s imports their
    packages, which ``serve`` and ``validate`` must not load."""
    parser = argparse.ArgumentParser(prog="specdecode", description="Speculative-decoding LLM serving.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for command in SUBCOMMANDS:
        command_parser = sub.add_parser(command.name, help=command.help, description=command.help)
        if only is None or command.name == only:
            command.add_arguments(command_parser)
        command_parser.set_defaults(run=command.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    chosen = next((arg for arg in argv if not arg.startswith("-")), "")  # the top level takes no values
    args = build_parser(only=chosen).parse_args(argv)
    return int(args.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
