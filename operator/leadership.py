"""leadership: one replica of the operator reconciles, the one holding a Lease (coordination.k8s.io/v1).

kopf's peering is not leader election: each replica pauses itself when it sees a peer of higher
priority, so during a failover overlap two replicas can both reconcile. A Lease is: every write of
it is a ``replace`` carrying the resourceVersion read, so of two replicas writing the same version
one gets 409 Conflict and cannot believe it holds it.

The terms, as client-go's leaderelection uses them:

- **lease duration**: how long, from when a candidate first saw the Lease's last write, the holder
  is trusted without renewing; after it a candidate takes the Lease over.
- **renew deadline**: how long, from when the leader *sent* its last successful renewal, it goes on
  reconciling. Shorter than the lease duration, so a leader that cannot renew stops before
  another replica can acquire the Lease (a candidate's clock starts when it reads that renewal,
  which is after it was sent).
- **retry period**: how often a candidate tries to acquire and the leader renews.

Expiry is judged on each replica's own monotonic clock (when it saw the record change), never by
comparing ``renewTime`` with its wall clock, so clock skew between nodes does not matter.

Why not ``kubernetes.leaderelection`` (client 37): its ``LeaseLock`` talks through the default
global client configuration rather than the operator's ``ApiClient``, its elector competes once
(after losing the Lease it never tries again), and it cannot release the Lease on shutdown.

How kopf is kept from acting on a standby (``controller``, ``handlers``): kopf runs standalone
(no peering) in every replica, so every replica serves the validating webhook. Each handler that
reconciles is filtered on ``leading`` (the change handlers, the workload events) or checks it
before it starts (the analysis daemon and the resync timer: kopf's finalizer follows their
filters, and a filter that differs between replicas would have one add and the other remove it).
kopf stores a change as handled (its diff-base annotation) even when no handler matched; the
progress and diff-base storages (``controller.LeaderProgressStorage``, ``LeaderDiffBaseStorage``)
write nothing while this replica does not lead, so a standby never marks handled a change the
leader has not seen. A replica that becomes leader reconciles every resource once (the takeover)
and then follows kopf's triggers. Pausing kopf the way its peering does is not possible from
outside kopf: the toggle its watchers obey is private to ``kopf.spawn_tasks``.
"""
from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from enum import Enum
from typing import Any, Protocol

import kopf
import kubernetes

from specdecode.operator.kube import NO_ANSWER

Obj = dict[str, Any]
MICRO_TIME = "%Y-%m-%dT%H:%M:%S.%fZ"  # the Lease's acquireTime and renewTime (metav1.MicroTime)


@dataclass(frozen=True)
class LeaseTiming:
    """Seconds; client-go's defaults."""

    duration: float = 15.0
    renew_deadline: float = 10.0
    retry_period: float = 2.0

    def __post_init__(self) -> None:
        if not 0 < self.retry_period < self.renew_deadline < self.duration:
            raise ValueError(f"a Lease needs 0 < retry period ({self.retry_period}) < renew deadline "
                             f"({self.renew_deadline}) < lease duration ({self.duration})")


@dataclass(frozen=True)
class LeaseRecord:
    """The Lease as read: its holder and the version a write must carry."""

    holder: str | None
    duration: float | None
    acquire_time: str | None
    transitions: int
    resource_version: str

    @classmethod
    def of(cls, lease: Mapping[str, Any]) -> LeaseRecord:
        spec = lease.get("spec") or {}
        return cls(holder=spec.get("holderIdentity") or None, duration=spec.get("leaseDurationSeconds"),
                   acquire_time=spec.get("acquireTime"), transitions=spec.get("leaseTransitions") or 0,
                   resource_version=lease["metadata"]["resourceVersion"])


@dataclass(frozen=True)
class Sighting:
    """A record and when (this replica's monotonic clock) it was first seen with that version."""

    record: LeaseRecord
    seen_at: float


def sighted(previous: Sighting | None, record: LeaseRecord, now: float) -> Sighting:
    """The sighting after reading ``record`` at ``now``: the clock restarts whenever the Lease was
    written (a renewal included), not when it is merely read again."""
    if previous is not None and previous.record.resource_version == record.resource_version:
        return previous
    return Sighting(record, now)


class Move(str, Enum):
    RENEW = "renew"  # ours: write a fresh renewTime
    ACQUIRE = "acquire"  # free, released or expired: take it
    WAIT = "wait"  # another replica holds it and has not let it expire


def next_move(sighting: Sighting, identity: str, now: float, timing: LeaseTiming) -> Move:
    record = sighting.record
    if record.holder == identity:
        return Move.RENEW
    expired = now >= sighting.seen_at + (record.duration or timing.duration)
    return Move.ACQUIRE if record.holder is None or expired else Move.WAIT


def lease_spec(record: LeaseRecord, identity: str, move: Move, now: datetime, timing: LeaseTiming) -> Obj:
    """The Lease's spec after ``move`` (RENEW or ACQUIRE) at wall-clock ``now``."""
    stamp = now.astimezone(timezone.utc).strftime(MICRO_TIME)
    renewing = move is Move.RENEW
    return {"holderIdentity": identity, "leaseDurationSeconds": int(timing.duration),
            "acquireTime": record.acquire_time if renewing and record.acquire_time else stamp, "renewTime": stamp,
            "leaseTransitions": record.transitions if renewing else record.transitions + 1}


def released_spec(record: LeaseRecord) -> Obj:
    """The Lease given up on a clean shutdown (client-go's ReleaseOnCancel): no holder, so a
    candidate takes it at its next try instead of after the lease duration."""
    return {"holderIdentity": None, "leaseDurationSeconds": 1, "acquireTime": record.acquire_time,
            "renewTime": None, "leaseTransitions": record.transitions}


# -- the shell ------------------------------------------------------------------------------------


class Leadership(Protocol):
    def start(self, on_elected: Callable[[], None]) -> None: ...

    def leading(self) -> bool: ...

    def stop(self) -> None: ...


class Alone:
    """No Lease configured (one replica, tests, a developer's ``kopf run``): always leading, and
    kopf's resume handlers take every resource over at startup."""

    def start(self, on_elected: Callable[[], None]) -> None:
        pass

    def leading(self) -> bool:
        return True

    def stop(self) -> None:
        pass


class Elector:
    """Acquires and renews the Lease ``namespace/name`` as ``identity`` in a thread of its own.
    A call to the API server that takes longer than the renew deadline is given up: by then this
    replica would have stopped leading anyway."""

    def __init__(self, leases: kubernetes.client.CoordinationV1Api, namespace: str, name: str, identity: str,
                 timing: LeaseTiming, logger: logging.Logger) -> None:
        self._leases = leases
        self.namespace, self.name, self.identity, self.timing = namespace, name, identity, timing
        self._logger = logger
        self._on_elected: Callable[[], None] = lambda: None
        self._until = 0.0  # monotonic time until which this replica leads
        self._sighting: Sighting | None = None
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lease elector", daemon=True)

    def start(self, on_elected: Callable[[], None]) -> None:
        """Compete from now on; ``on_elected`` runs (in a thread of its own, so that renewals go
        on) each time this replica starts leading."""
        self._on_elected = on_elected
        self._thread.start()

    def leading(self) -> bool:
        return time.monotonic() < self._until

    def stop(self) -> None:
        """Stop competing; give the Lease up if this replica holds it."""
        self._stopped.set()
        if self._thread.is_alive():
            self._thread.join()
        if self.leading() and self._sighting is not None:
            self._until = 0.0
            self._write(released_spec(self._sighting.record), self._sighting.record)
            self._logger.info("Lease %s/%s released", self.namespace, self.name)

    def _run(self) -> None:
        while not self._stopped.is_set():
            self._try()
            self._stopped.wait(self.timing.retry_period)

    def _try(self) -> None:
        was_leading = self.leading()
        self._attempt()
        if was_leading and not self.leading():
            self._logger.warning("Lease %s/%s not renewed or held by another: standing by", self.namespace, self.name)

    def _attempt(self) -> None:
        sent = time.monotonic()
        try:
            lease = json.loads(self._leases.read_namespaced_lease(
                self.name, self.namespace, _preload_content=False, _request_timeout=self.timing.renew_deadline).data)
        except (kubernetes.client.ApiException, *NO_ANSWER) as exc:
            self._logger.warning("Lease %s/%s not read: %s", self.namespace, self.name, _reason(exc))
            return
        self._sighting = sighted(self._sighting, LeaseRecord.of(lease), sent)
        move = next_move(self._sighting, self.identity, sent, self.timing)
        if move is Move.WAIT:  # another holds it: this replica does not lead, whatever it believed
            self._until = 0.0
            return
        record = self._sighting.record
        if not self._write(lease_spec(record, self.identity, move, datetime.now(timezone.utc), self.timing), record):
            return
        was_leading, self._until = self.leading(), sent + self.timing.renew_deadline
        if not was_leading:
            self._logger.info("Lease %s/%s acquired (%s): leading", self.namespace, self.name, move.value)
            threading.Thread(target=self._on_elected, name="takeover", daemon=True).start()

    def _write(self, spec: Obj, record: LeaseRecord) -> bool:
        """Replace the Lease's spec, guarded by the version read; False if another write came first."""
        body = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "spec": spec,
                "metadata": {"name": self.name, "namespace": self.namespace,
                             "resourceVersion": record.resource_version}}
        try:
            answer = json.loads(self._leases.replace_namespaced_lease(
                self.name, self.namespace, body, _preload_content=False,
                _request_timeout=self.timing.renew_deadline).data)
        except (kubernetes.client.ApiException, *NO_ANSWER) as exc:
            self._logger.warning("Lease %s/%s not written: %s", self.namespace, self.name, _reason(exc))
            return False
        self._sighting = Sighting(LeaseRecord.of(answer), time.monotonic())
        return True


class _WrittenWhileLeading:
    """A kopf storage mixin: its writes happen only while ``leadership`` leads (reads always do)."""

    def __init__(self, leadership: Leadership, **options: Any) -> None:
        super().__init__(**options)
        self.leadership = leadership

    def store(self, **kwargs: Any) -> None:
        if self.leadership.leading():
            super().store(**kwargs)


class LeaderProgressStorage(_WrittenWhileLeading, kopf.AnnotationsProgressStorage):
    """kopf's handler progress in annotations, written only while ``leadership`` leads."""

    def purge(self, **kwargs: Any) -> None:
        if self.leadership.leading():
            super().purge(**kwargs)

    def touch(self, **kwargs: Any) -> None:
        if self.leadership.leading():
            super().touch(**kwargs)


class LeaderDiffBaseStorage(_WrittenWhileLeading, kopf.AnnotationsDiffBaseStorage):
    """kopf's last handled spec in an annotation, written only while ``leadership`` leads: a
    standby, whose change handlers are filtered out, must not store a change as handled."""


def _reason(exc: Exception) -> str:
    return f"{exc.status} {exc.reason}" if isinstance(exc, kubernetes.client.ApiException) else str(exc)
