"""Helpers for tests that start real servers and process groups on this machine: a free port, waiting
for /ready, running a process tree under a hard deadline, finding the workers it spawned."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from contextlib import closing
from pathlib import Path

import httpx


def free_port() -> int:
    with closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_ready(proc: subprocess.Popen, url: str, log: Path, timeout: float = 120) -> None:
    """Until ``url``/ready answers 200; fails with the end of the server's ``log`` if it exits or times out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"server exited early:\n{log.read_text()[-4000:]}"
        try:
            if httpx.get(url + "/ready", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"server not ready after {timeout}s:\n{log.read_text()[-4000:]}")


def run_group(argv: list[str], deadline_s: float, cwd: Path) -> subprocess.CompletedProcess:
    """Run a process that spawns ranks; past the deadline, kill its whole process group."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cwd,
                            start_new_session=True, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    try:
        out, err = proc.communicate(timeout=deadline_s)
    finally:
        kill_group(proc)
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        return
    proc.wait(timeout=10)


def descendants(pid: int) -> set[int]:
    found, todo = set(), [pid]
    while todo:
        parent = todo.pop()
        try:
            children = Path(f"/proc/{parent}/task/{parent}/children").read_text().split()
        except FileNotFoundError:
            continue
        for child in map(int, children):
            found.add(child)
            todo.append(child)
    return found


def is_worker(pid: int) -> bool:
    try:
        return b"multiprocessing.spawn" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except FileNotFoundError:
        return False


def running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state not in ("Z", "X")


def start_serve(model: Path, port: int, log: Path, *flags: str, env: dict[str, str] | None = None,
                launcher: Path | None = None) -> subprocess.Popen:
    """``specdecode serve`` of ``model`` on the CPU with ``flags`` (e.g. a parallel layout), its own
    session (``kill_group`` takes the whole tree), output in ``log``. ``launcher``: a script run
    instead of the CLI module, with the same arguments (a test's fault injection, then the CLI's main)."""
    main = [str(launcher)] if launcher is not None else ["-m", "specdecode.runtime.cli"]
    cmd = [sys.executable, "-P", *main, "serve", "--model", str(model), "--no-weight-cache",
           "--device", "cpu", "--port", str(port), "--kv-cache-blocks", "64", "--log-level", "warning", *flags]
    with open(log, "w") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=log.parent, start_new_session=True,
                                env={**os.environ, "TOKENIZERS_PARALLELISM": "false", **(env or {})})
