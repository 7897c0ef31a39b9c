"""What the operator writes to the cluster, end to end against the emulated API server
(kube_emulator.py, with field ownership and server-side apply as kube_fields.py models them):

- children applied under one field manager, so a field no longer rendered disappears, also from
  children an earlier operator version wrote with creates and merge patches (their fields are
  handed over first), while another manager's fields stay;
- the multi-pod workload kind chosen once: LeaderWorkerSet registered mid-life starts no canary
  and leaves the traffic Service alone; the workload-kind annotation changes it through a rollout;
- a child the API server refuses (here a field newer than the emulated 1.30 server) in status;
- every write dry-run first: a denied or failed write (a policy webhook, one that is down)
  changes nothing, shows in status, and is retried until admitted;
- watches the API server filters by label.
"""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kmock
import kopf
import kubernetes
import pytest
from operator_harness import (
    NS,
    Cluster,
    crd_of,
    emulated_cluster,
    example,
    healthy,
    running_stable,
    start_canary,
    wait_for,
)

from specdecode.operator import controller, names
from specdecode.operator.settings import RUNTIME_POD_LABELS, WORKLOAD_LABELS
from specdecode.operator.kube import MERGE_PATCH
from specdecode.operator.render import render, revision
from specdecode.operator.resolve import resolve

pytestmark = pytest.mark.timeout(120)

NAME = "smollm2-ngram"
LWS_CRD = crd_of("leaderworkerset.x-k8s.io", "v1", "LeaderWorkerSet", "leaderworkersets")


@pytest.fixture
def cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Cluster]:
    with emulated_cluster(tmp_path, monkeypatch) as running:
        yield running


def service(cluster: Cluster) -> Any:
    return cluster.core.read_namespaced_service(names.service_name(NAME), NS)


def workloads(cluster: Cluster, plural: str) -> list[dict[str, Any]]:
    group, version = ("leaderworkerset.x-k8s.io", "v1") if plural == "leaderworkersets" else ("apps", "v1")
    listed = cluster.custom.list_namespaced_custom_object(group, version, NS, plural,
                                                          label_selector=f"{names.LABEL_INSTANCE}={NAME}")
    return listed["items"]


def test_children_an_earlier_version_merge_patched_lose_what_is_no_longer_rendered(cluster: Cluster) -> None:
    """The earlier version created the children and merge-patched them (fields owned by the
    kubernetes client's default manager, operation Update); this one hands those fields to its
    own apply, so what it no longer renders goes and what another manager set stays."""
    cluster.stop_operator()
    body = example()
    body["spec"]["service"] = {"annotations": {"keep": "1"}}
    cluster.create(body)
    owner = cluster.get(NAME)
    r = resolve(owner).resolved
    # the earlier version's client: the kubernetes client's default User-Agent, no fieldManager
    earlier = kubernetes.client.ApiClient(cluster.core.api_client.configuration)
    core, custom = kubernetes.client.CoreV1Api(earlier), kubernetes.client.CustomObjectsApi(earlier)
    for child in render(r):
        kopf.adopt(child, owner=owner)
        if child["kind"] == "Service":
            core.create_namespaced_service(NS, child)
        else:
            custom.create_namespaced_custom_object("apps", "v1", NS, "deployments", child)
    # what the earlier version's spec rendered then: an annotation, a label, a selector key
    core.patch_namespaced_service(NAME, NS, {"metadata": {"annotations": {"gone": "x"}, "labels": {"gone": "x"}},
                                             "spec": {"selector": {"gone": "x"}}}, _content_type=MERGE_PATCH)
    cluster.core.patch_namespaced_service(NAME, NS, {"metadata": {"annotations": {"team": "ml"}}},
                                          field_manager="kubectl-annotate", _content_type=MERGE_PATCH)
    rev = revision(r)
    cluster.custom.patch_namespaced_custom_object_status(names.GROUP, names.VERSION, NS, names.PLURAL, NAME,
                                                         {"status": {"stableRevision": rev}})
    legacy = {(m.manager, m.operation) for m in service(cluster).metadata.managed_fields}
    assert legacy == {("OpenAPI-Generator", "Update"), ("kubectl-annotate", "Update")}

    cluster.start_operator()
    wait_for(lambda: "gone" not in (service(cluster).metadata.annotations or {}), "the stale annotation removed")
    migrated = service(cluster)
    assert migrated.spec.selector == names.selector_labels(NAME) and "gone" not in migrated.metadata.labels
    assert {k: migrated.metadata.annotations[k] for k in ("keep", "team")} == {"keep": "1", "team": "ml"}
    assert {(m.manager, m.operation) for m in migrated.metadata.managed_fields} == {
        (names.MANAGER, "Apply"), ("kubectl-annotate", "Update")}
    status = wait_for(lambda: (s := cluster.status(NAME)).get("workloadKind") and s, "the status of the pass")
    assert status["stableRevision"] == rev and "canaryRevision" not in status and status["workloadKind"] == "Deployment"

    cluster.patch(NAME, {"spec": {"service": {"annotations": None}}})  # removed from the spec: removed from the Service
    wait_for(lambda: "keep" not in service(cluster).metadata.annotations, "the annotation removed with the spec's")
    assert service(cluster).metadata.annotations["team"] == "ml"


def test_leader_worker_set_registered_mid_life_changes_nothing_until_asked_for(cluster: Cluster) -> None:
    assert cluster.server is not None
    stable = running_stable(cluster, parallelism={"pipeline": 2})
    assert cluster.status(NAME)["workloadKind"] == "StatefulSet"
    selector = service(cluster).spec.selector
    assert selector[names.LABEL_STS_POD_INDEX] == "0"

    cluster.server.install_crd(LWS_CRD)
    cluster.stop_operator()
    cluster.start_operator()  # its discovery sees LeaderWorkerSet from the start
    running_stable(cluster, "fresh", parallelism={"pipeline": 2})
    assert cluster.status("fresh")["workloadKind"] == "LeaderWorkerSet"  # a new resource gets it
    cluster.patch(NAME, {"spec": {"replicas": 3}})
    wait_for(lambda: cluster.status(NAME).get("replicas") == 3, "the running resource reconciled")
    status = cluster.status(NAME)
    assert status["stableRevision"] == stable and "canaryRevision" not in status
    assert status["workloadKind"] == "StatefulSet" and service(cluster).spec.selector == selector
    assert len(workloads(cluster, "statefulsets")) == 3 and workloads(cluster, "leaderworkersets") == []

    # asked for: a rollout; the traffic Service keeps selecting the running leaders until promotion
    cluster.patch(NAME, {"metadata": {"annotations": {names.ANNOTATION_WORKLOAD_KIND: "LeaderWorkerSet"}}})
    canary = wait_for(lambda: cluster.status(NAME).get("canaryRevision"), "a canary of the other kind")
    (lws,) = wait_for(lambda: workloads(cluster, "leaderworkersets"), "the canary's LeaderWorkerSet")
    assert lws["metadata"]["name"] == names.workload_name(NAME, canary)
    assert service(cluster).spec.selector == selector and cluster.status(NAME)["workloadKind"] == "StatefulSet"

    cluster.patch(NAME, {"metadata": {"annotations": {names.ANNOTATION_PROMOTE: "true"}}})
    wait_for(lambda: cluster.status(NAME).get("stableRevision") == canary, "the LeaderWorkerSet promoted")
    assert cluster.status(NAME)["workloadKind"] == "LeaderWorkerSet"
    wait_for(lambda: workloads(cluster, "statefulsets") == [], "the StatefulSet groups removed")
    assert service(cluster).spec.selector == {**names.selector_labels(NAME), names.LABEL_LWS_WORKER_INDEX: "0"}


def test_leader_worker_sets_kopf_never_watches_still_become_ready(cluster: Cluster) -> None:
    """The LeaderWorkerSet API installed mid-life where kopf's discovery never lists it (as when the
    CRD's event came before discovery listed the group), so kopf never watches LeaderWorkerSets: a
    new resource still gets them (the operator's own discovery looks again) and turns Ready, noticed
    by the resync timer since no LeaderWorkerSet event ever reaches the operator."""
    assert cluster.server is not None
    cluster.server.hidden_from_kopf.add("leaderworkerset.x-k8s.io")
    cluster.server.install_crd(LWS_CRD)
    running_stable(cluster, "fresh", parallelism={"pipeline": 2})
    assert cluster.status("fresh")["workloadKind"] == "LeaderWorkerSet"
    watched = {str(r.resource) for r in cluster.server if r.action == kmock.action.WATCH and r.resource is not None}
    assert str(kmock.resource("leaderworkerset.x-k8s.io/v1/leaderworkersets")) not in watched


def test_a_child_the_api_server_refuses_shows_in_status_until_fixed(cluster: Cluster) -> None:
    """An image volume (Kubernetes 1.31+) passes admission, which knows the newest schema; the
    emulated 1.30 API server refuses the Deployment that carries it."""
    stable = running_stable(cluster)
    volume = {"name": "weights", "image": {"reference": "registry.example.com/weights:1", "pullPolicy": "IfNotPresent"}}
    cluster.patch(NAME, {"spec": {"pod": {"volumes": [volume]}}})
    ready = wait_for(lambda: (c := cluster.condition(NAME, "Ready")).get("reason") == "ChildRefused" and c,
                     "Ready=False, reason ChildRefused")
    canary = cluster.status(NAME)["canaryRevision"]
    assert ready["status"] == "False"
    assert ready["message"].startswith(f"Deployment {names.workload_name(NAME, canary)}: Deployment.apps")
    assert "'image' was unexpected" in ready["message"]  # the API server's own words
    wait_for(lambda: ("Warning", "ChildRefused", ready["message"]) in cluster.events(NAME), "a ChildRefused Event")
    assert healthy(cluster.liveness_url)
    assert set(cluster.deployments(NAME)) == {names.workload_name(NAME, stable)}  # the stable revision serves on

    cluster.patch(NAME, {"spec": {"pod": {"volumes": None}}})  # fixed: back to the stable revision
    wait_for(lambda: cluster.condition(NAME, "Ready").get("status") == "True", "Ready=True once fixed")
    assert "canaryRevision" not in cluster.status(NAME)
    wait_for(lambda: cluster.deployments(NAME)[names.workload_name(NAME, stable)].spec.replicas == 2,
             "every replica on the stable revision again")


# A policy engine's answer (Gatekeeper, Kyverno: a validating webhook that denies), as the API server
# words it (k8s.io/apiserver/pkg/admission/plugin/webhook/errors: "admission webhook %q denied the
# request: %s"), and a webhook that is down (its "failed calling webhook" Internal error).
DENIED = 'admission webhook "validation.gatekeeper.sh" denied the request: [no-canary] canaries need a ticket'
WEBHOOK_DOWN = ('Internal error occurred: failed calling webhook "validation.gatekeeper.sh": failed to call '
                'webhook: Post "https://gatekeeper-webhook-service.gatekeeper-system.svc:443/v1/admit": '
                "dial tcp 10.96.0.12:443: connect: connection refused")


def test_a_denied_write_changes_nothing_and_shows_in_status_until_admitted(
        cluster: Cluster, monkeypatch: pytest.MonkeyPatch) -> None:
    """A policy denies the canary's Deployment. With maxSurge 0 the pass would scale the stable
    down before applying the canary; every write is dry-run first, so nothing is written: the
    stable keeps both replicas, Ready=False with ChildRefused and the webhook's words (and an
    Event). A webhook that is down is ApplyFailed. Retried with backoff, the rollout goes on once
    the writes are admitted."""
    monkeypatch.setattr(controller, "RETRY_FIRST_SECONDS", 0.2)
    monkeypatch.setattr(controller, "RETRY_MAX_SECONDS", 1.0)
    assert cluster.server is not None
    stable = running_stable(cluster, rollout={**example()["spec"]["rollout"], "maxSurge": 0})
    stable_workload = names.workload_name(NAME, stable)
    answer = {"error": kmock.KubernetesError(status=403, reason="Forbidden", message=DENIED)}

    def policy(request: kmock.Request) -> None:
        deployment = request.resource == kmock.resource("apps/v1/deployments")
        named = request.name or (request.data or {}).get("metadata", {}).get("name")
        if deployment and named != stable_workload and answer["error"] is not None:
            raise answer["error"]

    cluster.server.admission.append(policy)
    canary = start_canary(cluster)
    refused = wait_for(lambda: (c := cluster.condition(NAME, "Ready")).get("reason") == "ChildRefused" and c,
                       "Ready=False, reason ChildRefused")
    assert refused["message"] == f"Deployment {names.workload_name(NAME, canary)}: {DENIED}"
    wait_for(lambda: ("Warning", "ChildRefused", refused["message"]) in cluster.events(NAME), "a ChildRefused Event")
    assert set(cluster.deployments(NAME)) == {stable_workload}
    assert cluster.deployments(NAME)[stable_workload].spec.replicas == 2  # not scaled down for a canary that never came
    assert healthy(cluster.liveness_url)

    answer["error"] = kmock.KubernetesError(status=500, reason="InternalError", message=WEBHOOK_DOWN)
    failed = wait_for(lambda: (c := cluster.condition(NAME, "Ready")).get("reason") == "ApplyFailed" and c,
                      "Ready=False, reason ApplyFailed")
    assert failed["message"] == f"Deployment {names.workload_name(NAME, canary)}: {WEBHOOK_DOWN}"
    assert cluster.deployments(NAME)[stable_workload].spec.replicas == 2

    answer["error"] = None
    wait_for(lambda: names.workload_name(NAME, canary) in cluster.deployments(NAME), "the canary's Deployment")
    wait_for(lambda: cluster.condition(NAME, "Ready").get("reason") not in ("ChildRefused", "ApplyFailed"),
             "Ready no longer about the writes")


def test_the_emulator_stores_nothing_for_a_dry_run(cluster: Cluster) -> None:
    """``dryRun=All`` answers as the write would (a refusal included) and stores nothing."""
    cluster.stop_operator()
    body = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "dry", "namespace": NS},
            "spec": {"ports": [{"port": 80}]}}
    applied = cluster.core.patch_namespaced_service("dry", NS, body, field_manager="t", dry_run="All",
                                                    _content_type="application/apply-patch+yaml")
    assert applied.metadata.name == "dry"
    with pytest.raises(kubernetes.client.ApiException) as missing:
        cluster.core.read_namespaced_service("dry", NS)
    assert missing.value.status == 404
    cluster.core.create_namespaced_service(NS, body)
    cluster.core.patch_namespaced_service("dry", NS, {"metadata": {"labels": {"a": "b"}}}, dry_run="All")
    cluster.core.delete_namespaced_service("dry", NS, dry_run="All")
    assert not cluster.core.read_namespaced_service("dry", NS).metadata.labels
    with pytest.raises(kubernetes.client.ApiException) as invalid:
        cluster.core.patch_namespaced_service("dry", NS, {"spec": {"ports": [{"port": "eighty"}]}}, dry_run="All")
    assert invalid.value.status == 422


def test_the_api_server_filters_the_watches_by_label(cluster: Cluster) -> None:
    assert cluster.server is not None
    running_stable(cluster)
    asked = {(str(r.resource), r.params.get("labelSelector")) for r in cluster.server
             if r.action == kmock.action.WATCH and r.resource is not None}
    assert (str(kmock.resource("apps/v1/deployments")), names.label_selector(WORKLOAD_LABELS)) in asked
    assert (str(kmock.resource("apps/v1/statefulsets")), names.label_selector(WORKLOAD_LABELS)) in asked
    assert (str(kmock.resource("v1/pods")), names.label_selector(RUNTIME_POD_LABELS)) in asked
