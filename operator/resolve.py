"""resolve: a SpecDecodeDeployment as written → the spec the operator renders, or what to change.

Pure (no I/O). The validating webhook answers with ``admission_response(admit(new, old))``;
reconcile calls ``resolve`` again, so a spec that slipped past admission gets ``Ready=False,
reason=InvalidSpec`` with the same messages instead of a crash loop. ``specdecode validate``
prints the webhook's answer.

Every message starts with the field to change (``spec.resources.gpusPerPod: …``) and says what
to change it to. Decisions:

- ``mtp`` drafts with the heads at ``speculative.mtpPath`` (pvc://, file:// or hf://, brought
  into the pod as ``model.uri`` is) or, unset, with the MTP layers of the model's own checkpoint.
  Admission cannot look inside a model, so an ``mtp`` spec without ``mtpPath`` is allowed with a
  warning; a model without MTP layers is refused by the runtime at start, which the status shows
  (``Degraded``, reason ``RuntimeRefused``).
- ``eagle3`` drafts with the head at ``speculative.eagle3Path``, given the same three ways; the
  runtime's config refuses the method without it, and so does admission. Both head fields come
  into the pod as ``sources.py`` says.
- Pipeline parallelism (``parallelism.pipeline`` > 1) is admitted. With ``mtp`` or ``eagle3`` it is
  experimental and needs the ``mtp-pipeline-parallel`` gate: the refusal is the runtime's own sentence
  (``mtp_pipeline_gate_refusal`` in the shared config, the rule ``EngineConfig`` applies), read
  from the spec as written so that it is reported beside any schema error; with the gate,
  admission warns with the runtime's ``MTP_PIPELINE_WARNING``.
- ``gates`` (top level) are merged into ``speculative.gates``, which the runtime reads.
- GPUs per pod default to ``parallelism.tensor``: one pod per pipeline stage, so tensor-only
  layouts are one pod (a Deployment). A divisor of ``tensor`` spreads a stage over several pods;
  anything else is refused. 0 runs on CPU with the same pod layout.
- The parallel group (tensor, pipeline, GPUs per pod) is immutable after creation, as in KServe:
  a running group cannot change its rendezvous shape; create a new resource instead.
- Runtime pods' resources get the defaults of ``resources.py`` filled here (cpu and memory
  requests, /dev/shm by ranks); a memory limit too small beside /dev/shm is allowed with a warning.
"""
from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from specdecode.operator import names
from specdecode.operator.kubeschema import UNKNOWN_FIELD, SchemaViolations
from specdecode.operator.resources import memory_limit_warnings, with_defaults
from specdecode.operator.sources import HEAD_SOURCES, SOURCES, brought_in
from specdecode.operator.spec import (
    SOURCE_URI_PATTERN,
    IntOrString,
    ModelScheme,
    SpecDecodeDeploymentSpec,
    in_crd_spelling,
)
from specdecode.runtime.config import (
    HEAD_METHODS,
    MTP_PIPELINE_GATE,
    MTP_PIPELINE_WARNING,
    SpeculativeMethod,
    VerifyStrategy,
    mtp_pipeline_gate_refusal,
)
from specdecode.runtime.models.aliases import ALIASES
from specdecode.runtime.serve_flags import ArgumentsRefused, serve_parser

# Flags the operator renders itself; extraArgs may not set them a second time.
RENDERED_FLAGS = {
    "--model": "spec.model.uri",
    "--host": "the operator (pods listen on all addresses)",
    "--port": "the operator",
    "--served-model-name": "spec.model.servedName",
    "--speculative-config": "spec.speculative",
    "--tensor-parallel-size": "spec.parallelism.tensor",
    "--pipeline-parallel-size": "spec.parallelism.pipeline",
}
TOP_LEVEL_FIELDS = ("apiVersion", "kind", "metadata", "spec", "status")
_SPEC_FIELDS = {field.alias for field in SpecDecodeDeploymentSpec.model_fields.values()}
_SOURCE_URI = re.compile(SOURCE_URI_PATTERN)
_NAME = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_PERCENT = re.compile(r"^[0-9]+%$")
_DURATION_PART = re.compile(r"([0-9]+)(ms|s|m|h)")
_UNIT_SECONDS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600}
_PATTERN_HINTS = {
    "uri": "must be pvc://claim/path, file:///path, hf://org/name or the alias of a packaged model "
    f"({', '.join(sorted(ALIASES))})",
    "interval": "must be a duration such as 30s, 5m or 1h30m",
    "window": "must be a duration such as 30s, 5m or 1h30m",
    "url": "must be an http:// or https:// address",
    **{field: "must be a DNS subdomain: lowercase letters, digits, '-' and '.', at most 253 characters"
       for field in ("priorityClassName", "runtimeClassName", "schedulerName")},
}


@dataclass(frozen=True)
class Layout:
    """How one replica's parallel group maps onto pods."""

    tensor: int
    pipeline: int
    gpus_per_pod: int  # 0 = CPU

    @property
    def ranks_per_pod(self) -> int:
        return self.gpus_per_pod or self.tensor

    @property
    def pods_per_group(self) -> int:
        return self.tensor * self.pipeline // self.ranks_per_pod

    @property
    def single_pod(self) -> bool:
        return self.pods_per_group == 1

    def describe(self) -> str:
        return f"tensor={self.tensor}, pipeline={self.pipeline}, gpusPerPod={self.gpus_per_pod}"

    @property
    def notation(self) -> str:
        """``TP2×PP2``: the group as ``kubectl get`` shows it (``status.layout``)."""
        return f"TP{self.tensor}×PP{self.pipeline}"


@dataclass(frozen=True)
class Resolved:
    """A valid spec with every default filled: what render takes."""

    name: str
    namespace: str
    spec: SpecDecodeDeploymentSpec
    layout: Layout
    warnings: tuple[str, ...] = ()


@dataclass(frozen=True)
class Resolution:
    resolved: Resolved | None
    errors: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()
    name: str = ""

    @property
    def allowed(self) -> bool:
        return not self.errors

    @property
    def message(self) -> str:
        """The refusal as admission and ``Ready=False, reason=InvalidSpec`` state it."""
        if self.allowed:
            return ""
        return f'{names.KIND} "{self.name}" is invalid: ' + "; ".join(self.errors)


def admission_response(resolution: Resolution) -> dict[str, Any]:
    """The ``response`` of an AdmissionReview (without ``uid``) for this resolution."""
    response: dict[str, Any] = {"allowed": resolution.allowed}
    if not resolution.allowed:
        response["status"] = {"code": 422, "reason": "Invalid", "message": resolution.message}
    if resolution.warnings:
        response["warnings"] = list(resolution.warnings)
    return response


# -- entry points -------------------------------------------------------------------------------


def admit(body: Mapping[str, Any], old: Mapping[str, Any] | None = None) -> Resolution:
    """What admission answers: ``resolve``'s answer, except that an UPDATE which leaves ``spec`` as it
    was, or which reaches a resource being deleted, is never refused (what resolve refuses becomes a
    warning). Such updates are metadata: the promote/abort/pause annotations, kopf's finalizer
    removal. A stored resource can be invalid without a write admission saw (a rule added by an
    operator upgrade); refusing them would leave it impossible to steer or to delete."""
    resolution = resolve(body, old)
    exemption = _exemption(body, old)
    if resolution.allowed or exemption is None:
        return resolution
    return Resolution(None, (), (*resolution.warnings, f"{resolution.message} (allowed: {exemption})"),
                      resolution.name)


def _exemption(body: Mapping[str, Any], old: Mapping[str, Any] | None) -> str | None:
    """Why this UPDATE may not be refused, or None (a CREATE, or a change of spec)."""
    if old is None:
        return None
    if _mapping(body, "metadata").get("deletionTimestamp"):
        return "the resource is being deleted"
    if body.get("spec") == old.get("spec"):
        return "this update leaves spec as it was"
    return None


def resolve(body: Mapping[str, Any], old: Mapping[str, Any] | None = None) -> Resolution:
    """``body`` is the whole custom resource; ``old`` the stored one on update (None on create)."""
    metadata = body.get("metadata") or {}
    name, namespace = str(metadata.get("name", "")), str(metadata.get("namespace") or "default")
    raw = body.get("spec")
    errors = _identity_errors(body, name)
    if not isinstance(raw, Mapping):
        return Resolution(None, (*errors, "spec: required"), name=name)
    errors += _raw_rule_errors(raw)
    try:
        # strict and by alias only, as the API server reads it: "2" is no integer, snake_case no field
        spec = SpecDecodeDeploymentSpec.model_validate_json(
            json.dumps(raw, default=dict), strict=True, by_alias=True, by_name=False)
    except ValidationError as exc:
        errors += _pydantic_errors(exc)
        return Resolution(None, tuple(errors), name=name)

    layout, layout_errors = _layout(spec)
    errors += layout_errors
    errors += _rule_errors(spec, name)
    if old is not None and layout is not None:
        errors += _immutable_errors(old, layout)
    filled = _filled(spec, layout) if layout is not None else None
    warnings = (*_warnings(spec, name), *(memory_limit_warnings(filled.resources) if filled else ()))
    if errors or filled is None:
        return Resolution(None, tuple(errors), warnings, name)
    return Resolution(Resolved(name, namespace, filled, layout, warnings), (), warnings, name)


# -- identity and schema ------------------------------------------------------------------------


def _identity_errors(body: Mapping[str, Any], name: str) -> list[str]:
    errors = []
    if body.get("apiVersion") != names.API_VERSION or body.get("kind") != names.KIND:
        errors.append(f"apiVersion/kind: must be {names.API_VERSION} {names.KIND}, not "
                      f"{body.get('apiVersion')} {body.get('kind')}")
    errors += [f"{key}: unknown field at the top level; move it under spec" if key in _SPEC_FIELDS
               else f"{key}: {UNKNOWN_FIELD}" for key in sorted(set(body) - set(TOP_LEVEL_FIELDS))]
    if not _NAME.match(name):
        errors.append("metadata.name: must be lowercase letters, digits and '-', starting with a letter "
                      "(it names the Service)")
    if len(name) > names.MAX_RESOURCE_NAME_LENGTH:
        errors.append(f"metadata.name: at most {names.MAX_RESOURCE_NAME_LENGTH} characters (the workloads are named "
                      f"{names.group_name(name, '<revision>', names.MAX_REPLICAS - 1)} at most); shorten it")
    return errors


def _mapping(raw: Mapping[str, Any], key: str) -> Mapping[str, Any]:
    """``raw[key]`` if it is a mapping, else empty: a lenient read of a spec as written."""
    value = raw.get(key)
    return value if isinstance(value, Mapping) else {}


def _strings(raw: Mapping[str, Any], key: str) -> list[str]:
    """The strings in ``raw[key]`` if it is a list (gates as written)."""
    value = raw.get(key)
    return [v for v in value if isinstance(v, str)] if isinstance(value, list) else []


def _path(loc: Iterable[Any]) -> str:
    out = "spec"
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else f".{part}"
    return out


def _pydantic_errors(exc: ValidationError) -> list[str]:
    out = []
    for err in exc.errors(include_url=False):
        loc = [part for part in err["loc"] if part not in ("function-after",)]
        cause = err.get("ctx", {}).get("error")
        if isinstance(cause, SchemaViolations):  # a pod field against Kubernetes' schema: one line per part
            out += [f"{_path([*loc, *inner])}: {message}" for inner, message in cause.violations]
            continue
        kind, msg = err["type"], err["msg"]
        if kind == "extra_forbidden":
            msg = UNKNOWN_FIELD
        elif kind == "missing":
            msg = "required"
        elif kind == "string_pattern_mismatch":
            msg = _PATTERN_HINTS.get(str(loc[-1]) if loc else "", msg)
        elif kind == "value_error":
            msg = in_crd_spelling(msg.removeprefix("Value error, "))
        out.append(f"{_path(loc)}: {msg}")
    return out


# -- layout -------------------------------------------------------------------------------------


def _layout(spec: SpecDecodeDeploymentSpec) -> tuple[Layout | None, list[str]]:
    tensor, pipeline = spec.parallelism.tensor, spec.parallelism.pipeline
    gpus = spec.resources.gpus_per_pod
    if gpus is None:
        gpus = tensor
    if gpus > tensor:
        return None, [f"spec.resources.gpusPerPod: {gpus} is more than parallelism.tensor ({tensor}); a pod runs at "
                      f"most one pipeline stage and would hold GPUs it never uses: set gpusPerPod to {tensor} (or "
                      "leave it unset) or raise parallelism.tensor"]
    if gpus and tensor % gpus:
        divisors = [d for d in range(1, tensor + 1) if tensor % d == 0]
        return None, [f"spec.resources.gpusPerPod: {gpus} does not divide parallelism.tensor ({tensor}); a stage's "
                      f"tensor-parallel group splits evenly across pods: use one of {divisors}"]
    return Layout(tensor, pipeline, gpus), []


def _raw_layout(body: Mapping[str, Any]) -> tuple[int, int, int] | None:
    """(tensor, pipeline, GPUs per pod) of a stored resource, read leniently (it may predate rules)."""
    spec = _mapping(body, "spec")
    par, res = _mapping(spec, "parallelism"), _mapping(spec, "resources")
    tensor, pipeline, gpus = par.get("tensor", 1), par.get("pipeline", 1), res.get("gpusPerPod")
    if not all(isinstance(v, int) for v in (tensor, pipeline)) or not isinstance(gpus, (int, type(None))):
        return None
    return tensor, pipeline, tensor if gpus is None else gpus


def _immutable_errors(old: Mapping[str, Any], new: Layout) -> list[str]:
    before = _raw_layout(old)
    if before is None or before == (new.tensor, new.pipeline, new.gpus_per_pod):
        return []
    was = Layout(*before)
    return [f"spec.parallelism: the parallel group is immutable after creation (was {was.describe()}; now "
            f"{new.describe()}): put it back, or create a new {names.KIND} and move traffic to it"]


# -- rules --------------------------------------------------------------------------------------


def _raw_rule_errors(raw: Mapping[str, Any]) -> list[str]:
    """The MTP × pipeline gate, read leniently from the spec as written: said even when the schema
    refuses something else (a value of the wrong type is the schema's to report)."""
    parallelism, speculative = _mapping(raw, "parallelism"), _mapping(raw, "speculative")
    pipeline, method = parallelism.get("pipeline", 1), speculative.get("method")
    if not isinstance(pipeline, int):
        return []
    gates = [*_strings(raw, "gates"), *_strings(speculative, "gates")]
    refusal = mtp_pipeline_gate_refusal(str(method), pipeline, gates)
    return [f"spec.parallelism.pipeline: {refusal}"] if refusal else []


def _rule_errors(spec: SpecDecodeDeploymentSpec, name: str) -> list[str]:
    return (_source_errors(spec) + _rollout_errors(spec) + _gpu_override_errors(spec)
            + _extra_args_errors(spec.extra_args) + _pod_collision_errors(spec))


# What the operator puts into every runtime pod itself (render.pod_template): spec.pod may not
# name them again, or the API server refuses the child (a duplicate volume name or mount path)
# or the runtime reads the user's value instead of the operator's (the rendezvous variables).
OPERATOR_ENV = {
    names.ENV_MASTER_ADDR: "the address of the parallel group's first pod",
    names.ENV_MASTER_PORT: "the parallel group's rendezvous port",
    names.ENV_NNODES: "the number of pods in the parallel group",
    names.ENV_NODE_RANK: "this pod's index in the parallel group",
    names.ENV_LWS_LEADER_ADDRESS: "LeaderWorkerSet's leader address",
}
OPERATOR_VOLUMES = {names.SHM_VOLUME: names.SHM_MOUNT, **{source.volume: source.described for source in SOURCES}}
OPERATOR_MOUNTS = {names.SHM_MOUNT: names.SHM_VOLUME, **{source.mount: source.volume for source in SOURCES}}


def _pod_collision_errors(spec: SpecDecodeDeploymentSpec) -> list[str]:
    """spec.pod entries that collide with the operator's own or with each other."""
    pod = spec.pod
    env, volumes, mounts = ([item.get(key) for item in items] for items, key in
                            ((pod.env, "name"), (pod.volumes, "name"), (pod.volume_mounts, "mountPath")))
    errors = [f"spec.pod.env[{i}].name: {name} is set by the operator ({OPERATOR_ENV[name]}): use another name"
              for i, name in enumerate(env) if name in OPERATOR_ENV]
    errors += [f"spec.pod.volumes[{i}].name: {name} is the operator's volume for {OPERATOR_VOLUMES[name]}: "
               "use another name" for i, name in enumerate(volumes) if name in OPERATOR_VOLUMES]
    errors += [f"spec.pod.volumeMounts[{i}].mountPath: {path} is where the operator mounts its volume "
               f"{OPERATOR_MOUNTS[path]}: mount elsewhere" for i, path in enumerate(mounts) if path in OPERATOR_MOUNTS]
    for field, values in (("env", env), ("volumes", volumes)):
        errors += _duplicates(f"spec.pod.{field}", "name", values)
    return errors + _duplicates("spec.pod.volumeMounts", "mountPath", mounts)


def _duplicates(path: str, key: str, values: list[Any]) -> list[str]:
    first: dict[Any, int] = {}
    errors = []
    for i, value in enumerate(values):
        if value in first:
            errors.append(f"{path}[{i}].{key}: {value} is given already at {path}[{first[value]}]: keep one")
        first.setdefault(value, i)
    return errors


def _gpu_override_errors(spec: SpecDecodeDeploymentSpec) -> list[str]:
    """The GPU resource is resources.gpusPerPod's; render writes it over requests and limits."""
    res = spec.resources
    return [f"spec.resources.{kind}[{res.gpu_resource_name}]: set from spec.resources.gpusPerPod (GPUs per pod; "
            "default parallelism.tensor, 0 = CPU), which would replace this value; remove it and set gpusPerPod"
            for kind, values in (("requests", res.requests), ("limits", res.limits)) if res.gpu_resource_name in values]


def _extra_args_errors(args: tuple[str, ...]) -> list[str]:
    """``extraArgs`` as ``specdecode serve`` will read them, checked with its own parser made strict
    (no abbreviations: ``--tensor-parallel`` would mean ``--tensor-parallel-size`` to the runtime)."""
    flags = [arg.split("=", 1)[0] for arg in args]
    errors = [f"spec.extraArgs[{i}]: {flag} is set from {RENDERED_FLAGS[flag]}; remove it"
              for i, flag in enumerate(flags) if flag in RENDERED_FLAGS]
    try:
        _, unknown = serve_parser(strict=True).parse_known_args(list(args))
    except ArgumentsRefused as exc:
        return [*errors, f"spec.extraArgs: `specdecode serve` refuses them: {exc}"]
    unknown_flags = list(dict.fromkeys(token.split("=", 1)[0] for token in unknown if token.startswith("-")))
    errors += [f"spec.extraArgs[{flags.index(flag)}]: {flag} is no `specdecode serve` flag (abbreviations are not "
               f"accepted); {_unknown_flag_hint(flag)}" for flag in unknown_flags]
    if not unknown_flags:  # values after a flag that takes none (the runtime would refuse them)
        errors += [f"spec.extraArgs[{args.index(value)}]: '{value}' is a value that no flag takes; remove it"
                   for value in dict.fromkeys(unknown)]
    return errors


def _unknown_flag_hint(flag: str) -> str:
    rendered = [full for full in RENDERED_FLAGS if full.startswith(flag)]
    if len(rendered) == 1:
        return f"{rendered[0]} is set from {RENDERED_FLAGS[rendered[0]]}; remove it"
    return "write the flag in full as `specdecode serve --help` lists it, or remove it"


def _source_errors(spec: SpecDecodeDeploymentSpec) -> list[str]:
    """Where the model, the MTP heads and the draft model come from."""
    errors: list[str] = []
    location = spec.model.location
    if location.scheme is ModelScheme.ALIAS and location.path.lower() not in ALIASES:
        errors.append(f"spec.model.uri: '{location.path}' is not a packaged model; use one of "
                      f"{sorted(ALIASES)} or a pvc://, file:// or hf:// address")
    errors += _head_uri_errors(spec)
    if spec.model.cache_claim and all(location.scheme is not ModelScheme.HF for location, _ in brought_in(spec)):
        downloaded = ", ".join(source.field.removeprefix("spec.") for source in SOURCES)
        errors.append(f"spec.model.cacheClaim: only hf:// sources ({downloaded}) are downloaded; remove it")
    draft = spec.speculative.draft_model
    if draft and "://" in draft:
        errors.append("spec.speculative.draftModel: takes a packaged alias or a path inside the pod (mount it with "
                      "spec.pod.volumes and spec.pod.volumeMounts), not an address")
    return errors


def _head_uri_errors(spec: SpecDecodeDeploymentSpec) -> list[str]:
    """Head sources written as something other than the three forms a pod can be given."""
    errors = []
    for source in HEAD_SOURCES:
        uri = source.uri(spec.speculative)
        if uri is not None and not _SOURCE_URI.match(uri):
            unset = f"; leave it unset to {source.when_unset}" if source.when_unset else ""
            errors.append(f"{source.field}: must be pvc://claim/path, file:///path or hf://org/name ({source.folder}, "
                          f"brought into the pod as spec.model.uri is){unset}")
    return errors


def _rollout_errors(spec: SpecDecodeDeploymentSpec) -> list[str]:
    rollout, errors = spec.rollout, []
    for field_name, value in (("maxSurge", rollout.max_surge), ("maxUnavailable", rollout.max_unavailable)):
        errors += _int_or_percent_errors(f"spec.rollout.{field_name}", value)
    pdb = spec.pod_disruption_budget
    errors += _int_or_percent_errors("spec.podDisruptionBudget.maxUnavailable", pdb.max_unavailable)
    if rollout.max_surge in (0, "0%") and rollout.max_unavailable in (0, "0%"):
        errors.append("spec.rollout: maxSurge and maxUnavailable are both 0, so no replica can ever be replaced; "
                      "set maxUnavailable to 1 (GPU-safe) or maxSurge to 1")
    weights = [step.weight for step in rollout.steps]
    if not weights:
        errors.append("spec.rollout.steps: give at least one step; the last has weight 100")
    elif any(b <= a for a, b in zip(weights, weights[1:])) or weights[-1] != 100:
        errors.append(f"spec.rollout.steps: weights {weights} must increase strictly and end at 100")
    analysis = rollout.analysis
    if duration_seconds(analysis.window) < duration_seconds(analysis.interval):
        errors.append(f"spec.rollout.analysis.window: {analysis.window} is shorter than interval {analysis.interval}; "
                      "a window covers at least one interval")
    return errors


def _int_or_percent_errors(path: str, value: IntOrString) -> list[str]:
    if isinstance(value, int):
        return [] if value >= 0 else [f"{path}: must not be negative"]
    if not _PERCENT.match(value) or int(value[:-1]) > 100:
        return [f"{path}: '{value}' must be a whole number or a percentage from 0% to 100%"]
    return []


def duration_seconds(text: str) -> float:
    """Seconds in a Go-style duration (``1h30m``, ``30s``, ``250ms``)."""
    return sum(int(n) * _UNIT_SECONDS[unit] for n, unit in _DURATION_PART.findall(text))


def _operator_pod_labels(name: str) -> dict[str, str]:
    """Label key → the value every runtime pod gets: from render, and the workload controllers' rank."""
    return {**{key: f"'{value}'" for key, value in names.runtime_pod_labels(name).items()},
            names.LABEL_REVISION: "its revision", names.LABEL_GROUP: "its replica's index",
            names.LABEL_STS_POD_INDEX: "its rank in the replica", names.LABEL_LWS_WORKER_INDEX: "its rank in the replica"}


def _warnings(spec: SpecDecodeDeploymentSpec, name: str) -> Iterable[str]:
    owned = _operator_pod_labels(name)
    for key in sorted(spec.pod.labels.keys() & owned.keys()):
        yield (f"spec.pod.labels[{key}]: every runtime pod gets this label set to {owned[key]} (the operator finds "
               f"and ranks its pods by it), so '{spec.pod.labels[key]}' is replaced; use another key")
    speculative = spec.speculative
    if (speculative.method in HEAD_METHODS and spec.parallelism.pipeline > 1
            and MTP_PIPELINE_GATE in {*spec.gates, *speculative.gates}):
        yield f"spec.parallelism.pipeline: {MTP_PIPELINE_WARNING}"
    if speculative.method is SpeculativeMethod.MTP and speculative.mtp_path is None:
        yield ("spec.speculative.mtpPath: unset, so the runtime drafts with the MTP layers of the model's own "
               "checkpoint; admission cannot look inside spec.model.uri to check that it has them: a model without "
               "them is refused when the pods start (condition Degraded, reason RuntimeRefused). For a model "
               "without MTP layers, train heads with `specdecode train-mtp` and set mtpPath")
    if speculative.method is not SpeculativeMethod.NONE and speculative.verify is VerifyStrategy.TOPP:
        yield (f"spec.speculative.verify: 'topp' is lossy: a draft inside the target's top-p mass "
               f"(verifyTopP={speculative.verify_top_p}) is accepted, so outputs can differ from the model's own; "
               "use 'rejection' (sampling) or 'greedy' to keep them identical")
    analysis = spec.rollout.analysis
    if speculative.method is SpeculativeMethod.NONE and (
        analysis.min_acceptance_rate is not None or analysis.min_mean_acceptance_length is not None
    ):
        yield ("spec.rollout.analysis: acceptance thresholds are ignored with method 'none' (no drafts are made); "
               "rollouts are judged on latency and errors")


def _filled(spec: SpecDecodeDeploymentSpec, layout: Layout) -> SpecDecodeDeploymentSpec:
    gates = tuple(sorted({*spec.gates, *spec.speculative.gates}))
    resources = with_defaults(spec.resources, layout.ranks_per_pod)
    return spec.model_copy(update={
        "gates": gates,
        "speculative": spec.speculative.model_copy(update={"gates": gates}),
        "resources": resources.model_copy(update={"gpus_per_pod": layout.gpus_per_pod}),
    })

