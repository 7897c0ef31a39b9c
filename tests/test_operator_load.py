"""The operator under load (issue 36): triggers of one resource coalesced (one pass in flight, one
more queued for whatever arrives meanwhile, each trigger getting that pass' outcome), and the
canary pods scraped all at once within one timeout, so pods that never answer (a NetworkPolicy
dropping the operator's packets, one trickling bytes) hold an analysis back one timeout, not one
per pod."""
from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
from operator_harness import wait_for

from specdecode.operator import scrape
from specdecode.operator.coalescing import Coalescing, Trigger

KEY = ("llm", "demo")
TRIGGERS = 5


class SlowPass:
    """A reconciliation that records each trigger it ran for and holds the first until released."""

    def __init__(self, error: Exception | None = None) -> None:
        self.ran: list[Trigger] = []
        self.running, self.release, self.error = threading.Event(), threading.Event(), error

    def __call__(self, trigger: Trigger) -> bool:
        self.ran.append(trigger)
        if len(self.ran) == 1:
            self.running.set()
            self.release.wait()
        elif self.error is not None:
            raise self.error
        return True


def in_threads(passes: Coalescing, triggers: list[Trigger], reconcile: SlowPass) -> list[object]:
    """Run one trigger per thread once the first pass is in flight and all have joined the pass
    queued behind it; each thread's outcome (a result or the exception it raised)."""
    outcomes: list[object] = [None] * len(triggers)

    def run(i: int) -> None:
        try:
            outcomes[i] = passes.run(KEY, triggers[i], reconcile)
        except Exception as exc:  # noqa: BLE001 - the outcome under test
            outcomes[i] = exc

    first = threading.Thread(target=passes.run, args=(KEY, Trigger(), reconcile))
    first.start()
    reconcile.running.wait()
    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(triggers))]
    for thread in threads:
        thread.start()
    wait_for(lambda: passes.waiting(KEY) == len(triggers) - 1, "every trigger queued behind the pass in flight")
    reconcile.release.set()
    for thread in [first, *threads]:
        thread.join()
    return outcomes


def test_triggers_during_a_pass_cost_one_more_pass_with_all_they_asked_for() -> None:
    passes, reconcile = Coalescing(), SlowPass()
    old = {"spec": {"replicas": 2}}
    triggers = [Trigger(), Trigger(analyze=True), Trigger(old=old), Trigger(), Trigger(old={"spec": {}})]
    assert in_threads(passes, triggers, reconcile) == [True] * TRIGGERS
    assert reconcile.ran == [Trigger(), Trigger(old=old, analyze=True)]  # one pass after the one in flight
    assert passes.run(KEY, Trigger(), reconcile) and len(reconcile.ran) == 3  # nothing in flight: at once


def test_the_queued_pass_error_reaches_every_trigger_that_waited_for_it() -> None:
    """A change handler coalesced into another trigger's pass still sees its writes fail (and kopf
    retries it)."""
    failed = RuntimeError("writes failed")
    outcomes = in_threads(Coalescing(), [Trigger()] * TRIGGERS, SlowPass(error=failed))
    assert outcomes == [failed] * TRIGGERS


# -- scrapes --------------------------------------------------------------------------------------

METRICS = b"specdecode_requests_finished_total 1\n"


@contextmanager
def server(serve: Callable[[socket.socket], None]) -> Iterator[str]:
    """A TCP server on 127.0.0.1 calling ``serve(connection)`` in a thread per connection; its URL."""
    listener = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def accept() -> None:
        while not stop.is_set():
            try:
                connection, _ = listener.accept()
            except OSError:
                return
            threading.Thread(target=serve, args=(connection,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}/metrics"
    finally:
        stop.set()
        listener.close()


def answer(connection: socket.socket) -> None:
    connection.recv(65536)
    connection.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\nConnection: close\r\n\r\n" % len(METRICS) + METRICS)
    connection.close()


class Together:
    """Pods that answer only once ``count`` scrapes are connected at the same time: scraped one
    after another, none would ever answer."""

    def __init__(self, count: int) -> None:
        self.barrier = threading.Barrier(count)

    def __call__(self, connection: socket.socket) -> None:
        self.barrier.wait()
        answer(connection)


def trickle(connection: socket.socket, stop: threading.Event) -> None:
    """A pod that answers a byte at a time, never finishing: no single read ever times out."""
    connection.recv(65536)
    connection.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 1000000\r\n\r\n")
    while not stop.wait(0.05):
        try:
            connection.sendall(b"#")
        except OSError:
            return
    connection.close()


@pytest.mark.timeout(60)
def test_pods_are_scraped_at_once_and_one_that_never_finishes_costs_one_timeout() -> None:
    """Three pods answer only while all three are connected, so they are scraped at the same
    time; a fourth trickles bytes forever, and the round ends at its timeout anyway, counting it
    as not answered."""
    together, stop = Together(3), threading.Event()
    with server(together) as a, server(together) as b, server(together) as c, \
            server(lambda connection: trickle(connection, stop)) as slow:
        answers = scrape.fetch_all([a, b, c, slow], timeout=2.0)
        stop.set()
    assert answers[:3] == [METRICS.decode()] * 3
    assert isinstance(answers[3], scrape.ScrapeError) and "no answer within 2s" in str(answers[3])
    assert scrape.fetch_all([], timeout=2.0) == []
