"""The CRD upgraded by its own chart on the real API server (issue 36): the CRD of an earlier version
(tests/fixtures/crd-previous.yaml, committed as that version generated it) is installed and a
resource made with it; the API server prunes the status fields that version lacks (what a CRD left
in a chart's ``crds/`` does to a newer operator); the CRD chart's rendered template is then applied
over it, as ``helm upgrade`` applies a template, and the same status write is kept while the
resource made before is still served as it was made (with the new version's defaults added).

The test's CRDs serve a group of their own (``upgrade.specdecode.io``): the session's CRD, which
the operator and the other tests use, stays as it is, and the operator watches none of this.
"""
from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import kubernetes
import pytest
import yaml
from operator_harness import example
from realk8s import ControlPlane, install_crds, wait_until
from test_crd_chart import rendered_crd_chart

from specdecode.operator import names

pytestmark = [pytest.mark.realk8s, pytest.mark.timeout(120, func_only=True)]

Obj = dict[str, Any]
PREVIOUS = Path(__file__).parent / "fixtures" / "crd-previous.yaml"
GROUP = f"upgrade.{names.GROUP}"
NAMESPACE = "crd-upgrade"
NEW_STATUS = {"stableRevision": "5e75eae315", "stableModel": "smollm2-135m"}  # stableModel: newer than PREVIOUS


def in_test_group(crd: Obj) -> Obj:
    crd = copy.deepcopy(crd)
    crd["spec"]["group"] = GROUP
    crd["metadata"]["name"] = f"{crd['spec']['names']['plural']}.{GROUP}"
    return crd


def written_status(custom: kubernetes.client.CustomObjectsApi, name: str) -> Obj:
    """Write ``NEW_STATUS`` through the status subresource; what the API server stored of its fields
    (the schema's defaults fill in the others)."""
    stored = custom.patch_namespaced_custom_object_status(GROUP, names.VERSION, NAMESPACE, names.PLURAL, name,
                                                          {"status": NEW_STATUS})
    return {key: value for key, value in (stored.get("status") or {}).items() if key in NEW_STATUS}


def contains(whole: Any, part: Any) -> bool:
    """Every field of ``part`` is in ``whole`` with the same value (objects compared field by field)."""
    if isinstance(part, dict):
        return isinstance(whole, dict) and all(k in whole and contains(whole[k], v) for k, v in part.items())
    return whole == part


def test_the_crd_chart_upgrades_an_earlier_crd_keeping_new_status_fields_and_old_resources(
        control_plane: ControlPlane) -> None:
    previous = in_test_group(yaml.safe_load(PREVIOUS.read_text()))
    (current,) = [in_test_group(obj) for obj in rendered_crd_chart()]
    name = current["metadata"]["name"]
    with control_plane.client() as client:
        extensions = kubernetes.client.ApiextensionsV1Api(client)
        custom = kubernetes.client.CustomObjectsApi(client)
        core = kubernetes.client.CoreV1Api(client)
        core.create_namespace({"metadata": {"name": NAMESPACE}})
        try:
            install_crds(client, [previous], control_plane.processes)
            body = example("made-before") | {"apiVersion": f"{GROUP}/{names.VERSION}"}
            body["metadata"]["namespace"] = NAMESPACE
            made = custom.create_namespaced_custom_object(GROUP, names.VERSION, NAMESPACE, names.PLURAL, body)
            assert written_status(custom, "made-before") == {"stableRevision": "5e75eae315"}  # stableModel pruned

            live = extensions.read_custom_resource_definition(name)
            current["metadata"]["resourceVersion"] = live.metadata.resource_version
            extensions.replace_custom_resource_definition(name, current)  # the rendered template, applied whole
            kept = wait_until(lambda: written_status(custom, "made-before") == NEW_STATUS,
                              "the upgraded schema to keep status.stableModel", control_plane.processes, timeout=30)
            assert kept
            served = custom.get_namespaced_custom_object(GROUP, names.VERSION, NAMESPACE, names.PLURAL, "made-before")
            assert contains(served["spec"], made["spec"])  # as made, with the new version's defaults added
            assert served["status"]["stableModel"] == NEW_STATUS["stableModel"]
        finally:
            extensions.delete_custom_resource_definition(name)
            core.delete_namespace(NAMESPACE)
