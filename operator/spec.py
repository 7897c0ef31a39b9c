"""The ``SpecDecodeDeployment`` custom resource as pydantic models: spec and typed status.

One model, two spellings (``Shared``): camelCase in the CRD and the CR, snake_case in Python.
``speculative`` *is* the runtime's ``SpeculativeConfig``; the CRD schema is generated from these
models (``crd.py``), so a field added there appears in the CRD and the rendered pod arguments
without a line changed here. Torch-free: only ``specdecode.runtime.config`` is imported.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime
from enum import Enum
from typing import Annotated, Any, Literal, get_args

from pydantic import AfterValidator, BaseModel, Field

from specdecode.operator import names
from specdecode.operator.kubeschema import check_quantity, kubernetes_object
from specdecode.operator.resources import DEFAULT_REQUESTS, SHM_BASE_GIB, SHM_PER_RANK_GIB
from specdecode.runtime.config import KNOWN_GATES, Shared, SpeculativeConfig

# int-or-string (Kubernetes IntOrString / Quantity): the CRD generator turns this union into
# ``x-kubernetes-int-or-string``; resolve checks IntOrString's string forms, a quantity checks its own.
IntOrString = int | str
Quantity = Annotated[int | str, AfterValidator(check_quantity),
                     Field(description="a Kubernetes quantity, e.g. 16Gi or 500m")]
# Pod fields passed through as written, each checked against Kubernetes' own schema (kubeschema).
Toleration = kubernetes_object("Toleration")
Affinity = kubernetes_object("Affinity")
EnvVar = kubernetes_object("EnvVar")
Volume = kubernetes_object("Volume")
VolumeMount = kubernetes_object("VolumeMount")
PodSecurityContext = kubernetes_object("PodSecurityContext")
SecurityContext = kubernetes_object("SecurityContext")
TopologySpreadConstraint = kubernetes_object("TopologySpreadConstraint")
# What the API server validates as a DNS-1123 subdomain: runtime class, scheduler and priority class names.
DnsSubdomain = Annotated[str, Field(pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$",
                                    max_length=253)]
# Go-style durations as kubectl and Argo Rollouts write them: 30s, 5m, 1h30m.
Duration = Annotated[str, Field(pattern=r"^([0-9]+(ms|s|m|h))+$")]
Gate = Literal[tuple(sorted(KNOWN_GATES))]  # type: ignore[valid-type] - the enum follows KNOWN_GATES

# -- model source -------------------------------------------------------------------------------

# pvc://claim/path, file:///path or hf://org/name: the model and the heads (sources.py)
_SOURCE_URI = r"pvc://[a-z0-9]([-a-z0-9]*[a-z0-9])?/.+|file:///.+|hf://[^/\s]+/[^/\s]+"
SOURCE_URI_PATTERN = f"^({_SOURCE_URI})$"
MODEL_URI_PATTERN = f"^({_SOURCE_URI}|[A-Za-z0-9][A-Za-z0-9._-]*)$"  # or the alias of a packaged model


class ModelScheme(str, Enum):
    ALIAS = "alias"  # a model packaged in the runtime image, e.g. smollm2-135m
    PVC = "pvc"  # pvc://claim/path/in/claim
    FILE = "file"  # file:///path/inside/the/container
    HF = "hf"  # hf://org/name, fetched by an init container into a cache volume


@dataclass(frozen=True)
class ModelLocation:
    """A parsed ``model.uri`` or head source (``speculative.mtpPath``, ``eagle3Path``): ``claim`` is
    set for pvc://, ``path`` is the claim-relative path (pvc), absolute path (file), repository id
    (hf) or alias name."""

    scheme: ModelScheme
    path: str
    claim: str | None = None

    @classmethod
    def parse(cls, uri: str) -> "ModelLocation":
        if uri.startswith("pvc://"):
            claim, _, path = uri.removeprefix("pvc://").partition("/")
            return cls(ModelScheme.PVC, path, claim)
        if uri.startswith("file://"):
            return cls(ModelScheme.FILE, uri.removeprefix("file://"))
        if uri.startswith("hf://"):
            return cls(ModelScheme.HF, uri.removeprefix("hf://"))
        return cls(ModelScheme.ALIAS, uri)


class ModelSource(Shared):
    uri: str = Field(
        pattern=MODEL_URI_PATTERN,
        description="pvc://claim/path, file:///path (inside the container), hf://org/name, or the alias of a "
        "model packaged in the runtime image (smollm2-135m)",
    )
    served_name: str | None = Field(None, description="the model name clients send; default: this resource's name")
    cache_claim: str | None = Field(
        None, description="hf:// (this uri, speculative.mtpPath, speculative.eagle3Path): a PersistentVolumeClaim "
        "caching downloads across pods; default: an emptyDir per pod"
    )

    @property
    def location(self) -> ModelLocation:
        return ModelLocation.parse(self.uri)


# -- layout and resources -----------------------------------------------------------------------


class Parallelism(Shared):
    """The parallel group that serves one replica; immutable after creation."""

    tensor: int = Field(1, ge=1, le=64, description="tensor-parallel size (GPUs sharing each layer)")
    pipeline: int = Field(1, ge=1, le=64, description="pipeline-parallel size (stages)")


class Resources(Shared):
    gpus_per_pod: int | None = Field(
        None, ge=0, le=16,
        description="GPUs each pod requests; default parallelism.tensor (one pod per pipeline stage). "
        "A divisor of tensor spreads one stage over several pods; 0 runs on CPU",
    )
    gpu_resource_name: str = Field("nvidia.com/gpu", description="the extended resource GPUs are requested as")
    requests: dict[str, Quantity] = Field(
        default_factory=dict,
        description="container requests; default " + " and ".join(f"{k} {v}" for k, v in DEFAULT_REQUESTS.items())
        + ", each unless given here or limited (a limit alone is also the request)",
    )
    limits: dict[str, Quantity] = Field(
        default_factory=dict, description="container limits (cpu, memory); none by default: /dev/shm counts toward a "
        "memory limit")
    shm_size: Quantity | None = Field(
        None, description=f"size of the /dev/shm memory volume; default {SHM_BASE_GIB}Gi + {SHM_PER_RANK_GIB}Gi per "
        "rank in the pod")


# -- rollout ------------------------------------------------------------------------------------


class Prometheus(Shared):
    url: str = Field(pattern=r"^https?://.+", description="query this Prometheus instead of scraping canary pods")


class Equivalence(Shared):
    """The equivalence probe: each analysis interval, greedy outputs of one canary replica against
    one stable replica on the same prompts (operator/equivalence.py). Greedy decoding with the same
    target model gives the same tokens whatever the speculative configuration, so a difference
    beyond a near-tie rolls the canary back at once (``OutputDiverged``)."""

    enabled: bool | None = Field(
        None, description="unset: on when the canary serves the stable's target model (the same model.uri); "
        "false: off")
    prompts: tuple[str, ...] | None = Field(
        None, min_length=1, description="prompts sent as one user turn each; unset: 16 built-in short prompts")
    max_tokens: int = Field(32, ge=1, le=1024, description="tokens generated per prompt")
    near_tie_logprob_gap: float = Field(
        0.1, ge=0.0, description="nats: a first difference where the stable's top-2 logprobs are closer than this "
        "is a near-tie (shown, not failed)")
    prompts_per_interval: int = Field(4, ge=1, le=64, description="prompts probed each analysis interval")


class Analysis(Shared):
    """The SLO a canary revision is held to, judged every ``interval`` over the last ``window``."""

    interval: Duration = "30s"
    window: Duration = "5m"
    min_acceptance_rate: float | None = Field(None, ge=0.0, le=1.0, description="accepted / draft tokens")
    min_mean_acceptance_length: float | None = Field(None, ge=1.0, description="1 + accepted / drafts")
    max_p95_inter_token_latency_ms: float | None = Field(None, gt=0.0)
    max_error_rate: float | None = Field(None, ge=0.0, le=1.0, description="errored / finished requests")
    failure_limit: int = Field(3, ge=1, description="consecutive failed analyses that roll back")
    inconclusive_limit: int = Field(3, ge=1, description="consecutive windows without data that pause")
    prometheus: Prometheus | None = None
    equivalence: Equivalence = Equivalence()


class CanaryStep(Shared):
    weight: int = Field(ge=1, le=100, description="percent of replicas running the new revision")


class TrafficRouting(Shared):
    """Canary traffic split by weight at a Gateway instead of by replica ratio (Gateway API)."""

    http_route: str = Field(
        pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$", max_length=253,
        description="an HTTPRoute (gateway.networking.k8s.io/v1) in this namespace. Each of its rules whose "
        "backends are all this resource's Services gets the stable and canary Services as backends, weighted by "
        "the current step; other rules (one without backends, e.g. a redirect, too) are left alone",
    )


class Rollout(Shared):
    max_surge: IntOrString = Field(0, description="extra replicas during a rollout (GPU-safe default 0); int or %")
    max_unavailable: IntOrString = Field(1, description="replicas that may be down during a rollout; int or percent")
    steps: tuple[CanaryStep, ...] = Field(
        (CanaryStep(weight=50), CanaryStep(weight=100)), description="strictly increasing; the last is 100"
    )
    analysis: Analysis = Analysis()
    progress_deadline: Duration = Field(
        "30m", description="a step whose canary replicas are not all set and ready this long after it began "
        "rolls back (ProgressDeadlineExceeded): an image that never pulls, a model that never loads"
    )
    traffic_routing: TrafficRouting | None = Field(
        None, description="split traffic at an HTTPRoute by step weight; without it, the one Service "
        "spreads requests over stable and canary pods (weight = replica ratio)"
    )


# -- service, probes, monitoring, pod pass-through -----------------------------------------------


class ServiceSpec(Shared):
    type: Literal["ClusterIP", "NodePort", "LoadBalancer"] = "ClusterIP"
    port: int = Field(8000, ge=1, le=65535)
    annotations: dict[str, str] = Field(default_factory=dict)


class Probes(Shared):
    startup_timeout_seconds: int = Field(1800, ge=10, description="time allowed for the model to load before /ready")
    period_seconds: int = Field(10, ge=1, le=300)
    failure_threshold: int = Field(3, ge=1, description="liveness (/health) and readiness (/ready) failures tolerated")


class ServiceMonitorSpec(Shared):
    enabled: bool = False
    interval: Duration = "15s"
    labels: dict[str, str] = Field(default_factory=dict, description="labels the Prometheus instance selects on")


class DisruptionBudget(Shared):
    enabled: bool = False
    max_unavailable: IntOrString = 1


class LocalObjectReference(Shared):
    name: str


class PodOverrides(Shared):
    """Passed through to every pod unchanged (the Kubernetes schema of each applies)."""

    node_selector: dict[str, str] = Field(default_factory=dict)
    tolerations: tuple[Toleration, ...] = ()
    affinity: Affinity | None = None
    topology_spread_constraints: tuple[TopologySpreadConstraint, ...] = ()
    image_pull_secrets: tuple[LocalObjectReference, ...] = ()
    service_account_name: str | None = None
    priority_class_name: DnsSubdomain | None = None
    runtime_class_name: DnsSubdomain | None = Field(None, description="e.g. nvidia, where GPUs need that runtime")
    scheduler_name: DnsSubdomain | None = Field(None, description="a scheduler other than the default one")
    security_context: PodSecurityContext | None = Field(
        None, description="the pod's securityContext, merged key by key over the operator's (restricted Pod Security)")
    container_security_context: SecurityContext | None = Field(
        None, description="every container's securityContext, merged key by key over the operator's")
    labels: dict[str, str] = Field(default_factory=dict)
    annotations: dict[str, str] = Field(default_factory=dict)
    leader_worker_set_annotations: dict[str, str] = Field(
        default_factory=dict, description="on the LeaderWorkerSet itself (multi-pod layouts), e.g. "
        "leaderworkerset.sigs.k8s.io/exclusive-topology")
    env: tuple[EnvVar, ...] = Field((), description="added to the runtime container's environment")
    volumes: tuple[Volume, ...] = ()
    volume_mounts: tuple[VolumeMount, ...] = Field((), description="mounted into the runtime container")


# -- the spec -----------------------------------------------------------------------------------


class SpecDecodeDeploymentSpec(Shared):
    model: ModelSource
    image: str = Field(min_length=1, description="the runtime image")
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"
    replicas: int = Field(1, ge=0, le=names.MAX_REPLICAS, description="model replicas (each one parallel group)")
    parallelism: Parallelism = Parallelism()
    resources: Resources = Resources()
    speculative: SpeculativeConfig = SpeculativeConfig()
    gates: tuple[Gate, ...] = Field((), description="experimental features; merged into speculative.gates")
    extra_args: tuple[str, ...] = Field((), description="more `specdecode serve` flags (engine sizing)")
    rollout: Rollout = Rollout()
    service: ServiceSpec = ServiceSpec()
    probes: Probes = Probes()
    service_monitor: ServiceMonitorSpec = ServiceMonitorSpec()
    pod_disruption_budget: DisruptionBudget = DisruptionBudget()
    pod: PodOverrides = PodOverrides()


# -- the status ---------------------------------------------------------------------------------


class ConditionType(str, Enum):
    READY = "Ready"
    PROGRESSING = "Progressing"
    DEGRADED = "Degraded"
    ROLLED_BACK = "RolledBack"
    PAUSED = "Paused"


class ConditionStatus(str, Enum):
    TRUE = "True"
    FALSE = "False"
    UNKNOWN = "Unknown"


class Condition(Shared):
    type: ConditionType
    status: ConditionStatus
    reason: str = Field(pattern=r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$", description="CamelCase, e.g. InvalidSpec")
    message: str = ""
    last_transition_time: datetime | None = None
    observed_generation: int | None = None


class MeasuredAcceptance(Shared):
    """What the last analysis measured on one revision's pods."""

    revision: str
    rate: float | None = Field(None, description="accepted / draft tokens; none when the window had no drafts")
    mean_length: float | None = Field(None, description="1 + accepted / drafts")
    p95_inter_token_latency_ms: float | None = None
    error_rate: float | None = None
    draft_tokens: int = 0
    measured_at: datetime | None = None


class CountedVerdict(Shared):
    """An analysis verdict the rollout counted, with the window it judged: one per analysis
    interval, so that a second writer or a new leader judging the same interval again (a window
    ending within half an interval of this one's end) is not counted twice."""

    revision: str
    result: str = Field(description="Pass, Fail or Inconclusive")
    start: datetime
    end: datetime


class RolloutPhase(str, Enum):
    STABLE = "Stable"  # one revision serves every replica
    PROGRESSING = "Progressing"  # a canary revision runs beside the stable one and is analysed step by step
    PAUSED = "Paused"  # held at its step: by hand, or after inconclusiveLimit windows without a verdict
    PROMOTING = "Promoting"  # promoted by hand: scaling to every replica, no more analysis
    ROLLED_BACK = "RolledBack"  # the canary failed or was aborted; the stable serves until the spec changes


class PauseCause(str, Enum):
    MANUAL = "ManualPause"  # the specdecode.io/pause annotation
    INCONCLUSIVE = "InconclusiveAnalysis"  # inconclusiveLimit windows in a row without data


class RetiringRevision(Shared):
    """A revision on its way out (rolled back, aborted, replaced by a newer edit): it keeps serving,
    shrinking only as the stable (and the new canary) regain the capacity it held."""

    revision: str
    replicas: int = Field(ge=0, description="replicas its workload is set to")


class RolloutStatus(Shared):
    """Where a rollout stands, kept in status so that an operator restart resumes it. The revisions
    and the step index are ``stableRevision``, ``canaryRevision`` and ``canaryStep``."""

    phase: RolloutPhase = RolloutPhase.STABLE
    stable_replicas: int = Field(0, ge=0, description="replicas the stable workload is set to")
    canary_replicas: int = Field(0, ge=0, description="replicas the canary workload is set to")
    retiring: tuple[RetiringRevision, ...] = Field(
        (), description="revisions being removed without dropping capacity: each shrinks only while the replicas "
        "that replace it are ready"
    )
    canary_ready_replicas: int = Field(0, ge=0, description="ready canary replicas when last observed")
    progress_at: datetime | None = Field(
        None, description="the last progress: the step began, a canary replica turned ready, or the step was reached; "
        "progressDeadline counts from it"
    )
    step_started_at: datetime | None = Field(
        None, description="when the canary reached the current step's replicas"
    )
    analysis_since: datetime | None = Field(
        None, description="when the current step's weight took effect (its replicas ready and, with trafficRouting, "
        "the route holding its weight); analysis windows count only from then"
    )
    consecutive_failures: int = Field(0, ge=0, description="failed analyses in a row (failureLimit rolls back)")
    consecutive_inconclusive: int = Field(0, ge=0, description="windows without a verdict in a row (pause)")
    paused_by: PauseCause | None = None
    canary_weight: int | None = Field(
        None, ge=0, le=100, description="percent of requests the HTTPRoute sends to the canary Service (trafficRouting "
        "only); during a restore, to the retiring revision it still selects"
    )
    rolled_back_revision: str | None = Field(
        None, description="the revision last rolled back; retried only by a spec change or the retry command"
    )
    message: str = Field("", description="the last analysis verdict, or why the rollout paused, rolled back or was promoted")
    verdicts: tuple[CountedVerdict, ...] = Field(
        (), description="the last verdicts counted on the canary, each with its window (start, end), oldest first"
    )


class EquivalenceState(str, Enum):
    """Where the equivalence probe of the canary stands."""

    PROBING = "Probing"  # every prompt so far gave the stable's tokens, or a near-tie
    DIVERGED = "Diverged"  # a prompt's tokens differed beyond a near-tie: the canary was rolled back
    INCONCLUSIVE = "Inconclusive"  # the stable disagreed with itself: equivalence cannot be proven here
    SKIPPED = "Skipped"  # the canary serves another model, or the stable's is not known yet


class OutputDivergence(Shared):
    """The first position at which two greedy outputs of one prompt differ."""

    prompt: str
    position: int = Field(ge=0, description="index of the first differing generated token")
    stable_token: str = Field(description="the stable's token there ('' where its output had ended)")
    other_token: str = Field(description="the canary's token there (the stable's own, for the control)")
    logprob_gap: float | None = Field(
        None, description="the stable's top-1 minus top-2 logprob there, in nats (none where its output had ended)")


class EquivalenceStatus(Shared):
    """The equivalence probe of ``revision`` (the canary when probed), so far."""

    revision: str
    state: EquivalenceState
    prompts_same: int = Field(0, ge=0, description="prompts whose greedy tokens equalled the stable's")
    near_ties: int = Field(0, ge=0, description="prompts that first differed at a near-tie")
    last_divergence: OutputDivergence | None = None
    message: str = ""


class CommandRecord(Shared):
    """The last value of each command annotation the operator handled: a value is obeyed once, so
    an annotation re-applied (GitOps) or left in place does nothing more."""

    promote: str | None = None
    abort: str | None = None
    pause: str | None = None
    resume: str | None = None
    retry: str | None = None


class WorkloadKind(str, Enum):
    """What runs a revision's pods: a Deployment (one pod per replica), or per multi-pod group a
    StatefulSet (+ headless Service) or one LeaderWorkerSet for all groups."""

    DEPLOYMENT = "Deployment"
    STATEFUL_SET = "StatefulSet"
    LEADER_WORKER_SET = "LeaderWorkerSet"


class SpecDecodeDeploymentStatus(Shared):
    observed_generation: int | None = None
    conditions: tuple[Condition, ...] = Field(
        (), json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]}
    )
    stable_revision: str | None = None
    canary_revision: str | None = None
    canary_step: int | None = Field(None, ge=0, description="index into spec.rollout.steps")
    replicas: int = Field(0, ge=0, description="model replicas of every revision (scale subresource)")
    ready_replicas: int = Field(0, ge=0)
    selector: str | None = Field(None, description="label selector of the serving pods (scale subresource)")
    layout: str | None = Field(None, description="a replica's parallel group, tensor × pipeline ranks, e.g. TP2×PP2")
    workload_kind: WorkloadKind | None = Field(
        None, description="what runs the stable revision's pods: chosen once (LeaderWorkerSet if the cluster served it "
        "then), changed only by the specdecode.io/workload-kind annotation, as a rollout")
    acceptance: MeasuredAcceptance | None = None
    stable_model: str | None = Field(
        None, description="spec.model.uri of the stable revision: a canary on the same one has its outputs compared")
    equivalence: EquivalenceStatus | None = None
    warnings: tuple[str, ...] = Field((), description="what resolve flagged, e.g. a lossy verify strategy")
    rollout: RolloutStatus = RolloutStatus()
    commands: CommandRecord = CommandRecord()



def field_spellings(model: type[BaseModel]) -> dict[str, str]:
    """snake_case → alias of every field of ``model`` and of the models it contains."""
    spellings: dict[str, str] = {}
    seen: set[type] = set()

    def visit(annotation: Any) -> None:
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            if annotation in seen:
                return
            seen.add(annotation)
            for name, field in annotation.model_fields.items():
                spellings[name] = field.alias or name
                visit(field.annotation)
        for arg in get_args(annotation):
            visit(arg)

    visit(model)
    return spellings


CRD_SPELLINGS = field_spellings(SpecDecodeDeploymentSpec) | field_spellings(SpecDecodeDeploymentStatus)


def in_crd_spelling(text: str) -> str:
    """``text`` (a docstring, a validator's message) with snake_case field names as the CRD spells them."""
    return re.sub(r"\b[a-z][a-z0-9]*(?:_[a-z0-9]+)+\b", lambda m: CRD_SPELLINGS.get(m.group(0), m.group(0)), text)
