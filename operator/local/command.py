"""The ``specdecode up`` family on the command line: ``up``, ``apply``, ``status``, ``down``, the
rollout commands ``promote``, ``abort``, ``pause``, ``resume``, ``retry``, and ``traffic``.
``runtime/cli.py`` imports this module only once one of them is chosen."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from specdecode.operator.local import traffic, up
from specdecode.operator.local.backend import specdecode_command
from specdecode.operator.local.store import default_root
from specdecode.operator.rollout import Command

DETACH_WAIT_SECONDS = 600.0
STOP_POLL_S = 0.2  # how often `traffic` looks for Ctrl-C or SIGTERM


def add_arguments(name: str, parser: argparse.ArgumentParser) -> None:
    if name == "traffic":
        _add_traffic_arguments(parser)
        return
    parser.add_argument("--state-dir", type=Path, default=None,
                        help=f"where deployments keep their state (default {default_root()})")
    if name == "up":
        parser.add_argument("file", metavar="FILE", help="YAML with one SpecDecodeDeployment; saving it applies it")
        parser.add_argument("--port", type=int, default=up.DEFAULT_PORT, help="the router's port (default %(default)s)")
        parser.add_argument("--detach", action="store_true", help="run in the background once the router serves")
        parser.add_argument("--traffic", metavar="PROMPTSET", default=None,
                            help="replay this prompt set at the router once it serves (as `specdecode traffic`)")
        parser.add_argument("--rate", type=float, default=1.0, help="with --traffic: requests per second [%(default)s]")
    elif name == "apply":
        parser.add_argument("file", metavar="FILE")
    elif name in ("status", "down"):
        parser.add_argument("name", metavar="NAME", nargs="?", help="default: every deployment run by `up`")
        if name == "status":
            parser.add_argument("-o", "--output", choices=["table", "json"], default="table")
    else:
        parser.add_argument("name", metavar="NAME")
        parser.add_argument("value", metavar="VALUE", nargs="?",
                            help="the revision meant, or any token (default: a fresh token)")


def _add_traffic_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("url", metavar="URL", help="the OpenAI API's base URL, e.g. http://127.0.0.1:8000/v1")
    parser.add_argument("promptset", metavar="PROMPTSET",
                        help=f"{' | '.join(traffic.PROMPT_SET_NAMES)} | a .json/.jsonl file (runtime/prompt_sets.py)")
    parser.add_argument("--rate", type=float, default=1.0,
                        help="requests started per second, evenly spaced [%(default)s]")
    parser.add_argument("--concurrency", type=int, default=4,
                        help="requests in flight at most; a request due beyond it is skipped and counted [%(default)s]")
    parser.add_argument("--duration", type=float, default=None, metavar="S", help="seconds to run (default: to Ctrl-C)")
    parser.add_argument("--requests", type=int, default=None, metavar="N", help="requests to send (default: to Ctrl-C)")
    parser.add_argument("--num-prompts", type=int, default=None,
                        help=f"prompts of the set (default: all; {traffic.DEFAULT_NUM_PROMPTS} of a packaged set)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--model", default=None, help="default: the first id /v1/models lists")
    parser.add_argument("--api-key", default=None, help="sent as a Bearer token (default: $OPENAI_API_KEY, if set)")
    parser.add_argument("--no-stream", dest="stream", action="store_false", help="ask for whole answers, not SSE")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds one request may take [%(default)s]")
    parser.add_argument("--report-every", type=float, default=5.0, help="seconds between progress lines on stderr")
    parser.add_argument("-o", "--output", choices=["text", "json"], default="text", help="the final summary's form")


def run(name: str, args: argparse.Namespace) -> int:
    if name == "traffic":
        return _traffic(args)
    root = args.state_dir or default_root()
    try:
        if name == "up":
            replayer = _replayer(args.traffic, None, rate=args.rate) if args.traffic else None  # refused before up
            if args.detach:
                return _detach(args, root)
            return up.run(args.file, root=root, port=args.port, out=sys.stdout, traffic=replayer)
        if name == "apply":
            print(up.apply(args.file, root=root))
        elif name == "status":
            print("\n\n".join(up.show_status(n, root=root, output=args.output) for n in _names(args.name, root)))
        elif name == "down":
            print("\n".join(up.down(n, root=root) for n in _names(args.name, root)))
        else:
            print(up.command(args.name, Command(name), args.value, root=root))
    except (up.Refused, FileNotFoundError) as exc:
        print(f"specdecode {name}: {exc}", file=sys.stderr)
        return up.EXIT_REFUSED
    return 0


def _replayer(source: str, num_prompts: int | None, **config: Any) -> traffic.Replayer:
    """Raises ``up.Refused`` for an unknown, missing or bad prompt set or a bad setting (one line)."""
    try:
        return traffic.Replayer(traffic.load_prompt_set(source, num_prompts), traffic.TrafficConfig(**config),
                                progress=sys.stderr)
    except (ValueError, OSError) as exc:  # MissingData is a FileNotFoundError
        raise up.Refused(str(exc)) from exc


def _traffic(args: argparse.Namespace) -> int:
    """``specdecode traffic``: replay until the duration or count is reached, or Ctrl-C (SIGINT or
    SIGTERM: a replayer started in the background by a shell ignores SIGINT); exit 1
    when no model was found (``/models`` refused, or never answered before Ctrl-C)."""
    try:
        replayer = _replayer(
            args.promptset, args.num_prompts, rate=args.rate, concurrency=args.concurrency, duration_s=args.duration,
            requests=args.requests, max_tokens=args.max_tokens, temperature=args.temperature, model=args.model,
            api_key=args.api_key or os.environ.get("OPENAI_API_KEY") or None, stream=args.stream,
            timeout_s=args.timeout, report_every_s=args.report_every if args.report_every > 0 else None)
    except up.Refused as exc:
        print(f"specdecode traffic: {exc}", file=sys.stderr)
        return up.EXIT_REFUSED
    stop = up.Stop()
    stop.install()
    try:
        replayer.start(args.url)
        while not replayer.wait(STOP_POLL_S) and not stop.event.is_set():
            pass
        summary = replayer.stop()
    finally:
        stop.uninstall()
    print(json.dumps(summary.as_dict(), indent=2) if args.output == "json" else summary.report(), flush=True)
    return 0 if summary.model is not None else up.EXIT_REFUSED  # no model: nothing could be sent


def _names(name: str | None, root: Path) -> list[str]:
    if name is not None:
        return [name]
    return sorted(p.name for p in root.iterdir() if (p / "resource.json").exists()) if root.is_dir() else []


def _detach(args: argparse.Namespace, root: Path) -> int:
    """``up`` in a session of its own, its output in ``root/up-PORT.log``; returns once the router
    answers, or with the log's tail when it stopped first."""
    root.mkdir(parents=True, exist_ok=True)
    log_path = root / f"up-{args.port}.log"
    argv = [*specdecode_command(), "up", args.file, "--port", str(args.port), "--state-dir", str(root)]
    if args.traffic:
        argv += ["--traffic", args.traffic, "--rate", str(args.rate)]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    deadline = time.monotonic() + DETACH_WAIT_SECONDS
    while proc.poll() is None and time.monotonic() < deadline:
        if _answers(f"http://127.0.0.1:{args.port}/health"):
            print(f"up (pid {proc.pid}) on http://127.0.0.1:{args.port}/v1; log {log_path}; stop it with "
                  "`specdecode down`")
            return 0
        time.sleep(0.5)
    print(f"specdecode up: stopped before serving:\n{log_path.read_text()[-2000:]}", file=sys.stderr)
    return up.EXIT_REFUSED


def _answers(url: str) -> bool:
    """Whether the router is up (it answers /health, 200 or 503)."""
    try:
        with urllib.request.urlopen(url, timeout=2):
            return True
    except urllib.error.HTTPError:
        return True
    except OSError:
        return False
