"""Every kopf handler of the operator; each unpacks its arguments and calls one function.

Run as the Helm chart does, in every replica (the one holding the release's Lease reconciles, all
serve the webhook; see ``leadership``)::

    kopf run --standalone --all-namespaces --liveness=http://0.0.0.0:8080/healthz \
        -m specdecode.operator.handlers

Environment (read once, at startup): ``SPECDECODE_WEBHOOK_PORT`` (unset or empty: no webhook
server), ``SPECDECODE_WEBHOOK_CERT_DIR`` (tls.crt, tls.key), ``SPECDECODE_METRICS_PORT`` (default
8081), ``SPECDECODE_LEASE_NAME`` (unset: no Lease, this replica leads alone) with ``POD_NAMESPACE``
(where it is), ``POD_ID`` (the holder's name: the pod's) and ``SPECDECODE_LEASE_DURATION_SECONDS``,
``_RENEW_DEADLINE_SECONDS``, ``_RETRY_PERIOD_SECONDS`` (default 15, 10, 2), ``KUBECONFIG`` outside
a cluster.
The validating webhook answers on ``/{WEBHOOK_ID}``
(kopf routes by handler id); the chart's ValidatingWebhookConfiguration points there.

Deletion needs no handler of its own: every child carries a controller owner reference, so the
garbage collector removes them with the resource. kopf puts a finalizer on resources while the
analysis daemon or the resync timer runs, only to stop them first.
"""
from __future__ import annotations

import asyncio
import logging
import os
from typing import Any

import kopf

from specdecode.operator import controller, names
from specdecode.operator.reconcile import APPLY_FAILED, CHILD_REFUSED, INVALID_SPEC, ROUTE_REFUSED
from specdecode.operator.resolve import admit
from specdecode.operator.settings import RUNTIME_POD_LABELS, WORKLOAD_LABELS, OperatorConfig, configure

RESOURCE = (names.GROUP, names.VERSION, names.PLURAL)
WEBHOOK_ID = "validate-specdecodedeployment"
WORKLOADS, RUNTIME_PODS = WORKLOAD_LABELS, RUNTIME_POD_LABELS  # the API server filters too
STOP_CHECK_SECONDS = 1.0  # how often the analysis daemon looks at its stop flag while it waits
RESYNC_SECONDS = 10.0  # how often a resource waiting on its workloads is reconciled without an event
NOT_WAITING = frozenset({INVALID_SPEC, CHILD_REFUSED, APPLY_FAILED, ROUTE_REFUSED})  # Ready=False reasons resync skips


@kopf.on.startup()
def start(settings: kopf.OperatorSettings, memo: kopf.Memo, logger: logging.Logger, **_: Any) -> None:
    config = OperatorConfig.from_env(os.environ)
    memo.ctx = controller.Context.start(config, logger)
    configure(settings, config, memo.ctx.leadership, logger)
    memo.ctx.lead(settings.persistence.diffbase_storage, logger)


@kopf.on.cleanup()
def stop(memo: kopf.Memo, **_: Any) -> None:
    memo.ctx.stop()


def leading(memo: kopf.Memo, **_: Any) -> bool:
    """Whether this replica holds the Lease: the filter of every handler that reconciles on an
    event. Not of the analysis daemon and the resync timer (kopf's finalizer follows their filters,
    which must agree between replicas); ``controller.reconcile`` checks it again in every case."""
    return memo.ctx.leadership.leading()


@kopf.on.resume(*RESOURCE, when=leading)
@kopf.on.create(*RESOURCE, when=leading)
@kopf.on.update(*RESOURCE, when=leading)
def reconcile(namespace: str, name: str, old: Any, retry: int, memo: kopf.Memo, logger: logging.Logger,
              **_: Any) -> None:
    """Spec changes and the command annotations (promote, abort, pause, resume); tried again, with
    backoff, while the API server does not take the writes."""
    try:
        controller.reconcile(memo.ctx, namespace, name, logger, old=old)
    except controller.WritesFailed as exc:
        raise kopf.TemporaryError(str(exc), delay=controller.retry_delay(retry)) from exc


def has_canary(status: kopf.Status, **_: Any) -> bool:
    return bool(status.get("canaryRevision"))


@kopf.daemon(*RESOURCE, when=has_canary, cancellation_timeout=30)
async def analyse(stopped: kopf.DaemonStopped, namespace: str, name: str, body: kopf.Body, memo: kopf.Memo,
                  logger: logging.Logger, **_: Any) -> None:
    """While a canary exists: every spec.rollout.analysis.interval, judge it and move the rollout.
    Async, so that kopf can cancel it; the blocking work runs in a thread."""
    while await interval_passed(stopped, controller.analysis_interval(body)):
        if not await asyncio.to_thread(reconcile_without_retry, memo.ctx, namespace, name, logger, analyze=True):
            return  # deleted (possibly before kopf's finalizer was on it to stop this daemon)


def reconcile_without_retry(ctx: controller.Context, namespace: str, name: str, logger: logging.Logger,
                            **options: Any) -> bool:
    """``controller.reconcile`` for the triggers that do not retry: writes the API server did not
    take are in status already, and the change handlers retry them."""
    try:
        return controller.reconcile(ctx, namespace, name, logger, **options)
    except controller.WritesFailed:
        return True


async def interval_passed(stopped: kopf.DaemonStopped, seconds: float) -> bool:
    """Sleep ``seconds``; False as soon as the daemon is asked to stop (noticed within a second).

    Not ``stopped.wait(seconds)``: kopf runs that wait as a task of its own, and when the operator
    stops just as its timeout fires, that task ends in a TimeoutError that no one awaits and kopf
    re-raises on the way out, so the operator exits with a traceback."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    while not stopped:
        left = deadline - loop.time()
        if left <= 0:
            return True
        await asyncio.sleep(min(left, STOP_CHECK_SECONDS))
    return False


def waiting_on_workloads(status: kopf.Status, **_: Any) -> bool:
    """Not Ready, no canary (the analysis daemon moves rollouts), not refused for its spec, and not
    waiting for writes the API server did not take (the change handlers retry those, with backoff)."""
    ready = next((c for c in status.get("conditions") or [] if c.get("type") == "Ready"), {})
    return (not status.get("canaryRevision") and ready.get("status") != "True"
            and ready.get("reason") not in NOT_WAITING)


@kopf.timer(*RESOURCE, interval=RESYNC_SECONDS, when=waiting_on_workloads)
def resync(namespace: str, name: str, memo: kopf.Memo, logger: logging.Logger, **_: Any) -> None:
    """Readiness noticed without the workload's event. kopf starts watching an API installed
    mid-life (LeaderWorkerSet) when its CRD changes, by reading the API server's discovery then;
    the CRD's last event can come before discovery lists the group, and kopf then never watches
    it (until restarted), so no LeaderWorkerSet event would ever reach ``workload_changed``."""
    reconcile_without_retry(memo.ctx, namespace, name, logger)


@kopf.on.event("apps", "v1", "deployments", labels=WORKLOADS, when=leading)
@kopf.on.event("apps", "v1", "statefulsets", labels=WORKLOADS, when=leading)
@kopf.on.event("leaderworkerset.x-k8s.io", "v1", "leaderworkersets", labels=WORKLOADS, when=leading)
@kopf.on.event("v1", "pods", labels=RUNTIME_PODS, when=leading)
def workload_changed(namespace: str, labels: kopf.Labels, memo: kopf.Memo, logger: logging.Logger,
                     **_: Any) -> None:
    """A workload's readiness moves the rollout on (and a deleted one is made again); a runtime
    pod that refuses to start, or starts again, shows in the status; a pod of a StatefulSet group
    that starts again (every pod event: a restartCount changed, a pod replaced) restarts its group."""
    reconcile_without_retry(memo.ctx, namespace, labels[names.LABEL_INSTANCE], logger)


@kopf.on.delete(*RESOURCE, optional=True)
def forget(namespace: str, name: str, memo: kopf.Memo, **_: Any) -> None:
    memo.ctx.forget(namespace, name)


@kopf.on.validate(*RESOURCE, id=WEBHOOK_ID, operations=["CREATE", "UPDATE"])
def validate(body: kopf.Body, old: kopf.Body | None, warnings: list[str], **_: Any) -> None:
    answer = admit(body, old)
    warnings.extend(answer.warnings)
    if not answer.allowed:
        raise kopf.AdmissionError(answer.message, code=422)
