"""The ``specdecode up`` family on the command line: ``up``, ``apply``, ``status``, ``down`` and
the rollout commands ``promote``, ``abort``, ``pause``, ``resume``, ``retry``. ``runtime/cli.py``
imports this module only once one of them is chosen."""
from __future__ import annotations

import argparse
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from specdecode.operator.local import up
from specdecode.operator.local.backend import specdecode_command
from specdecode.operator.local.store import default_root
from specdecode.operator.rollout import Command

DETACH_WAIT_SECONDS = 600.0


def add_arguments(name: str, parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--state-dir", type=Path, default=None,
                        help=f"where deployments keep their state (default {default_root()})")
    if name == "up":
        parser.add_argument("file", metavar="FILE", help="YAML with one SpecDecodeDeployment; saving it applies it")
        parser.add_argument("--port", type=int, default=up.DEFAULT_PORT, help="the router's port (default %(default)s)")
        parser.add_argument("--detach", action="store_true", help="run in the background once the router serves")
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


def run(name: str, args: argparse.Namespace) -> int:
    root = args.state_dir or default_root()
    try:
        if name == "up":
            return _detach(args, root) if args.detach else up.run(args.file, root=root, port=args.port, out=sys.stdout)
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
