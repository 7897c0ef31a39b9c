"""Hardening of the HTTP front (issue 20), one test per item: hostile JSON is a 400, a body past the
limit a 413 refused while reading, tokenization off the event loop, server-made response ids, a
computed Retry-After, an exact waiting cap, and a drain deadline that ends cut streams with an error
event and exits non-zero. The tiny random model serves; the drain runs ``specdecode serve`` itself.
"""
from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
from local_process import free_port, wait_ready
from server_harness import (
    CHAT,
    TIMEOUT,
    check_error,
    post,
    serve,
    sse_payloads,
    started,
    tiny_engine,
    wait_until,
)

from specdecode.runtime.serve_flags import serve_parser
from specdecode.runtime.engine.async_engine import FinishRate
from specdecode.runtime.server.body import default_max_request_bytes
from specdecode.runtime.server.errors import MAX_RETRY_AFTER_S, overloaded

LONG = {"prompt": "hello", "max_tokens": 2000, "ignore_eos": True}


@pytest.fixture(scope="module")
def engine(tiny_hf_model_dir):
    with started(tiny_engine(tiny_hf_model_dir)) as engine:
        yield engine


@pytest.fixture(scope="module")
def url(engine):
    with serve(engine) as url:
        yield url


# ---------------------------------------------------------------------------- hostile JSON

HOSTILE_JSON = [
    # (id, raw body, param, code, said)
    ("5000-digit integer", b'{"prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}", None, "invalid_json",
     "Exceeds the limit"),
    ("100000 nested [", b"[" * 100_000, None, "invalid_json", "nested too deeply"),
    ("5000-deep object", b'{"a":' * 5000 + b"1" + b"}" * 5000, None, "invalid_json", "nested too deeply"),
    ("lone surrogate in a message",
     b'{"messages": [{"role": "user", "content": "hi \\ud800 there"}]}', "messages[0].content", "invalid_unicode",
     "surrogate"),
    ("lone surrogate in a stop list", b'{"messages": [{"role": "user", "content": "hi"}], "stop": ["a", "\\udfff"]}',
     "stop[1]", "invalid_unicode", "surrogate"),
]


@pytest.mark.parametrize("body,param,code,said", [case[1:] for case in HOSTILE_JSON],
                         ids=[case[0] for case in HOSTILE_JSON])
def test_hostile_json_is_a_400_naming_what_is_wrong(url, body, param, code, said):
    r = post(url, "/v1/chat/completions", body)
    check_error(r, 400, param, code)
    assert said in r.json()["error"]["message"]


def test_a_valid_surrogate_pair_is_text(url):
    r = post(url, "/tokenize", b'{"prompt": "smile \\ud83d\\ude00"}')
    assert r.status_code == 200 and r.json()["count"] > 0


# ------------------------------------------------------------------------- request size


def raw_exchange(port: int, head: bytes, chunks: list[bytes]) -> bytes:
    """Send ``head`` then ``chunks`` on a raw socket, never finishing the body; the response so far."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(head)
        for chunk in chunks:
            sock.sendall(chunk)
        response = b""
        while b"\r\n\r\n" not in response or not response.rstrip().endswith(b"}"):
            data = sock.recv(65536)
            if not data:
                break
            response += data
    return response


def parse_response(raw: bytes) -> tuple[int, dict]:
    head, _, body = raw.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), json.loads(body)


def test_a_body_past_the_limit_is_refused_with_413_while_reading(engine):
    limit = 4096
    with serve(engine, max_request_bytes=limit) as url:
        port = int(url.rsplit(":", 1)[1])
        # Declared too large: refused from the headers, before the server reads a byte of the body.
        declared = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    b"Content-Length: 5000000\r\n\r\n")
        status, body = parse_response(raw_exchange(port, declared, []))
        assert status == 413 and body["error"]["code"] == "request_too_large"
        assert set(body["error"]) == {"message", "type", "param", "code"} and str(limit) in body["error"]["message"]
        # Sent in chunks without a length: refused once the count passes the limit, the body never finished.
        chunked = (b"POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                   b"Transfer-Encoding: chunked\r\n\r\n")
        kib = b"400\r\n" + b" " * 1024 + b"\r\n"
        status, body = parse_response(raw_exchange(port, chunked, [kib] * 5))
        assert status == 413 and body["error"]["code"] == "request_too_large"
        # The limit itself is allowed.
        prompt = "x" * (limit - len('{"prompt": ""}'))
        assert post(url, "/tokenize", {"prompt": prompt}).status_code == 200
        check_error(post(url, "/tokenize", {"prompt": prompt + "x"}), 413, None, "request_too_large")


def test_the_default_limit_is_sized_from_the_context_and_at_least_1_mib(url):
    assert default_max_request_bytes(2048) == 1 << 20
    assert default_max_request_bytes(128 * 1024) == 8 << 20
    args = serve_parser().parse_args(["--max-request-bytes", "5000"])
    assert args.max_request_bytes == 5000
    filler = b'{"prompt": "' + b"x" * ((1 << 20) - 14) + b'"}'
    assert len(filler) == 1 << 20 and post(url, "/tokenize", filler).status_code == 200
    check_error(post(url, "/tokenize", filler + b" "), 413, None, "request_too_large")


# ------------------------------------------------------------------- off the event loop


class RecordingTokenizer:
    """The engine's tokenizer, recording for every encode/decode/template call whether the calling
    thread runs an event loop."""

    def __init__(self, inner):
        self.inner = inner
        self.calls: list[tuple[str, int, bool]] = []

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def _record(self, what: str) -> None:
        try:
            asyncio.get_running_loop()
            on_loop = True
        except RuntimeError:
            on_loop = False
        self.calls.append((what, threading.get_ident(), on_loop))

    def encode(self, *args, **kwargs):
        self._record("encode")
        return self.inner.encode(*args, **kwargs)

    def decode(self, *args, **kwargs):
        self._record("decode")
        return self.inner.decode(*args, **kwargs)

    def apply_chat_template(self, *args, **kwargs):
        self._record("apply_chat_template")
        return self.inner.apply_chat_template(*args, **kwargs)


@pytest.mark.parametrize("path,body,expect", [
    ("/v1/completions", {"prompt": "hello there", "max_tokens": 2}, {"encode"}),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 2}, {"encode", "apply_chat_template"}),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 2, "stream": True}, {"encode", "apply_chat_template"}),
    ("/tokenize", {"prompt": "hello there"}, {"encode"}),
    ("/tokenize", {"messages": CHAT}, {"encode", "apply_chat_template"}),
    ("/detokenize", {"tokens": [5, 6, 7]}, {"decode"}),
])
def test_tokenization_runs_off_the_event_loop(engine, monkeypatch, path, body, expect):
    recorder = RecordingTokenizer(engine.engine.tokenizer)
    monkeypatch.setattr(engine.engine, "tokenizer", recorder)
    with serve(engine) as url:  # a fresh app: it takes the recorder
        loop_thread = loop_thread_of(url)
        assert post(url, path, body).status_code == 200
    server_calls = [(what, ident) for what, ident, on_loop in recorder.calls if what in expect]
    assert {what for what, _ in server_calls} == expect
    assert all(ident != loop_thread for _, ident in server_calls)
    assert not [call for call in recorder.calls if call[2]], "a tokenizer call ran on a thread with an event loop"


def loop_thread_of(url: str) -> int:
    """The ident of the thread running the event loop of the harness's server at ``url``."""
    (thread,) = [t for t in threading.enumerate() if t.name == f"uvicorn-{url.rsplit(':', 1)[1]}"]
    return thread.ident


# ------------------------------------------------------------------------------ ids


def test_response_ids_are_the_servers_own(url, engine):
    same = {"X-Request-Id": "client-chosen"}
    ids = []
    for path, body in (("/v1/completions", {"prompt": "hi", "max_tokens": 1}),
                       ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 1})):
        for _ in range(2):
            r = post(url, path, body, headers=same)
            assert r.headers["x-request-id"] == "client-chosen"
            ids.append(r.json()["id"])
    assert [i.split("-")[0] for i in ids] == ["cmpl", "cmpl", "chatcmpl", "chatcmpl"]
    assert len(set(ids)) == 4 and not any("client-chosen" in i for i in ids)
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120,
                           default_headers=same)
    chunks = list(client.chat.completions.create(model=engine.model_name, messages=CHAT, max_tokens=3, stream=True))
    assert len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("chatcmpl-") and chunks[0].id not in ids


# ------------------------------------------------------------------- overload: 503s


def test_retry_after_is_the_queue_over_the_finish_rate_and_grows_with_the_queue():
    now = [100.0]
    rate = FinishRate(window_s=60.0, clock=lambda: now[0])
    assert rate.per_second() == 1.0  # started, nothing finished yet: as if one had, over at least a second
    now[0] += 30
    rate.record(10)
    assert rate.per_second() == pytest.approx(10 / 30)
    now[0] += 90  # all ten past the window: one over the 60 s window
    assert rate.per_second() == pytest.approx(1 / 60)
    retry = [int(overloaded("full", waiting / 2.0).headers["Retry-After"]) for waiting in range(0, 200, 10)]
    assert retry == sorted(retry) and retry[0] == 1 and retry[-1] == MAX_RETRY_AFTER_S and len(set(retry)) > 5


def test_a_full_queue_answers_503_with_a_retry_after_that_grows_with_the_queue(tiny_hf_model_dir):
    engine = tiny_engine(tiny_hf_model_dir, max_num_seqs=1, max_waiting_requests=1)
    engine.start()
    now = [0.0]
    engine.finish_rate = FinishRate(clock=lambda: now[0])  # a clock that moves only when told
    now[0] = 30.0
    engine.finish_rate.record(15)  # 15 finished in the 30 s since the start: 1/2 request a second

    tasks: list[asyncio.Task] = []

    async def fill_then_refuse(http: httpx.AsyncClient, cap: int) -> httpx.Response:
        engine.max_waiting_requests = cap
        tasks.extend(asyncio.create_task(http.post("/v1/completions", json=LONG))
                     for _ in range(cap - engine.num_waiting))
        await wait_async(lambda: engine.num_waiting == cap)
        return await http.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})

    async def scenario() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as http:
            tasks.append(asyncio.create_task(http.post("/v1/completions", json={**LONG, "stream": True})))
            await wait_async(lambda: engine.stats().num_running == 1)
            refusals = [await fill_then_refuse(http, 1), await fill_then_refuse(http, 4)]
            assert not any(task.done() for task in tasks)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            return refusals

    try:
        with serve(engine) as url:
            one, four = asyncio.run(asyncio.wait_for(scenario(), 120))
            wait_until(lambda: engine.num_waiting == 0 and engine.stats().num_running == 0, 60, "the queue to empty")
    finally:
        engine.shutdown()
    for refused in (one, four):
        check_error(refused, 503, None, "overloaded")
    assert (one.headers["retry-after"], four.headers["retry-after"]) == ("2", "8")  # 1 and 4 waiting, 1/2 a second


async def wait_async(condition, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


def test_the_waiting_cap_is_never_exceeded_by_concurrent_requests(tiny_hf_model_dir, monkeypatch):
    """24 requests, 5 ms apart, against one seat and a queue of 3: exactly 3 are admitted, the rest
    get 503. Admission into the engine is slowed and steps keep running, so a cap read from a figure
    the engine thread updates after admitting (or once per step) would let more in."""
    cap, fired = 3, 24
    engine = tiny_engine(tiny_hf_model_dir, max_num_seqs=1, max_waiting_requests=cap)
    engine.start()
    admitted: list[int] = []  # the scheduler's waiting queue after each admission
    real_add, real_step = engine.engine.add_request, engine.engine.step

    def slow_add(*args, **kwargs):
        time.sleep(0.05)
        real_add(*args, **kwargs)
        admitted.append(len(engine.engine.scheduler.waiting))

    def slow_step():
        time.sleep(0.002)  # the seat holder's 2000 tokens outlast the burst
        return real_step()

    monkeypatch.setattr(engine.engine, "add_request", slow_add)
    monkeypatch.setattr(engine.engine, "step", slow_step)

    async def scenario() -> tuple[list[int], list[int]]:
        async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as http:
            holder = asyncio.create_task(http.post("/v1/completions", json={**LONG, "stream": True}))
            await wait_async(lambda: engine.stats().num_running == 1)
            burst = []
            for _ in range(fired):
                burst.append(asyncio.create_task(http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1})))
                await asyncio.sleep(0.005)
            await wait_async(lambda: sum(t.done() for t in burst) + len(admitted) - 1 == fired)  # each answered
            refused = [t.result().status_code for t in burst if t.done()]
            holder.cancel()  # the seat frees: the admitted three run
            await asyncio.gather(holder, return_exceptions=True)
            return refused, [(await t).status_code for t in burst]

    try:
        with serve(engine) as url:
            refused, statuses = asyncio.run(asyncio.wait_for(scenario(), 120))
            wait_until(lambda: engine.num_waiting == 0, 30, "every seat to be given back")
    finally:
        engine.shutdown()
    assert refused == [503] * (fired - cap)
    assert sorted(statuses) == [200] * cap + [503] * (fired - cap)
    assert len(admitted) == 1 + cap and max(admitted) <= cap  # the holder, then exactly the cap


# -------------------------------------------------------------------------------- drain


def test_the_drain_deadline_ends_cut_streams_with_an_error_event_and_exits_nonzero(tiny_hf_model_dir, tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "serve.log"
    cmd = [sys.executable, "-P", "-m", "specdecode.runtime.cli", "serve", "--model", str(tiny_hf_model_dir),
           "--no-weight-cache", "--port", str(port), "--kv-cache-blocks", "256", "--max-num-seqs", "1",
           "--drain-timeout", "0.5", "--log-level", "info"]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=tmp_path,
                                env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    try:
        wait_ready(proc, url, log)

        async def scenario() -> tuple[list, httpx.Response]:
            async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as http:
                async with http.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as stream:
                    lines = stream.aiter_lines()
                    first = await anext(lines)
                    waiting = asyncio.create_task(http.post("/v1/completions", json=LONG))  # behind the one seat
                    await wait_async_metric(http, "specdecode:num_requests_waiting 1.0")
                    proc.send_signal(signal.SIGTERM)
                    rest = [line async for line in lines]
                return [first, *rest], await waiting

        lines, waiting = asyncio.run(asyncio.wait_for(scenario(), 120))
        code = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    text = log.read_text()
    payloads = list(sse_payloads(iter(lines)))
    assert payloads[-1] == "[DONE]", text
    check_error_body(payloads[-2], "overloaded")
    assert all("choices" in p for p in payloads[:-2])
    check_error(waiting, 503, None, "overloaded")
    assert 1 <= int(waiting.headers["retry-after"]) <= MAX_RETRY_AFTER_S
    assert code == 1, text
    assert "cut: the server shut down before this request finished" in text and "exiting 1: the drain's deadline cut 2 request(s)" in text
    for never in ("Event loop is closed", "Traceback", "timeout graceful shutdown exceeded"):
        assert never not in text, text


async def wait_async_metric(http: httpx.AsyncClient, line: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while line not in (await http.get("/metrics")).text.splitlines():
        assert time.monotonic() < deadline, f"timed out waiting for {line!r} in /metrics"
        await asyncio.sleep(0.02)


def check_error_body(payload: dict, code: str) -> None:
    assert set(payload) == {"error"} and set(payload["error"]) == {"message", "type", "param", "code"}
    assert payload["error"]["code"] == code and payload["error"]["message"]
