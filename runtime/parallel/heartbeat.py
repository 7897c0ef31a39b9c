"""Heartbeats that make rank 0 see its whole group, not just its own pod.

A rank in another pod can vanish without a word: its pod deleted with its node, a network
partition, a process hung. No connection closes, so rank 0 would notice only when a step waits on
that rank for the collective timeout (minutes), and meanwhile answer ``/ready`` 200 and take
requests it cannot finish. So every rank but 0 *beats*: from a thread of its own (a long step does
not delay it) it adds 1 to its counter ``heartbeat/<rank>`` in rank 0's rendezvous store, the link
every rank already has, ``BEATS_PER_TIMEOUT`` times per ``group_heartbeat_timeout_s``.

- Rank 0 *watches* (``GroupWatch``): a counter that has not moved for the timeout means its rank is
  lost; ``on_lost`` is called once with a line saying which (the server then fails the requests in
  flight with it, answers ``/ready`` and ``/health`` 503, and exits non-zero: a torch process group
  cannot take a new member, so the group re-forms only by starting again — the kubelet restarts the
  pod, and the operator restarts a StatefulSet group whole).
- A worker rank that cannot reach rank 0's store for the timeout exits 1 (``beat``): its leader is
  gone, and waiting for the next step would wait for ever.

Each side talks to the store over a connection of its own, so a beat never queues behind the
group's use of the store.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Sequence

import torch.distributed as dist

log = logging.getLogger(__name__)
BEATS_PER_TIMEOUT = 5
EXIT_LEADER_LOST = 1


def heartbeat_key(rank: int) -> str:
    return f"heartbeat/{rank}"


class Beats:
    """When each watched rank's counter last moved; pure, so the rule is tested without processes."""

    def __init__(self, ranks: Sequence[int], timeout_s: float, now: float):
        self.timeout_s = timeout_s
        self._last: dict[int, tuple[int, float]] = {rank: (0, now) for rank in ranks}  # rank → (count, when it moved)

    def observe(self, counts: dict[int, int], now: float) -> list[int]:
        """Record the counters read at ``now``; the ranks whose counter has not moved for the timeout."""
        for rank, count in counts.items():
            if count != self._last[rank][0]:
                self._last[rank] = (count, now)
        return [rank for rank, (_, moved) in self._last.items() if now - moved > self.timeout_s]


class GroupWatch:
    """Rank 0's thread reading every other rank's counter; ``on_lost(line)`` once a rank stops beating."""

    def __init__(self, store: dist.Store, ranks: Sequence[int], timeout_s: float, on_lost: Callable[[str], None]):
        self.store = store
        self.ranks = list(ranks)
        self.timeout_s = timeout_s
        self.on_lost = on_lost
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="specdecode-group-watch", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        beats = Beats(self.ranks, self.timeout_s, time.monotonic())
        while not self._stop.wait(self.timeout_s / BEATS_PER_TIMEOUT):
            counts = {rank: self.store.add(heartbeat_key(rank), 0) for rank in self.ranks}
            lost = beats.observe(counts, time.monotonic())
            if lost:
                line = (f"the parallel group lost rank(s) {lost}: no heartbeat for {self.timeout_s:.0f}s "
                        "(its pod gone or hung); this server cannot generate until the group re-forms")
                log.error(line)
                self.on_lost(line)
                return


def beat(store: dist.Store, rank: int, timeout_s: float) -> None:
    """A worker rank's heartbeat loop (run it in a daemon thread); exits the process once rank 0's
    store has been unreachable for ``timeout_s``."""
    reached = time.monotonic()
    while True:
        time.sleep(timeout_s / BEATS_PER_TIMEOUT)
        try:
            store.add(heartbeat_key(rank), 1)
            reached = time.monotonic()
        except (RuntimeError, OSError) as exc:  # DistStoreError and DistNetworkError are RuntimeErrors
            if time.monotonic() - reached >= timeout_s:
                log.error("rank 0's store unreachable for %.0fs (%s): the leader is gone; exiting", timeout_s, exc)
                os._exit(EXIT_LEADER_LOST)  # the main thread may wait in a collective that never ends


def start_beating(store: dist.Store, rank: int, timeout_s: float) -> None:
    threading.Thread(target=beat, args=(store, rank, timeout_s), name="specdecode-heartbeat", daemon=True).start()
