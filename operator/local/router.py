"""router: one port in front of the local replicas, splitting requests between revisions by weight.

Terms. A *revision* has *replicas* (id → base URL of a runtime process). A replica is *servable*
when it is ready and not draining; a revision is *eligible* when its weight is positive and it has
a servable replica. *Dispatch* is the moment a request is given a replica: the choice and the
replica's in-flight count change together, with no await between them.

- ``Chooser`` (pure, no I/O, no clock): smooth weighted round-robin across eligible revisions
  (nginx's algorithm: each pick adds every weight to its revision's current value, takes the
  largest and subtracts the total from it). Under fixed weights the round repeats every 100 picks,
  so any 100 consecutive picks give each revision exactly its percent; within a revision, the
  servable replica with the fewest requests in flight, ties taken in turn.
- ``Router``: the aiohttp server. ``/v1/*``, ``/tokenize``, ``/detokenize`` go to a chosen
  replica with their method, query, buffered body and end-to-end headers; the response streams
  back chunk by chunk. A failure before the replica's response headers retries on another replica
  (each at most once per request); after them it cuts the client's connection. With nothing
  servable a request is held (``max_held`` at once, ``hold_seconds`` each), then answered 503
  with ``Retry-After`` and the runtime's OpenAI error body. ``/health``, ``/metrics`` (the
  router's own) and ``/revisions/{revision}/replicas/{replica}/metrics`` (a replica's, passed
  through). Its state methods run on the router's event loop, so ``set_weights`` is in effect for
  every request dispatched after it returns.
- ``RouterThread``: the router's loop in a thread, with blocking, thread-safe state methods, for
  the synchronous ``up`` shell.
"""
from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Awaitable, Callable, Collection, Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import Any, TypeVar

import aiohttp
from aiohttp import web
from multidict import CIMultiDict, CIMultiDictProxy
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, generate_latest
from yarl import URL

log = logging.getLogger(__name__)
T = TypeVar("T")

DEFAULT_PORT = 8000
PROXIED_PATHS = ("/v1/{tail:.*}", "/tokenize", "/detokenize")  # the runtime's OpenAI and vLLM-style API
# RFC 9110 §7.6.1: meaningful for one connection only, never forwarded (plus those `Connection` names).
HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "proxy-connection",
                        "te", "trailer", "transfer-encoding", "upgrade"})
NOT_FORWARDED = HOP_BY_HOP | {"host", "content-length"}  # the client session sets these for the replica
SHUTDOWN_TIMEOUT_S = 2.0  # open streams at stop() get this long; drain replicas first to lose nothing
NO_REVISION = "none"  # the revision label of the router's own answers (503 held, 502 all replicas failed)


# -- choosing ------------------------------------------------------------------------------------
@dataclass(eq=False)
class Replica:
    """One runtime process; compared by identity, so a request can exclude the ones it tried."""

    revision: str
    id: str
    url: str
    ready: bool = False
    draining: bool = False
    in_flight: int = 0  # dispatched requests whose response (stream included) has not ended

    @property
    def servable(self) -> bool:
        return self.ready and not self.draining


@dataclass
class _Revision:
    replicas: dict[str, Replica]
    weight: int = 0
    current: int = 0  # smooth weighted round-robin's current weight
    turn: int = 0  # rotates ties between replicas with as few requests in flight

    def candidates(self, exclude: Collection[Replica]) -> list[Replica]:
        return [r for r in self.replicas.values() if r.servable and r not in exclude]

    def take(self, candidates: list[Replica]) -> Replica:
        """The candidate with the fewest requests in flight; ties in turn."""
        fewest = min(r.in_flight for r in candidates)
        tied = [r for r in candidates if r.in_flight == fewest]
        self.turn += 1
        return tied[self.turn % len(tied)]


class Chooser:
    """Which replica gets the next request. Pure: the router owns the I/O and the in-flight counts."""

    def __init__(self) -> None:
        self._revisions: dict[str, _Revision] = {}

    def set_revision(self, revision: str, replicas: Mapping[str, str]) -> None:
        """Set ``revision``'s replicas (id → base URL). A replica kept with its URL keeps its state;
        a new one starts not ready. A new revision has weight 0 until ``set_weights``."""
        rev = self._revisions.setdefault(revision, _Revision({}))
        old = rev.replicas
        rev.replicas = {rid: old[rid] if rid in old and old[rid].url == url else Replica(revision, rid, url)
                        for rid, url in replicas.items()}

    def remove_revision(self, revision: str) -> None:
        """Forget ``revision`` and its weight (its share goes to the others)."""
        self._revisions.pop(revision, None)

    def set_ready(self, revision: str, replica: str, ready: bool) -> None:
        """A replica turning ready from not ready is a new process: it is no longer draining. (Saying
        ready again while it drains changes nothing, so a level-triggered probe never undoes a drain.)"""
        target = self.replica(revision, replica)
        if ready and not target.ready:
            target.draining = False
        target.ready = ready

    def drain(self, revision: str, replica: str) -> Replica:
        """Send ``replica`` nothing new; returns it (the router waits for its in-flight count)."""
        target = self.replica(revision, replica)
        target.draining = True
        return target

    def replica(self, revision: str, replica: str) -> Replica:
        """Raises KeyError for a revision or replica not set."""
        return self._revisions[revision].replicas[replica]

    def set_weights(self, weights: Mapping[str, int]) -> None:
        """Percent per revision (ints ≥ 0 summing to 100); revisions not named get 0. New weights
        start a fresh round; the same weights again change nothing."""
        check_weights(weights, self._revisions)
        if {name: w for name, w in weights.items() if w} == self.weights():
            return
        for name, rev in self._revisions.items():
            rev.weight, rev.current = weights.get(name, 0), 0

    def weights(self) -> dict[str, int]:
        return {name: rev.weight for name, rev in self._revisions.items() if rev.weight}

    def servable(self) -> bool:
        """Whether some eligible revision exists: what /health reports and holding waits for."""
        return bool(self._eligible(()))

    def pick(self, exclude: Collection[Replica] = ()) -> Replica | None:
        """The next replica by weight, not one of ``exclude``; None if no revision is eligible."""
        eligible = self._eligible(exclude)
        if not eligible:
            return None
        for rev, _ in eligible:
            rev.current += rev.weight
        best, candidates = max(eligible, key=lambda pair: pair[0].current)
        best.current -= sum(rev.weight for rev, _ in eligible)
        return best.take(candidates)

    def pick_any(self, exclude: Collection[Replica] = ()) -> Replica | None:
        """A replica of the heaviest eligible revision, leaving the round untouched (``/v1/models``)."""
        eligible = self._eligible(exclude)
        if not eligible:
            return None
        best, candidates = max(eligible, key=lambda pair: pair[0].weight)
        return best.take(candidates)

    def _eligible(self, exclude: Collection[Replica]) -> list[tuple[_Revision, list[Replica]]]:
        """Revisions with a positive weight and servable replicas outside ``exclude``, with those."""
        return [(rev, c) for rev in self._revisions.values() if rev.weight > 0 and (c := rev.candidates(exclude))]


def check_weights(weights: Mapping[str, int], known: Collection[str]) -> None:
    """Raises ValueError unless ``weights`` are ints ≥ 0 summing to 100 for known revisions."""
    unknown = set(weights) - set(known)
    if unknown:
        raise ValueError(f"weights name unknown revisions: {sorted(unknown)}")
    if any(not isinstance(w, int) or isinstance(w, bool) or w < 0 for w in weights.values()):
        raise ValueError(f"weights must be ints >= 0: {dict(weights)}")
    if sum(weights.values()) != 100:
        raise ValueError(f"weights must sum to 100: {dict(weights)}")


# -- configuration, metrics, answers -------------------------------------------------------------
@dataclass(frozen=True)
class RouterConfig:
    max_held: int = 64  # requests waiting at once for a servable replica; more are answered 503
    hold_seconds: float = 30.0  # how long each may wait
    retry_after_s: int = 5  # the Retry-After of a 503
    connect_timeout_s: float = 5.0  # to a replica; a timeout counts as a failure before headers
    max_body_bytes: int = 64 * 2**20  # request bodies are buffered (to resend them on a retry)

    def __post_init__(self) -> None:
        if self.max_held < 0 or self.hold_seconds < 0 or self.retry_after_s < 1 or self.connect_timeout_s <= 0:
            raise ValueError(f"invalid router config: {self}")


class RouterMetrics:
    """The router's own series, in a registry of its own (two routers in one process never clash)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        reg = self.registry
        self.requests = Counter("specdecode_router_requests_total", "Requests answered, by revision and status "
                                f"class (revision {NO_REVISION!r}: answered by the router)",
                                ("revision", "status_class"), registry=reg)
        self.retries = Counter("specdecode_router_retries_total", "Requests sent again after a replica failed before "
                               "its response headers, by the failed replica's revision", ("revision",), registry=reg)
        self.held = Counter("specdecode_router_requests_held_total", "Requests that waited for a servable replica",
                            registry=reg)
        self.holding = Gauge("specdecode_router_requests_holding", "Requests waiting now", registry=reg)
        self.hold_timeouts = Counter("specdecode_router_held_timeouts_total", "Held requests whose wait ran out",
                                     registry=reg)
        self.in_flight = Gauge("specdecode_router_requests_in_flight", "Requests dispatched and not ended",
                               ("revision",), registry=reg)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def answered(self) -> dict[str, float]:
        """Requests answered so far, per revision."""
        totals: dict[str, float] = {}
        for family in self.requests.collect():
            for sample in family.samples:
                if sample.name.endswith("_total") and sample.labels["revision"] != NO_REVISION:
                    totals[sample.labels["revision"]] = totals.get(sample.labels["revision"], 0.0) + sample.value
        return totals


def status_class(status: int) -> str:
    return f"{status // 100}xx"


def error_response(status: int, message: str, code: str, headers: Mapping[str, str] | None = None) -> web.Response:
    """The runtime's OpenAI error body (``runtime/server/errors.py``), which this torch-free package
    cannot import: ``{"error": {"message", "type", "param", "code"}}``."""
    kind = "service_unavailable_error" if status == 503 else "server_error"
    body = {"error": {"message": message, "type": kind, "param": None, "code": code}}
    return web.json_response(body, status=status, headers=headers)


def end_to_end(headers: CIMultiDictProxy[str], dropped: frozenset[str]) -> CIMultiDict[str]:
    """``headers`` without ``dropped`` and those the ``Connection`` header names."""
    named = {h.strip().lower() for value in headers.getall("Connection", ()) for h in value.split(",")}
    return CIMultiDict((k, v) for k, v in headers.items() if k.lower() not in dropped | named)


class _UpstreamFailed(Exception):
    """The replica failed before its response headers: the request may go to another one."""


# -- the server ----------------------------------------------------------------------------------
class Router:
    """The HTTP front. State methods (``set_*``, ``remove_revision``) must run on the router's loop;
    ``RouterThread`` calls them from other threads."""

    def __init__(self, config: RouterConfig | None = None) -> None:
        self.config = config or RouterConfig()
        self.chooser = Chooser()
        self.metrics = RouterMetrics()
        self.port: int | None = None  # the bound port, once started
        self._changed = asyncio.Event()  # set (and replaced) on every change a waiter may await
        self._held = 0
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None

    # state
    def set_revision(self, revision: str, replicas: Mapping[str, str]) -> None:
        self.chooser.set_revision(revision, replicas)
        self._notify()

    def set_ready(self, revision: str, replica: str, ready: bool) -> None:
        self.chooser.set_ready(revision, replica, ready)
        self._notify()

    def remove_revision(self, revision: str) -> None:
        self.chooser.remove_revision(revision)
        self._notify()

    def set_weights(self, weights: Mapping[str, int]) -> None:
        """In effect for every request dispatched after this returns (the rollout's acknowledgement)."""
        self.chooser.set_weights(weights)
        self._notify()

    async def drain(self, revision: str, replica: str, timeout_s: float | None = None) -> bool:
        """Send ``replica`` nothing new; True once its requests (open streams too) have ended, False
        if ``timeout_s`` ran out first. It drains until set not ready and then ready again."""
        target = self.chooser.drain(revision, replica)
        self._notify()
        return await self._wait_until(lambda: target.in_flight == 0, timeout_s)

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def _wait_until(self, predicate: Callable[[], bool], timeout_s: float | None) -> bool:
        try:
            async with asyncio.timeout(timeout_s):
                while not predicate():
                    await self._changed.wait()
        except TimeoutError:
            return predicate()
        return True

    # lifecycle
    async def start(self, host: str = "127.0.0.1", port: int = DEFAULT_PORT) -> None:
        # One connection per request: localhost connects are cheap, and a pooled connection to a
        # replica that restarted or timed it out would fail a request that never reached it.
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(force_close=True), auto_decompress=False,
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=self.config.connect_timeout_s),
            skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding", "Content-Type"))
        # aiohttp resends an idempotent request once on the same replica when the connection drops
        # (meant for stale pooled connections, which force_close never has); the router retries on
        # another replica instead. No public switch: aiohttp's own test_utils sets this attribute.
        self._session._retry_connection = False
        self._runner = web.AppRunner(self._app(), access_log=None, shutdown_timeout=SHUTDOWN_TIMEOUT_S)
        await self._runner.setup()
        await web.TCPSite(self._runner, host, port).start()
        self.port = self._runner.addresses[0][1]

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        if self._session is not None:
            await self._session.close()
        self._runner = self._session = None

    def _app(self) -> web.Application:
        app = web.Application(client_max_size=self.config.max_body_bytes)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/revisions/{revision}/replicas/{replica}/metrics", self._replica_metrics)
        app.router.add_get("/v1/models", partial(self._proxy, pick=self.chooser.pick_any))
        for path in PROXIED_PATHS:
            app.router.add_route("*", path, partial(self._proxy, pick=self.chooser.pick))
        return app

    # handlers
    async def _health(self, request: web.Request) -> web.Response:
        ready = self.chooser.servable()
        return web.json_response({"status": "ready" if ready else "unavailable"}, status=200 if ready else 503)

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _replica_metrics(self, request: web.Request) -> web.Response:
        revision, replica = request.match_info["revision"], request.match_info["replica"]
        try:
            url = self.chooser.replica(revision, replica).url
        except KeyError:
            return error_response(404, f"no replica {replica!r} in revision {revision!r}", "unknown_replica")
        try:
            async with self._client().get(f"{url}/metrics") as upstream:
                return web.Response(body=await upstream.read(), status=upstream.status,
                                    headers=end_to_end(upstream.headers, NOT_FORWARDED))
        except (aiohttp.ClientError, TimeoutError) as exc:
            return error_response(502, f"replica {replica!r} of revision {revision!r}: {exc!r}", "upstream_failed")

    async def _proxy(self, request: web.Request, pick: Callable[[Collection[Replica]], Replica | None]
                     ) -> web.StreamResponse:
        body = await request.read()
        if not self.chooser.servable() and not await self._hold():
            self.metrics.requests.labels(NO_REVISION, "5xx").inc()
            return error_response(503, "No replica is ready to serve this request; try again later.",
                                  "no_ready_replica", {"Retry-After": str(self.config.retry_after_s)})
        tried: list[Replica] = []
        while (replica := pick(tried)) is not None:
            if tried:
                self.metrics.retries.labels(tried[-1].revision).inc()
            tried.append(replica)
            try:
                return await self._forward(request, body, replica)
            except _UpstreamFailed as exc:
                log.warning("replica %s/%s failed before its response: %r", replica.revision, replica.id, exc.__cause__)
        self.metrics.requests.labels(NO_REVISION, "5xx").inc()
        return error_response(502, f"every replica tried failed before answering ({len(tried)})", "upstream_failed")

    async def _hold(self) -> bool:
        """Wait for a servable replica; False when the bound is full or the wait ran out."""
        if self._held >= self.config.max_held:
            return False
        self._held += 1
        self.metrics.held.inc()
        self.metrics.holding.inc()
        try:
            served = await self._wait_until(self.chooser.servable, self.config.hold_seconds)
        finally:
            self._held -= 1
            self.metrics.holding.dec()
        if not served:
            self.metrics.hold_timeouts.inc()
        return served

    async def _forward(self, request: web.Request, body: bytes, replica: Replica) -> web.StreamResponse:
        """Dispatch to ``replica`` (its count rises before any await) and relay its response.
        Raises ``_UpstreamFailed`` when it fails before the response headers."""
        replica.in_flight += 1
        self.metrics.in_flight.labels(replica.revision).inc()
        try:
            try:
                upstream = await self._client().request(
                    request.method, URL(replica.url.rstrip("/") + request.raw_path, encoded=True),
                    headers=end_to_end(request.headers, NOT_FORWARDED), data=body or None)
            except (aiohttp.ClientError, TimeoutError) as exc:
                raise _UpstreamFailed from exc
            async with upstream:
                self.metrics.requests.labels(replica.revision, status_class(upstream.status)).inc()
                return await relay(request, upstream, f"{replica.revision}/{replica.id}")
        finally:
            replica.in_flight -= 1
            self.metrics.in_flight.labels(replica.revision).dec()
            self._notify()

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("the router is not started")
        return self._session


async def relay(request: web.Request, upstream: aiohttp.ClientResponse, source: str) -> web.StreamResponse:
    """Stream ``upstream`` to the client chunk by chunk as it arrives. If the upstream fails now,
    the client's connection is cut (no clean end), so the client sees the response is incomplete.
    If the client leaves, closing ``upstream`` (the caller's) ends the replica's work."""
    response = web.StreamResponse(status=upstream.status, reason=upstream.reason,
                                  headers=end_to_end(upstream.headers, HOP_BY_HOP))
    if not await to_client(response.prepare(request)):
        return response
    try:
        async for chunk in upstream.content.iter_any():
            if not await to_client(response.write(chunk)):
                return response
    except (aiohttp.ClientError, TimeoutError) as exc:
        log.warning("replica %s failed during its response: %r", source, exc)
        if request.transport is not None:
            request.transport.close()
        return response
    await to_client(response.write_eof())
    return response


async def to_client(sending: Awaitable[object]) -> bool:
    """Await a send to the client; False if the client has gone. (aiohttp's error for that is also
    a ``ClientError``: caught here, it is never taken for the replica's failure.)"""
    try:
        await sending
    except ConnectionResetError:
        return False
    return True


# -- from a synchronous caller -------------------------------------------------------------------
@dataclass
class RouterThread:
    """``with RouterThread(router, port=8000) as rt:`` serves on a background thread's event loop;
    the methods below block until the router has applied them (``set_weights`` included)."""

    router: Router
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    _loop: asyncio.AbstractEventLoop = field(default_factory=asyncio.new_event_loop, init=False)
    _thread: threading.Thread | None = field(default=None, init=False)

    def __enter__(self) -> RouterThread:
        self._thread = threading.Thread(target=self._loop.run_forever, name="specdecode-router", daemon=True)
        self._thread.start()
        try:
            self._await(self.router.start(self.host, self.port))
        except BaseException:
            self.__exit__()
            raise
        self.port = self.router.port or self.port
        return self

    def __exit__(self, *exc_info: Any) -> None:
        try:
            self._await(self.router.stop())
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            if self._thread is not None:
                self._thread.join()
            self._loop.close()

    def set_revision(self, revision: str, replicas: Mapping[str, str]) -> None:
        self._call(self.router.set_revision, revision, replicas)

    def set_ready(self, revision: str, replica: str, ready: bool) -> None:
        self._call(self.router.set_ready, revision, replica, ready)

    def remove_revision(self, revision: str) -> None:
        self._call(self.router.remove_revision, revision)

    def set_weights(self, weights: Mapping[str, int]) -> None:
        self._call(self.router.set_weights, weights)

    def drain(self, revision: str, replica: str, timeout_s: float | None = None) -> bool:
        return self._await(self.router.drain(revision, replica, timeout_s))

    def _call(self, fn: Callable[..., T], *args: Any) -> T:
        async def on_loop() -> T:
            return fn(*args)
        return self._await(on_loop())

    def _await(self, coro: Awaitable[T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()  # type: ignore[arg-type]
