"""The generated CRD: equal to crds/, structural, accepted by Kubernetes' own schema, and the
example resources pass (or, for the invalid one, fail) its openAPIV3Schema."""
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from pydantic import BaseModel

from specdecode.operator import crd, names
from specdecode.operator.resolve import TOP_LEVEL_FIELDS
from specdecode.operator.spec import SpecDecodeDeploymentSpec
from specdecode.runtime.config import SpeculativeConfig

REPO = Path(__file__).resolve().parents[1]
CRD_COPIES = [REPO / path for path in crd.CRD_PATHS]  # crds/ and the CRD chart's template
EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))
INVALID = [p for p in EXAMPLES if p.name.startswith("invalid")]
VALID = [p for p in EXAMPLES if p not in INVALID]
FORBIDDEN = {"$ref", "anyOf", "oneOf", "allOf", "not", "const", "uniqueItems", "prefixItems", "$defs", "title"}


def served_schema() -> dict[str, Any]:
    return crd.build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def walk(node: dict[str, Any], path: str = ""):
    yield path, node
    for name, sub in node.get("properties", {}).items():
        yield from walk(sub, f"{path}.{name}")
    if isinstance(node.get("items"), dict):
        yield from walk(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        yield from walk(node["additionalProperties"], f"{path}{{}}")


@pytest.mark.parametrize("path", CRD_COPIES, ids=lambda p: str(p.relative_to(REPO).parent))
def test_crd_files_equal_what_the_models_generate(path):
    assert path.read_text(encoding="utf-8") == crd.crd_yaml(), (
        f"{path.relative_to(REPO)} is stale: run `python -P -m specdecode.operator.crd`"
    )


def test_generator_writes_and_checks_every_copy(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    assert [p.parent.as_posix() for p in crd.CRD_PATHS] == ["crds", "charts/specdecode-crds/templates"]
    assert crd.main(["--check"]) == 0  # the defaults: both copies in the repository
    monkeypatch.chdir(tmp_path)
    assert crd.main([]) == 0 and crd.main(["--check"]) == 0
    stale = tmp_path / crd.CRD_PATHS[1]
    stale.write_text(crd.crd_yaml().replace("v1alpha1", "v1alpha2"), encoding="utf-8")
    assert crd.main(["--check"]) == 1


def test_crd_identity_subresources_and_columns():
    spec = crd.build_crd()["spec"]
    assert (spec["group"], spec["scope"], spec["names"]["shortNames"]) == ("specdecode.io", "Namespaced", ["sdd"])
    version = spec["versions"][0]
    assert version["name"] == "v1alpha1" and version["served"] and version["storage"]
    assert version["subresources"]["scale"]["specReplicasPath"] == ".spec.replicas"
    assert "status" in version["subresources"]
    columns = [c["name"] for c in version["additionalPrinterColumns"]]
    assert columns[:5] == ["Ready", "Method", "Layout", "Acceptance", "Revision"] and columns[-1] == "Age"
    (layout,) = [c for c in version["additionalPrinterColumns"] if c["name"] == "Layout"]
    assert (layout["jsonPath"], layout["type"]) == (".status.layout", "string")
    schema = served_schema()
    for column in version["additionalPrinterColumns"]:  # every column points at a real field
        if column["jsonPath"].startswith((".spec", ".status")) and "[" not in column["jsonPath"]:
            node = schema
            for part in column["jsonPath"].strip(".").split("."):
                node = node["properties"][part]


def test_replicas_are_bounded_in_the_schema_that_scale_obeys():
    """/scale (kubectl scale, an HPA) skips admission but not the CRD's schema: the replicas bound
    the name limit assumes holds there too."""
    replicas = served_schema()["properties"]["spec"]["properties"]["replicas"]
    assert (replicas["minimum"], replicas["maximum"]) == (0, names.MAX_REPLICAS)
    assert crd.build_crd()["spec"]["versions"][0]["subresources"]["scale"]["specReplicasPath"] == ".spec.replicas"


@pytest.mark.parametrize("version", ["1.30", kubernetes_validate.latest_version()])
def test_crd_passes_kubernetes_schema(version):
    kubernetes_validate.validate(crd.build_crd(), version, strict=True)


def test_schema_is_structural():
    for path, node in walk(served_schema()):
        assert not FORBIDDEN & node.keys(), f"{path}: {FORBIDDEN & node.keys()}"
        assert node.get("additionalProperties") is not False, path
        assert not ("properties" in node and "additionalProperties" in node), path
        typed = "type" in node or node.get("x-kubernetes-int-or-string")
        assert typed, f"{path}: no type"
        if node.get("x-kubernetes-preserve-unknown-fields") and "properties" not in node:
            # free-form only where pod fields pass through (and the resource's own metadata)
            assert path.startswith(".spec.pod.") or path == ".metadata", path
        if "exclusiveMinimum" in node:
            assert node["exclusiveMinimum"] is True and "minimum" in node, path


def test_unknown_fields_are_kept_for_admission_everywhere_but_status():
    """Pruned, a typo'd field would silently become its default for every client that does not ask
    for strict field validation (Helm, Argo CD, Flux); kept, the webhook refuses it."""
    schema = served_schema()
    objects = [(path, node) for path, node in walk(schema) if "properties" in node]
    assert [path for path, node in objects if not path.startswith(".status")] == \
        [path for path, node in objects if node.get("x-kubernetes-preserve-unknown-fields")]
    assert "" in dict(objects) and ".spec.rollout.analysis" in dict(objects)  # the root and nested objects
    assert list(schema["properties"]) == list(TOP_LEVEL_FIELDS)  # what admission knows at the top level


def test_every_default_validates_against_its_own_schema():
    for path, node in walk(served_schema()):
        if "default" in node:
            jsonschema.Draft4Validator(node).validate(node["default"])


def fields(model: type[BaseModel]) -> list[str]:
    return [f.alias or n for n, f in model.model_fields.items()]


def test_shared_speculative_config_is_the_crd_schema():
    """Every field of the runtime's SpeculativeConfig appears, camelCase, without a line here."""
    speculative = served_schema()["properties"]["spec"]["properties"]["speculative"]
    assert list(speculative["properties"]) == fields(SpeculativeConfig)
    assert set(served_schema()["properties"]["spec"]["properties"]) == set(fields(SpecDecodeDeploymentSpec))
    assert speculative["properties"]["method"]["enum"] == [m.value for m in SpeculativeConfig.model_fields["method"].annotation]


def test_unsupported_constructs_fail_the_generator():
    class Bad(BaseModel):
        either: int | list[str]

    with pytest.raises(crd.UnsupportedSchema, match="either"):
        crd.model_schema(Bad)


def load(path: Path) -> dict[str, Any]:
    return yaml.safe_load(path.read_text(encoding="utf-8"))


def test_examples_exist():
    assert {REPO / "examples" / name for name in ("smollm2-ngram.yaml", "smollm2-mtp.yaml")} <= set(VALID) and INVALID


@pytest.mark.parametrize("path", VALID, ids=lambda p: p.name)
def test_valid_examples_pass_the_crd_schema(path):
    body = load(path)
    assert (body["apiVersion"], body["kind"]) == (names.API_VERSION, names.KIND)
    jsonschema.Draft4Validator(served_schema()).validate(body)


@pytest.mark.parametrize("path", INVALID, ids=lambda p: p.name)
def test_invalid_examples_fail_the_crd_schema(path):
    errors = list(jsonschema.Draft4Validator(served_schema()).iter_errors(load(path)))
    assert ("spec", "speculative", "numSpeculativeTokens") in {tuple(e.path) for e in errors}
