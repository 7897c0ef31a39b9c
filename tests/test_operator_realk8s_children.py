"""What the operator writes to its children, on the real control plane (issue 19 items 2 and 3;
issue 30 item 5):

- children applied under one field manager: a field removed from the spec disappears from them,
  also from children an earlier operator version created and merge-patched (their fields are
  handed over to our apply first), while another manager's fields stay;
- the multi-pod workload kind chosen once: the LeaderWorkerSet API registered mid-life starts no
  canary and never moves the traffic Service off the running pods; the workload-kind annotation
  changes it through a rollout; a LeaderWorkerSet canary rolled back is deleted;
- quantities the API server writes back in its own spelling are not applied again.

No LeaderWorkerSet controller runs: ``LeaderWorkerSets`` reports their groups ready, as the
``workloads`` stand-in does for Deployments and StatefulSets.
"""
from __future__ import annotations

import threading
import urllib.parse
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from typing import Any

import kopf
import kubernetes
import pytest
from operator_harness import NS, HttpStandIn, RuntimeStandIn, example, start_canary
from realk8s import install_crds, other_project_crd
from realk8s_cluster import RealCluster, Workloads
from realk8s_operator import Release, hand_lease

from specdecode.operator import kube, names
from specdecode.operator.kube import MERGE_PATCH
from specdecode.operator.render import render, revision
from specdecode.operator.resolve import resolve

pytestmark = [pytest.mark.realk8s, pytest.mark.timeout(180, func_only=True)]

Obj = dict[str, Any]
LWS = kube.LEADER_WORKER_SET
# The kubernetes client's User-Agent is OpenAPI-Generator/<version>/python, and the API server
# names a writer that sends no fieldManager after its User-Agent's product: how an earlier operator
# version's writes show. The tests name that manager explicitly, so that the audit log still tells
# their requests (their own User-Agent) from the operator's.
KUBERNETES_CLIENT = "OpenAPI-Generator"
OTHER_MANAGER = "kubectl-annotate"  # a user's `kubectl annotate`
EARLIER_PEER = "specdecode-operator-earlier-version"
ROLLOUT_SECONDS = 120  # a rollout's waits, on a busy 2-core machine
DISCOVERY_MARGIN_SECONDS = 5


def service(cluster: RealCluster, name: str) -> Any:
    return cluster.core.read_namespaced_service(names.service_name(name), NS)


def annotations(cluster: RealCluster, name: str) -> dict[str, str]:
    """The traffic Service's annotations; none before it exists."""
    try:
        return service(cluster, name).metadata.annotations or {}
    except kubernetes.client.ApiException as exc:
        if exc.status == 404:
            return {}
        raise


def managers(obj: Any) -> set[tuple[str, str]]:
    return {(m.manager, m.operation) for m in obj.metadata.managed_fields}


# -- item 3: what the spec no longer says goes ----------------------------------------------------


def test_a_field_removed_from_the_spec_disappears_from_the_children(cluster: RealCluster) -> None:
    body = example("ch-removed")
    body["spec"]["service"] = {"annotations": {"keep": "1", "drop": "2"}}
    cluster.create(body)
    cluster.until(lambda: annotations(cluster, "ch-removed").get("drop") == "2", "the Service")
    cluster.core.patch_namespaced_service("ch-removed", NS, {"metadata": {"annotations": {"team": "ml"}}},
                                          field_manager=OTHER_MANAGER, _content_type=MERGE_PATCH)

    cluster.patch("ch-removed", {"spec": {"service": {"annotations": {"drop": None}}}})
    cluster.until(lambda: "drop" not in annotations(cluster, "ch-removed"),
                  "the annotation removed with the spec's")
    assert {k: annotations(cluster, "ch-removed").get(k) for k in ("keep", "team")} == {"keep": "1", "team": "ml"}
    cluster.settled("ch-removed")


# -- issue 30 item 5: quantities come back in the API server's spelling --------------------------


def test_quantities_the_api_server_respells_are_not_applied_again(cluster: RealCluster) -> None:
    """The API server stores ``1024Mi`` as ``1Gi`` and ``0.5`` as ``500m``: reconciling an
    unchanged spec again writes nothing to the children (their writes counted in the audit log)."""
    body = example("ch-quantities")
    body["spec"]["resources"] = {"gpusPerPod": 0, "requests": {"cpu": "0.5", "memory": "1024Mi"},
                                 "limits": {"memory": "4096Mi"}, "shmSize": "2048Mi"}
    cluster.create(body)
    cluster.settled("ch-quantities")
    deployment = cluster.apps.read_namespaced_deployment(names.workload_name("ch-quantities", cluster.status(
        "ch-quantities")["stableRevision"]), NS)
    assert deployment.spec.template.spec.containers[0].resources.limits["memory"] == "4Gi"  # respelled

    def writes() -> list[str]:
        return [e["objectRef"]["resource"] for e in cluster.operator_requests()
                if e["verb"] in ("patch", "update", "create") and e["objectRef"].get("resource") != "events"
                and e["objectRef"].get("name", "").startswith("ch-quantities") and not e["objectRef"].get("subresource")]

    before = len(writes())
    for note in ("1", "2", "3"):  # three more reconciliations of the same spec
        cluster.patch("ch-quantities", {"metadata": {"annotations": {"note": note}}, "spec": {"replicas": 2}})
        cluster.until(lambda: cluster.get("ch-quantities")["metadata"]["annotations"].get("note") == note, "patched")
        cluster.settled("ch-quantities")
    again = writes()[before:]
    assert again.count("deployments") == 0 and again.count("services") == 0, again


@contextmanager
def earlier_version_active(cluster: RealCluster, release: Release) -> Iterator[None]:
    """An earlier operator version's replica holds the release's Lease (renewed for an hour), so
    ours stands by, as during an upgrade; on leaving, it releases the Lease (as on a clean exit)
    and ours takes over."""
    client = cluster.apps.api_client
    hand_lease(client, release, EARLIER_PEER)
    try:
        cluster.until(lambda: not cluster.operator.leading(), "the operator standing by")
        yield
    finally:
        hand_lease(client, release, None)
        cluster.until(cluster.operator.leading, "the operator leading again")


def write_as_earlier_version(cluster: RealCluster, name: str) -> str:
    """What an earlier operator version left: ``name``'s children created and then merge-patched
    without a field manager of its own (an annotation, a label and a selector key that this spec
    does not render), and the revision in status; that revision."""
    owner = cluster.get(name)
    r = resolve(owner).resolved
    assert r is not None
    served = cluster.plane.served()
    for child in render(r):
        kopf.adopt(child, owner=owner)
        kind = kube.kind_of(child)
        if kind is kube.SERVICE:
            cluster.core.create_namespaced_service(NS, child, field_manager=KUBERNETES_CLIENT)
        elif kind.api_version in served:  # 1.20 serves no policy/v1 (the PodDisruptionBudget)
            cluster.custom.create_namespaced_custom_object(kind.group, kind.version, NS, kind.plural, child,
                                                           field_manager=KUBERNETES_CLIENT)
    stale = {"metadata": {"annotations": {"gone": "x"}, "labels": {"gone": "x"}}, "spec": {"selector": {"gone": "x"}}}
    cluster.core.patch_namespaced_service(name, NS, stale, field_manager=KUBERNETES_CLIENT, _content_type=MERGE_PATCH)
    rev = revision(r)
    cluster.custom.patch_namespaced_custom_object_status(names.GROUP, names.VERSION, NS, names.PLURAL, name,
                                                         {"status": {"stableRevision": rev}})
    return rev


def test_children_an_earlier_version_merge_patched_lose_what_is_no_longer_rendered(
        cluster: RealCluster, release: Release) -> None:
    with kubernetes.client.ApiClient() as default_client:
        assert default_client.user_agent.startswith(f"{KUBERNETES_CLIENT}/")
    with earlier_version_active(cluster, release):
        body = example("ch-migrated")
        body["spec"]["service"] = {"annotations": {"keep": "1"}}
        cluster.create(body)
        rev = write_as_earlier_version(cluster, "ch-migrated")
        cluster.core.patch_namespaced_service("ch-migrated", NS, {"metadata": {"annotations": {"team": "ml"}}},
                                              field_manager=OTHER_MANAGER, _content_type=MERGE_PATCH)
        assert managers(service(cluster, "ch-migrated")) == {(KUBERNETES_CLIENT, "Update"), (OTHER_MANAGER, "Update")}
        assert "observedGeneration" not in cluster.status("ch-migrated")  # the operator stood by

    cluster.until(lambda: "gone" not in service(cluster, "ch-migrated").metadata.annotations,
                  "the stale annotation removed")
    migrated = service(cluster, "ch-migrated")
    assert migrated.spec.selector == names.selector_labels("ch-migrated") and "gone" not in migrated.metadata.labels
    assert {k: migrated.metadata.annotations.get(k) for k in ("keep", "team")} == {"keep": "1", "team": "ml"}
    assert managers(migrated) == {(names.MANAGER, "Apply"), (OTHER_MANAGER, "Update")}
    (deployment,) = cluster.deployments("ch-migrated").values()
    assert managers(deployment) == {(names.MANAGER, "Apply")}
    cluster.settled("ch-migrated")
    status = cluster.status("ch-migrated")
    assert status["stableRevision"] == rev and "canaryRevision" not in status and status["workloadKind"] == "Deployment"

    cluster.patch("ch-migrated", {"spec": {"service": {"annotations": None}}})
    cluster.until(lambda: "keep" not in service(cluster, "ch-migrated").metadata.annotations,
                  "the annotation removed with the spec's")
    assert service(cluster, "ch-migrated").metadata.annotations["team"] == "ml"
    cluster.settled("ch-migrated")


# -- item 2: the workload kind, chosen once -------------------------------------------------------


def leader_worker_set_crd() -> Obj:
    """LeaderWorkerSet's API as an open-schema stand-in, with its status subresource (as the real
    CRD has: the operator's applies never write status)."""
    crd = other_project_crd(LWS.group, LWS.version, LWS.kind, LWS.plural)
    crd["spec"]["versions"][0]["subresources"] = {"status": {}}
    return crd


def leader_worker_sets_served(cluster: RealCluster) -> bool:
    return LWS.api_version in cluster.plane.served()


class LeaderWorkerSets:
    """Stands in for LeaderWorkerSet's controller: the LeaderWorkerSets of ``name`` report every
    group ready (the status fields the controller writes; ``reconcile`` reads readyReplicas)."""

    def __init__(self, cluster: RealCluster, name: str) -> None:
        self.client = cluster.plane.client()
        self.custom = kubernetes.client.CustomObjectsApi(self.client)
        self.selector = f"{names.LABEL_INSTANCE}={name}"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.3):
            listed = self.custom.list_namespaced_custom_object(LWS.group, LWS.version, NS, LWS.plural,
                                                               label_selector=self.selector)
            for lws in listed["items"]:
                want = lws["spec"]["replicas"]
                if (lws.get("status") or {}).get("readyReplicas") != want:
                    self._report_ready(lws["metadata"]["name"], want)

    def _report_ready(self, name: str, replicas: int) -> None:
        available = {"type": "Available", "status": "True", "reason": "AllGroupsReady", "message": "",
                     "lastTransitionTime": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")}
        status = {"replicas": replicas, "readyReplicas": replicas, "updatedReplicas": replicas,
                  "conditions": [available]}
        try:
            self.custom.patch_namespaced_custom_object_status(LWS.group, LWS.version, NS, LWS.plural, name,
                                                              {"status": status})
        except kubernetes.client.ApiException as exc:
            if exc.status != 404:  # deleted since listed
                raise

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self.client.close()


@contextmanager
def leader_worker_sets_ready(cluster: RealCluster, name: str) -> Iterator[None]:
    stand_in = LeaderWorkerSets(cluster, name)
    try:
        yield
    finally:
        stand_in.stop()


class SelectorWatch:
    """Reads the traffic Service's selector, over and over, from a client of its own: every
    selector it had, in order (a change shows even if it is undone before the test looks)."""

    def __init__(self, cluster: RealCluster, name: str) -> None:
        self.client = cluster.plane.client()
        self.core = kubernetes.client.CoreV1Api(self.client)
        self.name = names.service_name(name)
        self.seen: list[dict[str, str]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            selector = self.core.read_namespaced_service(self.name, NS).spec.selector
            if not self.seen or self.seen[-1] != selector:
                self.seen.append(selector)

    def stop(self) -> list[dict[str, str]]:
        self._stop.set()
        self._thread.join(timeout=10)
        self.client.close()
        return self.seen


def outlast_the_operators_discovery(cluster: RealCluster) -> None:
    """Until the LeaderWorkerSet API has been established for longer than the operator waits before
    it looks for an API it lacked again (``kube.UNSERVED_RECHECK_SECONDS``, and a margin for the API
    server's own discovery), so that the operator's next reconciliation sees the API served."""
    api = kubernetes.client.ApiextensionsV1Api(cluster.apps.api_client)

    def established_long_enough() -> bool:
        crd = api.read_custom_resource_definition(f"{LWS.plural}.{LWS.group}")
        (established,) = [c for c in crd.status.conditions if c.type == "Established" and c.status == "True"]
        age = datetime.now(timezone.utc) - established.last_transition_time
        return age.total_seconds() > kube.UNSERVED_RECHECK_SECONDS + DISCOVERY_MARGIN_SECONDS

    cluster.until(established_long_enough, "the operator's discovery to expire", timeout=ROLLOUT_SECONDS)


def operator_listed_leader_worker_sets(cluster: RealCluster, name: str) -> bool:
    """Whether the operator's own client listed resource ``name``'s LeaderWorkerSets (its discovery
    found the API in a reconciliation of ``name``)."""
    def of_name(uri: str) -> bool:
        selector = urllib.parse.parse_qs(urllib.parse.urlsplit(uri).query).get("labelSelector", [""])[0]
        return f"{names.LABEL_INSTANCE}={name}" in selector.split(",")

    return any(e["verb"] == "list" and e["objectRef"].get("resource") == LWS.plural
               and e["userAgent"].startswith(f"{KUBERNETES_CLIENT}/") and e["responseStatus"]["code"] == 200
               and of_name(e["requestURI"]) for e in cluster.operator_requests())


def leader_worker_sets(cluster: RealCluster, name: str) -> set[str]:
    listed = cluster.custom.list_namespaced_custom_object(LWS.group, LWS.version, NS, LWS.plural,
                                                          label_selector=f"{names.LABEL_INSTANCE}={name}")
    return {lws["metadata"]["name"] for lws in listed["items"]}


def groups(cluster: RealCluster, name: str) -> set[str]:
    """The StatefulSets and headless Services of ``name``'s parallel groups."""
    selector = f"{names.LABEL_INSTANCE}={name}"
    sets = cluster.apps.list_namespaced_stateful_set(NS, label_selector=selector).items
    rendezvous = cluster.core.list_namespaced_service(
        NS, label_selector=f"{selector},{names.LABEL_COMPONENT}={names.COMPONENT_RENDEZVOUS}").items
    return {f"StatefulSet {s.metadata.name}" for s in sets} | {f"Service {s.metadata.name}" for s in rendezvous}


def leader_stand_in(cluster: RealCluster, name: str, revision_: str, port: int) -> None:
    """A ready leader pod of a LeaderWorkerSet of ``revision_``, its runtime on 127.0.0.1:``port``:
    a stand-in pod with the worker index LeaderWorkerSet gives its leaders."""
    cluster.stand_in_pod(name, revision_, port)
    selector = names.label_selector({**names.runtime_pod_labels(name), names.LABEL_REVISION: revision_})
    for pod in cluster.core.list_namespaced_pod(NS, label_selector=selector).items:
        cluster.core.patch_namespaced_pod(pod.metadata.name, NS,
                                          {"metadata": {"labels": {names.LABEL_LWS_WORKER_INDEX: "0"}}})


def leaders(name: str, *, leader_worker_set: bool) -> dict[str, str]:
    """The traffic Service's selector: the leaders of StatefulSet groups, or of LeaderWorkerSets."""
    leader = names.LABEL_LWS_WORKER_INDEX if leader_worker_set else names.LABEL_STS_POD_INDEX
    return {**names.selector_labels(name), leader: "0"}


@pytest.mark.timeout(480, func_only=True)
def test_leader_worker_set_registered_mid_life_changes_nothing_until_asked_for(
        cluster: RealCluster, workloads: Workloads, stand_ins: list[HttpStandIn]) -> None:
    """StatefulSet groups run while the cluster has no LeaderWorkerSet API; registered, it starts
    no canary and the traffic Service never stops selecting the running leaders; asked for by
    annotation, LeaderWorkerSets roll out as a canary, and once promoted take the traffic."""
    assert not leader_worker_sets_served(cluster), "the LeaderWorkerSet API must come mid-life"
    workloads.ready.add("ch-mid")
    body = example("ch-mid")
    body["spec"] |= {"parallelism": {"pipeline": 2}}
    cluster.create(body)
    cluster.until(lambda: cluster.condition("ch-mid", "Ready").get("status") == "True", "Ready=True")
    stable = cluster.status("ch-mid")["stableRevision"]
    assert cluster.status("ch-mid")["workloadKind"] == "StatefulSet"
    assert service(cluster, "ch-mid").spec.selector == leaders("ch-mid", leader_worker_set=False)

    watch = SelectorWatch(cluster, "ch-mid")
    try:
        install_crds(cluster.apps.api_client, [leader_worker_set_crd()], cluster.plane.processes)
        outlast_the_operators_discovery(cluster)
        cluster.patch("ch-mid", {"spec": {"replicas": 3}})
        cluster.settled("ch-mid")
        assert operator_listed_leader_worker_sets(cluster, "ch-mid")  # it saw the API
        status = cluster.status("ch-mid")
        assert status["stableRevision"] == stable and "canaryRevision" not in status
        assert status["workloadKind"] == "StatefulSet" and not leader_worker_sets(cluster, "ch-mid")
        cluster.until(lambda: len(groups(cluster, "ch-mid")) == 6, "a third StatefulSet group")

        # asked for: a rollout, the traffic Service on the running leaders until promotion
        cluster.patch("ch-mid", {"metadata": {"annotations": {names.ANNOTATION_WORKLOAD_KIND: "LeaderWorkerSet"}}})
        canary = cluster.until(lambda: cluster.status("ch-mid").get("canaryRevision"), "a canary of the other kind")
        cluster.until(lambda: leader_worker_sets(cluster, "ch-mid") == {names.workload_name("ch-mid", canary)},
                      "the canary's LeaderWorkerSet")
        assert cluster.status("ch-mid")["workloadKind"] == "StatefulSet"
        stand_ins.append(runtime := RuntimeStandIn(acceptance=0.8))
        with leader_worker_sets_ready(cluster, "ch-mid"):
            leader_stand_in(cluster, "ch-mid", canary, runtime.port)
            cluster.until(lambda: cluster.status("ch-mid").get("stableRevision") == canary, "the canary promoted",
                          timeout=ROLLOUT_SECONDS)
            cluster.until(lambda: not groups(cluster, "ch-mid"), "the StatefulSet groups deleted")
            cluster.settled("ch-mid")
    finally:
        selectors = watch.stop()
    assert cluster.status("ch-mid")["workloadKind"] == "LeaderWorkerSet"
    assert selectors == [leaders("ch-mid", leader_worker_set=False), leaders("ch-mid", leader_worker_set=True)]


@pytest.fixture
def leader_worker_set_api(cluster: RealCluster) -> None:
    """The LeaderWorkerSet API served (registered here unless an earlier test did), long enough
    for the operator's next reconciliation to see it."""
    if not leader_worker_sets_served(cluster):
        install_crds(cluster.apps.api_client, [leader_worker_set_crd()], cluster.plane.processes)
    outlast_the_operators_discovery(cluster)


@pytest.mark.timeout(300, func_only=True)
@pytest.mark.usefixtures("leader_worker_set_api")
def test_a_resource_made_once_leader_worker_sets_are_served_runs_them_and_deletes_a_rolled_back_canary(
        cluster: RealCluster) -> None:
    body = example("ch-lws")
    body["spec"] |= {"parallelism": {"pipeline": 2}}
    with leader_worker_sets_ready(cluster, "ch-lws"):
        cluster.create(body)
        cluster.until(lambda: cluster.condition("ch-lws", "Ready").get("status") == "True", "Ready=True")
        stable = cluster.status("ch-lws")["stableRevision"]
        assert cluster.status("ch-lws")["workloadKind"] == "LeaderWorkerSet" and not groups(cluster, "ch-lws")
        assert leader_worker_sets(cluster, "ch-lws") == {names.workload_name("ch-lws", stable)}
        assert service(cluster, "ch-lws").spec.selector == leaders("ch-lws", leader_worker_set=True)

        canary = start_canary(cluster, "ch-lws")
        cluster.until(lambda: len(leader_worker_sets(cluster, "ch-lws")) == 2, "the canary's LeaderWorkerSet")
        cluster.patch("ch-lws", {"metadata": {"annotations": {names.ANNOTATION_ABORT: "true"}}})
        cluster.until(lambda: leader_worker_sets(cluster, "ch-lws") == {names.workload_name("ch-lws", stable)},
                      "the canary's LeaderWorkerSet deleted")
        cluster.until(lambda: cluster.condition("ch-lws", "RolledBack").get("status") == "True", "RolledBack=True")
        cluster.settled("ch-lws")
    deletes = [e for e in cluster.operator_requests() if e["verb"] == "delete"
               and e["objectRef"].get("name") == names.workload_name("ch-lws", canary)]
    assert deletes and all(e["responseStatus"]["code"] == 200 for e in deletes)
