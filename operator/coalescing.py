"""coalescing: one reconciliation in flight per resource, and a dirty flag for the next.

Every trigger of a resource (its change handlers, its workloads' and pods' events, the analysis
daemon, the resync timer, a takeover) asks for a pass that reads the resource afresh. A trigger
arriving while a pass runs queues one more pass (the dirty flag) or, if one is queued already,
joins it, and waits for it: however many triggers come during a pass, one pass follows it, and
each trigger still gets that pass' outcome (an exception included, so that a change handler's
retry is not lost to coalescing). A pass waiting behind another costs no reads: a burst of pod
events during a slow pass (a scrape, a dry run refused) does not queue a pass per event.
"""
from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

Key = tuple[str, str]  # namespace, name


@dataclass(frozen=True)
class Trigger:
    """What triggers ask of a pass: the spec before a change (the change handlers'), an analysis."""

    old: Mapping[str, Any] | None = None
    analyze: bool = False

    def joined(self, other: Trigger) -> Trigger:
        """One pass for both: the earliest old spec (the one closest to what was served), and an
        analysis if either asked for one."""
        return Trigger(self.old if self.old is not None else other.old, self.analyze or other.analyze)


class _Queued:
    """The pass queued behind the one in flight, with every trigger that joined it."""

    def __init__(self, trigger: Trigger) -> None:
        self.trigger, self.waiting = trigger, 0
        self.outcome: Future[bool] = Future()


class Coalescing:
    def __init__(self) -> None:
        self._guard = threading.Lock()
        self._running: dict[Key, threading.Lock] = {}
        self._queued: dict[Key, _Queued] = {}

    def run(self, key: Key, trigger: Trigger, reconcile: Callable[[Trigger], bool]) -> bool:
        """``reconcile(trigger)`` once no pass of ``key`` runs, or, if a pass is queued already,
        that pass' outcome (it runs with ``trigger`` joined to its own)."""
        with self._guard:
            queued = self._queued.get(key)
            joined = queued is not None
            if queued is not None:
                queued.trigger, queued.waiting = queued.trigger.joined(trigger), queued.waiting + 1
            else:
                queued = self._queued[key] = _Queued(trigger)
            running = self._running.setdefault(key, threading.Lock())
        if joined:
            return queued.outcome.result()
        with running:
            with self._guard:
                del self._queued[key]  # triggers from now on queue the next pass
                trigger = queued.trigger
            try:
                done = reconcile(trigger)
            except BaseException as exc:
                queued.outcome.set_exception(exc)
                raise
            queued.outcome.set_result(done)
            return done

    def waiting(self, key: Key) -> int:
        """How many triggers wait for the pass queued behind the one in flight, besides its own."""
        with self._guard:
            queued = self._queued.get(key)
            return queued.waiting if queued is not None else 0

    def forget(self, key: Key) -> None:
        with self._guard:
            self._running.pop(key, None)
