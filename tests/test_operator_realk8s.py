"""The operator on a real control plane (realk8s.py: etcd, kube-apiserver and
kube-controller-manager on loopback), installed from the chart as Helm would, running as the
chart's ServiceAccount (realk8s_operator.py), driven through the official ``kubernetes`` client
(realk8s_cluster.py): who the operator is, admission through the API server, create, roll out,
delete.
"""
from __future__ import annotations

import copy
import json
from typing import Any

import kubernetes
import pytest
from operator_harness import NS, HttpStandIn, RuntimeStandIn, example, start_canary
from realk8s import wait_until
from realk8s_cluster import RealCluster, Workloads, children_of, owned_by
from realk8s_operator import Release

from specdecode.operator import names, render
from specdecode.operator.resolve import resolve

# The control plane's start (and a cold build) have deadlines of their own.
pytestmark = [pytest.mark.realk8s, pytest.mark.timeout(180, func_only=True)]

WEBHOOK = "validate.specdecodedeployments.specdecode.io"
GARBAGE_COLLECTOR = "system:serviceaccount:kube-system:generic-garbage-collector"
Obj = dict[str, Any]


# -- who the operator is --------------------------------------------------------------------------


def test_the_api_server_sees_the_operator_as_the_charts_service_account(cluster: RealCluster,
                                                                       release: Release) -> None:
    """Every request from the operator's clients (kopf's, and the ``kubernetes`` client's, which only
    the operator uses with its default user agent) is authenticated as the ServiceAccount."""
    def operator_events() -> list[Obj]:
        return [e for e in cluster.plane.audit()
                if e.get("userAgent", "").startswith(("kopf/", "OpenAPI-Generator/"))]

    events = wait_until(operator_events, "requests from the operator in the audit log", cluster.plane.processes)
    assert {e["user"]["username"] for e in events} == {release.username}
    groups = {g for e in events for g in e["user"].get("groups", [])}
    namespace = release.service_account["metadata"]["namespace"]
    assert "system:masters" not in groups and f"system:serviceaccounts:{namespace}" in groups


# -- admission ------------------------------------------------------------------------------------


def test_the_api_server_calls_the_webhook_which_refuses_an_invalid_spec(cluster: RealCluster) -> None:
    """Schema-valid but refused by admission (MTP under pipeline parallelism needs a gate): the API
    server asks the operator's webhook and answers with its message."""
    body = example("mtp-pp")
    body["spec"] |= {"parallelism": {"pipeline": 2}, "speculative": {"method": "mtp"}}
    expected = resolve(copy.deepcopy(body))
    assert not expected.allowed
    with pytest.raises(kubernetes.client.ApiException) as refused:
        cluster.create(body)
    assert refused.value.status == 422
    message = json.loads(refused.value.body)["message"]
    assert message == f'admission webhook "{WEBHOOK}" denied the request: {expected.message}'
    assert cluster.gone("mtp-pp")


# -- create, ready, roll out, delete --------------------------------------------------------------


def test_a_resource_gets_owned_children_and_a_status(cluster: RealCluster, workloads: Workloads) -> None:
    body = example("created")
    body["spec"]["extraArgs"] = ["--drain-timeout", "120"]
    cluster.create(body)
    created = cluster.get("created")
    children = children_of(cluster, "created")
    assert all(owned_by(child, created) for child in children)
    # as the API server stored it: the kubelet's grace period covers the preStop wait and the drain
    (pod,) = [c["spec"]["template"]["spec"] for c in children if c["kind"] == "Deployment"]
    assert pod["terminationGracePeriodSeconds"] == render.PRE_STOP_SECONDS + 120 + render.EXIT_MARGIN_SECONDS
    (runtime,) = pod["containers"]
    assert runtime["lifecycle"]["preStop"]["exec"]["command"][3:] == [
        str(render.PRE_STOP_SECONDS), str(names.HTTP_PORT), str(render.LEADER_SERVING_SECONDS)]
    cluster.until(lambda: cluster.status("created").get("observedGeneration"), "a status")
    status = cluster.status("created")
    assert status["observedGeneration"] == 1 and status["stableRevision"]
    # policy/v1 PodDisruptionBudget is served from 1.21 on; before, the operator says so instead of failing
    assert any("PodDisruptionBudget" in w for w in status.get("warnings", [])) == (cluster.plane.minor < 21)
    assert cluster.condition("created", "Ready").get("status") == "False"  # no pod runs

    workloads.ready.add("created")
    cluster.until(lambda: cluster.condition("created", "Ready").get("status") == "True", "Ready=True")
    cluster.until(lambda: ("Normal", "Deployed") in {(t, r) for t, r, _ in cluster.events("created")},
                  "the Deployed Event")
    cluster.settled("created")


def test_a_good_canary_is_promoted_and_the_old_revision_deleted(cluster: RealCluster, workloads: Workloads,
                                                                 stand_ins: list[HttpStandIn]) -> None:
    workloads.ready.add("promoted")
    cluster.create(example("promoted"))
    cluster.until(lambda: cluster.condition("promoted", "Ready").get("status") == "True", "Ready=True")
    stable = cluster.status("promoted")["stableRevision"]
    canary = start_canary(cluster, "promoted")
    stand_ins.append(runtime := RuntimeStandIn(acceptance=0.8))
    cluster.stand_in_pod("promoted", canary, runtime.port)

    cluster.until(lambda: cluster.status("promoted").get("stableRevision") == canary, "the canary promoted")
    cluster.until(lambda: set(cluster.deployments("promoted")) == {names.workload_name("promoted", canary)},
                  "the old revision's Deployment deleted")
    status = cluster.status("promoted")
    assert "canaryRevision" not in status and status["acceptance"]["rate"] == pytest.approx(0.8)
    # Events are posted after the status is written
    cluster.until(lambda: {"RolloutStarted", "Promoted"} <= {r for _, r, _ in cluster.events("promoted")},
                  "the rollout's Events")
    deletes = [e for e in cluster.operator_requests() if e["verb"] == "delete"
               and e["objectRef"].get("name") == names.workload_name("promoted", stable)]
    assert deletes and all(e["responseStatus"]["code"] == 200 for e in deletes)
    cluster.settled("promoted")


def test_a_canary_behind_an_httproute_and_a_servicemonitor(cluster: RealCluster, workloads: Workloads,
                                                           stand_ins: list[HttpStandIn]) -> None:
    """The user's HTTPRoute gets the stable and canary Services weighted by step; switching the
    route and the ServiceMonitor off deletes the objects made for them."""
    workloads.ready.add("routed")
    routes = ("gateway.networking.k8s.io", "v1", NS, "httproutes")
    cluster.custom.create_namespaced_custom_object(*routes, {
        "apiVersion": "gateway.networking.k8s.io/v1", "kind": "HTTPRoute", "metadata": {"name": "gateway"},
        "spec": {"parentRefs": [{"name": "public"}], "rules": [{"backendRefs": [{"name": "routed", "port": 8000}]}]}})

    def weights() -> dict[str, int]:
        (rule,) = cluster.custom.get_namespaced_custom_object(*routes, "gateway")["spec"]["rules"]
        return {ref["name"]: ref["weight"] for ref in rule["backendRefs"] if "weight" in ref}

    def monitors() -> set[str]:
        listed = cluster.custom.list_namespaced_custom_object("monitoring.coreos.com", "v1", NS, "servicemonitors")
        return {m["metadata"]["name"] for m in listed["items"]}

    body = example("routed")
    body["spec"]["serviceMonitor"] = {"enabled": True}
    body["spec"]["rollout"]["trafficRouting"] = {"httpRoute": "gateway"}
    cluster.create(body)
    cluster.until(lambda: weights() == {"routed-stable": 100, "routed-canary": 0}, "all traffic to stable")
    assert monitors() == {names.service_monitor_name("routed")}
    canary = start_canary(cluster, "routed")
    stand_ins.append(runtime := RuntimeStandIn(acceptance=0.8))
    cluster.stand_in_pod("routed", canary, runtime.port)
    cluster.until(lambda: weights() == {"routed-stable": 50, "routed-canary": 50}, "half to the canary")
    cluster.until(lambda: cluster.status("routed").get("stableRevision") == canary, "the canary promoted")
    cluster.until(lambda: weights() == {"routed-stable": 100, "routed-canary": 0}, "all traffic to stable again")

    cluster.patch("routed", {"spec": {"serviceMonitor": {"enabled": False}, "rollout": {"trafficRouting": None}}})
    cluster.until(lambda: not monitors(), "the ServiceMonitor deleted")
    cluster.until(lambda: {c["metadata"]["name"] for c in cluster.children("routed") if c["kind"] == "Service"}
                  == {names.service_name("routed")}, "the route's Services deleted")
    cluster.settled("routed")


def test_a_pipeline_layout_runs_a_statefulset_group_per_replica(cluster: RealCluster, workloads: Workloads) -> None:
    """TP2×PP2 on CPU: a StatefulSet and a headless Service per replica; one replica fewer deletes
    the last group's."""
    workloads.ready.add("grouped")
    body = example("grouped")
    body["spec"] |= {"parallelism": {"tensor": 2, "pipeline": 2}}
    cluster.create(body)
    cluster.until(lambda: cluster.condition("grouped", "Ready").get("status") == "True", "Ready=True")
    stable = cluster.status("grouped")["stableRevision"]

    def groups() -> set[str]:
        listed = cluster.apps.list_namespaced_stateful_set(NS, label_selector=f"{names.LABEL_INSTANCE}=grouped")
        return {s.metadata.name for s in listed.items}

    def headless() -> set[str]:
        return {c["metadata"]["name"] for c in cluster.children("grouped")
                if c["kind"] == "Service" and c["metadata"]["name"] != names.service_name("grouped")}

    assert groups() == headless() == {names.group_name("grouped", stable, g) for g in (0, 1)}
    cluster.patch("grouped", {"spec": {"replicas": 1}})
    cluster.until(lambda: groups() == headless() == {names.group_name("grouped", stable, 0)}, "the second group deleted")
    cluster.settled("grouped")


def test_the_garbage_collector_deletes_the_children_of_a_deleted_resource(cluster: RealCluster) -> None:
    cluster.create(example("collected"))
    children = children_of(cluster, "collected")
    cluster.custom.delete_namespaced_custom_object(names.GROUP, names.VERSION, NS, names.PLURAL, "collected")
    cluster.until(lambda: cluster.gone("collected"), "the resource gone (kopf's finalizer removed)")
    cluster.until(lambda: not cluster.children("collected"), "the garbage collector to delete the children")
    deleted_by = {(e["objectRef"]["resource"], e["objectRef"]["name"]): e["user"]["username"]
                  for e in cluster.plane.audit() if e["verb"] == "delete" and e.get("objectRef", {}).get("name")}
    for child in children:
        resource = {"Deployment": "deployments", "Service": "services"}[child["kind"]]
        assert deleted_by[resource, child["metadata"]["name"]] == GARBAGE_COLLECTOR
