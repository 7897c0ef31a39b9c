"""Admission on the real control plane (issue 19, items 1, 6 and 7), driven through the official
``kubernetes`` client: the API server calls the operator's webhook itself and its refusals and
warnings reach the client; the chart's CRD keeps unknown fields, so the webhook sees a typo that
the server would otherwise prune; ``/scale``, metadata-only updates and deletion are never
refused; a child the API server refuses shows in the resource's status.

The emulator tier has the rule tables (test_operator_resolve.py, test_operator_webhook.py); here
each rule appears once, to show that the refusal travels through a real API server.
"""
from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import kubernetes
import pytest
from operator_harness import NS, example
from realk8s_cluster import RealCluster, Workloads
from realk8s_operator import Release

from specdecode.operator import names
from specdecode.operator.settings import KOPF_PREFIX
from specdecode.operator.resolve import resolve

pytestmark = [pytest.mark.realk8s, pytest.mark.timeout(180, func_only=True)]

WEBHOOK = "validate.specdecodedeployments.specdecode.io"
DENIED = f'admission webhook "{WEBHOOK}" denied the request: '
SDD = (names.GROUP, names.VERSION, NS, names.PLURAL)
FINALIZER = f"{KOPF_PREFIX}/finalizer"
UNKNOWN = "unknown field; remove it (field names are camelCase)"
UNADMITTED = "tests.specdecode.io/unadmitted"  # a label the webhook's objectSelector skips, while it does
APPLY_PATCH = "application/apply-patch+yaml"
Obj = dict[str, Any]


def longest(prefix: str) -> str:
    """A resource name as long as admission allows."""
    return prefix.ljust(names.MAX_RESOURCE_NAME_LENGTH, "x")


def refusal(call: Callable[[], Any]) -> str:
    """The message of the 422 with which the API server answers ``call``."""
    with pytest.raises(kubernetes.client.ApiException) as refused:
        call()
    assert refused.value.status == 422, refused.value.body
    return json.loads(refused.value.body)["message"]


def warnings(headers: Mapping[str, str] | None) -> list[str]:
    """The texts of an answer's ``Warning`` headers (``299 - "text"``, the text quoted as Go quotes it)."""
    value = (headers or {}).get("Warning", "")
    return [json.loads(f'"{text}"') for text in re.findall(r'\d{3} \S+ "((?:[^"\\]|\\.)*)"', value)]


def scale(cluster: RealCluster, name: str, replicas: int) -> None:
    """What ``kubectl scale`` and a HorizontalPodAutoscaler do: write the ``/scale`` subresource."""
    cluster.custom.patch_namespaced_custom_object_scale(*SDD, name, {"spec": {"replicas": replicas}})


def annotate(cluster: RealCluster, name: str, key: str) -> list[str]:
    """Set a command annotation (a metadata-only UPDATE); the warnings the client got."""
    _, _, headers = cluster.custom.patch_namespaced_custom_object_with_http_info(
        *SDD, name, {"metadata": {"annotations": {key: "true"}}})
    return warnings(headers)


def delete(cluster: RealCluster, name: str) -> None:
    cluster.custom.delete_namespaced_custom_object(*SDD, name)


def start_canary(cluster: RealCluster, name: str) -> None:
    """Change what the pods run and wait for the canary; kopf then puts its finalizer on ``name``
    (to stop the analysis daemon first), so that deleting it needs an UPDATE the webhook sees."""
    cluster.patch(name, {"spec": {"speculative": {"numSpeculativeTokens": 3}}})
    cluster.until(lambda: cluster.status(name).get("canaryRevision"), f"a canary of {name}")
    cluster.until(lambda: FINALIZER in (cluster.get(name)["metadata"].get("finalizers") or []),
                  f"kopf's finalizer on {name}")


def ready(cluster: RealCluster, name: str) -> None:
    cluster.until(lambda: cluster.condition(name, "Ready").get("status") == "True", f"{name} Ready=True")


# -- item 1: validity does not depend on replicas; metadata-only updates are never refused ---------


def test_scale_then_annotate_then_delete(cluster: RealCluster, workloads: Workloads) -> None:
    """A name at the limit, scaled through /scale (no admission) to the CRD's maximum, which the
    server enforces on /scale too, stays valid (under the old rule a name's limit shrank as replicas
    grew: scaling made a valid resource invalid). So during a rollout the pause annotation gets
    through the webhook, and so does kopf's finalizer removal on delete; the children are collected."""
    name = longest("ad-scaled")
    workloads.ready.add(name)
    cluster.create(example(name))
    ready(cluster, name)

    above = names.MAX_REPLICAS + 1  # refused by the API server's own schema check: /scale skips the webhook
    assert refusal(lambda: scale(cluster, name, above)).endswith(
        f"spec.replicas: Invalid value: {above}: spec.replicas in body should be less than or equal to "
        f"{names.MAX_REPLICAS}")
    scale(cluster, name, names.MAX_REPLICAS)
    assert resolve(cluster.get(name)).allowed
    cluster.settled(name)
    (deployment,) = cluster.deployments(name).values()
    assert deployment.spec.replicas == names.MAX_REPLICAS

    start_canary(cluster, name)
    assert annotate(cluster, name, names.ANNOTATION_PAUSE) == []
    assert cluster.get(name)["metadata"]["annotations"][names.ANNOTATION_PAUSE] == "true"
    delete(cluster, name)
    cluster.until(lambda: cluster.gone(name), "the resource gone (kopf's finalizer removed through the webhook)")
    cluster.until(lambda: not cluster.children(name), "the garbage collector to delete the children")


@contextmanager
def webhook_skipping_unadmitted(cluster: RealCluster, release: Release, probe: Obj) -> Iterator[None]:
    """While inside: the webhook is not called for objects labelled ``UNADMITTED`` (an
    objectSelector), as for an object stored before an upgrade added a rule. ``probe`` (a new
    object so labelled, invalid) tells when the API server's view of the configuration changed."""
    config = release.only("ValidatingWebhookConfiguration")["metadata"]["name"]
    admission = kubernetes.client.AdmissionregistrationV1Api(cluster.custom.api_client)

    def select(selector: Obj) -> None:
        admission.patch_validating_webhook_configuration(
            config, [{"op": "add", "path": "/webhooks/0/objectSelector", "value": selector}],
            _content_type="application/json-patch+json")

    def probe_admitted() -> bool:
        try:
            cluster.custom.create_namespaced_custom_object(*SDD, probe, dry_run="All")
        except kubernetes.client.ApiException as exc:
            if exc.status != 422:
                raise
            return False
        return True

    select({"matchExpressions": [{"key": UNADMITTED, "operator": "DoesNotExist"}]})
    try:
        cluster.until(probe_admitted, "the webhook skipping unadmitted objects")
        yield
    finally:
        select({})
        cluster.until(lambda: not probe_admitted(), "the webhook called for every object again")


def test_a_resource_stored_without_admission_takes_metadata_updates_and_its_deletion(
        cluster: RealCluster, workloads: Workloads, release: Release) -> None:
    """A typo'd field written while the webhook was not consulted is kept (the CRD preserves unknown
    fields) and the operator reports it; afterwards an annotation gets in with the refusal as a
    warning the client sees, a change of spec is refused, and deletion during the rollout (kopf's
    finalizer removal) goes through."""
    name = "ad-unadmitted"
    workloads.ready.add(name)
    body = example(name)
    body["metadata"]["labels"] = {UNADMITTED: "true"}
    cluster.create(body)
    ready(cluster, name)
    start_canary(cluster, name)

    probe = example("ad-unadmitted-probe")
    probe["metadata"]["labels"] = {UNADMITTED: "true"}
    probe["spec"]["replica"] = 3
    with webhook_skipping_unadmitted(cluster, release, probe):
        cluster.patch(name, {"spec": {"replica": 3}})
    assert cluster.get(name)["spec"]["replica"] == 3  # not pruned
    expected = f"spec.replica: {UNKNOWN}"
    invalid = cluster.until(lambda: (c := cluster.condition(name, "Ready")).get("reason") == "InvalidSpec" and c,
                            "Ready=False, reason InvalidSpec")
    assert expected in invalid["message"]

    (warning,) = annotate(cluster, name, names.ANNOTATION_PAUSE)
    assert expected in warning and warning.endswith("(allowed: this update leaves spec as it was)")
    assert expected in refusal(lambda: cluster.patch(name, {"spec": {"replicas": 1}}))
    delete(cluster, name)
    cluster.until(lambda: cluster.gone(name), "the resource gone (kopf's finalizer removed through the webhook)")
    cluster.until(lambda: not cluster.children(name), "the garbage collector to delete the children")


# -- item 6: a child the API server refuses --------------------------------------------------------


def test_a_child_the_api_server_refuses_shows_in_status_until_fixed(cluster: RealCluster,
                                                                    workloads: Workloads) -> None:
    """A toleration with operator Exists and a value fits Kubernetes' schema, which admission checks,
    but the API server's own validation of the Deployment refuses it: Ready=False, reason
    ChildRefused, with the server's message (and an Event), until the spec is fixed."""
    name = "ad-refused"
    workloads.ready.add(name)
    body = example(name)
    toleration = {"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}
    body["spec"]["pod"] = {"tolerations": [{**toleration, "value": "yes"}]}
    assert resolve(body).allowed
    cluster.create(body)

    refused = cluster.until(lambda: (c := cluster.condition(name, "Ready")).get("reason") == "ChildRefused" and c,
                            "Ready=False, reason ChildRefused")
    workload = names.workload_name(name, cluster.status(name)["stableRevision"])
    assert refused["status"] == "False"
    assert refused["message"].startswith(f'Deployment {workload}: Deployment.apps "{workload}" is invalid: '
                                         "spec.template.spec.tolerations[0].operator: Invalid value: ")
    assert refused["message"].endswith("value must be empty when `operator` is 'Exists'")  # the API server's words
    cluster.until(lambda: ("Warning", "ChildRefused", refused["message"]) in cluster.events(name),
                  "a ChildRefused Event")
    assert not cluster.children(name)  # every write is dry-run first: none is made while one is refused

    cluster.patch(name, {"spec": {"pod": {"tolerations": [toleration]}}})
    ready(cluster, name)
    (deployment,) = cluster.deployments(name).values()
    (applied,) = deployment.spec.template.spec.tolerations
    assert (applied.key, applied.operator, applied.value) == ("gpu", "Exists", None)
    cluster.settled(name)


# -- item 7: strict admission, through the API server ----------------------------------------------


def with_pod(**pod: Any) -> Callable[[Obj], None]:
    return lambda spec: spec.update(pod=pod)


REFUSALS = {
    "a GPU count in resources": (
        lambda spec: spec["resources"]["limits"].update({"nvidia.com/gpu": 1}),
        "spec.resources.limits[nvidia.com/gpu]: set from spec.resources.gpusPerPod"),
    "an abbreviated flag": (
        lambda spec: spec.update(extraArgs=["--tensor-parallel", "2"]),
        "spec.extraArgs[0]: --tensor-parallel is no `specdecode serve` flag (abbreviations are not accepted)"),
    "an unknown flag": (
        lambda spec: spec.update(extraArgs=["--gpu-memory-utilization", "0.9"]),
        "spec.extraArgs[0]: --gpu-memory-utilization is no `specdecode serve` flag"),
    "a toleration of the wrong type": (
        with_pod(tolerations=[{"key": "gpu", "operator": "Exists", "tolerationSeconds": "soon"}]),
        'spec.pod.tolerations[0].tolerationSeconds: must be integer, not "soon"'),
    "an env entry without a name": (with_pod(env=[{"value": "1"}]), "spec.pod.env[0].name: required"),
    "an env entry with a bad valueFrom": (
        with_pod(env=[{"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf"}}}]),
        "spec.pod.env[0].valueFrom.secretKeyRef.key: required"),
    "a volume with an unknown source": (
        with_pod(volumes=[{"name": "weights", "nfsv4": {"server": "nfs", "path": "/weights"}}]),
        f"spec.pod.volumes[0].nfsv4: {UNKNOWN}"),
    "a bad quantity": (
        lambda spec: spec["resources"]["limits"].update({"memory": "4GB"}),
        "spec.resources.limits.memory: '4GB' is not a Kubernetes quantity"),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_the_api_server_refuses_through_the_webhook_naming_the_field(cluster: RealCluster, case: str) -> None:
    """GPUs from ``resources``, ``extraArgs`` the runtime's strict parser refuses, pod fields against
    Kubernetes' own schemas, quantities: the API server answers 422 with the webhook's message, and
    nothing is stored."""
    change, expected = REFUSALS[case]
    name = "ad-" + case.lower().replace(" ", "-")[:30].strip("-")
    body = example(name)
    change(body["spec"])
    message = refusal(lambda: cluster.create(body))
    assert message.startswith(DENIED) and expected in message
    assert cluster.gone(name)


@pytest.mark.parametrize("field_validation", [None, "Strict"], ids=["plain client", "strict client"])
@pytest.mark.parametrize(("typo", "path"), [
    (lambda spec: spec.update(replica=2), "spec.replica"),
    (lambda spec: spec["speculative"].update(methd="mtp"), "spec.speculative.methd"),
], ids=["replica", "speculative.methd"])
def test_a_typoed_field_is_refused_for_every_client(cluster: RealCluster, typo: Callable[[Obj], None], path: str,
                                                    field_validation: str | None) -> None:
    """Helm, Argo CD and Flux create without asking for strict field validation (and before 1.25 no
    server offers it: 1.20 ignores the parameter): the CRD preserves unknown fields, so the server
    neither prunes the typo nor refuses it itself, and the webhook refuses it for every client."""
    body = example("ad-typo")
    typo(body["spec"])
    options = {"field_validation": field_validation} if field_validation else {}
    message = refusal(lambda: cluster.custom.create_namespaced_custom_object(*SDD, body, **options))
    assert message.startswith(DENIED) and f"{path}: {UNKNOWN}" in message
    assert cluster.gone("ad-typo")


def test_a_typoed_field_is_refused_for_a_server_side_apply(cluster: RealCluster) -> None:
    """Argo CD and Flux apply server-side (application/apply-patch+yaml): the webhook refuses a
    typo'd field whether the apply creates the resource or changes it."""
    name = "ad-applied"

    def apply(body: Obj) -> None:
        cluster.custom.patch_namespaced_custom_object(*SDD, name, body, field_manager="argocd-controller",
                                                      _content_type=APPLY_PATCH)

    typoed = example(name)
    typoed["spec"]["replica"] = 2
    message = refusal(lambda: apply(typoed))
    assert message.startswith(DENIED) and f"spec.replica: {UNKNOWN}" in message
    assert cluster.gone(name)
    apply(example(name))
    typoed["spec"]["replicas"] = 3
    message = refusal(lambda: apply(typoed))
    assert message.startswith(DENIED) and f"spec.replica: {UNKNOWN}" in message
    assert "replica" not in cluster.get(name)["spec"] and cluster.get(name)["spec"]["replicas"] == 2
    delete(cluster, name)
    cluster.until(lambda: cluster.gone(name), f"{name} deleted")


def test_a_label_that_collides_with_ours_is_allowed_with_a_warning_the_client_sees(cluster: RealCluster) -> None:
    """The API server passes the webhook's warnings on as ``Warning`` headers (1.19+)."""
    name = "ad-labelled"
    body = example(name)
    body["spec"]["pod"] = {"labels": {names.LABEL_COMPONENT: "llm", "team": "ml"}}
    (expected,) = resolve(body).warnings
    _, status, headers = cluster.custom.create_namespaced_custom_object_with_http_info(*SDD, body)
    assert status == 201 and warnings(headers) == [expected]
    assert expected.startswith(f"spec.pod.labels[{names.LABEL_COMPONENT}]: every runtime pod gets this label")
    delete(cluster, name)
    cluster.until(lambda: cluster.gone(name), f"{name} deleted")
