"""controller: one reconciliation of a SpecDecodeDeployment, and the state the handlers share.

``reconcile`` reads the resource and runs ``loop.converge`` over the cluster (``KubeBackend``: its
children through ``reconcile.plan``, its runtime pods, the user's HTTPRoute), then records the
operator's metrics. Every trigger runs it: the resource's
create/update/resume (spec changes and command annotations), an event on one of its workloads
(readiness) or runtime pods (a refusal to start, in their termination message), and
the analysis daemon every ``analysis.interval`` while a canary exists (``analyze=True`` adds a
verdict from the canary pods' ``/metrics`` or from Prometheus). Triggers of one resource are
coalesced (``coalescing``: one pass in flight, one more queued for whatever arrives meanwhile),
and each pass starts from a fresh read, so concurrent triggers cannot apply a stale state; the
status write carries the resourceVersion read, so neither can another writer (another replica
during a failover overlap): a 409 reads again and plans again.

Writes are all or nothing: every write a pass would make (deletes, scale-downs, applies) is
dry-run first (``dryRun=All``: validation, webhooks, policy engines and quotas answer, nothing is
stored), and only when all would pass are they made, scale-downs first. Otherwise nothing
changes but the status: ``Ready=False`` with ``ChildRefused`` (a 4xx: the server's message) or
``ApplyFailed`` (anything else), a Warning Event, and ``WritesFailed``, which the change handlers
turn into a retry with backoff. The user's HTTPRoute is patched after the children; a 4xx there
is ``RouteRefused``. Before the children, StatefulSet groups are healed (``group_restart``: their
members recorded, every pod of a group whose member started again deleted, a ``GroupRestarted``
Event) in a batch of their own, all or nothing too, so that a refused child never keeps a broken
group from starting again.

Configuration comes from the environment once, in the startup handler (``settings``).

High availability: the chart runs several replicas; the one holding the release's Lease
reconciles, every replica serves the admission webhook (``leadership``: the Lease, and how kopf
is kept from acting on a standby). Without a Lease configured the operator leads alone.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

import kopf
import kubernetes

from specdecode.operator import kube, names
from specdecode.operator.analysis import Verdict
from specdecode.operator.coalescing import Coalescing, Trigger
from specdecode.operator.failures import FAILED_CREATE, told_by_events
from specdecode.operator.leadership import Alone, Elector, Leadership
from specdecode.operator.group_restart import GroupChange, group_changes, record_patch, restart_event
from specdecode.operator.loop import Carried, Observed, Outcome, Unwritten, converge
from specdecode.operator.metrics import OperatorMetrics
from specdecode.operator.reconcile import (
    APPLY_FAILED,
    CHILD_REFUSED,
    INVALID_SPEC,
    ROUTE_REFUSED,
    Obj,
    Plan,
    children_of,
    desired_kind,
    is_not_ready,
    not_ready,
    plan,
    read_status,
    ready_replicas,
    running_kind,
    serving_endpoints,
    status_patch,
)
from specdecode.operator.render import revision, serving_selector
from specdecode.operator.resolve import Resolved, duration_seconds, resolve
from specdecode.operator.rollout import Event, EventType, Transition, route_canary
from specdecode.operator.settings import OperatorConfig
from specdecode.operator.spec import Analysis, RolloutPhase, SpecDecodeDeploymentStatus, WorkloadKind
from specdecode.operator.traffic import RouteError, route_patch

EventPoster = Callable[[Mapping[str, Any], Sequence[Event]], None]  # (the resource, its Events)
CONFLICT_ATTEMPTS = 5  # passes of one reconciliation whose status write another writer beat
RETRY_FIRST_SECONDS, RETRY_MAX_SECONDS = 5.0, 300.0  # backoff after writes the API server did not take
# -- per-resource memory ------------------------------------------------------------------------


class Memory:
    """What one reconciliation hands the next (``loop.Carried``: the canary's samples and a probe
    in flight; lost on restart, see analysis.py)."""

    def __init__(self) -> None:
        self._carried: dict[tuple[str, str], Carried] = {}

    def carried(self, namespace: str, name: str) -> Carried:
        return self._carried.get((namespace, name), Carried())

    def keep(self, namespace: str, name: str, carried: Carried) -> None:
        if carried == Carried():
            self._carried.pop((namespace, name), None)
        else:
            self._carried[namespace, name] = carried

    def forget(self, namespace: str, name: str) -> None:
        self._carried.pop((namespace, name), None)

    def forget_carried(self) -> None:
        """Drop every resource's samples and probes: another leader may have moved on meanwhile."""
        self._carried.clear()


@dataclass
class Context:
    """What every handler shares (kopf's memo carries it)."""

    cluster: kube.Cluster
    metrics: OperatorMetrics
    leadership: Leadership = field(default_factory=Alone)
    memory: Memory = field(default_factory=Memory)
    passes: Coalescing = field(default_factory=Coalescing)

    @classmethod
    def start(cls, config: OperatorConfig, logger: logging.Logger) -> Context:
        """The shared state, with the Lease's elector not yet competing (``lead``)."""
        metrics = OperatorMetrics()
        metrics.serve(config.metrics_port)
        cluster = kube.Cluster(config.kubeconfig)
        lease = config.lease
        leadership = Alone() if lease is None else Elector(
            kubernetes.client.CoordinationV1Api(cluster.api), lease.namespace, lease.name, lease.identity,
            lease.timing, logger)
        return cls(cluster, metrics, leadership)

    def lead(self, diffbase: kopf.DiffBaseStorage, logger: logging.Logger) -> None:
        """Compete for the Lease; each time this replica starts leading, it takes over."""
        self.leadership.start(lambda: take_over(self, diffbase, logger))

    def stop(self) -> None:
        self.leadership.stop()
        self.metrics.stop()

    def forget(self, namespace: str, name: str) -> None:
        self.passes.forget((namespace, name))
        self.memory.forget(namespace, name)
        self.metrics.forget(namespace, name)


def analysis_interval(body: Mapping[str, Any]) -> float:
    """Seconds between analyses (the default interval while the spec is invalid)."""
    resolved = resolve(body).resolved
    analysis = resolved.spec.rollout.analysis if resolved is not None else Analysis()
    return duration_seconds(analysis.interval)


def take_over(ctx: Context, diffbase: kopf.DiffBaseStorage, logger: logging.Logger) -> None:
    """Reconcile every resource once, as this replica starts leading: kopf does not fire again a
    change it saw while this replica stood by (nor one the last leader had not finished). The old
    spec is the one kopf last handled (its diff-base), as the change handlers would have it. This
    runs in the elector's thread, outside kopf's context, so its Events go straight to the API."""
    ctx.memory.forget_carried()
    try:
        listed = kubernetes.client.CustomObjectsApi(ctx.cluster.api).list_cluster_custom_object(
            names.GROUP, names.VERSION, names.PLURAL)
    except (kubernetes.client.ApiException, *kube.NO_ANSWER) as exc:
        logger.warning("takeover: resources not listed (%s); kopf's triggers reconcile them", exc)
        return
    for body in listed["items"]:
        meta = body["metadata"]
        try:
            reconcile(ctx, meta["namespace"], meta["name"], logger, old=diffbase.fetch(body=kopf.Body(body)),
                      post=events_through_api(ctx.cluster))
        except WritesFailed as exc:  # in status already; the change handlers retry
            logger.warning("takeover of %s/%s: %s", meta["namespace"], meta["name"], exc)


# -- one reconciliation -------------------------------------------------------------------------


def reconcile(ctx: Context, namespace: str, name: str, logger: logging.Logger, *,
              old: Mapping[str, Any] | None = None, analyze: bool = False,
              post: EventPoster = kube.post_events) -> bool:
    """One pass, coalesced with the other triggers of the resource (``coalescing``); False when
    the resource is gone or going (nothing was done). A pass whose status write finds the resource
    changed since it was read (``StatusConflict``) reads it again and plans again, up to
    ``CONFLICT_ATTEMPTS`` times. Raises ``WritesFailed`` when the API server did not take its
    writes (after the status says so), or the resource changed under every pass. ``post``: how
    its Events are posted (kopf's, from a handler's context)."""
    return ctx.passes.run((namespace, name), Trigger(old, analyze),
                          lambda trigger: _reconcile(ctx, namespace, name, logger, trigger, post))


def _reconcile(ctx: Context, namespace: str, name: str, logger: logging.Logger, trigger: Trigger,
               post: EventPoster) -> bool:
    with ctx.metrics.counting_errors(namespace, name):
        if not ctx.leadership.leading():  # a standby writes nothing, whatever triggered it
            return True
        for _ in range(CONFLICT_ATTEMPTS):
            try:
                return _pass(ctx, namespace, name, logger, trigger, post)
            except StatusConflict:
                logger.info("%s/%s changed since it was read: reading it again, planning again", namespace, name)
        raise WritesFailed(f"the resource changed under {CONFLICT_ATTEMPTS} passes in a row")


def _pass(ctx: Context, namespace: str, name: str, logger: logging.Logger, trigger: Trigger,
          post: EventPoster) -> bool:
    body = ctx.cluster.get(namespace, name)
    if body is None or body["metadata"].get("deletionTimestamp"):
        return False
    now = datetime.now(timezone.utc)
    status = read_status(body)
    # the old spec counts for the immutable fields only if it was ever served
    served = status.stable_revision is not None and not is_not_ready(status, INVALID_SPEC)
    resolution = resolve(body, trigger.old if served else None)
    if resolution.resolved is None:
        _refuse(ctx, body, status, resolution.message, now, post)
    else:
        _converge(ctx, body, resolution.resolved, status, now, logger, post, analyze=trigger.analyze)
    return True


def events_through_api(cluster: kube.Cluster) -> EventPoster:
    """Posting a resource's Events with a create each, where kopf's poster cannot be reached (it
    needs the context kopf gives its handlers)."""
    def post(owner: Mapping[str, Any], events: Sequence[Event]) -> None:
        meta, core = owner["metadata"], kubernetes.client.CoreV1Api(cluster.api)
        involved = {"apiVersion": owner["apiVersion"], "kind": owner["kind"], "name": meta["name"],
                    "namespace": meta["namespace"], "uid": meta["uid"]}
        for event in events:
            now = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
            core.create_namespaced_event(meta["namespace"], {
                "metadata": {"generateName": f"{meta['name']}."}, "involvedObject": involved,
                "type": event.type.value, "reason": event.reason, "message": event.message,
                "source": {"component": names.MANAGER}, "firstTimestamp": now, "lastTimestamp": now, "count": 1})
    return post


class StatusConflict(Exception):
    """The resource was written since this pass read it (409 on the resourceVersion its status
    write carried): what the pass planned may rest on a stale status."""


def write_status(cluster: kube.Cluster, body: Mapping[str, Any], status: Obj) -> None:
    """Merge-patch the resource's status on condition that it is still the version ``body`` is
    (its resourceVersion rides in the patch, so the API server answers 409 otherwise): two
    writers can never both apply a change planned from the same status. Gone: nothing to say."""
    meta = body["metadata"]
    patch = {"metadata": {"resourceVersion": meta["resourceVersion"]}, "status": status}
    try:
        kubernetes.client.CustomObjectsApi(cluster.api).patch_namespaced_custom_object_status(
            names.GROUP, names.VERSION, meta["namespace"], names.PLURAL, meta["name"], patch,
            field_manager=names.MANAGER, _content_type=kube.MERGE_PATCH)
    except kubernetes.client.ApiException as exc:
        if exc.status == 409:
            raise StatusConflict(str(exc.reason)) from exc
        if exc.status != 404:
            raise


def _refuse(ctx: Context, body: Mapping[str, Any], status: SpecDecodeDeploymentStatus, message: str,
            now: datetime, post: EventPoster) -> None:
    """An invalid spec (admission bypassed): say why in status, leave what runs alone, no retry."""
    meta = body["metadata"]
    if is_not_ready(status, INVALID_SPEC, message) and status.observed_generation == meta.get("generation"):
        return
    new = not_ready(status, INVALID_SPEC, message, now).model_copy(update={"observed_generation": meta.get("generation")})
    write_status(ctx.cluster, body, status_patch(new))
    post(body, [Event(EventType.WARNING, "InvalidSpec", message)])


def _converge(ctx: Context, body: Mapping[str, Any], r: Resolved, status: SpecDecodeDeploymentStatus,
              now: datetime, logger: logging.Logger, post: EventPoster, *, analyze: bool) -> None:
    meta = body["metadata"]
    done = converge(KubeBackend(ctx.cluster, body, logger, post), r, status, annotations=meta.get("annotations"),
                    generation=meta.get("generation"), now=now, carried=ctx.memory.carried(r.namespace, r.name),
                    logger=logger, analyze=analyze)
    ctx.memory.keep(r.namespace, r.name, done.carried)
    _record(ctx.metrics, r, status, done.status, done.verdict)
    if done.unwritten is not None:
        raise WritesFailed(f"{done.unwritten.reason}: {done.unwritten.message}")


class WritesFailed(Exception):
    """A reconciliation whose writes the API server did not take; its status says why (Ready=False
    with the reason) and nothing else changed. The change handlers retry it with backoff
    (``retry_delay``)."""


def retry_delay(retries: int) -> float:
    """Seconds before the next try of a reconciliation whose writes failed ``retries`` times."""
    return min(RETRY_MAX_SECONDS, RETRY_FIRST_SECONDS * 2 ** retries)


@dataclass(frozen=True)
class KubeObserved(Observed):
    kind: WorkloadKind = WorkloadKind.DEPLOYMENT  # what the desired revision runs as
    running: WorkloadKind | None = None  # what the stable revision runs as
    kind_warnings: tuple[str, ...] = ()


@dataclass
class KubeBackend:
    """The cluster as ``loop.converge`` sees it: children applied, scaled and deleted through
    ``reconcile.plan``, runtime pods, canary pods' ``/metrics``, the user's HTTPRoute, the
    resource's status, annotations and Events."""

    cluster: kube.Cluster
    body: Mapping[str, Any]
    logger: logging.Logger
    post: EventPoster = kube.post_events

    def observe(self, r: Resolved, status: SpecDecodeDeploymentStatus) -> KubeObserved:
        cluster, meta = self.cluster, self.body["metadata"]
        existing = children_of(cluster.children(r.namespace, r.name), self.body)
        running = running_kind(status, existing)
        kind, warnings = desired_kind(r, running, (meta.get("annotations") or {}).get(names.ANNOTATION_WORKLOAD_KIND),
                                      lambda: cluster.serves(kube.LEADER_WORKER_SET.api_version))
        return KubeObserved(revision=revision(r, leader_worker_set=kind is WorkloadKind.LEADER_WORKER_SET),
                            ready=ready_replicas(existing, r.layout.pods_per_group),
                            pods=cluster.pods(r.namespace, names.runtime_pod_labels(r.name)),
                            children=existing, events=self._events(r, existing), kind=kind, running=running,
                            kind_warnings=tuple(warnings))

    def _events(self, r: Resolved, children: Sequence[Obj]) -> list[Obj]:
        """FailedCreate Events, read only when a StatefulSet's failure to create pods can be in
        them and nowhere else."""
        return self.cluster.events(r.namespace, FAILED_CREATE) if told_by_events(children) else []

    def carry_out(self, r: Resolved, observed: KubeObserved, t: Transition) -> Outcome:
        kind = observed.kind
        stable_kind = kind if t.status.stable_revision == observed.revision else observed.running or kind
        changes = plan(r, observed.revision, t.replicas, observed.children, owner=self.body,
                       stable=t.status.stable_revision, canary=route_canary(t.status), kind=kind,
                       stable_kind=stable_kind)
        restarts, unhealed = self._heal(observed)
        warnings, unwritten = _apply(self.cluster, changes)
        route_warnings, carried = [], unwritten is None
        if unwritten is None:  # the route follows the children, once they are written
            route_warnings, carried, unwritten = _route(self.cluster, r, t.status.rollout.canary_weight, self.logger)
        lws = stable_kind is WorkloadKind.LEADER_WORKER_SET
        return Outcome(warnings=(*observed.kind_warnings, *warnings, *route_warnings), unwritten=unwritten or unhealed,
                       weight_carried=carried, events=restarts,
                       status={"selector": names.label_selector(serving_selector(r, leader_worker_set=lws)),
                               "layout": r.layout.notation, "workload_kind": stable_kind})

    def _heal(self, observed: KubeObserved) -> tuple[tuple[Event, ...], Unwritten | None]:
        """Record the members of the StatefulSet groups whose pods are all Ready, and restart those
        whose member started again (``group_restart``): the restarts' Events, or what was not written."""
        groups = group_changes(observed.children, observed.pods)
        unwritten = _attempt(_group_writes(self.cluster, groups))
        return (tuple(restart_event(c) for c in groups if c.delete) if unwritten is None else ()), unwritten

    def serving_endpoints(self, r: Resolved, observed: KubeObserved, revision_: str) -> list[tuple[str, str]]:
        lws = observed.kind is WorkloadKind.LEADER_WORKER_SET
        selector = {**serving_selector(r, leader_worker_set=lws), names.LABEL_REVISION: revision_}
        return list(serving_endpoints(self.cluster.pods(r.namespace, selector)))

    def write_status(self, r: Resolved, status: SpecDecodeDeploymentStatus) -> None:
        write_status(self.cluster, self.body, status_patch(status))

    def post_events(self, r: Resolved, events: Sequence[Event]) -> None:
        self.post(self.body, events)

    def remove_annotations(self, r: Resolved, keys: Sequence[str]) -> None:
        self.cluster.remove_annotations(r.namespace, r.name, keys)


def _apply(cluster: kube.Cluster, changes: Plan) -> tuple[list[str], Unwritten | None]:
    """Every write of ``changes`` dry-run first; only when the API server would take them all,
    delete and scale down (GPUs free up), hand earlier versions' fields over, then apply. Returns
    warnings (an object of an API the cluster does not serve, such as a ServiceMonitor without the
    Prometheus operator, is skipped) and what was not written: on any dry run's error nothing is,
    and a write that fails after its dry run passed stops the rest."""
    warnings, writes = _writes(cluster, changes)
    return warnings, _attempt(writes)


def _attempt(writes: Sequence[_Write]) -> Unwritten | None:
    """Dry-run every write; only when all would pass, make them in order. What was not written:
    everything on a dry run's error, the rest from a write that fails after its dry run passed."""
    failed = [(write.what, exc) for write in writes if (exc := write.attempt(dry_run=True))]
    if not failed:
        failed = next(([(write.what, exc)] for write in writes if (exc := write.attempt(dry_run=False))), [])
    if not failed:
        return None
    reason = CHILD_REFUSED if all(exc.refused for _, exc in failed) else APPLY_FAILED
    return Unwritten(reason, "; ".join(f"{what}: {exc.message}" for what, exc in failed))


@dataclass(frozen=True)
class _Write:
    """One write of a plan: ``call(*args, dry_run=…)``, named for status messages."""

    what: str
    call: Callable[..., None]
    args: tuple[Any, ...]

    def attempt(self, *, dry_run: bool) -> kube.WriteFailed | None:
        try:
            self.call(*self.args, dry_run=dry_run)
        except kube.WriteFailed as exc:
            return exc
        return None


def _writes(cluster: kube.Cluster, changes: Plan) -> tuple[list[str], list[_Write]]:
    """The writes of ``changes`` in the order they are made, and warnings for the objects skipped."""
    writes = [*(_Write(_named(o, "delete"), cluster.delete, (o,)) for o in changes.delete),
              *(_Write(_named(o, f"scale to {o['spec']['replicas']}"), cluster.patch, (o,)) for o in changes.scale),
              *(_Write(_named(live, "hand-over of earlier fields"), cluster.hand_over, (live, managed))
                for live, managed in changes.hand_over)]
    warnings = []
    for obj in changes.apply:
        if cluster.serves(obj["apiVersion"]):
            writes.append(_Write(_named(obj), cluster.apply, (obj,)))
        else:
            warnings.append(f"{_named(obj)} not created: the cluster does not serve {obj['apiVersion']}")
    return warnings, writes


def _group_writes(cluster: kube.Cluster, changes: Sequence[GroupChange]) -> list[_Write]:
    """The pod deletes of the groups to restart, then the members to record."""
    return [*(_Write(_named(pod, "delete: its group restarts"), cluster.delete, (pod,))
              for change in changes for pod in change.delete),
            *(_Write(_named(change.group, "record of the group's members"), cluster.patch,
                     (record_patch(change.group, change.record),)) for change in changes if change.record is not None)]


def _named(obj: Mapping[str, Any], verb: str = "") -> str:
    """How a status message names an object written to: 'StatefulSet demo-3f2a-0 (delete)'."""
    return f"{obj['kind']} {obj['metadata']['name']}" + (f" ({verb})" if verb else "")


def _route(cluster: kube.Cluster, r: Resolved, canary_weight: int | None,
           logger: logging.Logger) -> tuple[list[str], bool, Unwritten | None]:
    """Set the canary's weight on the HTTPRoute of ``rollout.trafficRouting``. Returns why not, as
    warnings or (the API server did not take the patch) as what was not written, and whether the
    weight is in effect: the route holds it, or no route can carry weights and the replica ratio
    rules (as without trafficRouting); not when the route changed meanwhile (the next
    reconciliation sets it)."""
    routing = r.spec.rollout.traffic_routing
    if routing is None or canary_weight is None:
        return [], True, None
    if not cluster.serves(kube.HTTP_ROUTE.api_version):
        return [f"HTTPRoute {routing.http_route}: the cluster does not serve {kube.HTTP_ROUTE.api_version}; "
                "traffic follows the replica ratio"], True, None
    route = cluster.read(kube.HTTP_ROUTE, r.namespace, routing.http_route)
    if route is None:
        return [f"HTTPRoute {routing.http_route} not found: traffic follows the replica ratio"], True, None
    try:
        change = route_patch(route, r, canary_weight)
    except RouteError as exc:
        return [str(exc)], True, None
    try:
        if change is not None and not cluster.patch_unless_changed(change):
            logger.info("HTTPRoute %s changed meanwhile: weights set on the next reconciliation", routing.http_route)
            return [], False, None
    except kube.WriteFailed as exc:
        return [], exc.refused, Unwritten(ROUTE_REFUSED if exc.refused else APPLY_FAILED, (
            f"HTTPRoute {routing.http_route} refused the weights: {exc.message}; traffic follows the replica ratio"
            if exc.refused else f"HTTPRoute {routing.http_route}: {exc.message}"))
    return [], True, None


def _record(metrics: OperatorMetrics, r: Resolved, before: SpecDecodeDeploymentStatus,
            after: SpecDecodeDeploymentStatus, verdict: Verdict | None) -> None:
    if verdict is not None and verdict.measurement.revision == before.canary_revision:
        metrics.analysed(r.namespace, r.name, verdict.result.value)
    rolled_back = RolloutPhase.ROLLED_BACK
    if after.rollout.phase == rolled_back and before.rollout.phase != rolled_back:
        metrics.rolled_back(r.namespace, r.name)
    metrics.observe(r.namespace, r.name, after)
