"""controller: one reconciliation of a SpecDecodeDeployment, and the operator's configuration.

``reconcile`` reads the resource, its children and its runtime pods, asks the pure cores what
should be (``resolve`` → ``render.revision`` → ``rollout.advance`` → ``reconcile.plan``), then
writes the children, the status, Events and metrics. Every trigger runs it: the resource's
create/update/resume (spec changes and command annotations), an event on one of its workloads
(readiness) or runtime pods (a refusal to start, in their termination message), and
the analysis daemon every ``analysis.interval`` while a canary exists (``analyze=True`` adds a
verdict from the canary pods' ``/metrics`` or from Prometheus). Runs of one resource are
serialised by a lock, and each starts from a fresh read, so concurrent triggers cannot apply a
stale state.

Configuration comes from the environment once, in the startup handler (``OperatorConfig``).

High availability: the chart runs the operator as a StatefulSet of several replicas peered by kopf
(``kopf run --peering``): each replica's priority comes from its ordinal (``peering_priority``), so
no two share one — kopf pauses every replica that sees another of the same priority — and the
lowest ordinal running reconciles while the others stand by. Every replica serves the admission
webhook, paused or not.
"""
from __future__ import annotations

import asyncio
import logging
import re
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import kopf

from specdecode.operator import kube, names
from specdecode.operator.analysis import (
    History,
    Measurement,
    Verdict,
    judge,
    measurement_from_prometheus,
    parse_metrics,
    prometheus_queries,
    without_data,
)
from specdecode.operator.metrics import OperatorMetrics
from specdecode.operator.reconcile import (
    CHILD_REFUSED,
    INVALID_SPEC,
    Plan,
    desired_kind,
    is_not_ready,
    not_ready,
    plan,
    read_status,
    ready_replicas,
    running_kind,
    scrape_targets,
    status_patch,
)
from specdecode.operator.render import revision, serving_selector
from specdecode.operator.resolve import Resolved, duration_seconds, resolve
from specdecode.operator.pods import not_ready_reason, runtime_refusal
from specdecode.operator.rollout import Event, EventType, advance, read_commands, route_canary, weight_in_effect
from specdecode.operator.spec import Analysis, RolloutPhase, SpecDecodeDeploymentStatus, WorkloadKind
from specdecode.operator.traffic import RouteError, route_patch
from specdecode.runtime.config import SpeculativeMethod

KOPF_PREFIX = f"kopf.{names.GROUP}"  # kopf's own annotations; ours (commands) stay in names.GROUP
ENV_WEBHOOK_PORT = "SPECDECODE_WEBHOOK_PORT"
ENV_WEBHOOK_CERT_DIR = "SPECDECODE_WEBHOOK_CERT_DIR"
ENV_METRICS_PORT = "SPECDECODE_METRICS_PORT"
ENV_KUBECONFIG = "KUBECONFIG"
ENV_POD_ID = "POD_ID"  # kopf's: this replica's identity among its peers (the chart: the pod's name)
ENV_PEERING_LIFETIME = "SPECDECODE_PEERING_LIFETIME_SECONDS"
DEFAULT_METRICS_PORT = 8081
SCRAPE_TIMEOUT_SECONDS = 5.0
TOP_PEERING_PRIORITY = 100  # of ordinal 0; below kopf's --dev (666), so that a developer's operator takes over
# What the operator watches besides its resource, asked of the API server by label (kopf's
# ``settings.watching.label_selectors``): its workloads and its runtime pods, nothing else in the cluster.
WORKLOAD_LABELS = {names.LABEL_MANAGED_BY: names.MANAGER, names.LABEL_COMPONENT: names.COMPONENT_RUNTIME}
RUNTIME_POD_LABELS = {names.LABEL_NAME: names.APP, names.LABEL_COMPONENT: names.COMPONENT_RUNTIME}
WATCHED = {("apps", "deployments"): WORKLOAD_LABELS, ("apps", "statefulsets"): WORKLOAD_LABELS,
           ("leaderworkerset.x-k8s.io", "leaderworkersets"): WORKLOAD_LABELS, ("v1", "pods"): RUNTIME_POD_LABELS}


@dataclass(frozen=True)
class OperatorConfig:
    webhook_port: int | None = None  # None: no webhook server
    webhook_cert_dir: Path | None = None  # tls.crt + tls.key; None: plain HTTP
    metrics_port: int = DEFAULT_METRICS_PORT
    kubeconfig: str | None = None  # outside a cluster
    peering_priority: int | None = None  # None: kopf's (--priority, default 0)
    peering_lifetime: int | None = None  # seconds a crashed replica's record holds the others back; None: kopf's 60

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> OperatorConfig:
        def value(key: str) -> str | None:
            return env.get(key, "").strip() or None  # unset and empty alike

        webhook_port, cert_dir, metrics_port, lifetime = (value(k) for k in (
            ENV_WEBHOOK_PORT, ENV_WEBHOOK_CERT_DIR, ENV_METRICS_PORT, ENV_PEERING_LIFETIME))
        return cls(webhook_port=int(webhook_port) if webhook_port else None,
                   webhook_cert_dir=Path(cert_dir) if cert_dir else None,
                   metrics_port=int(metrics_port) if metrics_port else DEFAULT_METRICS_PORT,
                   kubeconfig=value(ENV_KUBECONFIG), peering_priority=peering_priority(value(ENV_POD_ID)),
                   peering_lifetime=int(lifetime) if lifetime else None)


def peering_priority(pod_id: str | None) -> int | None:
    """The priority of StatefulSet pod ``<name>-<ordinal>`` among its peers: ordinal 0 highest,
    each ordinal its own; None for any other identity."""
    ordinal = re.fullmatch(r".+-(\d+)", pod_id or "")
    return TOP_PEERING_PRIORITY - int(ordinal[1]) if ordinal else None


async def no_webhook_server(fn: Any) -> Any:
    """Stands in for a webhook server when none is configured (kopf insists on one whenever a
    validating handler exists): it listens nowhere and never hands out a client config."""
    await asyncio.Event().wait()
    yield  # never reached; makes this an async generator, as kopf expects of a server


def webhook_server(config: OperatorConfig, logger: logging.Logger) -> Any:
    if config.webhook_port is None:
        return no_webhook_server
    if config.webhook_cert_dir is None:
        logger.warning("%s is not set: the admission webhook serves plain HTTP (tests, or behind a TLS proxy)",
                       ENV_WEBHOOK_CERT_DIR)
        return kopf.WebhookServer(addr="0.0.0.0", port=config.webhook_port, insecure=True)
    return kopf.WebhookServer(addr="0.0.0.0", port=config.webhook_port,
                              certfile=config.webhook_cert_dir / "tls.crt", pkeyfile=config.webhook_cert_dir / "tls.key")


def configure(settings: kopf.OperatorSettings, config: OperatorConfig, logger: logging.Logger) -> None:
    """kopf's settings: state in annotations (the CRD's structural schema has no room for kopf in
    status), a finalizer in our group (kopf needs one to stop the analysis daemon), handler logs
    posted as Events only from warnings up, the webhook server, the watches' label selectors
    (``WATCHED``), and this replica's peering priority and lifetime."""
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=KOPF_PREFIX)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix=KOPF_PREFIX)
    settings.persistence.finalizer = f"{KOPF_PREFIX}/finalizer"
    settings.posting.level = logging.WARNING
    settings.admission.server = webhook_server(config, logger)
    for resource, labels in WATCHED.items():
        settings.watching.label_selectors[resource] = names.label_selector(labels)
    if config.peering_priority is not None:
        settings.peering.priority = config.peering_priority
    if config.peering_lifetime is not None:
        settings.peering.lifetime = config.peering_lifetime


# -- per-resource memory ------------------------------------------------------------------------


class Memory:
    """A lock per resource and the canary's samples (lost on restart: see analysis.py)."""

    def __init__(self) -> None:
        self._guard = threading.Lock()
        self._locks: dict[tuple[str, str], threading.Lock] = {}
        self._histories: dict[tuple[str, str], History] = {}

    def lock(self, namespace: str, name: str) -> threading.Lock:
        with self._guard:
            return self._locks.setdefault((namespace, name), threading.Lock())

    def history(self, namespace: str, name: str, revision_: str) -> History:
        kept = self._histories.get((namespace, name))
        return kept if kept is not None and kept.revision == revision_ else History(revision_)

    def keep(self, namespace: str, name: str, history: History) -> None:
        self._histories[namespace, name] = history

    def forget(self, namespace: str, name: str) -> None:
        with self._guard:
            self._locks.pop((namespace, name), None)
            self._histories.pop((namespace, name), None)


@dataclass
class Context:
    """What every handler shares (kopf's memo carries it)."""

    cluster: kube.Cluster
    metrics: OperatorMetrics
    memory: Memory = field(default_factory=Memory)

    @classmethod
    def start(cls, config: OperatorConfig) -> Context:
        metrics = OperatorMetrics()
        metrics.serve(config.metrics_port)
        return cls(kube.Cluster(config.kubeconfig), metrics)

    def stop(self) -> None:
        self.metrics.stop()

    def forget(self, namespace: str, name: str) -> None:
        self.memory.forget(namespace, name)
        self.metrics.forget(namespace, name)


def analysis_interval(body: Mapping[str, Any]) -> float:
    """Seconds between analyses (the default interval while the spec is invalid)."""
    resolved = resolve(body).resolved
    analysis = resolved.spec.rollout.analysis if resolved is not None else Analysis()
    return duration_seconds(analysis.interval)


# -- one reconciliation -------------------------------------------------------------------------


def reconcile(ctx: Context, namespace: str, name: str, logger: logging.Logger, *,
              old: Mapping[str, Any] | None = None, analyze: bool = False) -> bool:
    """One pass; False when the resource is gone or going (nothing was done)."""
    with ctx.memory.lock(namespace, name), ctx.metrics.counting_errors(namespace, name):
        body = ctx.cluster.get(namespace, name)
        if body is None or body["metadata"].get("deletionTimestamp"):
            return False
        now = datetime.now(timezone.utc)
        status = read_status(body)
        # the old spec counts for the immutable fields only if it was ever served
        served = status.stable_revision is not None and not is_not_ready(status, INVALID_SPEC)
        resolution = resolve(body, old if served else None)
        if resolution.resolved is None:
            _refuse(ctx, body, status, resolution.message, now)
        else:
            _converge(ctx, body, resolution.resolved, status, now, logger, analyze=analyze)
        return True


def _refuse(ctx: Context, body: Mapping[str, Any], status: SpecDecodeDeploymentStatus, message: str,
            now: datetime) -> None:
    """An invalid spec (admission bypassed): say why in status, leave what runs alone, no retry."""
    meta = body["metadata"]
    if is_not_ready(status, INVALID_SPEC, message) and status.observed_generation == meta.get("generation"):
        return
    new = not_ready(status, INVALID_SPEC, message, now).model_copy(update={"observed_generation": meta.get("generation")})
    ctx.cluster.patch_status(meta["namespace"], meta["name"], status_patch(new))
    kube.post_events(body, [Event(EventType.WARNING, "InvalidSpec", message)])


def _converge(ctx: Context, body: Mapping[str, Any], r: Resolved, status: SpecDecodeDeploymentStatus,
              now: datetime, logger: logging.Logger, *, analyze: bool) -> None:
    cluster, meta = ctx.cluster, body["metadata"]
    existing = cluster.children(r.namespace, r.name)
    running = running_kind(status, existing)
    kind, kind_warnings = desired_kind(r, running, (meta.get("annotations") or {}).get(names.ANNOTATION_WORKLOAD_KIND),
                                       lambda: cluster.serves(kube.LEADER_WORKER_SET.api_version))
    lws = kind is WorkloadKind.LEADER_WORKER_SET
    pods = cluster.pods(r.namespace, names.runtime_pod_labels(r.name))
    verdict = _analyse(ctx, r, status, now, logger, lws=lws) if analyze else None
    desired = revision(r, leader_worker_set=lws)
    t = advance(status, desired, r.spec, now=now, ready=ready_replicas(existing, r.layout.pods_per_group),
                verdict=verdict, analysed=analyze, commands=read_commands(meta.get("annotations")),
                refusal=runtime_refusal(pods),
                not_ready=not_ready_reason(pods, status.canary_revision) if status.canary_revision else None)
    stable_kind = kind if t.status.stable_revision == desired else running or kind
    changes = plan(r, desired, t.replicas, existing, owner=body, stable=t.status.stable_revision,
                   canary=route_canary(t.status), kind=kind, stable_kind=stable_kind)
    warnings, refused = _apply(cluster, changes)
    weight = t.status.rollout.canary_weight
    route_warnings, carried = _route(cluster, r, weight, logger)
    warnings += route_warnings
    settled = weight_in_effect(t.status, weight, r.spec, now) if carried else t.status
    new = settled.model_copy(update={
        "observed_generation": meta.get("generation"), "warnings": (*r.warnings, *kind_warnings, *warnings),
        "selector": names.label_selector(serving_selector(r, leader_worker_set=stable_kind is WorkloadKind.LEADER_WORKER_SET)),
        "layout": r.layout.notation, "workload_kind": stable_kind})
    events = list(t.events)
    if refused:
        message = "; ".join(refused)
        if not is_not_ready(status, CHILD_REFUSED, message):
            events.append(Event(EventType.WARNING, CHILD_REFUSED, message))
        new = not_ready(new, CHILD_REFUSED, message, now, before=status)
    if new != status:
        cluster.patch_status(r.namespace, r.name, status_patch(new))
    cluster.remove_annotations(r.namespace, r.name, t.consumed_annotations)
    kube.post_events(body, events)
    _record(ctx.metrics, r, status, new, verdict)


def _apply(cluster: kube.Cluster, changes: Plan) -> tuple[list[str], list[str]]:
    """Delete and scale down first (GPUs free up), hand earlier versions' fields over, then apply.
    Returns (warnings, refusals): an object of an API the cluster does not serve (ServiceMonitor
    without the Prometheus operator) is skipped with a warning, one the API server refuses as
    invalid (a bad toleration, quantity or env entry passed through) is named with the server's
    message, and the others are applied all the same; neither fails the reconciliation."""
    for obj in changes.delete:
        cluster.delete(obj)
    for obj in changes.scale:
        cluster.patch(obj)
    for live, managed in changes.hand_over:
        cluster.hand_over(live, managed)
    warnings, refused = [], []
    for obj in changes.apply:
        what = f"{obj['kind']} {obj['metadata']['name']}"
        if not cluster.serves(obj["apiVersion"]):
            warnings.append(f"{what} not created: the cluster does not serve {obj['apiVersion']}")
            continue
        try:
            cluster.apply(obj)
        except kube.Refused as exc:
            refused.append(f"{what}: {exc}")
    return warnings, refused


def _route(cluster: kube.Cluster, r: Resolved, canary_weight: int | None,
           logger: logging.Logger) -> tuple[list[str], bool]:
    """Set the canary's weight on the HTTPRoute of ``rollout.trafficRouting``. Returns why not, as
    warnings, and whether the weight is in effect: the route holds it, or no route can carry
    weights and the replica ratio rules (as without trafficRouting); not when the route changed
    meanwhile (the next reconciliation sets it)."""
    routing = r.spec.rollout.traffic_routing
    if routing is None or canary_weight is None:
        return [], True
    if not cluster.serves(kube.HTTP_ROUTE.api_version):
        return [f"HTTPRoute {routing.http_route}: the cluster does not serve {kube.HTTP_ROUTE.api_version}; "
                "traffic follows the replica ratio"], True
    route = cluster.read(kube.HTTP_ROUTE, r.namespace, routing.http_route)
    if route is None:
        return [f"HTTPRoute {routing.http_route} not found: traffic follows the replica ratio"], True
    try:
        change = route_patch(route, r, canary_weight)
    except RouteError as exc:
        return [str(exc)], True
    if change is not None and not cluster.patch_unless_changed(change):
        logger.info("HTTPRoute %s changed meanwhile: weights set on the next reconciliation", routing.http_route)
        return [], False
    return [], True


def _record(metrics: OperatorMetrics, r: Resolved, before: SpecDecodeDeploymentStatus,
            after: SpecDecodeDeploymentStatus, verdict: Verdict | None) -> None:
    if verdict is not None and verdict.measurement.revision == before.canary_revision:
        metrics.analysed(r.namespace, r.name, verdict.result.value)
    rolled_back = RolloutPhase.ROLLED_BACK
    if after.rollout.phase == rolled_back and before.rollout.phase != rolled_back:
        metrics.rolled_back(r.namespace, r.name)
    metrics.observe(r.namespace, r.name, after)


# -- analysis -----------------------------------------------------------------------------------


def _analyse(ctx: Context, r: Resolved, status: SpecDecodeDeploymentStatus, now: datetime,
             logger: logging.Logger, *, lws: bool) -> Verdict | None:
    """The canary's verdict over the last window; None without a canary or without data yet."""
    canary, analysis = status.canary_revision, r.spec.rollout.analysis
    if canary is None:
        return None
    try:
        if analysis.prometheus is not None:
            queries = prometheus_queries(r.namespace, r.name, canary, analysis.window)
            results = kube.query_prometheus(analysis.prometheus.url, queries, SCRAPE_TIMEOUT_SECONDS)
            measurement: Measurement | None = measurement_from_prometheus(results, canary, now, analysis.window)
        else:
            measurement = _scrape(ctx, r, canary, now, logger, lws=lws)
    except kube.ScrapeError as exc:  # a window without data counts towards inconclusiveLimit, as one without traffic
        logger.warning("analysis of %s without data: %s", canary, exc)
        return without_data(canary, str(exc), now)
    if measurement is None:
        return None
    return judge(measurement, analysis, speculative=r.spec.speculative.method is not SpeculativeMethod.NONE)


def _scrape(ctx: Context, r: Resolved, canary: str, now: datetime, logger: logging.Logger, *,
            lws: bool) -> Measurement | None:
    """Sample every running canary pod's ``/metrics``; the increase over the window so far.
    Raises ``kube.ScrapeError`` when ready canary pods run but none could be sampled."""
    window = timedelta(seconds=duration_seconds(r.spec.rollout.analysis.window))
    pods = ctx.cluster.pods(r.namespace, {**serving_selector(r, leader_worker_set=lws), names.LABEL_REVISION: canary})
    history = ctx.memory.history(r.namespace, r.name, canary)
    targets, failures = list(scrape_targets(pods)), []
    for pod, url in targets:
        try:
            snapshot = parse_metrics(kube.fetch(url, SCRAPE_TIMEOUT_SECONDS))
        except (kube.ScrapeError, ValueError) as exc:  # unreachable, or not a Prometheus exposition
            logger.warning("canary pod %s not sampled: %s", pod, exc)
            failures.append(f"pod {pod}: {exc}")
            continue
        history = history.record(pod, now, snapshot, keep=window)
    ctx.memory.keep(r.namespace, r.name, history)
    if targets and len(failures) == len(targets):
        raise kube.ScrapeError("no canary pod answered /metrics: " + "; ".join(failures))
    return history.measure(now, window)
