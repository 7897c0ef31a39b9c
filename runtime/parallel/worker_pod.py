"""A pod of a multi-pod tensor-parallel group other than node 0: its ranks, and two probes.

It serves no API (the traffic Service selects only leaders), just what the kubelet probes:
``/health`` (200 while every local rank runs) and ``/ready`` (200 once every local rank joined
the group). It exits when its ranks do: 0 when rank 0 told them to stop, 1 when one failed (the
kubelet then restarts the pod); SIGTERM stops the ranks at once and exits 0.
"""
from __future__ import annotations

import logging
import signal
import sys
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import FrameType

from specdecode.runtime.config import ServerConfig
from specdecode.runtime.parallel.workers import LocalWorkers

log = logging.getLogger(__name__)
WORKER_EXIT_GRACE_S = 30.0


def serve_worker_pod(cfg: ServerConfig) -> int:
    """Run this pod's ranks (they meet rank 0 at MASTER_ADDR:MASTER_PORT) and the probes; the exit code."""
    par = cfg.engine.parallel
    workers = LocalWorkers(cfg.engine, par.local_ranks, par.master_addr, par.master_port)
    probes = {"/health": lambda: workers.alive, "/ready": lambda: workers.joined}
    server = ThreadingHTTPServer((cfg.host, cfg.port), _probe_handler(probes))
    threading.Thread(target=server.serve_forever, name="specdecode-probes", daemon=True).start()
    log.info("node %d: ranks %s, probes on %s:%d", par.node_rank, list(par.local_ranks), cfg.host, cfg.port)
    signal.signal(signal.SIGTERM, _exit_on_signal)
    grace = 0.0  # on a signal: stop the ranks at once
    try:
        workers.wait_any_exit()
        grace = WORKER_EXIT_GRACE_S  # the others follow when rank 0 said stop
    finally:
        workers.stop(grace)
        server.shutdown()
    codes = workers.exit_codes
    log.info("ranks exited with %s", codes)
    return 0 if all(code == 0 for code in codes) else 1


def _exit_on_signal(sig: int, frame: FrameType | None) -> None:
    log.info("%s: stopping this pod's ranks", signal.Signals(sig).name)
    sys.exit(0)


def _probe_handler(probes: dict[str, Callable[[], bool]]) -> type[BaseHTTPRequestHandler]:
    class ProbeHandler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            probe = probes.get(self.path)
            status = 404 if probe is None else 200 if probe() else 503
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"{}")

        def log_message(self, format: str, *args: object) -> None:  # probes every few seconds: not worth a line
            pass

    return ProbeHandler
