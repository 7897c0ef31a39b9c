"""render: a resolved spec → the Kubernetes objects that serve it, as plain dicts.

Pure (no I/O, no owner references: the handler adopts what it applies). Layouts:

- one pod per replica (tensor parallelism inside the pod) → a ``Deployment`` per revision;
- several pods per replica (pipeline stages, or a stage spread over pods) → per replica a
  ``StatefulSet`` + headless ``Service`` (ordinal 0 is the leader and rendezvous address), or
  one ``LeaderWorkerSet`` per revision when the cluster serves that API.

Every pod runs ``specdecode serve`` with the shared speculative config as snake_case JSON and
the runtime's ``--tensor-parallel-size``/``--pipeline-parallel-size``; in a multi-pod group it
also gets torchrun's ``MASTER_ADDR``/``MASTER_PORT``/``NNODES``/``NODE_RANK``, and pod
``NODE_RANK`` runs the group's consecutive global ranks (``stage * tensor + tp_rank``) from
``NODE_RANK * ranks_per_pod``, so a pod never spans two stages. Every rank serves ``/health`` and
``/ready``, and the traffic ``Service`` selects only leaders (rank 0 emits).

Shutdown follows the runtime's drain (``specdecode serve`` on SIGTERM answers ``/ready`` 503 and
finishes the requests in flight for up to ``--drain-timeout``, 600 s by default): a ``preStop``
hook first waits ``PRE_STOP_SECONDS`` while the pod, terminating, leaves the Services' endpoints
(kube-proxy and Gateways stop sending it requests), so that SIGTERM only comes once no new
request does; a worker pod of a multi-pod group then waits in its hook until its leader has
exited, because the leader's drain needs its ranks. ``terminationGracePeriodSeconds`` covers the
hook, the drain and ``EXIT_MARGIN_SECONDS`` to exit.

The revision is a hash of the pod template before anything revision-specific is added, so the
same spec always has the same revision and any change to what a pod runs makes a new one.
"""
from __future__ import annotations

import hashlib
import json
import math
from typing import Any

from specdecode.operator import names
from specdecode.operator.resolve import Resolved
from specdecode.operator.security import container_security_context, pod_security_context
from specdecode.operator.sources import MODEL, Source, brought_in, heads, local_path
from specdecode.operator.spec import ModelLocation, ModelScheme
from specdecode.runtime.config import ServerConfig

Obj = dict[str, Any]

# The init container of hf:// sources: huggingface_hub ships with tokenizers in the runtime image.
FETCH_SCRIPT = ("import sys; from huggingface_hub import snapshot_download; "
                "snapshot_download(sys.argv[1], local_dir=sys.argv[2])")
# A container that exits non-zero leaves the end of its log as its termination message when it
# wrote none itself (the runtime writes its one-line refusal); the operator puts it in status.
TERMINATION_MESSAGE_POLICY = "FallbackToLogsOnError"
DRAIN_TIMEOUT_FLAG = "--drain-timeout"  # the runtime's; extraArgs may set it
PRE_STOP_SECONDS = 10  # for endpoint controllers, kube-proxy and Gateways to stop sending requests
EXIT_MARGIN_SECONDS = 30  # after the drain: uvicorn's shutdown, the engine's ranks stopping
LEADER_SERVING_SECONDS = 30  # a leader ready this long after a worker's endpoints went is not shutting down
# The preStop hook (argv: seconds, the runtime's port, LEADER_SERVING_SECONDS): wait for the
# endpoints to go; in a worker pod (NODE_RANK > 0), then while the group's leader drains (its
# /ready answers 503), until it no longer answers (it has drained and exited, or died). A leader
# that stays ready is not going: the worker alone is (evicted, its node drained), so it does not
# wait out its grace period for a leader that will not exit.
PRE_STOP_SCRIPT = (
    "import os, sys, time, urllib.error, urllib.request\n"
    "time.sleep(float(sys.argv[1]))\n"
    "leader, serving_since = os.environ.get('MASTER_ADDR'), None\n"
    "while leader and os.environ.get('NODE_RANK', '0') != '0':\n"
    "    try:\n"
    "        urllib.request.urlopen(f'http://{leader}:{sys.argv[2]}/ready', timeout=2)\n"
    "        serving_since = serving_since or time.monotonic()\n"
    "    except urllib.error.HTTPError:\n"
    "        serving_since = None\n"
    "    except OSError:\n"
    "        break\n"
    "    if serving_since is not None and time.monotonic() - serving_since >= float(sys.argv[3]):\n"
    "        break\n"
    "    time.sleep(2)\n"
)


# -- the pod template ---------------------------------------------------------------------------


def model_path(r: Resolved) -> str:
    """What ``--model`` receives inside the pod."""
    return local_path(r.spec.model.location, MODEL)


def speculative_json(r: Resolved) -> str:
    """``--speculative-config``: snake_case (the runtime's spelling), only what differs from its
    defaults, so a field added to the runtime later does not change every revision; the heads'
    field (``mtp_path``, ``eagle3_path``) is their path inside the pod."""
    speculative, head = r.spec.speculative, heads(r.spec.speculative)
    if head:
        location, source = head
        speculative = speculative.model_copy(update={source.config_field: local_path(location, source)})
    return json.dumps(speculative.model_dump(mode="json", exclude_defaults=True), separators=(",", ":"))


def runtime_args(r: Resolved) -> list[str]:
    args = [
        "serve",
        "--model", model_path(r),
        "--host", "0.0.0.0",
        "--port", str(names.HTTP_PORT),
        "--served-model-name", r.spec.model.served_name or r.name,
        "--speculative-config", speculative_json(r),
    ]
    if r.layout.tensor > 1:
        args += ["--tensor-parallel-size", str(r.layout.tensor)]
    if r.layout.pipeline > 1:
        args += ["--pipeline-parallel-size", str(r.layout.pipeline)]
    return args + list(r.spec.extra_args)


def container_resources(r: Resolved) -> Obj:
    res = r.spec.resources
    requests = {k: str(v) for k, v in res.requests.items()}
    limits = {k: str(v) for k, v in res.limits.items()}
    if r.layout.gpus_per_pod:
        requests[res.gpu_resource_name] = limits[res.gpu_resource_name] = str(r.layout.gpus_per_pod)
    return {k: v for k, v in (("requests", requests), ("limits", limits)) if v}


def drain_timeout_seconds(r: Resolved) -> float:
    """How long the runtime drains on SIGTERM: ``--drain-timeout`` in extraArgs (the last one
    counts, as argparse takes it), else the runtime's default."""
    seconds = ServerConfig.model_fields["drain_timeout_s"].default
    args = r.spec.extra_args
    for i, arg in enumerate(args):
        if arg == DRAIN_TIMEOUT_FLAG and i + 1 < len(args):
            seconds = float(args[i + 1])
        elif arg.startswith(f"{DRAIN_TIMEOUT_FLAG}="):
            seconds = float(arg.partition("=")[2])
    return seconds


def termination_grace_seconds(r: Resolved) -> int:
    """The preStop wait, the whole drain and the margin to exit."""
    return math.ceil(PRE_STOP_SECONDS + drain_timeout_seconds(r) + EXIT_MARGIN_SECONDS)


def _pre_stop() -> Obj:
    return {"exec": {"command": ["python", "-c", PRE_STOP_SCRIPT, str(PRE_STOP_SECONDS), str(names.HTTP_PORT),
                                 str(LEADER_SERVING_SECONDS)]}}


def _http_probe(path: str, period: int, failures: int) -> Obj:
    return {"httpGet": {"path": path, "port": names.HTTP_PORT_NAME}, "periodSeconds": period,
            "timeoutSeconds": min(5, period), "failureThreshold": failures}


def startup_failure_threshold(r: Resolved) -> int:
    """Failed ``/ready`` probes in a row allowed while the model loads."""
    return math.ceil(r.spec.probes.startup_timeout_seconds / r.spec.probes.period_seconds)


def _source_volume(r: Resolved, location: ModelLocation, source: Source) -> tuple[list[Obj], list[Obj], list[Obj]]:
    """(volumes, runtime mounts, init containers) that bring ``location`` into the pod."""
    mount = {"name": source.volume, "mountPath": source.mount, "readOnly": True}
    if location.scheme is ModelScheme.PVC:
        volume = {"name": source.volume, "persistentVolumeClaim": {"claimName": location.claim, "readOnly": True}}
        return [volume], [mount], []
    if location.scheme is ModelScheme.HF:
        cache = r.spec.model.cache_claim
        backing = {"persistentVolumeClaim": {"claimName": cache}} if cache else {"emptyDir": {}}
        fetch = {
            "name": source.fetch_container,
            "image": r.spec.image,
            "imagePullPolicy": r.spec.image_pull_policy,
            "command": ["python", "-c", FETCH_SCRIPT, location.path, local_path(location, source)],
            "volumeMounts": [{"name": source.volume, "mountPath": source.mount}],
            "terminationMessagePolicy": TERMINATION_MESSAGE_POLICY,
            "securityContext": container_security_context(r.spec.pod),
            **({"env": list(r.spec.pod.env)} if r.spec.pod.env else {}),  # HF_TOKEN, HF_ENDPOINT (a mirror)
        }
        return [{"name": source.volume, **backing}], [mount], [fetch]
    return [], [], []


def _source_volumes(r: Resolved) -> tuple[list[Obj], list[Obj], list[Obj]]:
    """(volumes, runtime mounts, init containers) of the model and, if given, the heads."""
    parts = [_source_volume(r, location, source) for location, source in brought_in(r.spec)]
    volumes, mounts, init = ([obj for part in parts for obj in part[i]] for i in range(3))
    return volumes, mounts, init


def _group_env(r: Resolved, rank_label: str) -> list[Obj]:
    """Rendezvous env shared by every pod of a multi-pod group (the address is added per group)."""
    if r.layout.single_pod:
        return []
    return [
        {"name": names.ENV_MASTER_PORT, "value": str(names.RENDEZVOUS_PORT)},
        {"name": names.ENV_NNODES, "value": str(r.layout.pods_per_group)},
        {"name": names.ENV_NODE_RANK,
         "valueFrom": {"fieldRef": {"fieldPath": f"metadata.labels['{rank_label}']"}}},
    ]


def pod_template(r: Resolved, *, leader_worker_set: bool = False) -> Obj:
    """The pod template of ``r`` before any revision- or group-specific field."""
    spec, pod = r.spec, r.spec.pod
    volumes, mounts, init = _source_volumes(r)
    ports = [{"name": names.HTTP_PORT_NAME, "containerPort": names.HTTP_PORT, "protocol": "TCP"}]
    if not r.layout.single_pod:
        ports.append({"name": names.RENDEZVOUS_PORT_NAME, "containerPort": names.RENDEZVOUS_PORT, "protocol": "TCP"})
    rank_label = names.LABEL_LWS_WORKER_INDEX if leader_worker_set else names.LABEL_STS_POD_INDEX
    period, failures = spec.probes.period_seconds, spec.probes.failure_threshold
    container: Obj = {
        "name": names.CONTAINER,
        "image": spec.image,
        "imagePullPolicy": spec.image_pull_policy,
        "command": ["specdecode"],
        "args": runtime_args(r),
        "ports": ports,
        "env": [*_group_env(r, rank_label), *pod.env],
        "resources": container_resources(r),
        "volumeMounts": [{"name": names.SHM_VOLUME, "mountPath": names.SHM_MOUNT}, *mounts, *pod.volume_mounts],
        "startupProbe": _http_probe("/ready", period, startup_failure_threshold(r)),
        "readinessProbe": _http_probe("/ready", period, failures),
        "livenessProbe": _http_probe("/health", period, failures),
        "lifecycle": {"preStop": _pre_stop()},
        "terminationMessagePolicy": TERMINATION_MESSAGE_POLICY,
        "securityContext": container_security_context(pod),
    }
    pod_spec: Obj = {
        **({"initContainers": init} if init else {}),
        "containers": [{k: v for k, v in container.items() if v != []}],
        "terminationGracePeriodSeconds": termination_grace_seconds(r),
        "securityContext": pod_security_context(pod),
        "volumes": [
            {"name": names.SHM_VOLUME, "emptyDir": {"medium": "Memory", "sizeLimit": str(spec.resources.shm_size)}},
            *volumes,
            *pod.volumes,
        ],
    }
    optional = {
        "nodeSelector": dict(pod.node_selector),
        "tolerations": list(pod.tolerations),
        "affinity": pod.affinity,
        "topologySpreadConstraints": list(pod.topology_spread_constraints),
        "imagePullSecrets": [ref.model_dump() for ref in pod.image_pull_secrets],
        "serviceAccountName": pod.service_account_name,
        "priorityClassName": pod.priority_class_name,
        "runtimeClassName": pod.runtime_class_name,
        "schedulerName": pod.scheduler_name,
    }
    pod_spec.update({k: v for k, v in optional.items() if v})
    metadata: Obj = {"labels": {**pod.labels, **names.runtime_pod_labels(r.name)}}
    if pod.annotations:
        metadata["annotations"] = dict(pod.annotations)
    return {"metadata": metadata, "spec": pod_spec}


def revision(r: Resolved, *, leader_worker_set: bool = False) -> str:
    """Short hash of the pod template: equal specs share it, any change to the pods changes it."""
    canonical = json.dumps(pod_template(r, leader_worker_set=leader_worker_set), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[: names.REVISION_LENGTH]


def _with_revision(template: Obj, labels: dict[str, str], env: tuple[Obj, ...] | list[Obj] = ()) -> Obj:
    """A copy of ``template`` with ``labels`` added and ``env`` prepended to the runtime container."""
    out = json.loads(json.dumps(template))
    out["metadata"]["labels"].update(labels)
    if env:
        container = out["spec"]["containers"][0]
        container["env"] = [*env, *container.get("env", [])]
    return out


def _metadata(r: Resolved, name: str, labels: dict[str, str] | None = None) -> Obj:
    return {"name": name, "namespace": r.namespace, "labels": {**names.common_labels(r.name), **(labels or {})}}


def _workload_metadata(r: Resolved, name: str, labels: dict[str, str]) -> Obj:
    return _metadata(r, name, {**labels, names.LABEL_COMPONENT: names.COMPONENT_RUNTIME})


# -- workloads ----------------------------------------------------------------------------------


def build_deployment(r: Resolved, rev: str, replicas: int) -> Obj:
    labels = names.revision_labels(r.name, rev)
    rolling = {"maxSurge": r.spec.rollout.max_surge, "maxUnavailable": r.spec.rollout.max_unavailable}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _workload_metadata(r, names.workload_name(r.name, rev), labels),
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": labels},
            "strategy": {"type": "RollingUpdate", "rollingUpdate": rolling},
            "template": _with_revision(pod_template(r), labels),
        },
    }


def build_group_statefulset(r: Resolved, rev: str, group: int) -> Obj:
    name = names.group_name(r.name, rev, group)
    labels = {**names.revision_labels(r.name, rev), names.LABEL_GROUP: str(group)}
    address = {"name": names.ENV_MASTER_ADDR, "value": names.leader_address(name, r.namespace)}
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": _workload_metadata(r, name, labels),
        "spec": {
            "serviceName": name,
            "replicas": r.layout.pods_per_group,
            "podManagementPolicy": "Parallel",  # every rank must start for the rendezvous
            "selector": {"matchLabels": labels},
            "template": _with_revision(pod_template(r), labels, [address]),
        },
    }


def build_group_headless_service(r: Resolved, rev: str, group: int) -> Obj:
    name = names.group_name(r.name, rev, group)
    labels = {**names.revision_labels(r.name, rev), names.LABEL_GROUP: str(group)}
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(r, name, {**labels, names.LABEL_COMPONENT: names.COMPONENT_RENDEZVOUS}),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,  # ranks find each other before any is ready
            "selector": labels,
            "ports": [{"name": names.RENDEZVOUS_PORT_NAME, "port": names.RENDEZVOUS_PORT,
                       "targetPort": names.RENDEZVOUS_PORT_NAME, "protocol": "TCP"}],
        },
    }


def build_leader_worker_set(r: Resolved, rev: str, replicas: int) -> Obj:
    labels = names.revision_labels(r.name, rev)
    address = {"name": names.ENV_MASTER_ADDR, "value": f"$({names.ENV_LWS_LEADER_ADDRESS})"}
    metadata = _workload_metadata(r, names.workload_name(r.name, rev), labels)
    if r.spec.pod.leader_worker_set_annotations:  # e.g. exclusive-topology: LWS reads its placement here
        metadata["annotations"] = dict(r.spec.pod.leader_worker_set_annotations)
    return {
        "apiVersion": "leaderworkerset.x-k8s.io/v1",
        "kind": "LeaderWorkerSet",
        "metadata": metadata,
        "spec": {
            "replicas": replicas,
            "startupPolicy": "LeaderCreated",
            "leaderWorkerTemplate": {
                "size": r.layout.pods_per_group,
                "restartPolicy": "RecreateGroupOnPodRestart",
                "workerTemplate": _with_revision(pod_template(r, leader_worker_set=True), labels, [address]),
            },
        },
    }


def build_workloads(r: Resolved, rev: str, replicas: int, *, leader_worker_set: bool = False) -> list[Obj]:
    """The workloads running ``replicas`` replicas of revision ``rev``."""
    if r.layout.single_pod:
        return [build_deployment(r, rev, replicas)]
    if leader_worker_set:
        return [build_leader_worker_set(r, rev, replicas)]
    objs: list[Obj] = []
    for group in range(replicas):
        objs += [build_group_headless_service(r, rev, group), build_group_statefulset(r, rev, group)]
    return objs


# -- objects shared by every revision -----------------------------------------------------------


def serving_selector(r: Resolved, *, leader_worker_set: bool = False) -> dict[str, str]:
    """The pods that take traffic: every revision's, leaders only in multi-pod groups."""
    selector = names.selector_labels(r.name)
    if not r.layout.single_pod:
        leader = names.LABEL_LWS_WORKER_INDEX if leader_worker_set else names.LABEL_STS_POD_INDEX
        selector[leader] = "0"
    return selector


def build_service(r: Resolved, *, leader_worker_set: bool = False) -> Obj:
    service = r.spec.service
    metadata = _metadata(r, names.service_name(r.name), {names.LABEL_COMPONENT: names.COMPONENT_API})
    if service.annotations:
        metadata["annotations"] = dict(service.annotations)
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata,
        "spec": {
            "type": service.type,
            "selector": serving_selector(r, leader_worker_set=leader_worker_set),
            "ports": [{"name": names.HTTP_PORT_NAME, "port": service.port,
                       "targetPort": names.HTTP_PORT_NAME, "protocol": "TCP"}],
        },
    }


def build_route_services(r: Resolved, stable: str, canary: str | None, *, leader_worker_set: bool = False,
                         canary_leader_worker_set: bool = False) -> list[Obj]:
    """With ``rollout.trafficRouting``: the Services an HTTPRoute weighs, one selecting the stable
    revision's serving pods and one the canary's (the stable's while there is no canary, so the
    route's backends always resolve), each by its own revision's leader label. Not labelled as
    the API Service: a ServiceMonitor would otherwise scrape every pod twice more."""
    out = []
    backends = ((names.stable_service_name(r.name), stable, leader_worker_set),
                (names.canary_service_name(r.name), canary or stable,
                 canary_leader_worker_set if canary else leader_worker_set))
    for name, rev, lws in backends:
        service = build_service(r, leader_worker_set=lws)
        service["metadata"] = _metadata(r, name, {names.LABEL_COMPONENT: names.COMPONENT_ROUTE_BACKEND})
        service["spec"]["type"] = "ClusterIP"
        service["spec"]["selector"][names.LABEL_REVISION] = rev
        out.append(service)
    return out


def build_service_monitor(r: Resolved) -> Obj:
    """Scrapes the serving pods; the pod's revision label becomes each series' ``revision``."""
    monitor = r.spec.service_monitor
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "ServiceMonitor",
        "metadata": _metadata(r, names.service_monitor_name(r.name), dict(monitor.labels)),
        "spec": {
            "selector": {"matchLabels": {**names.selector_labels(r.name), names.LABEL_COMPONENT: names.COMPONENT_API}},
            "endpoints": [{
                "port": names.HTTP_PORT_NAME,
                "path": "/metrics",
                "interval": monitor.interval,
                "relabelings": [{
                    "action": "replace",
                    "sourceLabels": [names.prometheus_pod_label(names.LABEL_REVISION)],
                    "targetLabel": names.METRIC_LABEL_REVISION,
                }],
            }],
        },
    }


def build_pod_disruption_budget(r: Resolved) -> Obj:
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _metadata(r, names.pdb_name(r.name)),
        "spec": {
            "maxUnavailable": r.spec.pod_disruption_budget.max_unavailable,
            "selector": {"matchLabels": names.selector_labels(r.name)},
        },
    }


def build_shared(r: Resolved, stable: str, canary: str | None = None, *, leader_worker_set: bool = False,
                 canary_leader_worker_set: bool = False) -> list[Obj]:
    """The objects every revision shares: the traffic Service, with ``rollout.trafficRouting`` the
    stable and canary Services, and if asked ServiceMonitor and PDB. ``leader_worker_set`` is
    the stable revision's workload kind, which the traffic Service's leader label follows: a
    canary of another kind (an explicit change of kind) gets requests through its route Service
    only, and from the traffic Service once promoted."""
    objs = [build_service(r, leader_worker_set=leader_worker_set)]
    if r.spec.rollout.traffic_routing is not None:
        objs += build_route_services(r, stable, canary, leader_worker_set=leader_worker_set,
                                     canary_leader_worker_set=canary_leader_worker_set)
    if r.spec.service_monitor.enabled:
        objs.append(build_service_monitor(r))
    if r.spec.pod_disruption_budget.enabled:
        objs.append(build_pod_disruption_budget(r))
    return objs


def render(r: Resolved, *, replicas: int | None = None, leader_worker_set: bool = False) -> list[Obj]:
    """Everything a fresh resource needs: its revision's workloads at ``replicas`` (default
    ``spec.replicas``) and the shared objects."""
    rev = revision(r, leader_worker_set=leader_worker_set)
    count = r.spec.replicas if replicas is None else replicas
    return [*build_workloads(r, rev, count, leader_worker_set=leader_worker_set),
            *build_shared(r, rev, leader_worker_set=leader_worker_set)]
