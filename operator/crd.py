"""The CustomResourceDefinition, generated from the pydantic models in ``spec.py``.

``python -P -m specdecode.operator.crd [PATH ...]`` writes it to ``crds/`` and to the CRD's own Helm
chart, ``charts/specdecode-crds/templates/`` (``--check`` compares instead); tests prove both equal
what the models generate, so schema, chart, operator and runtime cannot drift. The CRD is a
template of its own chart, not in the operator chart's ``crds/``, because Helm installs a ``crds/``
folder once and never upgrades it: a new status field would be pruned and a new enum value refused
until someone applied the CRD by hand (KServe ships its CRDs the same way). ``helm.sh/resource-policy:
keep`` keeps it, and so every SpecDecodeDeployment, when that chart is uninstalled.

pydantic's JSON schema is turned into a *structural* OpenAPI v3 schema, as the API server
requires: ``$ref`` inlined, ``Optional`` unions collapsed, ``int | str`` as
``x-kubernetes-int-or-string``, free-form objects (the pass-through pod fields) as
``x-kubernetes-preserve-unknown-fields``, draft-2020 exclusive bounds in their OpenAPI 3.0
form, titles dropped. Anything else raises ``UnsupportedSchema``, so a new field of a kind
Kubernetes rejects fails here, not at ``kubectl apply``. Outside ``status`` every object keeps
unknown fields (``x-kubernetes-preserve-unknown-fields``) instead of having them pruned: the
validating webhook refuses them, for every client alike.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel
from pydantic.json_schema import GenerateJsonSchema

from specdecode.operator import names
from specdecode.operator.spec import SpecDecodeDeploymentSpec, SpecDecodeDeploymentStatus, in_crd_spelling

CRD_FILE = f"{names.GROUP}_{names.PLURAL}.yaml"
# Relative to the repository root: the plain manifests, and the CRD chart's template (the same text:
# nothing in it is templated).
CRD_PATHS = (Path("crds") / CRD_FILE, Path("charts/specdecode-crds/templates") / CRD_FILE)
HEADER = "# Generated from specdecode/operator/spec.py by `python -P -m specdecode.operator.crd`; do not edit.\n"

Schema = dict[str, Any]

# Keys a structural schema node may keep as they are.
_KEPT = {
    "type", "format", "description", "properties", "items", "additionalProperties", "required", "enum",
    "default", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "minLength", "maxLength",
    "pattern", "minItems", "maxItems", "minProperties", "maxProperties", "multipleOf",
}
_DROPPED = {"title", "$defs"}


class UnsupportedSchema(ValueError):
    """A pydantic construct that a structural CRD schema cannot express."""


class _CompactDefaults(GenerateJsonSchema):
    """A nested model left at its own defaults becomes ``default: {}``: the API server fills
    the fields below from their own defaults, and the stored object stays short."""

    def encode_default(self, dft: Any) -> Any:
        if isinstance(dft, BaseModel) and dft == type(dft)():
            return {}
        return super().encode_default(dft)


def model_schema(model: type[BaseModel]) -> Schema:
    """The structural OpenAPI v3 schema of ``model`` in its CRD (camelCase) spelling."""
    raw = model.model_json_schema(by_alias=True, mode="validation", schema_generator=_CompactDefaults)
    return structural(raw, raw.get("$defs", {}), path=model.__name__)


def structural(node: Schema, defs: dict[str, Schema], path: str) -> Schema:
    node = dict(node)
    if "$ref" in node:
        target = defs[node.pop("$ref").rsplit("/", 1)[-1]]
        node = {**structural(target, defs, path), **node}  # the field's description/default win
    for key in ("anyOf", "oneOf"):
        if key in node:
            node = {**_union(node.pop(key), defs, path), **node}
    if "allOf" in node:
        parts = node.pop("allOf")
        if len(parts) != 1:
            raise UnsupportedSchema(f"{path}: allOf with {len(parts)} parts")
        node = {**structural(parts[0], defs, path), **node}
    if "const" in node:
        node["enum"] = [node.pop("const")]
    if node.get("default", 0) is None:
        del node["default"]  # an unset optional field is simply absent
    for bound, inclusive in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
        if isinstance(node.get(bound), (int, float)) and not isinstance(node[bound], bool):
            node[inclusive], node[bound] = node[bound], True
    if node.pop("uniqueItems", False):
        node["x-kubernetes-list-type"] = "set"

    out: Schema = {}
    for key, value in node.items():
        if key in _DROPPED:
            continue
        if key == "properties":
            out[key] = {name: structural(sub, defs, f"{path}.{name}") for name, sub in value.items()}
        elif key == "items":
            out[key] = structural(value, defs, f"{path}[]")
        elif key == "additionalProperties":
            if isinstance(value, dict):
                out[key] = structural(value, defs, f"{path}{{}}")
            elif value is True and "properties" not in node:
                out["x-kubernetes-preserve-unknown-fields"] = True  # a pass-through object
            # additionalProperties: false (extra="forbid"): pruned, or kept for admission (keeping_unknown_fields)
        elif key in _KEPT or key.startswith("x-kubernetes-"):
            out[key] = value
        else:
            raise UnsupportedSchema(f"{path}: {key!r} has no structural form")
    if out.get("type") == "object" and "properties" not in out and "additionalProperties" not in out:
        out["x-kubernetes-preserve-unknown-fields"] = True
    if "type" not in out and not out.get("x-kubernetes-int-or-string"):
        raise UnsupportedSchema(f"{path}: no type")
    if out.get("default") == [] and out.get("type") == "array":
        del out["default"]  # absent is empty already; keep stored objects short
    if "description" in out:
        out["description"] = _prose(out["description"])
    return dict(sorted(out.items(), key=lambda kv: _ORDER.get(kv[0], len(_ORDER))))


_ORDER = {key: i for i, key in enumerate((
    "type", "x-kubernetes-int-or-string", "x-kubernetes-preserve-unknown-fields", "x-kubernetes-list-type",
    "x-kubernetes-list-map-keys", "description", "format", "enum", "default", "minimum", "exclusiveMinimum",
    "maximum", "exclusiveMaximum", "minLength", "maxLength", "pattern", "minItems", "maxItems", "required",
    "items", "additionalProperties", "properties",
))}


def _prose(text: str) -> str:
    """A docstring as ``kubectl explain`` shows it: one paragraph, CRD field spellings."""
    return in_crd_spelling(" ".join(text.replace("``", "`").split()))


def _union(members: list[Schema], defs: dict[str, Schema], path: str) -> Schema:
    kept = [m for m in members if m.get("type") != "null"]
    if len(kept) == 1:
        return structural(kept[0], defs, path)
    if sorted(m.get("type", "") for m in kept) == ["integer", "string"]:
        return {"x-kubernetes-int-or-string": True}
    raise UnsupportedSchema(f"{path}: union of {[m.get('type', m.get('$ref')) for m in kept]}")


def _column(name: str, type_: str, path: str, description: str, priority: int = 0) -> dict[str, Any]:
    column = {"name": name, "type": type_, "jsonPath": path, "description": description}
    return {**column, "priority": priority} if priority else column


PRINTER_COLUMNS = [
    _column("Ready", "string", '.status.conditions[?(@.type=="Ready")].status', "whether the stable revision serves"),
    _column("Method", "string", ".spec.speculative.method", "the proposer method"),
    _column("Layout", "string", ".status.layout", "the parallel group of a replica, e.g. TP2×PP2"),
    _column("Acceptance", "number", ".status.acceptance.rate", "last measured draft acceptance rate"),
    _column("Revision", "string", ".status.stableRevision", "the stable revision"),
    _column("Degraded", "string", '.status.conditions[?(@.type=="Degraded")].reason',
            "why it is degraded, e.g. RuntimeRefused (AsExpected when it is not)"),
    _column("Equivalence", "string", ".status.equivalence.state",
            "the equivalence probe of the canary: Probing, Diverged, Inconclusive or Skipped"),
    _column("Same", "integer", ".status.equivalence.promptsSame", "probed prompts that gave the stable's tokens"),
    _column("Near-Ties", "integer", ".status.equivalence.nearTies", "probed prompts that first differed at a near-tie"),
    _column("Diverged", "string", ".status.equivalence.lastDivergence.prompt",
            "the prompt of the last difference the probe found", priority=1),
    _column("Canary", "string", ".status.canaryRevision", "the revision being rolled out", priority=1),
    _column("Age", "date", ".metadata.creationTimestamp", "time since creation"),
]


def keeping_unknown_fields(node: Schema) -> Schema:
    """``node`` with every object that lists its properties keeping the others too. The API server
    then stores an unknown field, where it would prune it for every client that does not ask for
    strict field validation (Helm, Argo CD, Flux), and admission refuses it, naming its path."""
    out = dict(node)
    if "properties" in out:
        out["x-kubernetes-preserve-unknown-fields"] = True
        out["properties"] = {name: keeping_unknown_fields(sub) for name, sub in out["properties"].items()}
    for key in ("items", "additionalProperties"):
        if isinstance(out.get(key), dict):
            out[key] = keeping_unknown_fields(out[key])
    return dict(sorted(out.items(), key=lambda kv: _ORDER.get(kv[0], len(_ORDER))))


def openapi_schema() -> Schema:
    """The resource keeps unknown fields for admission to refuse, but in ``status`` (the operator's,
    pruned as usual)."""
    schema = keeping_unknown_fields({
        "type": "object",
        "description": "Serve a model with speculative decoding; rollouts are gated on measured acceptance.",
        "required": ["spec"],
        "properties": {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            "metadata": {"type": "object"},
            "spec": model_schema(SpecDecodeDeploymentSpec),
        },
    })
    schema["properties"]["status"] = model_schema(SpecDecodeDeploymentStatus)
    return schema


def build_crd() -> dict[str, Any]:
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": names.CRD_NAME, "labels": {names.LABEL_NAME: names.APP},
                     "annotations": {"helm.sh/resource-policy": "keep"}},
        "spec": {
            "group": names.GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": names.KIND,
                "listKind": f"{names.KIND}List",
                "plural": names.PLURAL,
                "singular": names.SINGULAR,
                "shortNames": list(names.SHORT_NAMES),
                "categories": ["all", names.APP],
            },
            "versions": [
                {
                    "name": names.VERSION,
                    "served": True,
                    "storage": True,
                    "schema": {"openAPIV3Schema": openapi_schema()},
                    "subresources": {
                        "status": {},
                        "scale": {
                            "specReplicasPath": ".spec.replicas",
                            "statusReplicasPath": ".status.replicas",
                            "labelSelectorPath": ".status.selector",
                        },
                    },
                    "additionalPrinterColumns": PRINTER_COLUMNS,
                }
            ],
        },
    }


def crd_yaml() -> str:
    return HEADER + yaml.safe_dump(build_crd(), sort_keys=False, allow_unicode=True, width=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -P -m specdecode.operator.crd", description=__doc__.split("\n")[0])
    parser.add_argument("paths", nargs="*", type=Path, default=list(CRD_PATHS),
                        help=f"default: {' and '.join(map(str, CRD_PATHS))}")
    parser.add_argument("--check", action="store_true", help="exit 1 when a file differs from the models")
    args = parser.parse_args(argv)
    text = crd_yaml()
    if args.check:
        stale = [path for path in args.paths if not (path.is_file() and path.read_text(encoding="utf-8") == text)]
        for path in args.paths:
            print(f"{path}: {'differs from the models; regenerate it' if path in stale else 'up to date'}")
        return 1 if stale else 0
    for path in args.paths:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
