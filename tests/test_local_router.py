"""The local router of `specdecode up`: the pure chooser (weights in every window of 100, skipped
revisions, fewest in flight), and the HTTP router against aiohttp stand-ins for runtime replicas:
streaming, pass-through, retries before headers, holding, draining, weights acknowledged, health,
metrics; the official openai client through it."""
from __future__ import annotations

import asyncio
import json
import logging
import random
import sys
import threading
import urllib.request
from collections import Counter
from collections.abc import AsyncIterator, Coroutine, Iterator, Mapping
from contextlib import asynccontextmanager, contextmanager
from typing import Any, TypeVar

import aiohttp
import openai
import pytest
from aiohttp import web
from yarl import URL

from specdecode.operator.local.router import Chooser, Router, RouterConfig, RouterThread

T = TypeVar("T")
TIMEOUT_S = 10


def run(scenario: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(asyncio.wait_for(scenario, TIMEOUT_S))


async def until(predicate) -> None:
    while not predicate():
        await asyncio.sleep(0.002)


# -- the pure chooser ----------------------------------------------------------------------------
def chooser(weights: Mapping[str, int], replicas: int = 1) -> Chooser:
    c = Chooser()
    for name in weights:
        c.set_revision(name, {f"{name}-{i}": f"http://{name}-{i}" for i in range(replicas)})
        for i in range(replicas):
            c.set_ready(name, f"{name}-{i}", True)
    c.set_weights(weights)
    return c


def random_weights(rng: random.Random) -> dict[str, int]:
    n = rng.randint(2, 6)
    cuts = sorted(rng.randint(0, 100) for _ in range(n - 1))
    return {f"r{i}": b - a for i, (a, b) in enumerate(zip([0, *cuts], [*cuts, 100]))}


def assert_windows(picked: list[str], weights: Mapping[str, int]) -> None:
    """Each revision's count in every 100 consecutive picks is its weight ± 2."""
    counts = Counter(picked[:100])
    for start in range(len(picked) - 99):
        if start:
            counts[picked[start - 1]] -= 1
            counts[picked[start + 99]] += 1
        assert all(abs(counts[name] - weight) <= 2 for name, weight in weights.items()), (start, counts, weights)


def test_weights_hold_in_every_window_of_100():
    rng = random.Random(7)
    for _ in range(60):
        weights = random_weights(rng)
        c = chooser(weights, replicas=rng.randint(1, 3))
        assert_windows([c.pick().revision for _ in range(300)], weights)


def test_a_revision_without_servable_replicas_gives_its_share_to_the_others():
    c = chooser({"a": 20, "b": 30, "c": 50})
    c.set_ready("c", "c-0", False)
    picked = [c.pick().revision for _ in range(500)]
    assert "c" not in picked
    assert_windows(picked, {"a": 40, "b": 60})
    c.set_ready("c", "c-0", True)
    c.drain("a", "a-0")
    c.set_ready("a", "a-0", True)  # a probe saying ready again does not undo the drain
    assert "a" not in [c.pick().revision for _ in range(100)]
    c.set_ready("a", "a-0", False)
    c.set_ready("a", "a-0", True)  # a new process
    assert "a" in [c.pick().revision for _ in range(100)]


def test_weight_zero_is_never_picked_and_nothing_eligible_picks_none():
    c = chooser({"a": 100, "b": 0})
    assert {c.pick().revision for _ in range(200)} == {"a"}
    assert c.weights() == {"a": 100}
    c.set_ready("a", "a-0", False)
    assert c.pick() is None and c.pick_any() is None and not c.servable()


def test_fewest_in_flight_first_ties_in_turn_and_exclusions():
    c = chooser({"a": 100}, replicas=3)
    assert sorted(c.pick().id for _ in range(6)) == ["a-0", "a-0", "a-1", "a-1", "a-2", "a-2"]
    busy = c.replica("a", "a-0")
    busy.in_flight = 1
    assert {c.pick().id for _ in range(6)} == {"a-1", "a-2"}
    assert c.pick(exclude=[c.replica("a", "a-1"), c.replica("a", "a-2")]) is busy
    assert c.pick(exclude=[c.replica("a", f"a-{i}") for i in range(3)]) is None


def test_pick_any_takes_the_heaviest_revision_without_moving_the_round():
    c = chooser({"a": 30, "b": 70})
    assert {c.pick_any().revision for _ in range(10)} == {"b"}
    assert_windows([c.pick().revision for _ in range(200)], {"a": 30, "b": 70})


def test_setting_replicas_keeps_the_state_of_those_kept():
    c = chooser({"a": 100}, replicas=2)
    c.set_revision("a", {"a-0": "http://a-0", "a-1": "http://moved", "a-2": "http://a-2"})
    assert c.replica("a", "a-0").ready and not c.replica("a", "a-1").ready and not c.replica("a", "a-2").ready
    c.remove_revision("a")
    with pytest.raises(KeyError):
        c.replica("a", "a-0")


@pytest.mark.parametrize("weights", [{"a": 50}, {"a": 60, "b": 50}, {"a": 110, "b": -10}, {"a": 50.0, "b": 50},
                                     {"a": 50, "zz": 50}])
def test_weights_must_be_known_ints_summing_to_100(weights):
    c = chooser({"a": 100, "b": 0})
    with pytest.raises(ValueError):
        c.set_weights(weights)
    assert c.weights() == {"a": 100}


# -- stand-ins for runtime replicas --------------------------------------------------------------
class StandIn:
    """A runtime replica stand-in that answers with its name. A chat request with ``"gate": true``
    streams its first chunk, then waits for ``gate``; ``"cut": true`` drops the connection after it;
    ``"endless": true`` streams until the router hangs up."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.seen: list[dict[str, Any]] = []
        self.gate = asyncio.Event()
        self.abandoned = asyncio.Event()
        self._runner: web.AppRunner | None = None

    async def start(self) -> str:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_route("*", "/v1/echo", self.echo)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.1)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", 0).start()
        return f"http://127.0.0.1:{self._runner.addresses[0][1]}"

    async def stop(self) -> None:
        self.gate.set()
        await self._runner.cleanup()

    async def record(self, request: web.Request) -> dict[str, Any]:
        body = await request.read()
        self.seen.append({"method": request.method, "raw_path": request.raw_path, "headers": dict(request.headers),
                          "body": body.decode()})
        return json.loads(body) if body else {}

    async def echo(self, request: web.Request) -> web.Response:
        await self.record(request)
        return web.json_response({"replica": self.name, **self.seen[-1]}, headers={"X-Replica": self.name})

    async def models(self, request: web.Request) -> web.Response:
        await self.record(request)
        return web.json_response({"object": "list", "data": [{"id": "m", "object": "model", "created": 0,
                                                               "owned_by": self.name}]})

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(text=f'standin_info{{replica="{self.name}"}} 1\n', content_type="text/plain")

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await self.record(request)
        if not body.get("stream"):
            return web.json_response(completion(self.name))
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "X-Replica": self.name})
        await response.prepare(request)
        if body.get("endless"):
            return await self.endless(response)
        for i, piece in enumerate([self.name, " says", " hi"]):
            await response.write(f"data: {json.dumps(chunk(piece))}\n\n".encode())
            if i == 0 and body.get("cut"):
                request.transport.close()
                return response
            if i == 0 and body.get("gate"):
                await self.gate.wait()
        await response.write(b"data: [DONE]\n\n")
        return response


    async def endless(self, response: web.StreamResponse) -> web.StreamResponse:
        """Stream until the router hangs up, then set ``abandoned``."""
        try:
            while True:
                await response.write(f"data: {json.dumps(chunk(self.name))}\n\n".encode())
                await asyncio.sleep(0.001)
        except ConnectionResetError:
            self.abandoned.set()
        return response


def completion(content: str) -> dict[str, Any]:
    return {"id": "c", "object": "chat.completion", "created": 0, "model": "m",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}


def chunk(content: str) -> dict[str, Any]:
    return {"id": "c", "object": "chat.completion.chunk", "created": 0, "model": "m",
            "choices": [{"index": 0, "delta": {"content": content}, "finish_reason": None}]}


class Refuser:
    """A replica that dies before its response headers: reads the request's first bytes and closes."""

    def __init__(self) -> None:
        self.connections = 0

    async def start(self) -> str:
        self._server = await asyncio.start_server(self.close, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    async def close(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        await reader.read(1)
        writer.close()

    async def stop(self) -> None:
        self._server.close()


Setup = tuple[Router, dict[str, StandIn], str]


@asynccontextmanager
async def routed(revisions: Mapping[str, list[str]], weights: Mapping[str, int],
                 config: RouterConfig | None = None, ready: bool = True) -> AsyncIterator[Setup]:
    """Stand-ins named ``revision/replica``, all ready (unless ``ready=False``), behind a router."""
    stand_ins = {f"{rev}/{rid}": StandIn(f"{rev}/{rid}") for rev, rids in revisions.items() for rid in rids}
    router = Router(config)
    await router.start("127.0.0.1", 0)
    try:
        for rev, rids in revisions.items():
            router.set_revision(rev, {rid: await stand_ins[f"{rev}/{rid}"].start() for rid in rids})
            for rid in rids:
                router.set_ready(rev, rid, ready)
        router.set_weights(weights)
        yield router, stand_ins, f"http://127.0.0.1:{router.port}"
    finally:
        await router.stop()
        for stand_in in stand_ins.values():
            await stand_in.stop()


def sample(router: Router, name: str, **labels: str) -> float:
    return router.metrics.registry.get_sample_value(name, labels) or 0.0


async def echo(http: aiohttp.ClientSession, base: str) -> str:
    async with http.get(f"{base}/v1/echo") as response:
        assert response.status == 200
        return (await response.json())["replica"]


# -- the router over HTTP ------------------------------------------------------------------------
def test_weights_through_http_in_every_window():
    async def scenario() -> list[str]:
        async with routed({"a": ["0", "1"], "b": ["0"]}, {"a": 30, "b": 70}) as (router, _, base):
            async with aiohttp.ClientSession() as http:
                return [(await echo(http, base)).split("/")[0] for _ in range(120)]
    assert_windows(run(scenario()), {"a": 30, "b": 70})


def test_weight_zero_and_unready_replicas_get_nothing():
    async def scenario() -> set[str]:
        async with routed({"a": ["0", "1"], "b": ["0"]}, {"a": 100, "b": 0}) as (router, _, base):
            router.set_ready("a", "1", False)
            async with aiohttp.ClientSession() as http:
                return {await echo(http, base) for _ in range(10)}
    assert run(scenario()) == {"a/0"}


def test_openai_client_chat_and_stream_pass_authorization_and_body():
    async def scenario() -> tuple[str, str, list[str], StandIn]:
        async with routed({"a": ["0"]}, {"a": 100}) as (router, stand_ins, base):
            client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="sk-router-test", max_retries=0)
            messages = [{"role": "user", "content": "hello"}]
            done = await client.chat.completions.create(model="m", messages=messages)
            stream = await client.chat.completions.create(model="m", messages=messages, stream=True)
            pieces = [c.choices[0].delta.content async for c in stream]
            models = await client.models.list()
            await client.close()
            return done.choices[0].message.content, models.data[0].owned_by, pieces, stand_ins["a/0"]
    content, owner, pieces, stand_in = run(scenario())
    assert content == "a/0" and owner == "a/0" and "".join(pieces) == "a/0 says hi"
    chat = stand_in.seen[0]
    assert chat["headers"]["Authorization"] == "Bearer sk-router-test"
    assert json.loads(chat["body"])["messages"] == [{"role": "user", "content": "hello"}]


def test_method_query_headers_and_body_pass_through_without_hop_by_hop_headers():
    async def scenario() -> tuple[dict, dict]:
        async with routed({"a": ["0"]}, {"a": 100}) as (_, _, base):
            async with aiohttp.ClientSession() as http:
                headers = {"Authorization": "Bearer k", "X-Custom": "1", "Connection": "X-Drop", "X-Drop": "1",
                           "Keep-Alive": "timeout=5"}
                async with http.put(URL(f"{base}/v1/echo?x=1&y=%2F", encoded=True), data=b'{"n": 1}', headers=headers) as response:
                    return await response.json(), dict(response.headers)
    seen, headers = run(scenario())
    assert seen["method"] == "PUT" and seen["raw_path"] == "/v1/echo?x=1&y=%2F" and seen["body"] == '{"n": 1}'
    assert seen["headers"]["Authorization"] == "Bearer k" and seen["headers"]["X-Custom"] == "1"
    assert "X-Drop" not in seen["headers"] and "Keep-Alive" not in seen["headers"]
    assert headers["X-Replica"] == "a/0"


async def gated_stream(http: aiohttp.ClientSession, base: str) -> tuple[aiohttp.ClientResponse, bytes]:
    """A streaming chat request held open by its replica's gate, with its first chunk read."""
    response = await http.post(f"{base}/v1/chat/completions", json={"stream": True, "gate": True})
    assert response.headers["Content-Type"].startswith("text/event-stream")
    return response, await response.content.readuntil(b"\n\n")


def test_sse_chunks_reach_the_client_before_the_replica_finishes():
    async def scenario() -> tuple[bytes, bytes]:
        async with routed({"a": ["0"]}, {"a": 100}) as (_, stand_ins, base):
            async with aiohttp.ClientSession() as http:
                response, first = await gated_stream(http, base)  # the replica now waits for its gate
                stand_ins["a/0"].gate.set()
                return first, await response.read()
    first, rest = run(scenario())
    assert json.loads(first.removeprefix(b"data: "))["choices"][0]["delta"]["content"] == "a/0"
    assert rest.endswith(b"data: [DONE]\n\n")


def test_a_replica_dying_before_headers_is_retried_elsewhere():
    async def scenario() -> tuple[list[str], int, float]:
        refuser = Refuser()
        async with routed({"a": ["good"]}, {"a": 100}) as (router, stand_ins, base):
            router.set_revision("a", {"good": router.chooser.replica("a", "good").url, "dead": await refuser.start()})
            router.set_ready("a", "dead", True)
            async with aiohttp.ClientSession() as http:
                answers = [await echo(http, base) for _ in range(4)]
            await refuser.stop()
            return answers, refuser.connections, sample(router, "specdecode_router_retries_total", revision="a")
    answers, connections, retries = run(scenario())
    assert answers == ["a/good"] * 4
    assert connections >= 1 and retries == connections


def test_every_replica_failing_before_headers_answers_502():
    async def scenario() -> tuple[int, dict, int]:
        refusers = [Refuser(), Refuser()]
        router = Router()
        await router.start("127.0.0.1", 0)
        router.set_revision("a", {"x": await refusers[0].start(), "y": await refusers[1].start()})
        router.set_ready("a", "x", True)
        router.set_ready("a", "y", True)
        router.set_weights({"a": 100})
        async with aiohttp.ClientSession() as http, http.get(f"http://127.0.0.1:{router.port}/v1/echo") as response:
            answer = response.status, await response.json()
        await router.stop()
        for refuser in refusers:
            await refuser.stop()
        return (*answer, sum(r.connections for r in refusers))
    status, body, connections = run(scenario())
    assert status == 502 and body["error"]["code"] == "upstream_failed" and connections == 2


def test_a_replica_failing_after_headers_cuts_the_client_without_retry():
    async def scenario() -> int:
        async with routed({"a": ["0", "1"]}, {"a": 100}) as (_, stand_ins, base):
            async with aiohttp.ClientSession() as http:
                async with http.post(f"{base}/v1/chat/completions", json={"stream": True, "cut": True}) as response:
                    assert response.status == 200
                    with pytest.raises(aiohttp.ClientPayloadError):
                        await response.read()
            return sum(len(s.seen) for s in stand_ins.values())
    assert run(scenario()) == 1


def test_held_requests_are_served_once_a_replica_is_ready():
    async def scenario() -> tuple[list[int], float]:
        async with routed({"a": ["0"]}, {"a": 100}, ready=False) as (router, _, base):
            async with aiohttp.ClientSession() as http:
                held = [asyncio.create_task(http.get(f"{base}/v1/echo")) for _ in range(3)]
                await until(lambda: sample(router, "specdecode_router_requests_holding") == 3)
                router.set_ready("a", "0", True)
                statuses = [(await task).status for task in held]
            return statuses, sample(router, "specdecode_router_requests_held_total")
    statuses, held = run(scenario())
    assert statuses == [200, 200, 200] and held == 3


def test_beyond_the_bound_or_the_wait_a_request_is_answered_503():
    config = RouterConfig(max_held=1, hold_seconds=0.05, retry_after_s=7)

    async def scenario() -> tuple[list[tuple[int, str, dict]], Router]:
        async with routed({"a": ["0"]}, {"a": 100}, config, ready=False) as (router, _, base):
            async with aiohttp.ClientSession() as http:
                async def answer(response: aiohttp.ClientResponse) -> tuple[int, str, dict]:
                    return response.status, response.headers.get("Retry-After"), await response.json()
                held = asyncio.create_task(http.get(f"{base}/v1/echo"))
                await until(lambda: sample(router, "specdecode_router_requests_holding") == 1)
                refused = await answer(await http.get(f"{base}/v1/echo"))  # the bound is full
                return [refused, await answer(await held)], router
    answers, router = run(scenario())
    for status, retry_after, body in answers:
        assert status == 503 and retry_after == "7"
        assert body == {"error": {"message": body["error"]["message"], "type": "service_unavailable_error",
                                  "param": None, "code": "no_ready_replica"}}
    assert sample(router, "specdecode_router_held_timeouts_total") == 1
    assert sample(router, "specdecode_router_requests_total", revision="none", status_class="5xx") == 2


def test_drain_waits_for_the_open_stream_and_sends_nothing_new():
    async def scenario() -> tuple[str, bool, bool, set[str], bool, bytes]:
        async with routed({"a": ["0", "1"]}, {"a": 100}) as (router, stand_ins, base):
            async with aiohttp.ClientSession() as http:
                stream, _ = await gated_stream(http, base)
                busy = next(s for s in stand_ins.values() if s.seen)
                drained = asyncio.create_task(router.drain("a", busy.name.split("/")[1]))
                in_time = await router.drain("a", busy.name.split("/")[1], timeout_s=0.01)
                others = {await echo(http, base) for _ in range(4)}
                waited_for_the_stream = not drained.done()
                busy.gate.set()
                rest = await stream.read()
                return busy.name, await drained, in_time, others, waited_for_the_stream, rest
    busy, drained, in_time, others, waited_for_the_stream, rest = run(scenario())
    assert waited_for_the_stream and drained and not in_time
    assert others == {"a/0", "a/1"} - {busy} and rest.endswith(b"data: [DONE]\n\n")


def test_a_client_leaving_mid_stream_ends_its_request_on_the_replica(caplog):
    async def scenario() -> bool:
        async with routed({"a": ["0"]}, {"a": 100}) as (router, stand_ins, base):
            async with aiohttp.ClientSession() as http:
                stream = await http.post(f"{base}/v1/chat/completions", json={"stream": True, "endless": True})
                await stream.content.readuntil(b"\n\n")
                stream.close()
                await stand_ins["a/0"].abandoned.wait()
                return await router.drain("a", "0")
    assert run(scenario())
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]  # not taken for a replica's failure


def test_health_metrics_and_replica_metrics_pass_through():
    async def scenario() -> dict[str, tuple[int, str]]:
        async with routed({"a": ["0"], "b": ["0"]}, {"a": 100}) as (router, _, base):
            async with aiohttp.ClientSession() as http:
                async def get(path: str) -> tuple[int, str]:
                    async with http.get(base + path) as response:
                        return response.status, await response.text()
                await echo(http, base)
                answers = {path: await get(path) for path in
                           ["/health", "/metrics", "/revisions/b/replicas/0/metrics", "/revisions/b/replicas/9/metrics"]}
                router.set_weights({"b": 100})
                router.set_ready("b", "0", False)
                answers["unhealthy"] = await get("/health")
                return answers
    answers = run(scenario())
    assert answers["/health"][0] == 200 and answers["unhealthy"][0] == 503
    status, text = answers["/metrics"]
    assert status == 200 and 'specdecode_router_requests_total{revision="a",status_class="2xx"} 1.0' in text
    assert answers["/revisions/b/replicas/0/metrics"] == (200, 'standin_info{replica="b/0"} 1\n')
    assert answers["/revisions/b/replicas/9/metrics"][0] == 404


@contextmanager
def background_loop() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield loop
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
        loop.close()


def test_router_thread_applies_weights_before_returning_and_stops_if_it_cannot_start():
    stand_ins = [StandIn("a/0"), StandIn("b/0")]
    with background_loop() as loop:
        urls = [asyncio.run_coroutine_threadsafe(s.start(), loop).result(TIMEOUT_S) for s in stand_ins]
        try:
            with RouterThread(Router(), port=0) as rt:
                rt.set_revision("a", {"0": urls[0]})
                rt.set_revision("b", {"0": urls[1]})
                rt.set_ready("a", "0", True)
                rt.set_ready("b", "0", True)

                def answered_by() -> str:
                    with urllib.request.urlopen(f"http://127.0.0.1:{rt.port}/v1/echo", timeout=TIMEOUT_S) as response:
                        return json.load(response)["replica"]
                rt.set_weights({"a": 100})
                assert answered_by() == "a/0"
                rt.set_weights({"b": 100})
                assert [answered_by() for _ in range(3)] == ["b/0"] * 3
                with pytest.raises(ValueError):
                    rt.set_weights({"a": 99})
                assert rt.drain("a", "0", timeout_s=1)
                rt.remove_revision("a")
                with pytest.raises(OSError), RouterThread(Router(), port=rt.port):  # the port is taken
                    pass
        finally:
            for s in stand_ins:
                asyncio.run_coroutine_threadsafe(s.stop(), loop).result(TIMEOUT_S)

