"""Helpers for tests that start real servers on this machine: a free port, waiting for /ready."""
from __future__ import annotations

import socket
import subprocess
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
