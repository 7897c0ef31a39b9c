"""Every name the operator spells more than once: the API, label keys, object names, env names.

One helper per name, so that the builders, the handlers and the tests can never disagree on it.
"""
from __future__ import annotations

GROUP = "specdecode.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "SpecDecodeDeployment"
PLURAL = "specdecodedeployments"
SINGULAR = "specdecodedeployment"
SHORT_NAMES = ("sdd",)
CRD_NAME = f"{PLURAL}.{GROUP}"

# -- label keys ---------------------------------------------------------------------------------
LABEL_NAME = "app.kubernetes.io/name"
LABEL_INSTANCE = "app.kubernetes.io/instance"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
LABEL_COMPONENT = "app.kubernetes.io/component"
LABEL_REVISION = f"{GROUP}/revision"
LABEL_GROUP = f"{GROUP}/group"  # the replica (parallel group) index of a multi-pod layout
LABEL_STS_POD_INDEX = "apps.kubernetes.io/pod-index"  # set by the StatefulSet controller (1.28+)
LABEL_LWS_WORKER_INDEX = "leaderworkerset.sigs.k8s.io/worker-index"  # set by LeaderWorkerSet

APP = "specdecode"
MANAGER = "specdecode-operator"
COMPONENT_RUNTIME = "runtime"  # workloads and their pods
COMPONENT_API = "api"  # the traffic Service
COMPONENT_RENDEZVOUS = "rendezvous"  # the headless Service of a multi-pod group
COMPONENT_ROUTE_BACKEND = "route-backend"  # the stable and canary Services an HTTPRoute weighs
METRIC_LABEL_REVISION = "revision"  # the label a ServiceMonitor puts on every scraped series

# -- annotations a user sets on the SpecDecodeDeployment to steer a rollout ----------------------
# The value names the revision meant (or is any token); each value acts once and the annotation
# stays (status.commands records it), so GitOps re-applying it does nothing. "true" still acts
# and is removed, with a deprecation Warning.
ANNOTATION_PROMOTE = f"{GROUP}/promote"  # skip the remaining steps and analysis
ANNOTATION_ABORT = f"{GROUP}/abort"  # roll back now
ANNOTATION_RESUME = f"{GROUP}/resume"  # resume a paused rollout (also one paused by the analysis)
ANNOTATION_PAUSE = f"{GROUP}/pause"  # hold the rollout (one set before an edit holds it from its start); removing it resumes
ANNOTATION_RETRY = f"{GROUP}/retry"  # start the rolled-back revision's canary again
# held: StatefulSet or LeaderWorkerSet, the multi-pod workload kind to run (a change rolls out)
ANNOTATION_WORKLOAD_KIND = f"{GROUP}/workload-kind"
# on each child: a hash of what the operator last applied to it (applied again when it differs)
ANNOTATION_APPLIED = f"{GROUP}/applied"
# on a StatefulSet group: its pods (uid, runtime restarts) when last all Ready (see group_restart)
ANNOTATION_GROUP_MEMBERS = f"{GROUP}/group-members"

# -- ports, paths, container and volume names ---------------------------------------------------
CONTAINER = "runtime"
FETCH_CONTAINER = "fetch-model"
FETCH_MTP_CONTAINER = "fetch-mtp"
FETCH_EAGLE3_CONTAINER = "fetch-eagle3"
HTTP_PORT = 8000
HTTP_PORT_NAME = "http"
RENDEZVOUS_PORT = 29500
RENDEZVOUS_PORT_NAME = "rendezvous"
SHM_VOLUME = "dshm"
SHM_MOUNT = "/dev/shm"
MODEL_VOLUME = "model"
MODEL_MOUNT = "/mnt/models"
MTP_VOLUME = "mtp"  # speculative.mtpPath
MTP_MOUNT = "/mnt/mtp"
EAGLE3_VOLUME = "eagle3"  # speculative.eagle3Path
EAGLE3_MOUNT = "/mnt/eagle3"

# -- env read by `specdecode serve` in a multi-pod group (torchrun's names) ----------------------
ENV_MASTER_ADDR = "MASTER_ADDR"
ENV_MASTER_PORT = "MASTER_PORT"
ENV_NNODES = "NNODES"
ENV_NODE_RANK = "NODE_RANK"
ENV_LWS_LEADER_ADDRESS = "LWS_LEADER_ADDRESS"  # injected into every pod by LeaderWorkerSet

REVISION_LENGTH = 10
# spec.replicas' maximum, in the CRD's schema, so that /scale (kubectl scale, an HPA) obeys it too:
# a replica (group) index has at most three digits whatever the replicas.
MAX_REPLICAS = 1000
# A StatefulSet's name is capped at 52 characters (its controller-revision-hash label adds 11):
# {name}-{revision}-{group} must fit, so the resource name is bounded (see resolve).
MAX_STATEFULSET_NAME = 52


def selector_labels(name: str) -> dict[str, str]:
    """The labels every pod of one SpecDecodeDeployment carries, whatever its revision."""
    return {LABEL_NAME: APP, LABEL_INSTANCE: name}


def runtime_pod_labels(name: str) -> dict[str, str]:
    """The labels every runtime pod of one SpecDecodeDeployment carries, whatever its revision."""
    return {**selector_labels(name), LABEL_COMPONENT: COMPONENT_RUNTIME}


def common_labels(name: str) -> dict[str, str]:
    return {**selector_labels(name), LABEL_MANAGED_BY: MANAGER}


def revision_labels(name: str, revision: str) -> dict[str, str]:
    return {**selector_labels(name), LABEL_REVISION: revision}


def label_selector(labels: dict[str, str]) -> str:
    """The string form a scale subresource and ``kubectl -l`` use."""
    return ",".join(f"{k}={v}" for k, v in labels.items())


def prometheus_pod_label(key: str) -> str:
    """The meta label under which Prometheus' Kubernetes discovery exposes pod label ``key``."""
    return "__meta_kubernetes_pod_label_" + "".join(c if c.isalnum() else "_" for c in key)


def workload_name(name: str, revision: str) -> str:
    """The Deployment (single-pod layout) or LeaderWorkerSet of one revision."""
    return f"{name}-{revision}"


def group_name(name: str, revision: str, group: int) -> str:
    """The StatefulSet and its headless Service for one parallel group (replica) of one revision."""
    return f"{name}-{revision}-{group}"


def leader_address(group: str, namespace: str) -> str:
    """DNS name of ordinal 0 of a StatefulSet behind its headless Service of the same name."""
    return f"{group}-0.{group}.{namespace}.svc"


def service_name(name: str) -> str:
    """The one Service for traffic, selecting stable and canary pods."""
    return name


def stable_service_name(name: str) -> str:
    """The Service selecting the stable revision's serving pods (an HTTPRoute backend)."""
    return f"{name}-stable"


def canary_service_name(name: str) -> str:
    """The Service selecting the canary revision's serving pods (the stable's when none)."""
    return f"{name}-canary"


def service_monitor_name(name: str) -> str:
    return name


def pdb_name(name: str) -> str:
    return name


# The longest resource name whose StatefulSet names fit at every replicas the schema allows: a
# resource's validity never depends on its replicas, which /scale changes without admission.
MAX_RESOURCE_NAME_LENGTH = MAX_STATEFULSET_NAME - len(group_name("", "x" * REVISION_LENGTH, MAX_REPLICAS - 1))
