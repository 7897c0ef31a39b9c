"""The operator's own Prometheus metrics: rollout progress, analysis verdicts, rollbacks, errors.

The names are the contract the Grafana dashboard queries. Each operator run gets its own
``CollectorRegistry`` (created in the startup handler, served on ``SPECDECODE_METRICS_PORT``), so a
second run in one process (the integration tests) starts from zero and never registers twice.
"""
from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

from specdecode.operator.spec import SpecDecodeDeploymentStatus

ROLLOUT_STEP = "specdecode_operator_rollout_step"
CANARY_WEIGHT = "specdecode_operator_canary_weight_percent"
ANALYSIS_RUNS = "specdecode_operator_analysis_runs_total"
ACCEPTANCE_RATE = "specdecode_operator_acceptance_rate"
ROLLBACKS = "specdecode_operator_rollbacks_total"
RECONCILE_ERRORS = "specdecode_operator_reconcile_errors_total"
ALL = (ROLLOUT_STEP, CANARY_WEIGHT, ANALYSIS_RUNS, ACCEPTANCE_RATE, ROLLBACKS, RECONCILE_ERRORS)

RESOURCE = ("namespace", "name")


class OperatorMetrics:
    """The metrics of one operator run, labelled by resource (namespace, name)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.rollout_step = Gauge(ROLLOUT_STEP, "Index of the canary step in spec.rollout.steps; -1 without a rollout",
                                  RESOURCE, registry=self.registry)
        self.canary_weight = Gauge(CANARY_WEIGHT, "Percent of traffic sent to the canary revision: the HTTPRoute's "
                                   "weight with trafficRouting, else the share of replicas running it",
                                   RESOURCE, registry=self.registry)
        self.analysis_runs = Counter(ANALYSIS_RUNS, "Canary analyses by verdict (pass, fail, inconclusive)",
                                     (*RESOURCE, "result"), registry=self.registry)
        self.acceptance_rate = Gauge(ACCEPTANCE_RATE, "Acceptance rate (accepted / draft tokens) last measured",
                                     (*RESOURCE, "revision"), registry=self.registry)
        self.rollbacks = Counter(ROLLBACKS, "Canary revisions rolled back (analysis failed or aborted by hand)",
                                 RESOURCE, registry=self.registry)
        self.reconcile_errors = Counter(RECONCILE_ERRORS, "Reconciliations that raised", RESOURCE,
                                        registry=self.registry)
        self._server: WSGIServer | None = None
        self._thread: threading.Thread | None = None

    def serve(self, port: int, addr: str = "0.0.0.0") -> None:
        """Expose ``/metrics`` on ``addr:port`` in a background thread until ``stop``."""
        self._server, self._thread = start_http_server(port, addr, registry=self.registry)

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def observe(self, namespace: str, name: str, status: SpecDecodeDeploymentStatus) -> None:
        """Set the gauges from the status just written."""
        rollout = status.rollout
        step = status.canary_step if status.canary_revision is not None and status.canary_step is not None else -1
        self.rollout_step.labels(namespace, name).set(step)
        running = rollout.stable_replicas + rollout.canary_replicas
        weight = 100.0 * rollout.canary_replicas / running if status.canary_revision and running else 0.0
        self.canary_weight.labels(namespace, name).set(weight if rollout.canary_weight is None else rollout.canary_weight)
        acceptance = status.acceptance
        if acceptance is not None and acceptance.rate is not None:
            self.acceptance_rate.labels(namespace, name, acceptance.revision).set(acceptance.rate)

    def analysed(self, namespace: str, name: str, result: str) -> None:
        self.analysis_runs.labels(namespace, name, result.lower()).inc()

    def rolled_back(self, namespace: str, name: str) -> None:
        self.rollbacks.labels(namespace, name).inc()

    @contextmanager
    def counting_errors(self, namespace: str, name: str) -> Iterator[None]:
        """Count an exception escaping the block (and let it go on to kopf's retry logic)."""
        try:
            yield
        except Exception:
            self.reconcile_errors.labels(namespace, name).inc()
            raise

    def forget(self, namespace: str, name: str) -> None:
        """Drop the series of a deleted resource."""
        for metric in (self.rollout_step, self.canary_weight, self.analysis_runs, self.acceptance_rate,
                       self.rollbacks, self.reconcile_errors):
            metric.remove_by_labels({"namespace": namespace, "name": name})
