"""up: ``specdecode up FILE`` — the platform's loop on this machine — and the commands that steer it.

``up`` admits the file's one SpecDecodeDeployment as the webhook would, refuses in one line what
this machine cannot run (``local_refusals``), stores it (``Store``) and runs ``loop.converge``
over a ``LocalBackend`` every ``TICK_SECONDS`` (and with an analysis every
``analysis.interval`` while a canary runs), until Ctrl-C, SIGTERM (``specdecode down``) or an
error; then every replica is drained and stopped. Saving the file applies it, as
``specdecode apply FILE`` does. ``specdecode promote|abort|pause|resume|retry NAME [VALUE]`` set
the command annotations (VALUE: the revision meant; default a fresh token), which the loop obeys
once, as the operator does.
"""
from __future__ import annotations

import json
import logging
import os
import signal
import socket
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Protocol, TextIO

from specdecode.operator.commands import UnreadableFile, load_documents
from specdecode.operator.local.backend import LocalBackend, with_router
from specdecode.operator.local.processes import AlreadyRunning, Supervisor, pid_file_path, read_pid_file
from specdecode.operator.local.router import Router, RouterThread
from specdecode.operator.local.store import Store, default_root
from specdecode.operator.local.traffic import Summary
from specdecode.operator.loop import Carried, converge
from specdecode.operator.resolve import Resolved, admit, duration_seconds
from specdecode.operator.failures import RUNTIME_REFUSED
from specdecode.operator.rollout import COMMAND_ANNOTATIONS, Command
from specdecode.operator.sources import heads
from specdecode.operator.spec import ConditionType, EquivalenceState, ModelScheme, SpecDecodeDeploymentStatus

log = logging.getLogger("specdecode.up")
TICK_SECONDS = 1.0
TABLE_SECONDS = 15.0  # the status table is printed at least this often while it moves
DEFAULT_PORT = 8000
EXIT_REFUSED = 1
RUNTIME_IMAGE = "specdecode/runtime"


class Refused(ValueError):
    """The file cannot run here; the message says why, in one line."""


def local_refusals(r: Resolved) -> list[str]:
    """What of ``r`` this machine cannot honour, a line each naming the field (probes,
    podDisruptionBudget, serviceMonitor, service and pod overrides are ignored)."""
    spec, out = r.spec, []
    if spec.model.location.scheme not in (ModelScheme.ALIAS, ModelScheme.FILE):
        out.append(f"spec.model.uri: {spec.model.uri}: `up` runs packaged aliases and file:// models only")
    head = heads(spec.speculative)
    if head is not None and head[0].scheme is not ModelScheme.FILE:
        out.append(f"{head[1].field}: {head[1].uri(spec.speculative)}: `up` reads file:// heads only")
    if not spec.image.startswith(f"{RUNTIME_IMAGE}:"):
        out.append(f"spec.image: {spec.image}: `up` runs the installed runtime ({RUNTIME_IMAGE}:…) only")
    if not r.layout.single_pod:
        out.append(f"spec.parallelism: {r.layout.notation} spans pods; `up` runs one process per replica")
    if (r.layout.gpus_per_pod or 0) > local_gpus():
        out.append(f"spec.resources.gpusPerPod: {r.layout.gpus_per_pod} GPUs per replica, this machine has "
                   f"{local_gpus()}")
    if spec.rollout.traffic_routing is not None:
        out.append("spec.rollout.trafficRouting: `up`'s router splits traffic itself; remove it")
    return out


def local_gpus() -> int:
    """NVIDIA GPUs the driver lists (torch-free)."""
    listed = Path("/proc/driver/nvidia/gpus")
    return len(list(listed.iterdir())) if listed.is_dir() else 0


def admitted(path: str) -> tuple[dict[str, Any], Resolved]:
    """The file's one SpecDecodeDeployment, as admission and this machine accept it."""
    try:
        docs = load_documents(path)
    except UnreadableFile as exc:
        raise Refused(str(exc)) from exc
    if len(docs) != 1:
        raise Refused(f"{path}: {len(docs)} documents; `up` runs one SpecDecodeDeployment")
    answer = admit(docs[0])
    if not answer.allowed:
        raise Refused(f"denied: {answer.message}")
    refusals = local_refusals(answer.resolved)
    if refusals:
        raise Refused(f"{answer.name}: cannot run here: " + "; ".join(refusals))
    return docs[0], answer.resolved


class Stop:
    """Set by Ctrl-C and SIGTERM."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self._previous: dict[int, Any] = {}

    def install(self) -> None:
        self._previous = {sig: signal.signal(sig, lambda *_: self.event.set()) for sig in (signal.SIGINT, signal.SIGTERM)}

    def uninstall(self) -> None:
        """The handlers before ``install`` again."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}


class Traffic(Protocol):
    """Requests replayed at the router while ``up`` runs (``traffic.Replayer``)."""

    def start(self, url: str) -> None: ...

    def stop(self) -> Summary: ...


def run(path: str, *, root: Path | None = None, port: int = DEFAULT_PORT, out: TextIO,
        stop: Stop | None = None, ready: Callable[[int], None] | None = None, traffic: Traffic | None = None) -> int:
    """``specdecode up``: runs until stopped; the exit code. ``ready(port)`` once the router serves;
    ``traffic`` starts then and stops before the replicas do."""
    try:
        body, r = admitted(path)
        store = Store(root or default_root(), r.name)
        if stop is None:
            stop = Stop()
            stop.install()
        Supervisor.reap_leftovers(store.dir, r.name)
        with Supervisor(store.dir, r.name) as supervisor, _router(port) as router:
            store.apply(body)
            print(f"{r.name}: router on http://127.0.0.1:{router.port}/v1 (state in {store.dir})", file=out,
                  flush=True)
            if ready is not None:
                ready(router.port)
            if traffic is not None:
                traffic.start(f"http://127.0.0.1:{router.port}/v1")
            try:
                _Loop(path, store, LocalBackend(store, supervisor, router), out).run(stop)
            finally:
                if traffic is not None:
                    print(traffic.stop().line(), file=out, flush=True)
                print(f"{r.name}: stopping every replica", file=out, flush=True)
    except (Refused, AlreadyRunning) as exc:
        print(f"specdecode up: {exc}", file=out, flush=True)
        return EXIT_REFUSED
    return 0


def _router(port: int) -> RouterThread:
    check = socket.socket()
    try:
        check.bind(("127.0.0.1", port))
    except OSError as exc:
        raise Refused(f"port {port} is in use (--port chooses another)") from exc
    finally:
        check.close()
    return RouterThread(Router(), port=port)


class _Loop:
    """``converge`` every tick: the watched file applied when saved, an analysis every interval
    while a canary runs, the new Events printed, and the status table when it changed (or every
    ``TABLE_SECONDS``). Ends on ``stop``, or when the first revision's replicas refuse to start
    and nothing ever served (the refusal is then the error)."""

    def __init__(self, path: str, store: Store, backend: LocalBackend, out: TextIO) -> None:
        self.path, self.store, self.backend, self.out = path, store, backend, out
        self.watched, self.carried, self.next_analysis = _mtime(path), Carried(), 0.0
        self.shown = 0  # bytes of the event log printed
        self.table, self.table_at, self.served = "", 0.0, False
        self.rates = Rates()

    def run(self, stop: Stop) -> None:
        while not stop.event.is_set():
            status = self.tick()
            refusal = _refusal(status)
            if refusal is not None and not self.served and status.canary_revision is None:
                raise Refused(f"{self.store.name}: its replicas refuse to start: {refusal}")
            stop.event.wait(TICK_SECONDS)

    def tick(self) -> SpecDecodeDeploymentStatus:
        self.watched = _reapply(self.path, self.watched, self.store, self.out)
        body = self.store.resource()
        r = with_router(admit(body).resolved)
        status, now = self.store.status(), time.monotonic()
        analyze = status.canary_revision is not None and now >= self.next_analysis
        if analyze:
            self.next_analysis = now + duration_seconds(r.spec.rollout.analysis.interval)
        done = converge(self.backend, r, status, annotations=body["metadata"].get("annotations"),
                        generation=body["metadata"].get("generation"), now=datetime.now(timezone.utc),
                        carried=self.carried, logger=log, analyze=analyze)
        self.carried, self.served = done.carried, self.served or done.status.ready_replicas > 0
        self._print(done.status, now)
        return done.status

    def _print(self, status: SpecDecodeDeploymentStatus, now: float) -> None:
        events, self.shown = self.store.events(self.shown)
        for event in events:
            print(f"{event['time']} {event['type']:7} {event['reason']}: {event['message']}", file=self.out,
                  flush=True)
        rates = self.rates.update(self.backend.router.router.metrics.answered(), now)
        table = _table(status_rows(status), status)
        if table != self.table or now - self.table_at >= TABLE_SECONDS:
            print(_table(status_rows(status, rates), status), file=self.out, flush=True)
            self.table, self.table_at = table, now


@dataclass
class Rates:
    """Requests per second per revision, over the last ``TABLE_SECONDS``."""

    seen: list[tuple[float, dict[str, float]]] = field(default_factory=list)

    def update(self, answered: dict[str, float], now: float) -> dict[str, float]:
        self.seen = [(at, counts) for at, counts in self.seen if now - at <= TABLE_SECONDS] + [(now, answered)]
        (since, before) = self.seen[0]
        elapsed = now - since
        return {rev: (n - before.get(rev, 0.0)) / elapsed for rev, n in answered.items()} if elapsed > 0 else {}


def _refusal(status: SpecDecodeDeploymentStatus) -> str | None:
    degraded = next((c for c in status.conditions if c.type == ConditionType.DEGRADED), None)
    return degraded.message if degraded is not None and degraded.reason == RUNTIME_REFUSED else None


def _mtime(path: str) -> float:
    try:
        return os.stat(path).st_mtime
    except OSError:
        return 0.0


def _reapply(path: str, seen: float, store: Store, out: TextIO) -> float:
    """Apply the watched file again once it was saved; a refusal is printed, what runs stays."""
    mtime = _mtime(path)
    if mtime == seen:
        return seen
    try:
        body, r = admitted(path)
        if r.name != store.name:
            raise Refused(f"{path} now names {r.name}, `up` runs {store.name}")
        if store.apply(body):
            print(f"{store.name}: {path} applied", file=out, flush=True)
    except Refused as exc:
        print(f"specdecode up: {exc}; still running the last version applied", file=out, flush=True)
    return mtime


# -- the commands -------------------------------------------------------------------------------


def apply(path: str, *, root: Path | None = None) -> str:
    """``specdecode apply FILE``: the running ``up`` of the same name picks it up; a message."""
    body, r = admitted(path)
    store = Store.existing(root or default_root(), r.name)
    return f"{r.name}: {'applied' if store.apply(body) else 'unchanged'}"


def command(name: str, which: Command, value: str | None = None, *, root: Path | None = None) -> str:
    """``specdecode promote|abort|pause|resume|retry NAME [VALUE]``: the annotation, once per value."""
    token = value or uuid.uuid4().hex[:12]
    Store.existing(root or default_root(), name).set_annotation(COMMAND_ANNOTATIONS[which], token)
    return f"{name}: {COMMAND_ANNOTATIONS[which]}={token}"


def down(name: str, *, root: Path | None = None, timeout: float = 120.0) -> str:
    """``specdecode down NAME``: SIGTERM to its ``up``, which drains and stops every replica."""
    store = Store.existing(root or default_root(), name)
    record = read_pid_file(pid_file_path(store.dir, name))
    if record is None or not record.supervisor.alive():
        return f"{name}: not running"
    os.kill(record.supervisor.pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while record.supervisor.alive() and time.monotonic() < deadline:
        time.sleep(0.2)
    return f"{name}: stopped" if not record.supervisor.alive() else f"{name}: still stopping after {timeout:.0f}s"


def status_rows(status: SpecDecodeDeploymentStatus, rates: Mapping[str, float] | None = None) -> list[dict[str, Any]]:
    """The status table: a row per revision that runs (``rates``: requests/s per revision, when
    known)."""
    r, measured = status.rollout, status.acceptance
    rows = [(status.stable_revision, "stable", r.stable_replicas)]
    if status.canary_revision:
        rows.append((status.canary_revision, "canary", r.canary_replicas))
    rows += [(old.revision, "retiring", old.replicas) for old in r.retiring]
    out = []
    for rev, role, replicas in rows:
        seen = measured if measured is not None and measured.revision == rev else None
        out.append({"revision": rev, "role": role, "replicas": replicas,
                    "acceptanceRate": seen.rate if seen else None, "meanAcceptanceLength": seen.mean_length if seen else None,
                    "p95ItlMs": seen.p95_inter_token_latency_ms if seen else None,
                    "requestsPerSecond": rates.get(rev) if rates is not None else None, "phase": r.phase.value,
                    "step": None if status.canary_step is None else status.canary_step + 1,
                    "weight": r.canary_weight if role != "stable" else None})
    return out


def show_status(name: str, *, root: Path | None = None, output: str = "table") -> str:
    """``specdecode status NAME``: the table, or ``-o json``."""
    store = Store.existing(root or default_root(), name)
    status = store.status()
    rows = status_rows(status)
    if output == "json":
        return json.dumps({"name": name, "readyReplicas": status.ready_replicas, "rows": rows,
                           "status": status.model_dump(mode="json", by_alias=True, exclude_none=True)}, indent=2)
    return _table(rows, status)


def _table(rows: list[dict[str, Any]], status: SpecDecodeDeploymentStatus) -> str:
    def cell(value: Any, spec: str = "") -> str:
        return "-" if value is None else format(value, spec)

    head = (f"{'REVISION':12} {'ROLE':9} {'REPLICAS':8} {'ACCEPT':7} {'MEAN-LEN':8} {'P95-ITL':8} {'REQ/S':6} "
            f"{'PHASE':12} STEP WEIGHT")
    lines = [head] + [f"{row['revision'] or '-':12} {row['role']:9} {row['replicas']:<8} "
                      f"{cell(row['acceptanceRate'], '.2f'):7} {cell(row['meanAcceptanceLength'], '.2f'):8} "
                      f"{cell(row['p95ItlMs'], '.0f'):8} {cell(row.get('requestsPerSecond'), '.1f'):6} "
                      f"{row['phase']:12} {cell(row['step']):4} {cell(row['weight'])}" for row in rows]
    footer = [f"ready {status.ready_replicas} of {status.replicas} replicas; {status.rollout.message}"]
    if (eq := status.equivalence) is not None:
        footer.append(f"equivalence of {eq.revision}: {eq.state.value}, {eq.prompts_same} prompts same, "
                      f"{eq.near_ties} near-ties; {eq.message}")
        if (d := eq.last_divergence) is not None and eq.state is not EquivalenceState.DIVERGED:
            footer.append(f"last difference: prompt {d.prompt!r}, token {d.position}: stable {d.stable_token!r}, "
                          f"other {d.other_token!r}")
    return "\n".join([*lines, *footer])

