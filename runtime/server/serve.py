"""Run the server under uvicorn, with a graceful SIGTERM drain.

On SIGTERM (or Ctrl-C) the server keeps listening but drains: ``/ready`` answers 503 (so a load
balancer stops sending traffic), new generation requests get 503, requests in flight run to the
end; once none is left, uvicorn shuts down and the process exits 0. If ``drain_timeout_s`` passes
first, the requests still running are cut — a stream ends with an error event and ``[DONE]``, a
non-streaming request gets a 503 — uvicorn waits at most ``CUT_GRACE_S`` for those answers to go
out, and the process exits ``EXIT_REQUESTS_CUT``. The engine is stopped only once the server's
event loop no longer waits on it. A second signal exits at once.

If the engine dies — a rank of its parallel group is gone or a step timed out (``--collective-timeout``)
— ``/health`` and ``/ready`` answer 503 at once and, ``DEAD_EXIT_S`` later, the process exits 1
(its workers with it), so the kubelet restarts the pod rather than keep a server that cannot
generate.

A model, draft model or MTP heads that cannot be served (``STARTUP_REFUSALS`` while the engine is
built) is refused in one line, without a traceback, exit code 1; the line also goes to the
container's termination message file, where the operator reads it into the
SpecDecodeDeployment's status (``Degraded``, reason ``RuntimeRefused``).
"""
from __future__ import annotations

import logging
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType

import uvicorn

from specdecode.runtime.config import ServerConfig
from specdecode.runtime.server.serving import DrainDeadlinePassed, ServingState

log = logging.getLogger(__name__)

# What building the engine raises for a model, draft model or MTP heads it cannot serve.
STARTUP_REFUSALS = (ValueError, FileNotFoundError, KeyError)
EXIT_REFUSED = 1
EXIT_ENGINE_DIED = 1
EXIT_REQUESTS_CUT = 1  # the drain's deadline cut requests that were still running
DEAD_EXIT_S = 5.0  # /health answers 503 this long before the process exits
CUT_GRACE_S = 2.0  # after the drain's deadline, the longest uvicorn waits for the cut requests' answers


def refuse(line: str, termination_message_path: Path | None) -> None:
    """Say why serving cannot start: ``line`` on stderr and in the termination message file, if
    its folder exists (in a pod it does; elsewhere there may be none to write)."""
    print(line, file=sys.stderr)
    if termination_message_path is None or not termination_message_path.parent.is_dir():
        return
    try:
        termination_message_path.write_text(line + "\n", encoding="utf-8")
    except OSError as exc:  # e.g. /dev outside a container, not writable
        log.debug("termination message not written: %s", exc)


def refusal_line(exc: Exception) -> str:
    """``exc`` as one line: our messages are written for users; a KeyError says only its key."""
    text = f"{type(exc).__name__}: {exc}" if isinstance(exc, KeyError) else str(exc)
    return "specdecode serve: cannot start: " + " ".join(text.split())


class DrainingServer(uvicorn.Server):
    """``uvicorn.Server`` whose exit signal starts a drain instead of closing the listener."""

    def __init__(self, config: uvicorn.Config, state: ServingState, drain_timeout_s: float,
                 engine_dead: Callable[[], bool], abort_all: Callable[[BaseException], None]):
        super().__init__(config)
        self.state = state
        self.drain_timeout_s = drain_timeout_s
        self.engine_dead = engine_dead
        self.abort_all = abort_all
        self.died_at: float | None = None
        self.num_cut = 0  # requests still running at the drain's deadline
        self._drain_deadline: float | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Not uvicorn's: it would re-raise the signal after shutdown, and the exit code would be -15.
        if self._drain_deadline is not None:
            log.warning("second %s: exiting without waiting", signal.Signals(sig).name)
            self.should_exit = self.force_exit = True
            return
        self.begin_drain()

    def begin_drain(self) -> None:
        log.info("draining: %d request(s) in flight, waiting up to %.0fs", self.state.inflight, self.drain_timeout_s)
        self.state.draining = True
        self._drain_deadline = time.monotonic() + self.drain_timeout_s

    async def on_tick(self, counter: int) -> bool:
        if self.died_at is None and self.engine_dead():
            log.error("the engine died (a rank of its group is gone, or a step timed out): exiting in %.0fs", DEAD_EXIT_S)
            self.died_at = time.monotonic()
            self.state.draining = True
        if self.died_at is not None and time.monotonic() - self.died_at > DEAD_EXIT_S:
            self.should_exit = True
        if self._drain_deadline is not None and not self.should_exit:
            if self.state.inflight == 0:
                log.info("drained: shutting down")
                self.should_exit = True
            elif time.monotonic() > self._drain_deadline:
                log.warning("drain timeout: cutting the %d request(s) still in flight", self.state.inflight)
                self.num_cut = self.state.inflight
                self.abort_all(DrainDeadlinePassed())
                self.should_exit = True
        return await super().on_tick(counter)


def run_server(cfg: ServerConfig, log_level: str = "info",
               termination_message_path: Path | None = None) -> int:
    """Load the model, listen, warm up in the background (``/ready`` turns 200 after), serve, drain;
    the exit code. A refusal to start also goes to ``termination_message_path``. A pod of a
    tensor-parallel group other than node 0 only runs its ranks and probes."""
    if cfg.engine.parallel.node_rank > 0:
        from specdecode.runtime.parallel.worker_pod import serve_worker_pod

        return serve_worker_pod(cfg)
    from specdecode.runtime.engine.async_engine import AsyncEngine
    from specdecode.runtime.server.app import build_app

    try:
        engine = AsyncEngine.from_config(cfg.engine)
    except STARTUP_REFUSALS as exc:
        log.debug("refused at start", exc_info=True)  # the traceback, for --log-level debug
        refuse(refusal_line(exc), termination_message_path)
        return EXIT_REFUSED
    app = build_app(engine, cfg)
    config = uvicorn.Config(app, host=cfg.host, port=cfg.port, log_level=log_level,
                            timeout_graceful_shutdown=CUT_GRACE_S, access_log=False)
    server = DrainingServer(config, app.state.serving, cfg.drain_timeout_s, lambda: engine.dead, engine.abort_all)
    warm_up = threading.Thread(target=engine.start, name="specdecode-warmup", daemon=True)
    warm_up.start()
    try:
        server.run()
    finally:
        warm_up.join()
        engine.shutdown()
    if server.died_at is not None:
        return EXIT_ENGINE_DIED
    if server.num_cut:
        log.error("exiting %d: the drain's deadline cut %d request(s)", EXIT_REQUESTS_CUT, server.num_cut)
        return EXIT_REQUESTS_CUT
    return 0
