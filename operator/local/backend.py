"""backend: ``loop.Backend`` over this machine — each replica a ``specdecode serve`` process
(``processes.Supervisor``), the revisions behind one ``router.Router``, the state in a ``Store``.

- A replica is named ``REVISION-INDEX`` and runs the container's args ``render.runtime_args``
  gives a pod, on 127.0.0.1 and a port of its own (``local_args``), so what runs here is what a
  pod runs. A revision's args are kept in the store: the stable revision is scaled long after
  the spec that rendered it changed.
- Scaling down drains a replica at the router first and stops it then (SIGTERM: the runtime
  finishes what it serves), unready replicas first, as a Deployment removes them.
- The router is this backend's route: the resource is resolved with ``trafficRouting`` set
  (``with_router``), so the rollout asks for the step's weight (and during a restore the retired
  revision's share) and the weight is in effect once the router took it.
- Processes show as pods (``as_pod``): Ready as their ``/ready`` answers, and a process that
  exited and waits to restart as a container in CrashLoopBackOff with its exit code and last log
  line, so ``pods.runtime_refusal`` and ``pods.not_ready_reason`` read them as they read pods.
"""
from __future__ import annotations

import dataclasses
import shutil
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from specdecode.operator import names
from specdecode.operator.local.processes import ReplicaStatus, Supervisor, free_port
from specdecode.operator.local.router import RouterThread
from specdecode.operator.local.store import Obj, Store
from specdecode.operator.loop import Observed, Outcome
from specdecode.operator.render import revision, runtime_args
from specdecode.operator.resolve import Resolved
from specdecode.operator.rollout import Event, EventType, Transition, route_canary
from specdecode.operator.spec import ModelScheme, SpecDecodeDeploymentStatus, TrafficRouting

HOST = "127.0.0.1"
ROUTER_ROUTE = "specdecode-up-router"  # the route the rollout weighs: the router itself
DRAIN_SECONDS = 30.0


def with_router(r: Resolved) -> Resolved:
    """``r`` with the router as its ``trafficRouting``: the rollout then sets weights by step."""
    rollout = r.spec.rollout.model_copy(update={"traffic_routing": TrafficRouting(http_route=ROUTER_ROUTE)})
    return dataclasses.replace(r, spec=r.spec.model_copy(update={"rollout": rollout}))


def local_args(r: Resolved) -> list[str]:
    """A pod's ``specdecode serve`` args, less ``--host``/``--port`` (each replica gets its own),
    with a ``file://`` model at its path on this machine and no termination-message file."""
    args, out, skip = runtime_args(r), [], False
    location = r.spec.model.location
    for i, arg in enumerate(args):
        if skip:
            skip = False
            continue
        if arg in ("--host", "--port"):
            skip = True
            continue
        if arg == "--model" and location.scheme is ModelScheme.FILE:
            out += ["--model", location.path]
            skip = True
            continue
        out.append(arg)
    return [*out, "--termination-message-path", ""]


def specdecode_command() -> list[str]:
    """The ``specdecode`` console script of this installation."""
    beside = Path(sys.executable).with_name("specdecode")
    found = str(beside) if beside.exists() else shutil.which("specdecode")
    return [found] if found else [sys.executable, "-P", "-c", "from specdecode.runtime.cli import main; main()"]


def as_pod(revision_: str, replica: ReplicaStatus) -> Obj:
    container: Obj = {"name": names.CONTAINER, "ready": replica.ready, "restartCount": replica.restarts,
                      "state": {"running": {}}}
    if replica.pid is None and replica.last_exit_code not in (None, 0):
        container["state"] = {"waiting": {"reason": "CrashLoopBackOff",
                                          "message": f"restarting in {replica.backoff_s or 0:.0f}s"}}
        container["lastState"] = {"terminated": {"exitCode": replica.last_exit_code,
                                                 "message": replica.last_line or ""}}
    return {"metadata": {"name": replica.id, "labels": {names.LABEL_REVISION: revision_}},
            "status": {"phase": "Running",
                       "conditions": [{"type": "Ready", "status": "True" if replica.ready else "False"}],
                       "containerStatuses": [container]}}


def _revision_of(replica_id: str) -> str:
    return replica_id.rpartition("-")[0]


def _index_of(replica_id: str) -> int:
    return int(replica_id.rpartition("-")[2])


@dataclass(frozen=True)
class LocalObserved(Observed):
    replicas: tuple[ReplicaStatus, ...] = ()


@dataclass
class LocalBackend:
    store: Store
    supervisor: Supervisor
    router: RouterThread
    command: Sequence[str] = dataclasses.field(default_factory=specdecode_command)
    env: Mapping[str, str] = dataclasses.field(default_factory=dict)
    routed: set[str] = dataclasses.field(default_factory=set)  # the revisions the router knows
    restarts: dict[str, int] = dataclasses.field(default_factory=dict)  # per replica, as last reported

    def observe(self, r: Resolved, status: SpecDecodeDeploymentStatus) -> LocalObserved:
        replicas = tuple(self.supervisor.replicas())
        ready: dict[str, int] = {}
        for replica in replicas:
            ready[_revision_of(replica.id)] = ready.get(_revision_of(replica.id), 0) + int(replica.ready)
        desired = revision(r)
        if self.store.argv(desired) is None:
            self.store.keep_argv(desired, local_args(r))
        return LocalObserved(revision=desired, ready=ready,
                             pods=[as_pod(_revision_of(rep.id), rep) for rep in replicas], replicas=replicas)

    def carry_out(self, r: Resolved, observed: LocalObserved, t: Transition) -> Outcome:
        running = {_revision_of(rep.id) for rep in observed.replicas}
        for rev in running | set(t.replicas):
            self._scale(rev, t.replicas.get(rev, 0), [rep for rep in observed.replicas if _revision_of(rep.id) == rev])
        self._route(t)
        return Outcome(status={"layout": r.layout.notation}, events=self._restarted(observed.replicas))

    def _restarted(self, replicas: Sequence[ReplicaStatus]) -> tuple[Event, ...]:
        """A Warning for each replica that exited and was restarted since the last call."""
        events = tuple(Event(EventType.WARNING, "ReplicaRestarted",
                             f"replica {rep.id} exited with code {rep.last_exit_code} "
                             f"({rep.last_line or 'no output'}); restart {rep.restarts}")
                       for rep in replicas if rep.restarts > self.restarts.get(rep.id, 0))
        self.restarts = {rep.id: rep.restarts for rep in replicas}
        return events

    def serving_endpoints(self, r: Resolved, observed: LocalObserved, revision_: str) -> list[tuple[str, str]]:
        return [(rep.id, f"http://{HOST}:{rep.port}") for rep in observed.replicas
                if rep.ready and _revision_of(rep.id) == revision_]

    def write_status(self, r: Resolved, status: SpecDecodeDeploymentStatus) -> None:
        self.store.write_status(status)

    def post_events(self, r: Resolved, events: Sequence[Event]) -> None:
        self.store.append_events(events)

    def remove_annotations(self, r: Resolved, keys: Sequence[str]) -> None:
        self.store.remove_annotations(keys)

    def _scale(self, rev: str, want: int, mine: list[ReplicaStatus]) -> None:
        """Start or stop replicas of ``rev`` until it has ``want``: unready ones go first."""
        for going in sorted(mine, key=lambda rep: (rep.ready, -_index_of(rep.id)))[:max(len(mine) - want, 0)]:
            self.router.drain(rev, going.id, timeout_s=DRAIN_SECONDS)
            self.supervisor.stop(going.id, grace_seconds=DRAIN_SECONDS)
        taken = {_index_of(rep.id) for rep in mine}
        free = (i for i in range(want + len(mine)) if i not in taken)
        for _ in range(want - len(mine)):
            port = free_port()
            self.supervisor.start(f"{rev}-{next(free)}", self._argv(rev, port), self.env, port)

    def _argv(self, rev: str, port: int) -> list[str]:
        args = self.store.argv(rev)
        if args is None:
            raise RuntimeError(f"revision {rev}: no command line kept for it in {self.store.dir}")
        return [*self.command, *args, "--host", HOST, "--port", str(port)]

    def _route(self, t: Transition) -> None:
        """Each revision's ready replicas at the router, and the weights the rollout asked for."""
        by_revision: dict[str, list[ReplicaStatus]] = {rev: [] for rev in t.replicas}
        for rep in self.supervisor.replicas():
            by_revision.setdefault(_revision_of(rep.id), []).append(rep)
        for rev in self.routed - set(by_revision):
            self.router.remove_revision(rev)
        for rev, reps in by_revision.items():
            self.router.set_revision(rev, {rep.id: f"http://{HOST}:{rep.port}" for rep in reps})
            for rep in reps:
                self.router.set_ready(rev, rep.id, rep.ready)
        self.routed = set(by_revision)
        stable, canary, weight = t.status.stable_revision, route_canary(t.status), t.status.rollout.canary_weight or 0
        weights = {stable: 100} if canary in (None, stable) else {stable: 100 - weight, canary: weight}
        self.router.set_weights({rev: weights.get(rev, 0) for rev in by_revision})
