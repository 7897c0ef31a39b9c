"""traffic: replay a prompt set at a bounded rate against an OpenAI-compatible server, so that a
canary's analysis has requests to judge (``specdecode traffic URL PROMPTSET``, ``up --traffic``).

Terms. A *slot* is a moment a request is due: slot i at start + i / rate, evenly spaced (no
jitter, no Poisson draw). At a slot a request is *sent* if fewer than ``concurrency`` are in
flight; otherwise the slot is *skipped* and counted, and the schedule does not move, so a server
slower than the rate never gets a burst to catch up with. A sent request ends *answered* (a 2xx
whose body, or stream up to ``[DONE]``, is complete) or as an *error* of a kind: its HTTP status,
``timeout``, ``connect``, ``bad response``, ``stream`` (an error event inside a stream) or the
client error's name; each kind keeps its count and its last message. Requests still in flight at
``stop()`` are *cancelled*. Nothing a server does raises out of the replayer.

Prompts come from ``specdecode.runtime.prompt_sets``: a chat (the built-in and packaged sets, a
file's message lists) goes to ``/chat/completions``, a file's plain string or ``{"prompt": …}`` to
``/completions``; the set is replayed in its order, round and round. The model is ``model`` or the
first id ``/models`` lists, asked again each second while the answer may change (a 401 or 404 ends
the replay: nothing can be sent). Latency is a request's whole time; p50/p95 are over the last
``LATENCY_WINDOW`` answers; tokens/s is the completion tokens answered (``usage``, else a stream's
content chunks) over the time since the first slot. ``Replayer`` runs on a thread of its own
(``start(url)``, ``stop()``) and writes a one-line summary to ``progress`` every ``report_every_s``.
"""
from __future__ import annotations

import asyncio
import itertools
import json
import math
import threading
import time
from collections import Counter, deque
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TextIO

import aiohttp
from yarl import URL

from specdecode.runtime.prompt_sets import BUILTIN_PROMPTS, PROMPT_SET_NAMES, PROMPT_SETS, Messages, load_prompts

DEFAULT_NUM_PROMPTS = 16  # of a packaged set (as `specdecode bench`); builtin and files: all
MODEL_RETRY_S = 1.0
RETRIED_STATUSES = (408, 429)  # of a 4xx from /models, only these may change on asking again
ERROR_MESSAGE_CHARS = 200
LATENCY_WINDOW = 10_000  # percentiles are over the last this many answers


class UnknownPromptSet(ValueError):
    """Neither a known prompt set nor a file; the message lists the known sets."""


# -- prompts -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Prompt:
    """A chat (``messages``) or a plain text (``text``): exactly one is set."""

    messages: Messages | None = None
    text: str | None = None

    @property
    def endpoint(self) -> str:
        return "/chat/completions" if self.messages is not None else "/completions"

    def body(self, model: str, config: TrafficConfig) -> dict[str, Any]:
        body: dict[str, Any] = {"model": model, "max_tokens": config.max_tokens, "temperature": config.temperature}
        body.update({"messages": self.messages} if self.messages is not None else {"prompt": self.text})
        if config.stream:
            body.update(stream=True, stream_options={"include_usage": True})
        return body


def load_prompt_set(source: str, num_prompts: int | None = None) -> list[Prompt]:
    """``source`` as ``prompt_sets.load_prompts`` takes it; ``num_prompts`` None = the whole set
    (``DEFAULT_NUM_PROMPTS`` of a packaged one). Raises ``UnknownPromptSet``, ``MissingData`` and
    ``ValueError`` (a bad count or item), each with a one-line message."""
    if source in PROMPT_SET_NAMES:
        default = DEFAULT_NUM_PROMPTS if source in PROMPT_SETS else len(BUILTIN_PROMPTS)
        return [Prompt(messages=chat) for chat in load_prompts(source, default if num_prompts is None else num_prompts)]
    if not Path(source).is_file():
        raise UnknownPromptSet(f"unknown prompt set {source!r}: the known sets are {', '.join(PROMPT_SET_NAMES)}, "
                               "or give a .json/.jsonl file")
    items = _file_items(source)
    chats = load_prompts(source, len(items) if num_prompts is None else num_prompts)
    return [Prompt(messages=chat) if (text := _plain_text(item)) is None else Prompt(text=text)
            for item, chat in zip(items, chats)]


def _file_items(source: str) -> list[Any]:
    text = Path(source).read_text(encoding="utf-8")
    if source.endswith(".jsonl"):
        return [json.loads(line) for line in text.splitlines() if line.strip()]
    items = json.loads(text)
    return items if isinstance(items, list) else [items]


def _plain_text(item: Any) -> str | None:
    """A file item's text when it is plain text (a string, or an object whose ``prompt`` is one)."""
    if isinstance(item, dict) and "messages" not in item:
        item = item.get("prompt")
    return item if isinstance(item, str) else None


# -- configuration and counts --------------------------------------------------------------------
@dataclass(frozen=True)
class TrafficConfig:
    rate: float = 1.0  # slots per second
    concurrency: int = 4  # requests in flight at most
    duration_s: float | None = None  # slots only before this; None = no limit
    requests: int | None = None  # requests sent at most; None = no limit
    max_tokens: int = 64
    temperature: float = 0.0
    model: str | None = None  # None = the first id /models lists
    api_key: str | None = None  # sent as `Authorization: Bearer …`
    stream: bool = True
    timeout_s: float = 300.0  # one request's whole time
    report_every_s: float | None = 5.0  # None = no progress lines

    def __post_init__(self) -> None:
        if not (self.rate > 0 and math.isfinite(self.rate)):
            raise ValueError(f"--rate must be a positive number, got {self.rate}")
        if self.concurrency < 1 or self.max_tokens < 1 or (self.requests is not None and self.requests < 1):
            raise ValueError("--concurrency, --max-tokens and --requests must be at least 1")
        if self.duration_s is not None and self.duration_s <= 0:
            raise ValueError(f"--duration must be positive, got {self.duration_s}")


@dataclass
class Stats:
    """What happened so far; touched only on the replayer's event loop."""

    sent: int = 0
    answered: int = 0
    skipped: int = 0
    cancelled: int = 0
    in_flight: int = 0
    tokens: int = 0
    errors: Counter[str] = field(default_factory=Counter)
    messages: dict[str, str] = field(default_factory=dict)  # error kind → its last message
    latencies_s: deque[float] = field(default_factory=lambda: deque(maxlen=LATENCY_WINDOW))
    ttfts_s: deque[float] = field(default_factory=lambda: deque(maxlen=LATENCY_WINDOW))  # streamed answers
    model: str | None = None
    model_error: str | None = None  # why no model is known (yet)

    def error(self, kind: str, message: str) -> None:
        self.errors[kind] += 1
        self.messages[kind] = message[:ERROR_MESSAGE_CHARS]

    def summary(self, elapsed_s: float) -> Summary:
        return Summary(
            elapsed_s=round(elapsed_s, 3), model=self.model, sent=self.sent, answered=self.answered,
            skipped=self.skipped, cancelled=self.cancelled, in_flight=self.in_flight, errors=dict(self.errors),
            error_messages=dict(self.messages), latency_p50_s=percentile(self.latencies_s, 50),
            latency_p95_s=percentile(self.latencies_s, 95), ttft_p50_s=percentile(self.ttfts_s, 50),
            completion_tokens=self.tokens,
            tokens_per_s=round(self.tokens / elapsed_s, 2) if elapsed_s > 0 else None,
            model_error=self.model_error)


@dataclass(frozen=True)
class Summary:
    elapsed_s: float
    model: str | None
    sent: int
    answered: int
    skipped: int
    cancelled: int
    in_flight: int
    errors: dict[str, int]  # kind → count
    error_messages: dict[str, str]  # kind → its last message
    latency_p50_s: float | None
    latency_p95_s: float | None
    ttft_p50_s: float | None
    completion_tokens: int
    tokens_per_s: float | None
    model_error: str | None

    def line(self) -> str:
        errors = ", ".join(f"{kind} ×{n}" for kind, n in sorted(self.errors.items())) or "none"
        latency = f"latency p50 {_seconds(self.latency_p50_s)} p95 {_seconds(self.latency_p95_s)}"
        parts = [f"{self.elapsed_s:.1f}s", f"sent {self.sent}", f"answered {self.answered}", f"errors {errors}",
                 f"skipped {self.skipped}", f"in flight {self.in_flight}",
                 *([f"cancelled {self.cancelled}"] if self.cancelled else []),
                 latency + (f" ttft p50 {_seconds(self.ttft_p50_s)}" if self.ttft_p50_s is not None else ""),
                 f"{self.tokens_per_s or 0:.1f} tok/s",
                 *([f"no model: {self.model_error}"] if self.model_error else [])]
        return "traffic: " + " | ".join(parts)

    def report(self) -> str:
        """The final summary: the line, then each error kind's last message."""
        return "\n".join([self.line(), *(f"  {kind}: {m}" for kind, m in sorted(self.error_messages.items()))])

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def percentile(values: Iterable[float], q: float) -> float | None:
    """Nearest-rank percentile; None without values."""
    ordered = sorted(values)
    if not ordered:
        return None
    return round(ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)], 4)


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}s"


# -- errors of one request -----------------------------------------------------------------------
class Failed(Exception):
    """A request's error: ``kind`` (an HTTP status, ``stream``, ``bad response``) and message."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


def error_message(body: str) -> str:
    """An OpenAI error body's ``error.message``, else the body itself."""
    try:
        error = json.loads(body).get("error")
    except (ValueError, AttributeError):
        return body.strip()
    if isinstance(error, dict) and isinstance(error.get("message"), str):
        return error["message"]
    return error if isinstance(error, str) else body.strip()


def first_model(payload: Any) -> str | None:
    """The first id of a ``/models`` answer."""
    data = payload.get("data") if isinstance(payload, dict) else None
    first = data[0] if isinstance(data, list) and data else None
    model = first.get("id") if isinstance(first, dict) else None
    return model if isinstance(model, str) else None


def completion_tokens(payload: Any) -> int:
    usage = payload.get("usage") if isinstance(payload, dict) else None
    tokens = usage.get("completion_tokens") if isinstance(usage, dict) else None
    return tokens if isinstance(tokens, int) else 0


# -- the replayer --------------------------------------------------------------------------------
class Clock:
    """Monotonic time and waiting; tests give a fake one."""

    def now(self) -> float:
        return time.monotonic()

    async def wait(self, event: asyncio.Event, seconds: float) -> bool:
        """Wait ``seconds`` or until ``event`` is set; whether it is set."""
        if seconds > 0 and not event.is_set():
            try:
                await asyncio.wait_for(event.wait(), seconds)
            except TimeoutError:
                pass
        return event.is_set()


class Replayer:
    """``start(url)`` replays ``prompts`` at ``url`` (an OpenAI base URL, ``…/v1``) on a thread of
    its own until ``duration_s`` or ``requests`` is reached or ``stop()`` is called; ``stop()``
    cancels what is in flight and returns the ``Summary``. ``replay`` is the same on a caller's
    event loop."""

    def __init__(self, prompts: list[Prompt], config: TrafficConfig, *, progress: TextIO | None = None,
                 clock: Clock | None = None) -> None:
        if not prompts:
            raise ValueError("no prompts to replay")
        self.prompts, self.config, self.progress, self.clock = prompts, config, progress, clock or Clock()
        self.stats = Stats(model=config.model)
        self._began: float | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop = asyncio.Event()  # bound to the loop that first waits on it
        self._thread: threading.Thread | None = None
        self._done = threading.Event()

    # from a synchronous caller
    def start(self, url: str) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_until_complete, args=(self.replay(url, self._stop),),
                                        name="specdecode-traffic", daemon=True)
        self._thread.start()

    def wait(self, timeout_s: float | None = None) -> bool:
        """Whether the replay has ended (its duration or request count reached), within ``timeout_s``."""
        return self._done.wait(timeout_s)

    def stop(self) -> Summary:
        if self._thread is not None and self._loop is not None:
            if self._thread.is_alive():
                self._loop.call_soon_threadsafe(self._stop.set)
                self._thread.join()
            self._loop.close()
            self._thread = None
        return self.summary()

    def summary(self) -> Summary:
        """So far: call it on the replay's loop, or after ``stop()``."""
        return self.stats.summary(0.0 if self._began is None else self.clock.now() - self._began)

    # on the event loop
    async def replay(self, url: str, stop: asyncio.Event | None = None) -> Summary:
        """Replay until the duration or request count is reached, or ``stop`` is set."""
        stop = stop or asyncio.Event()
        base = url.rstrip("/") + ("" if URL(url).path.strip("/") else "/v1")  # a bare host:port means its /v1
        headers = {"Authorization": f"Bearer {self.config.api_key}"} if self.config.api_key else {}
        timeout = aiohttp.ClientTimeout(total=self.config.timeout_s)
        reporter = asyncio.create_task(self._report(stop)) if self.config.report_every_s else None
        try:
            async with aiohttp.ClientSession(headers=headers, timeout=timeout) as session:
                if self.stats.model is None:
                    await self._find_model(session, base, stop)
                if self.stats.model is not None:
                    await self._pace(session, base, stop)
                    await self._finish(stop)
        finally:
            if reporter is not None:
                await _cancelled(reporter)
            self._done.set()
        return self.summary()

    async def _find_model(self, session: aiohttp.ClientSession, base: str, stop: asyncio.Event) -> None:
        """Ask ``/models`` each second while the answer may change (no connection, a timeout, a 5xx,
        408, 429: a server starting, or ``up``'s router holding requests until a replica is ready)."""
        while self.stats.model is None and not stop.is_set():
            try:
                async with session.get(base + "/models") as response:
                    if response.status >= 400:
                        raise Failed(str(response.status), error_message(await response.text()))
                    self.stats.model = first_model(await response.json(content_type=None))
                if self.stats.model is None:
                    raise Failed("bad response", "no model listed")
                self.stats.model_error = None
            except (Failed, aiohttp.ClientError, TimeoutError, ValueError) as exc:
                kind, message = _kind_and_message(exc)
                self.stats.model_error = f"{base}/models: {kind} {message}"
                if kind.isdigit() and 400 <= int(kind) < 500 and int(kind) not in RETRIED_STATUSES:
                    return
                await self.clock.wait(stop, MODEL_RETRY_S)

    async def _pace(self, session: aiohttp.ClientSession, base: str, stop: asyncio.Event) -> None:
        config = self.config
        self._began = start = self.clock.now()
        for slot in itertools.count():
            if config.duration_s is not None and slot / config.rate >= config.duration_s:
                await self.clock.wait(stop, start + config.duration_s - self.clock.now())
                return
            if config.requests is not None and self.stats.sent >= config.requests:
                return
            if await self.clock.wait(stop, start + slot / config.rate - self.clock.now()):
                return
            if self.stats.in_flight >= config.concurrency:
                self.stats.skipped += 1
                continue
            prompt = self.prompts[self.stats.sent % len(self.prompts)]
            self.stats.sent += 1
            self.stats.in_flight += 1
            task = asyncio.create_task(self._send(session, base, prompt))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _finish(self, stop: asyncio.Event) -> None:
        """Let what is in flight end, unless stopped: then cancel it."""
        stopping = asyncio.create_task(stop.wait())
        while self._tasks and not stop.is_set():
            await asyncio.wait([*self._tasks, stopping], return_when=asyncio.FIRST_COMPLETED)
        await _cancelled(stopping, *self._tasks)

    async def _send(self, session: aiohttp.ClientSession, base: str, prompt: Prompt) -> None:
        began = self.clock.now()
        try:
            tokens, ttft = await self._request(session, base, prompt, began)
        except asyncio.CancelledError:
            self.stats.cancelled += 1
            raise
        except (Failed, aiohttp.ClientError, TimeoutError, ValueError) as exc:
            self.stats.error(*_kind_and_message(exc))
        else:
            self.stats.answered += 1
            self.stats.tokens += tokens
            self.stats.latencies_s.append(self.clock.now() - began)
            if ttft is not None:
                self.stats.ttfts_s.append(ttft)
        finally:
            self.stats.in_flight -= 1

    async def _request(self, session: aiohttp.ClientSession, base: str, prompt: Prompt,
                       began: float) -> tuple[int, float | None]:
        """The completion tokens of one answer and, streamed, its time to the first token."""
        assert self.stats.model is not None
        async with session.post(base + prompt.endpoint, json=prompt.body(self.stats.model, self.config)) as response:
            if response.status >= 400:
                raise Failed(str(response.status), error_message(await response.text()))
            if not self.config.stream:
                return completion_tokens(await response.json(content_type=None)), None
            return await self._read_stream(response, began)

    async def _read_stream(self, response: aiohttp.ClientResponse, began: float) -> tuple[int, float | None]:
        chunks, tokens, ttft = 0, 0, None
        async for raw in response.content:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[len(b"data:"):].strip()
            if data == b"[DONE]":
                return tokens or chunks, ttft
            event = json.loads(data)
            if not isinstance(event, dict):
                raise Failed("bad response", f"a stream event is not an object: {data[:80]!r}")
            if "error" in event:
                raise Failed("stream", error_message(data.decode(errors="replace")))
            tokens = completion_tokens(event) or tokens
            if any(_has_text(choice) for choice in event.get("choices") or []):
                chunks += 1
                ttft = self.clock.now() - began if ttft is None else ttft
        raise Failed("bad response", "the stream ended before [DONE]")

    async def _report(self, stop: asyncio.Event) -> None:
        assert self.config.report_every_s is not None
        while not await self.clock.wait(stop, self.config.report_every_s):
            if self.progress is not None:
                print(self.summary().line(), file=self.progress, flush=True)


async def _cancelled(*tasks: asyncio.Task[Any]) -> None:
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def _has_text(choice: Any) -> bool:
    if not isinstance(choice, dict):
        return False
    delta = choice.get("delta")
    return bool(choice.get("text") or (isinstance(delta, dict) and delta.get("content")))


def _kind_and_message(exc: BaseException) -> tuple[str, str]:
    if isinstance(exc, Failed):
        return exc.kind, str(exc)
    if isinstance(exc, TimeoutError):
        return "timeout", "no complete answer in time"
    if isinstance(exc, aiohttp.ClientConnectorError):
        return "connect", str(exc)
    if isinstance(exc, aiohttp.ClientError):
        return type(exc).__name__, str(exc)
    return "bad response", f"{type(exc).__name__}: {exc}"
