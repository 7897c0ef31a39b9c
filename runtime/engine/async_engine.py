"""Drive ``LLMEngine`` from a background thread and stream its outputs to asyncio callers.

The engine thread owns the engine: requests and aborts reach it through a thread-safe inbox,
outputs go back through ``loop.call_soon_threadsafe`` into one asyncio queue per request. An
exception inside a step fails the requests in flight with that error instead of killing the
thread, so one bad step never takes the server down — except a step that broke the
tensor-parallel group: the thread stops, and the engine reports itself dead (so does a lost
worker process of this pod). A rank of the group that stops beating (``parallel.heartbeat``) fails
the requests in flight at once, from the watch's thread: the engine thread may be waiting on that
rank in a step.

Admission is counted where it happens: ``generate`` checks and takes a seat in the waiting queue
under one lock, and the engine thread gives the seat back when the scheduler first takes the
request off its waiting queue (or the request ends before that), so ``max_waiting_requests`` is
never exceeded however many callers race. How long a refused caller should wait comes from the
waiting queue and the requests finished per second recently (``FinishRate``).
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from specdecode.runtime.config import EngineConfig
from specdecode.runtime.engine.grammar import GrammarCompiler
from specdecode.runtime.engine.llm_engine import EngineStats, LLMEngine
from specdecode.runtime.engine.sequence import RequestOutput, SamplingParams
from specdecode.runtime.parallel.step_channel import TensorParallelBroken

if TYPE_CHECKING:
    from specdecode.runtime.parallel.leader import Leader

log = logging.getLogger(__name__)
FINISH_RATE_WINDOW_S = 60.0
ENGINE_STOP_S = 30.0  # the longest shutdown waits for a step to end (1 s once the group is lost: it may never)


class EngineOverloaded(Exception):
    """The waiting queue is full; the caller should answer 503 and let the client retry."""


class EngineDead(Exception):
    """The engine thread has stopped."""


@dataclass
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    sink: "_Sink"


@dataclass
class _Abort:
    request_id: str


@dataclass
class _AbortAll:
    error: BaseException  # what every request in flight raises to its caller


class _Sink:
    """Hands engine outputs (or an exception) to one asyncio consumer."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()

    def put(self, item: RequestOutput | BaseException) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the loop has closed: the server stopped before this request's abort came
            log.debug("output for a closed event loop dropped")


class FinishRate:
    """Requests finished per second over the last ``window_s`` seconds (or since the engine started,
    if that is sooner, counting at least one second). With none finished in that span it answers
    as if one had: a finite, pessimistic guess that grows as the span does."""

    def __init__(self, window_s: float = FINISH_RATE_WINDOW_S, clock: Callable[[], float] = time.monotonic):
        self.window_s = window_s
        self.clock = clock
        self.started = clock()
        self._finished: deque[float] = deque()
        self._lock = threading.Lock()  # recorded by the engine thread, read by the server's

    def record(self, count: int = 1) -> None:
        now = self.clock()
        with self._lock:
            self._finished.extend([now] * count)
            self._forget(now)

    def per_second(self) -> float:
        now = self.clock()
        with self._lock:
            self._forget(now)
            finished = len(self._finished)
        span = min(self.window_s, max(now - self.started, 1.0))
        return max(finished, 1) / span

    def _forget(self, now: float) -> None:
        while self._finished and self._finished[0] < now - self.window_s:
            self._finished.popleft()


class AsyncEngine:
    def __init__(self, engine: LLMEngine, model_name: str, max_waiting_requests: int, leader: Leader | None = None):
        self.engine = engine
        self.model_name = model_name
        self.max_waiting_requests = max_waiting_requests
        self.leader = leader  # rank 0 of a tensor-parallel group: the other ranks' keeper
        self.ready = False
        self._inbox: queue.Queue[_Add | _Abort | _AbortAll | None] = queue.Queue()
        self._sinks: dict[str, _Sink] = {}  # the engine thread's, but for ``_take_sinks`` (any thread)
        self._sinks_lock = threading.Lock()
        self._num_waiting = 0  # seats taken in the waiting queue: submitted, not yet scheduled once
        self._lock = threading.Lock()  # guards _num_waiting
        self._queued: set[str] = set()  # the engine thread's: ids it added that the scheduler has not yet taken
        self.finish_rate = FinishRate()
        self._thread: threading.Thread | None = None
        self._stats = engine.stats()

    @classmethod
    def from_config(cls, cfg: EngineConfig) -> "AsyncEngine":
        """Load the model; with tensor parallelism, as rank 0 of a group it forms (see ``parallel``)."""
        if cfg.parallel.world_size > 1:
            from specdecode.runtime.parallel.leader import start_leader_engine

            engine, name, leader = start_leader_engine(cfg)
            return cls(engine, name, cfg.scheduler.max_waiting_requests, leader)
        from specdecode.runtime.models.loader import load_model

        loaded = load_model(cfg.load)
        engine = LLMEngine(loaded.model, loaded.tokenizer, cfg, loaded.max_model_len, loaded.device, loaded.dtype)
        return cls(engine, loaded.name, cfg.scheduler.max_waiting_requests)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def grammars(self) -> GrammarCompiler:
        return self.engine.grammars

    def start(self) -> None:
        """Watch the group's heartbeats, warm up (one real step, so the first request does not pay
        for it) and start stepping."""
        if self.leader is not None:
            self.leader.watch(self._group_lost)
        self._warm_up()
        thread = threading.Thread(target=self._run, name="specdecode-engine", daemon=True)
        thread.start()
        self._thread = thread  # only once started: until then ``dead`` would see a stopped thread
        self.ready = True

    def shutdown(self) -> None:
        self.ready = False
        if self._thread is not None:
            self._inbox.put(None)
            self._thread.join(timeout=ENGINE_STOP_S if self.leader is None or self.leader.lost is None else 1.0)
            stepping = self._thread.is_alive()
            self._thread = None
            if stepping:  # stuck in a step: no shutdown message can go out beside it
                log.error("the engine thread is stuck in a step; stopping without it")
                return
        self.engine.shutdown()
        if self.leader is not None:
            self.leader.shutdown()

    @property
    def dead(self) -> bool:
        """The stepping thread was started and has stopped on its own, a worker process of this pod
        is gone, or a rank of the group stopped beating (liveness probe fails)."""
        thread_stopped = self._thread is not None and not self._thread.is_alive()
        return thread_stopped or (self.leader is not None and not self.leader.alive)

    def stats(self) -> EngineStats:
        return self._stats

    @property
    def num_waiting(self) -> int:
        """Requests admitted and not yet scheduled: the exact figure the waiting cap applies to."""
        return self._num_waiting

    def expected_wait_s(self) -> float:
        """Seconds until the waiting queue has drained at the recent finish rate."""
        return self._num_waiting / self.finish_rate.per_second()

    async def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[RequestOutput]:
        if self._thread is None or self.dead:
            raise EngineDead(self.leader and self.leader.lost or "the engine is not running")
        self.engine._validate(request_id, prompt_token_ids, params)
        with self._lock:
            if self._num_waiting >= self.max_waiting_requests:
                raise EngineOverloaded(f"{self._num_waiting} requests are waiting; retry later")
            self._num_waiting += 1
        sink = _Sink(asyncio.get_running_loop())
        self._inbox.put(_Add(request_id, prompt_token_ids, params, sink))
        finished = False
        try:
            while not finished:
                item = await sink.queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._inbox.put(_Abort(request_id))

    def abort_all(self, error: BaseException) -> None:
        """Abort every request submitted so far; each caller's stream raises ``error``."""
        self._inbox.put(_AbortAll(error))

    def _warm_up(self) -> None:
        params = SamplingParams(max_tokens=2, temperature=0.0)
        self.engine.add_request("__warmup__", [0, 1, 2, 3], params)
        while self.engine.has_unfinished():
            self.engine.step()

    def _run(self) -> None:
        while True:
            block = not self.engine.has_unfinished()
            if not self._drain_inbox(block):
                return
            if not self.engine.has_unfinished():
                continue
            try:
                outputs = self.engine.step()
            except TensorParallelBroken as exc:  # the ranks are out of lockstep: stop, /health fails
                log.exception("engine step broke the tensor-parallel group; the engine stops")
                self._fail_all(exc)
                return
            except Exception as exc:  # a failed step fails its requests, not the server
                log.exception("engine step failed")
                self._fail_all(exc)
                continue
            self._stats = self.engine.stats()
            self._release_started()
            self.finish_rate.record(sum(out.finished for out in outputs))
            for out in outputs:
                sink = self._sinks.pop(out.request_id) if out.finished else self._sinks.get(out.request_id)
                if sink is not None:
                    sink.put(out)

    def _drain_inbox(self, block: bool) -> bool:
        """Apply queued adds/aborts; False once shutdown was asked for."""
        while True:
            try:
                msg = self._inbox.get(block=block)
            except queue.Empty:
                return True
            block = False
            if msg is None:
                self._fail_all(EngineDead("the engine is shutting down"))
                return False
            if isinstance(msg, _Abort):
                self.engine.abort_request(msg.request_id)
                self._sinks.pop(msg.request_id, None)
                if msg.request_id in self._queued:
                    self._queued.discard(msg.request_id)
                    self._give_back_seats(1)
            elif isinstance(msg, _AbortAll):
                self._fail_all(msg.error)
            else:
                self._admit(msg)
            self._stats = self.engine.stats()

    def _admit(self, msg: _Add) -> None:
        try:
            self.engine.add_request(msg.request_id, msg.prompt_token_ids, msg.params)
        except ValueError as exc:
            self._give_back_seats(1)
            msg.sink.put(exc)
            return
        self._queued.add(msg.request_id)
        self._sinks[msg.request_id] = msg.sink

    def _release_started(self) -> None:
        """Give back the seats of queued requests the scheduler has taken off its waiting queue."""
        if self._queued:
            started = self._queued - {seq.request_id for seq in self.engine.scheduler.waiting}
            self._queued -= started
            self._give_back_seats(len(started))

    def _give_back_seats(self, count: int) -> None:
        with self._lock:
            self._num_waiting -= count

    def _group_lost(self, line: str) -> None:
        """On the heartbeat watch's thread: every caller in flight gets the error now — the engine
        thread may wait in a step on the lost rank for the collective timeout — and the engine
        drops their requests when it next looks at its inbox."""
        error = EngineDead(line)
        for sink in self._take_sinks():
            sink.put(error)
        self.abort_all(error)

    def _take_sinks(self) -> list[_Sink]:
        """Every caller's sink, removed (other accesses are single dict operations, atomic as they are)."""
        with self._sinks_lock:
            sinks = list(self._sinks.values())
            self._sinks.clear()
        return sinks

    def _fail_all(self, exc: BaseException) -> None:
        for request_id in list(self.engine.requests):
            self.engine.abort_request(request_id)
        for sink in self._take_sinks():
            sink.put(exc)
        self._give_back_seats(len(self._queued))
        self._queued.clear()
        self._stats = self.engine.stats()
