"""Run the server under uvicorn, with a graceful SIGTERM drain.

On SIGTERM (or Ctrl-C) the server keeps listening but drains: ``/ready`` answers 503 (so a load
balancer stops sending traffic), new generation requests get 503, requests in flight run to the
end; once none is left — or ``drain_timeout_s`` has passed — uvicorn shuts down and the process
exits 0. A second signal exits at once.
"""
from __future__ import annotations

import logging
import signal
import threading
import time
from types import FrameType

import uvicorn

from specdecode.runtime.config import ServerConfig
from specdecode.runtime.server.serving import ServingState

log = logging.getLogger(__name__)


class DrainingServer(uvicorn.Server):
    """``uvicorn.Server`` whose exit signal starts a drain instead of closing the listener."""

    def __init__(self, config: uvicorn.Config, state: ServingState, drain_timeout_s: float):
        super().__init__(config)
        self.state = state
        self.drain_timeout_s = drain_timeout_s
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
        if self._drain_deadline is not None and not self.should_exit:
            if self.state.inflight == 0:
                log.info("drained: shutting down")
                self.should_exit = True
            elif time.monotonic() > self._drain_deadline:
                log.warning("drain timeout: %d request(s) still in flight", self.state.inflight)
                self.should_exit = True
        return await super().on_tick(counter)


def run_server(cfg: ServerConfig, log_level: str = "info") -> int:
    """Load the model, listen, warm up in the background (``/ready`` turns 200 after), serve, drain;
    the exit code. A pod of a tensor-parallel group other than node 0 only runs its ranks and probes."""
    if cfg.engine.parallel.node_rank > 0:
        from specdecode.runtime.parallel.worker_pod import serve_worker_pod

        return serve_worker_pod(cfg)
    from specdecode.runtime.engine.async_engine import AsyncEngine
    from specdecode.runtime.server.app import build_app

    engine = AsyncEngine.from_config(cfg.engine)
    app = build_app(engine, cfg)
    config = uvicorn.Config(app, host=cfg.host, port=cfg.port, log_level=log_level,
                            timeout_graceful_shutdown=5, access_log=False)
    server = DrainingServer(config, app.state.serving, cfg.drain_timeout_s)
    warm_up = threading.Thread(target=engine.start, name="specdecode-warmup", daemon=True)
    warm_up.start()
    try:
        server.run()
    finally:
        warm_up.join()
        engine.shutdown()
    return 0
