"""Kubernetes' own schemas for what a SpecDecodeDeployment passes through to its pods.

``spec.pod`` entries (tolerations, env, volumes, volumeMounts, affinity, topologySpreadConstraints,
securityContext, containerSecurityContext) go into every pod as written, so admission checks each
against its Kubernetes definition instead of letting the API server refuse the child later:
kubernetes-validate's strict JSON schemas (generated from the API
server's OpenAPI document; unknown fields are refused), of the newest Kubernetes it bundles, so
that no cluster's field is refused. A field the cluster is too old for is still refused by its
API server when the operator writes the child.

OpenAPI types a quantity as a string and states its grammar only in prose; here the grammar is
added (``QUANTITY_PATTERN``, the one controller-gen writes into CRDs), so a volume's
``emptyDir.sizeLimit`` is checked as ``spec.resources.limits`` is. Enum-valued fields are strings
there too; ``ENUMS`` adds their allowed values.
"""
from __future__ import annotations

import functools
import json
import re
from collections.abc import Iterable
from fractions import Fraction
from typing import Annotated, Any

import jsonschema
import referencing
from kubernetes_validate import utils as kubernetes_validate
from pydantic import AfterValidator, Field

QUANTITY_PATTERN = (r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)"
                    r"|(\.[0-9]+))))?$")
QUANTITY_HINT = "is not a Kubernetes quantity: a number with an optional suffix, e.g. 16Gi, 500m or 2"
_QUANTITY = re.compile(QUANTITY_PATTERN)
_QUANTITY_DEFINITION = "io.k8s.apimachinery.pkg.api.resource.Quantity"
CORE = "io.k8s.api.core.v1."  # the definitions spec.pod passes through: Toleration, EnvVar, Volume, …

UNKNOWN_FIELD = "unknown field; remove it (field names are camelCase)"

# Enum-valued fields of what spec.pod passes through. The bundled schemas type them as plain
# strings (the allowed values are only in the field descriptions), and an API server refuses a
# child carrying another value (422), so the values are added here, each from the Kubernetes API
# reference (https://kubernetes.io/docs/reference/kubernetes-api/), page and field named.
ENUMS: dict[tuple[str, str], tuple[str, ...]] = {
    # workload-resources/pod-v1 § Scheduling, tolerations.operator ("" is Equal) and .effect ("" is all)
    (CORE + "Toleration", "operator"): ("Exists", "Equal", ""),
    (CORE + "Toleration", "effect"): ("NoSchedule", "PreferNoSchedule", "NoExecute", ""),
    # workload-resources/pod-v1 § Volumes: hostPath.type ("" skips the check)
    (CORE + "HostPathVolumeSource", "type"): ("", "DirectoryOrCreate", "Directory", "FileOrCreate", "File", "Socket",
                                              "CharDevice", "BlockDevice"),
    # workload-resources/pod-v1 § Volumes: volumeMounts.mountPropagation
    (CORE + "VolumeMount", "mountPropagation"): ("None", "HostToContainer", "Bidirectional"),
    # common-definitions/node-selector-requirement: operator
    (CORE + "NodeSelectorRequirement", "operator"): ("In", "NotIn", "Exists", "DoesNotExist", "Gt", "Lt"),
    # common-definitions/label-selector: matchExpressions.operator
    ("io.k8s.apimachinery.pkg.apis.meta.v1.LabelSelectorRequirement", "operator"): ("In", "NotIn", "Exists",
                                                                                    "DoesNotExist"),
    # workload-resources/pod-v1 § Scheduling: topologySpreadConstraints.whenUnsatisfiable, nodeAffinityPolicy,
    # nodeTaintsPolicy
    (CORE + "TopologySpreadConstraint", "whenUnsatisfiable"): ("DoNotSchedule", "ScheduleAnyway"),
    (CORE + "TopologySpreadConstraint", "nodeAffinityPolicy"): ("Honor", "Ignore"),
    (CORE + "TopologySpreadConstraint", "nodeTaintsPolicy"): ("Honor", "Ignore"),
    # workload-resources/pod-v1 § Security context: securityContext.fsGroupChangePolicy, seLinuxChangePolicy,
    # supplementalGroupsPolicy, seccompProfile.type, appArmorProfile.type; the container's procMount
    (CORE + "PodSecurityContext", "fsGroupChangePolicy"): ("OnRootMismatch", "Always"),
    (CORE + "PodSecurityContext", "seLinuxChangePolicy"): ("MountOption", "Recursive"),
    (CORE + "PodSecurityContext", "supplementalGroupsPolicy"): ("Merge", "Strict"),
    (CORE + "SeccompProfile", "type"): ("RuntimeDefault", "Localhost", "Unconfined"),
    (CORE + "AppArmorProfile", "type"): ("RuntimeDefault", "Localhost", "Unconfined"),
    (CORE + "SecurityContext", "procMount"): ("Default", "Unmasked"),
}
Path = tuple[str | int, ...]


class SchemaViolations(ValueError):
    """What Kubernetes' schema refuses in one value: (path inside it, what to change) pairs."""

    def __init__(self, kind: str, violations: list[tuple[Path, str]]) -> None:
        super().__init__(f"not a valid Kubernetes {kind}: " + "; ".join(message for _, message in violations))
        self.violations = violations


_SUFFIXES: dict[str, Fraction] = {
    **{suffix: Fraction(1024) ** power for power, suffix in enumerate(("", "Ki", "Mi", "Gi", "Ti", "Pi", "Ei"))},
    **{suffix: Fraction(10) ** power for suffix, power in (("n", -9), ("u", -6), ("m", -3), ("k", 3), ("M", 6),
                                                            ("G", 9), ("T", 12), ("P", 15), ("E", 18))},
}
_NUMBER = re.compile(r"[+-]?[0-9]*\.?[0-9]*")


def quantity_value(value: int | float | str) -> Fraction | None:
    """The exact amount a Kubernetes quantity stands for (``1Gi`` and ``1024Mi`` alike, ``0.5`` and
    ``500m``); None for what is no quantity. The API server returns quantities in its canonical
    spelling, so what runs is compared with what we render by amount."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return Fraction(str(value))
    if not isinstance(value, str) or not _QUANTITY.match(value):
        return None
    number = _NUMBER.match(value).group()
    rest = value[len(number):]  # a suffix (E alone is exa), or an exponent (e3, E-2)
    scale = Fraction(10) ** int(rest[1:]) if rest[:1] in ("e", "E") and len(rest) > 1 else _SUFFIXES[rest]
    return Fraction(number) * scale


def check_quantity(value: int | str) -> int | str:
    """``value`` if it is a Kubernetes quantity (a pydantic after-validator)."""
    if isinstance(value, str) and not _QUANTITY.match(value):
        raise ValueError(f"'{value}' {QUANTITY_HINT}")
    return value


def kubernetes_object(kind: str) -> Any:
    """A pydantic field type: a mapping passed through as written, checked against the schema of
    Kubernetes' core/v1 ``kind`` (``SchemaViolations`` when it does not fit)."""

    def check(value: dict[str, Any]) -> dict[str, Any]:
        violations = schema_violations(CORE + kind, value)
        if violations:
            raise SchemaViolations(kind, violations)
        return value

    description = f"a Kubernetes {kind} (core/v1), checked against its schema"
    return Annotated[dict[str, Any], AfterValidator(check), Field(description=description)]


def schema_violations(definition: str, value: Any) -> list[tuple[Path, str]]:
    """(path inside ``value``, message) for each part the schema of ``definition`` refuses."""
    errors = sorted(_validator(definition).iter_errors(value), key=lambda e: [str(p) for p in e.absolute_path])
    return list(dict.fromkeys(violation for error in errors for violation in _violations(error)))


def _violations(error: jsonschema.ValidationError) -> Iterable[tuple[Path, str]]:
    path, schema, instance = tuple(error.absolute_path), error.schema, error.instance
    if error.validator == "additionalProperties":
        for field in sorted(set(instance) - set(schema.get("properties", {}))):
            yield (*path, field), UNKNOWN_FIELD
    elif error.validator == "required":  # one error per missing field, each told all of them
        for field in error.validator_value:
            if field not in instance:
                yield (*path, field), "required"
    elif error.validator == "type":
        wanted = [t for t in schema["type"] if t != "null"] if isinstance(schema["type"], list) else [schema["type"]]
        yield path, f"must be {' or '.join(wanted)}, not {json.dumps(instance)}"
    elif error.validator == "pattern" and schema.get("pattern") == QUANTITY_PATTERN:
        yield path, f"'{instance}' {QUANTITY_HINT}"
    elif error.validator == "enum":
        yield path, f"'{instance}' is not one of " + ", ".join(f"'{v}'" for v in error.validator_value if v is not None)
    else:
        yield path, error.message


@functools.cache
def _definitions() -> dict[str, Any]:
    """The newest bundled ``_definitions.json`` (strict), with the quantity grammar added."""
    version = kubernetes_validate.latest_version()
    document = kubernetes_validate.schema_contents(
        f"kubernetes-json-schema/v{version}-local-strict/_definitions.json", version)
    document["$defs"][_QUANTITY_DEFINITION] = {"type": ["string", "number", "null"], "pattern": QUANTITY_PATTERN}
    for (definition, field), values in ENUMS.items():
        document["$defs"][definition]["properties"][field]["enum"] = [*values, None]
    return document


@functools.cache
def _validator(definition: str) -> jsonschema.Draft202012Validator:
    document = _definitions()
    registry = referencing.Resource.from_contents(document) @ referencing.Registry()
    return jsonschema.Draft202012Validator({"$ref": f"{document['$id']}#/$defs/{definition}"}, registry=registry)
