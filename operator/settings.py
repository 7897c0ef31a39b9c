"""The operator's configuration, read from the environment once at startup, and kopf's settings.

Environment: ``SPECDECODE_WEBHOOK_PORT`` (unset or empty: no webhook server),
``SPECDECODE_WEBHOOK_CERT_DIR`` (tls.crt, tls.key), ``SPECDECODE_METRICS_PORT`` (default 8081),
``POD_ID`` (this replica's name: the Lease's holder), ``POD_NAMESPACE`` and
``SPECDECODE_LEASE_NAME`` (the Lease; unset: this replica leads alone) with its timing
(``SPECDECODE_LEASE_*_SECONDS``), ``KUBECONFIG`` outside a cluster.
"""
from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import kopf

from specdecode.operator import names
from specdecode.operator.leadership import LeaderDiffBaseStorage, Leadership, LeaderProgressStorage, LeaseTiming

KOPF_PREFIX = f"kopf.{names.GROUP}"  # kopf's own annotations; ours (commands) stay in names.GROUP
ENV_WEBHOOK_PORT = "SPECDECODE_WEBHOOK_PORT"
ENV_WEBHOOK_CERT_DIR = "SPECDECODE_WEBHOOK_CERT_DIR"
ENV_METRICS_PORT = "SPECDECODE_METRICS_PORT"
ENV_KUBECONFIG = "KUBECONFIG"
ENV_POD_ID = "POD_ID"  # kopf's identity of this replica, and the Lease's holder (the chart: the pod's name)
ENV_POD_NAMESPACE = "POD_NAMESPACE"  # where the Lease is
ENV_LEASE_NAME = "SPECDECODE_LEASE_NAME"  # unset: no Lease, this replica leads alone
ENV_LEASE_TIMING = {"duration": "SPECDECODE_LEASE_DURATION_SECONDS",
                    "renew_deadline": "SPECDECODE_LEASE_RENEW_DEADLINE_SECONDS",
                    "retry_period": "SPECDECODE_LEASE_RETRY_PERIOD_SECONDS"}
DEFAULT_METRICS_PORT = 8081
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
    lease: LeaseConfig | None = None  # None: no Lease, this replica leads alone

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> OperatorConfig:
        def value(key: str) -> str | None:
            return env.get(key, "").strip() or None  # unset and empty alike

        webhook_port, cert_dir, metrics_port, lease_name = (value(k) for k in (
            ENV_WEBHOOK_PORT, ENV_WEBHOOK_CERT_DIR, ENV_METRICS_PORT, ENV_LEASE_NAME))
        timing = {key: float(seconds) for key, env_key in ENV_LEASE_TIMING.items() if (seconds := value(env_key))}
        identity = value(ENV_POD_ID) or socket.gethostname()
        lease = LeaseConfig(lease_name, value(ENV_POD_NAMESPACE) or "default", identity,
                            LeaseTiming(**timing)) if lease_name else None
        return cls(webhook_port=int(webhook_port) if webhook_port else None,
                   webhook_cert_dir=Path(cert_dir) if cert_dir else None,
                   metrics_port=int(metrics_port) if metrics_port else DEFAULT_METRICS_PORT,
                   kubeconfig=value(ENV_KUBECONFIG), lease=lease)


@dataclass(frozen=True)
class LeaseConfig:
    name: str
    namespace: str
    identity: str  # the holder's name: this pod's
    timing: LeaseTiming = LeaseTiming()


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


def configure(settings: kopf.OperatorSettings, config: OperatorConfig, leadership: Leadership,
              logger: logging.Logger) -> None:
    """kopf's settings: state in annotations (the CRD's structural schema has no room for kopf in
    status), written only while leading (``leadership``), a finalizer in our group (kopf needs one
    to stop the analysis daemon), handler logs posted as Events only from warnings up, the webhook
    server, and the watches' label selectors (``WATCHED``)."""
    settings.persistence.progress_storage = LeaderProgressStorage(leadership, prefix=KOPF_PREFIX)
    settings.persistence.diffbase_storage = LeaderDiffBaseStorage(leadership, prefix=KOPF_PREFIX)
    settings.persistence.finalizer = f"{KOPF_PREFIX}/finalizer"
    settings.posting.level = logging.WARNING
    settings.admission.server = webhook_server(config, logger)
    for resource, labels in WATCHED.items():
        settings.watching.label_selectors[resource] = names.label_selector(labels)
