"""The HTTP server's test harness: a real uvicorn on a free port in a thread, the tiny engine, and
helpers to post, read SSE and check OpenAI error bodies. Every network call has a timeout and every
wait is bounded, so a broken server fails a test, never hangs it."""
from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import httpx
import uvicorn

from specdecode.runtime.config import CacheConfig, EngineConfig, LoadConfig, SchedulerConfig, ServerConfig
from specdecode.runtime.engine.async_engine import AsyncEngine
from specdecode.runtime.server.app import build_app

TIMEOUT = httpx.Timeout(120.0, connect=10.0)
CHAT = [{"role": "user", "content": "hello there"}]


def wait_until(condition: Callable[[], bool], timeout: float = 60.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.02)


@contextmanager
def serve(engine: AsyncEngine, **server_fields) -> Iterator[str]:
    """A fresh app (own metrics registry) for ``engine`` under uvicorn in a thread named
    ``uvicorn-PORT`` (its event loop's); yields its URL."""
    cfg = ServerConfig(engine=EngineConfig(cache=CacheConfig(block_size=16)), **server_fields)
    app = build_app(engine, cfg)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, timeout_graceful_shutdown=5))
    port = sock.getsockname()[1]
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True, name=f"uvicorn-{port}")
    thread.start()
    wait_until(lambda: server.started or not thread.is_alive(), 30, "uvicorn to start")
    assert server.started, "uvicorn did not start"
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()
        assert not thread.is_alive(), "uvicorn did not stop"


@contextmanager
def started(engine: AsyncEngine) -> Iterator[AsyncEngine]:
    """``engine`` stepping (warmed up) until the block ends."""
    engine.start()
    try:
        yield engine
    finally:
        engine.shutdown()


@contextmanager
def serving(engine: AsyncEngine) -> Iterator[str]:
    """``engine`` started and served; its URL."""
    with started(engine), serve(engine) as url:
        yield url


@contextmanager
def serving_with_ngram(make_engine, model, tokenizer) -> Iterator[str]:
    """``model`` served as "tiny" with n-gram speculation (3 tokens) on; ``make_engine`` is conftest's fixture."""
    engine = make_engine(model, tokenizer, spec={"method": "ngram", "num_speculative_tokens": 3})
    with serving(AsyncEngine(engine, "tiny", 8)) as url:
        yield url


def tiny_engine(model_dir, **scheduler) -> AsyncEngine:
    cfg = EngineConfig(
        load=LoadConfig(model=str(model_dir), weight_cache_dir=None),
        cache=CacheConfig(block_size=16, num_blocks=256),
        scheduler=SchedulerConfig(**scheduler),
    )
    return AsyncEngine.from_config(cfg)


def post(url: str, path: str, body, **kwargs) -> httpx.Response:
    content = body if isinstance(body, (bytes, str)) else json.dumps(body)
    headers = {"Content-Type": "application/json", **kwargs.pop("headers", {})}
    return httpx.post(url + path, content=content, headers=headers, timeout=kwargs.pop("timeout", TIMEOUT), **kwargs)


def sse_payloads(lines: Iterator[str]) -> Iterator[dict | str]:
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: "):]
            yield data if data == "[DONE]" else json.loads(data)


def all_blocks_free(engine: AsyncEngine) -> bool:
    s = engine.stats()
    return s.num_running == 0 and s.num_waiting == 0 and s.num_free_blocks == s.num_total_blocks


def check_error(r: httpx.Response, status: int, param: str | None, code: str | None) -> None:
    """An OpenAI error body with this status, param and code, whose message names the param."""
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param and error["code"] == code, error
    assert error["message"] and "Traceback" not in error["message"]
    if param:
        assert param.split("[")[0].split(".")[0] in error["message"]
