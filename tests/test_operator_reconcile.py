"""The operator shell's pure parts: the child plan (applied forms, the hand-over of fields earlier
versions wrote, the workload kind chosen once), readiness, scrape targets, the status patch, the
configuration from the environment, the operator's metrics and its per-resource memory."""
from __future__ import annotations

import json
import logging
from datetime import datetime, timedelta, timezone
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import kopf
import kubernetes
import pytest
import urllib3
from prometheus_client import generate_latest

from specdecode.operator import kube, metrics, names
from specdecode.operator.analysis import History, MetricSnapshot
from specdecode.operator.controller import Memory
from specdecode.operator.settings import LeaseConfig, OperatorConfig, configure, no_webhook_server, webhook_server
from specdecode.operator.leadership import Alone, LeaseTiming
from specdecode.operator.loop import Carried, analyse
from specdecode.operator.kubeschema import quantity_value
from specdecode.operator.reconcile import (
    CHILD_REFUSED,
    INVALID_SPEC,
    LEGACY_MANAGERS,
    Plan,
    applied_form,
    children_of,
    contains,
    desired_kind,
    handed_over,
    is_not_ready,
    not_ready,
    plan,
    ready_replicas,
    running_kind,
    serving_endpoints,
    status_patch,
)
from specdecode.operator.render import build_shared, build_workloads
from specdecode.operator.resolve import Resolved, resolve
from specdecode.operator.spec import (
    Condition,
    ConditionStatus,
    ConditionType,
    MeasuredAcceptance,
    RolloutStatus,
    SpecDecodeDeploymentStatus,
    WorkloadKind,
)

NOW = datetime(2026, 1, 1, tzinfo=timezone.utc)


def resolved(**spec: Any) -> Resolved:
    body = {"apiVersion": names.API_VERSION, "kind": names.KIND, "metadata": {"name": "demo", "namespace": "llm"},
            "spec": {"model": {"uri": "smollm2-135m"}, "image": "specdecode/runtime:test", "replicas": 2, **spec}}
    answer = resolve(body)
    assert answer.allowed, answer.message
    return answer.resolved


OWNER = {"apiVersion": names.API_VERSION, "kind": names.KIND,
         "metadata": {"name": "demo", "namespace": "llm", "uid": "owner-uid", "labels": {"team": "ml"}}}
DEPLOYMENT, STATEFUL_SET, LWS = WorkloadKind.DEPLOYMENT, WorkloadKind.STATEFUL_SET, WorkloadKind.LEADER_WORKER_SET
LWS_API = kube.LEADER_WORKER_SET.api_version


def live(objs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``objs`` as the API server returns them once applied: owned, stamped, with server-filled fields."""
    out = []
    for obj in objs:
        applied = applied_form(obj, OWNER)
        copy = {**applied, "metadata": {**applied["metadata"], "uid": "u", "resourceVersion": "7"}}
        if obj["kind"] in ("Deployment", "StatefulSet"):
            copy["status"] = {"readyReplicas": obj["spec"]["replicas"]}
        out.append(copy)
    return out


def planned(r: Resolved, desired: str, replicas: dict[str, int], existing: list[dict[str, Any]], *,
            stable: str, canary: str | None = None, kind: WorkloadKind = DEPLOYMENT,
            stable_kind: WorkloadKind | None = None) -> Plan:
    return plan(r, desired, replicas, existing, owner=OWNER, stable=stable, canary=canary, kind=kind,
                stable_kind=stable_kind or kind)


def names_of(objs: tuple[dict[str, Any], ...]) -> set[tuple[str, str]]:
    return {(o["kind"], o["metadata"]["name"]) for o in objs}


# -- plan -----------------------------------------------------------------------------------------


def test_a_fresh_resource_applies_its_revision_and_the_shared_objects_owned() -> None:
    r = resolved(podDisruptionBudget={"enabled": True})
    changes = planned(r, "rev1", {"rev1": 2}, [], stable="rev1")
    assert names_of(changes.apply) == {("Deployment", "demo-rev1"), ("Service", "demo"),
                                       ("PodDisruptionBudget", "demo")}
    assert not changes.scale and not changes.delete and not changes.hand_over
    for obj in changes.apply:
        (owner,) = obj["metadata"]["ownerReferences"]
        assert (owner["uid"], owner["controller"], owner["blockOwnerDeletion"]) == ("owner-uid", True, True)
        assert obj["metadata"]["labels"]["team"] == "ml"  # the resource's labels, under ours
        assert len(obj["metadata"]["annotations"][names.ANNOTATION_APPLIED]) == 16


def test_objects_another_controller_owns_are_not_children_even_with_our_labels() -> None:
    """A LeaderWorkerSet's StatefulSets may carry the labels of the LeaderWorkerSet they were made
    from; they are its to scale and delete, not ours."""
    r = resolved(parallelism={"pipeline": 2})
    ours = live(build_workloads(r, "rev1", 1, leader_worker_set=True))
    theirs = {**ours[0], "kind": "StatefulSet", "metadata": {**ours[0]["metadata"], "ownerReferences": [
        {"apiVersion": LWS_API, "kind": "LeaderWorkerSet", "name": "demo-rev1", "uid": "lws-uid", "controller": True}]}}
    unowned = {**ours[0], "metadata": {k: v for k, v in ours[0]["metadata"].items() if k != "ownerReferences"}}
    assert children_of([*ours, theirs, unowned], OWNER) == [*ours, unowned]


def test_what_already_runs_is_left_alone() -> None:
    r = resolved()
    existing = live([*build_workloads(r, "rev1", 2), *build_shared(r, "rev1")])
    assert not planned(r, "rev1", {"rev1": 2}, existing, stable="rev1")


def test_the_stable_revision_is_only_scaled_during_a_rollout() -> None:
    r = resolved()
    old_template = build_workloads(resolved(image="specdecode/runtime:old"), "stable", 2)
    existing = live([*old_template, *build_shared(r, "stable")])
    changes = planned(r, "canary", {"stable": 1, "canary": 1}, existing, stable="stable", canary="canary")
    assert names_of(changes.apply) == {("Deployment", "demo-canary")}
    assert changes.scale == ({"apiVersion": "apps/v1", "kind": "Deployment",
                              "metadata": {"name": "demo-stable", "namespace": "llm"}, "spec": {"replicas": 1}},)
    assert not changes.delete


def test_revisions_and_shared_objects_no_longer_wanted_are_deleted() -> None:
    before = resolved(podDisruptionBudget={"enabled": True})
    existing = live([*build_workloads(before, "old", 2), *build_workloads(before, "new", 2), *build_shared(before, "new")])
    changes = planned(resolved(), "new", {"new": 2}, existing, stable="new")
    assert names_of(changes.delete) == {("Deployment", "demo-old"), ("PodDisruptionBudget", "demo")}
    assert not changes.apply and not changes.scale


def test_a_child_is_applied_whole_when_what_is_rendered_changes_even_by_a_removal() -> None:
    r = resolved()
    existing = live([*build_workloads(r, "rev1", 2),
                     *build_shared(resolved(service={"port": 9000, "annotations": {"gone": "x"}}), "rev1")])
    (service,) = planned(r, "rev1", {"rev1": 2}, existing, stable="rev1").apply
    assert service["kind"] == "Service" and service["spec"]["ports"][0]["port"] == 8000
    assert service["metadata"]["annotations"].keys() == {names.ANNOTATION_APPLIED}  # what applying it removes
    # a removal alone (what runs still contains all we render) changes the stamp, and so applies
    fewer = live([*build_workloads(r, "rev1", 2), *build_shared(resolved(service={"annotations": {"gone": "x"}}), "rev1")])
    assert names_of(planned(r, "rev1", {"rev1": 2}, fewer, stable="rev1").apply) == {("Service", "demo")}
    # and a field someone else removed from what runs is applied back
    edited = live([*build_workloads(r, "rev1", 2), *build_shared(r, "rev1")])
    del edited[-1]["spec"]["selector"][names.LABEL_INSTANCE]
    assert names_of(planned(r, "rev1", {"rev1": 2}, edited, stable="rev1").apply) == {("Service", "demo")}


def test_statefulset_groups_of_an_older_revision_scale_to_zero_and_back() -> None:
    layout = dict(parallelism={"tensor": 4}, resources={"gpusPerPod": 2})  # 2 pods per group
    r = resolved(**layout)
    existing = live([*build_workloads(resolved(image="x:old", **layout), "old", 2), *build_shared(r, "old")])
    shrink = planned(r, "new", {"old": 1, "new": 1}, existing, stable="old", canary="new", kind=STATEFUL_SET)
    assert [(p["metadata"]["name"], p["spec"]["replicas"]) for p in shrink.scale] == [("demo-old-1", 0)]
    assert names_of(shrink.apply) == {("StatefulSet", "demo-new-0"), ("Service", "demo-new-0")}
    assert not shrink.delete  # a rollback scales the group back instead of re-rendering an old spec

    scaled = [o if o["metadata"]["name"] != "demo-old-1" else {**o, "spec": {**o["spec"], "replicas": 0}}
              for o in existing]
    back = planned(r, "new", {"old": 2}, scaled, stable="old", kind=STATEFUL_SET)
    assert [(p["metadata"]["name"], p["spec"]["replicas"]) for p in back.scale] == [("demo-old-1", 2)]  # pods per group


# -- the hand-over of fields an earlier operator version wrote ------------------------------------


def managed(manager: str, operation: str, fields: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"manager": manager, "operation": operation, "apiVersion": "v1", "time": "2026-01-01T00:00:00Z",
            "fieldsType": "FieldsV1", "fieldsV1": fields, **extra}


def test_fields_earlier_versions_wrote_are_handed_to_our_apply_entry_once() -> None:
    (legacy,) = LEGACY_MANAGERS
    created = managed(legacy, "Update", {"f:metadata": {"f:annotations": {"f:gone": {}}}, "f:spec": {"f:type": {}}})
    patched = managed(legacy, "Update", {"f:spec": {"f:selector": {"f:old": {}}}})
    status = managed(legacy, "Update", {"f:status": {"f:loadBalancer": {}}}, subresource="status")
    users = managed("kubectl-edit", "Update", {"f:metadata": {"f:labels": {"f:mine": {}}}})
    service = {"apiVersion": "v1", "kind": "Service",
               "metadata": {"name": "demo", "managedFields": [created, users, patched, status]}}
    entries = handed_over(service)
    assert entries is not None and entries[:2] == [users, status]  # another manager's and a subresource's stay
    ours = entries[2]
    assert (ours["manager"], ours["operation"], ours["apiVersion"]) == (names.MANAGER, "Apply", "v1")
    assert ours["fieldsV1"] == {"f:metadata": {"f:annotations": {"f:gone": {}}},
                                "f:spec": {"f:type": {}, "f:selector": {"f:old": {}}}}
    assert handed_over({**service, "metadata": {"managedFields": entries}}) is None  # applied since: done
    assert handed_over({**service, "metadata": {"managedFields": [users]}}) is None  # never ours


def test_only_children_about_to_be_applied_are_handed_over() -> None:
    r = resolved()
    (legacy,) = LEGACY_MANAGERS
    existing = live([*build_workloads(r, "rev1", 2), *build_shared(resolved(service={"port": 9000}), "rev1")])
    for obj in existing:
        obj["metadata"]["managedFields"] = [managed(legacy, "Update", {"f:spec": {"f:replicas": {}}})]
    (only,) = planned(r, "rev1", {"rev1": 2}, existing, stable="rev1").hand_over
    assert only[0]["kind"] == "Service" and only[1][-1]["manager"] == names.MANAGER


# -- the workload kind, chosen once ---------------------------------------------------------------


class Discovery:
    """``Cluster.serves`` for LeaderWorkerSet, counting the questions."""

    def __init__(self, serves: bool) -> None:
        self.serves, self.asked = serves, 0

    def __call__(self) -> bool:
        self.asked += 1
        return self.serves


def test_a_failed_write_is_a_refusal_only_when_the_api_server_answered_4xx() -> None:
    denied = kubernetes.client.ApiException(status=403, reason="Forbidden")
    denied.body = json.dumps({"kind": "Status", "message": 'admission webhook "p" denied the request: no'})
    down = kubernetes.client.ApiException(status=500, reason="Internal Server Error")  # no Status body
    unreachable = urllib3.exceptions.MaxRetryError(None, "/apis", "connection refused")
    failed = [kube.WriteFailed.of(exc) for exc in (denied, down, unreachable)]
    assert [(f.status, f.refused) for f in failed] == [(403, True), (500, False), (None, False)]
    assert failed[0].message == 'admission webhook "p" denied the request: no' and failed[1].message == (
        "Internal Server Error")
    assert failed[2].message.startswith("no answer from the API server: ")


def test_the_multi_pod_kind_is_chosen_once_then_kept_until_asked_for_another() -> None:
    multi = resolved(parallelism={"pipeline": 2})
    served = Discovery(True)
    assert desired_kind(resolved(), None, None, served) == (DEPLOYMENT, []) and served.asked == 0
    assert desired_kind(multi, None, None, served) == (LWS, []) and served.asked == 1  # a new resource: discovery
    assert desired_kind(multi, STATEFUL_SET, None, served) == (STATEFUL_SET, []) and served.asked == 1  # kept
    assert desired_kind(multi, STATEFUL_SET, "LeaderWorkerSet", served) == (LWS, [])  # asked for
    assert desired_kind(multi, LWS, "StatefulSet", served) == (STATEFUL_SET, [])
    kind, warnings = desired_kind(multi, STATEFUL_SET, "LeaderWorkerSet", Discovery(False))
    assert kind is STATEFUL_SET and "does not serve leaderworkerset.x-k8s.io/v1" in warnings[0]
    kind, warnings = desired_kind(multi, LWS, "Deployment", served)
    assert kind is LWS and "neither StatefulSet nor LeaderWorkerSet" in warnings[0]


def test_discovery_looks_again_soon_for_an_api_the_cluster_lacked(monkeypatch: pytest.MonkeyPatch) -> None:
    """An API installed mid-life is seen within ``UNSERVED_RECHECK_SECONDS``; what is served is
    trusted for ``DISCOVERY_TTL_SECONDS``."""
    now, asked, served = [0.0], [], [{"apps/v1"}, {"apps/v1", LWS_API}]

    class Apis:
        def __init__(self, api: object) -> None:
            pass

        def get_api_versions(self) -> SimpleNamespace:
            asked.append(now[0])
            versions = served[min(len(asked), len(served)) - 1]
            return SimpleNamespace(groups=[SimpleNamespace(versions=[SimpleNamespace(group_version=v)])
                                           for v in versions])

    monkeypatch.setattr(kube.kubernetes.client, "ApisApi", Apis)
    monkeypatch.setattr(kube.time, "monotonic", lambda: now[0])
    cluster = kube.Cluster()
    cluster.__dict__["api"] = object()  # cached_property: no connection
    assert not cluster.serves(LWS_API) and cluster.serves("apps/v1") and asked == [0.0]
    now[0] = kube.UNSERVED_RECHECK_SECONDS / 2
    assert not cluster.serves(LWS_API) and asked == [0.0]
    now[0] = kube.UNSERVED_RECHECK_SECONDS + 1
    assert cluster.serves(LWS_API) and len(asked) == 2  # installed since: seen now
    now[0] += kube.DISCOVERY_TTL_SECONDS / 2
    assert cluster.serves(LWS_API) and cluster.serves("v1") and len(asked) == 2
    now[0] += kube.DISCOVERY_TTL_SECONDS
    assert cluster.serves("apps/v1") and len(asked) == 3


def test_what_runs_is_read_from_status_else_from_the_stable_revisions_workloads() -> None:
    layout = dict(parallelism={"pipeline": 2})
    existing = live([*build_workloads(resolved(**layout), "old", 1), *build_workloads(resolved(**layout), "new", 1,
                                                                                      leader_worker_set=True)])
    assert running_kind(SpecDecodeDeploymentStatus(stable_revision="old"), existing) is STATEFUL_SET
    assert running_kind(SpecDecodeDeploymentStatus(stable_revision="new"), existing) is LWS
    assert running_kind(SpecDecodeDeploymentStatus(stable_revision="old", workload_kind=LWS), existing) is LWS
    assert running_kind(SpecDecodeDeploymentStatus(), []) is None


def test_a_change_of_kind_keeps_the_traffic_service_on_the_stable_kinds_leaders() -> None:
    r = resolved(parallelism={"pipeline": 2}, rollout={"trafficRouting": {"httpRoute": "gw"}})
    existing = live([*build_workloads(r, "old", 2), *build_shared(r, "old")])
    changes = planned(r, "new", {"old": 1, "new": 1}, existing, stable="old", canary="new", kind=LWS,
                      stable_kind=STATEFUL_SET)
    applied = {o["metadata"]["name"]: o for o in changes.apply}
    assert applied["demo-new"]["kind"] == "LeaderWorkerSet"
    assert "demo" not in applied and "demo-stable" not in applied  # the Services of running pods stay as they are
    canary_service = applied["demo-canary"]["spec"]["selector"]
    assert canary_service[names.LABEL_LWS_WORKER_INDEX] == "0" and names.LABEL_STS_POD_INDEX not in canary_service


def test_contains_allows_server_filled_fields_but_not_other_lists() -> None:
    assert contains({"a": 1, "b": {"c": 2, "d": 3}}, {"b": {"c": 2}})
    assert contains([{"x": 1, "y": 2}], [{"x": 1}])
    assert not contains([{"x": 1}, {"x": 2}], [{"x": 1}])
    assert not contains({"a": "1"}, {"a": 1})


# -- readiness and scraping ---------------------------------------------------------------------


def test_ready_replicas_count_whole_groups() -> None:
    deployment = {"kind": "Deployment", "metadata": {"labels": {names.LABEL_REVISION: "a"}},
                  "spec": {"replicas": 3}, "status": {"readyReplicas": 5}}  # old pods still terminating
    group = {"kind": "StatefulSet", "metadata": {"labels": {names.LABEL_REVISION: "b"}}, "spec": {"replicas": 2}}
    ready_groups = [{**group, "status": {"readyReplicas": 2}}, {**group, "status": {"readyReplicas": 1}},
                    {**group, "spec": {"replicas": 0}}]
    service = {"kind": "Service", "metadata": {"labels": {names.LABEL_REVISION: "b"}}}
    assert ready_replicas([deployment, *ready_groups, service], pods_per_group=2) == {"a": 3, "b": 1}


def pod(name: str, ip: str | None = "10.0.0.1", ready: str = "True", port: int | None = 8000,
        **meta: Any) -> dict[str, Any]:
    ports = [{"name": "rendezvous", "containerPort": 29500}]
    ports += [{"name": names.HTTP_PORT_NAME, "containerPort": port}] if port else []
    status = {"phase": "Running", "conditions": [{"type": "Ready", "status": ready}], **({"podIP": ip} if ip else {})}
    return {"metadata": {"name": name, **meta}, "spec": {"containers": [{"name": names.CONTAINER, "ports": ports}]},
            "status": status}


def test_serving_endpoints_are_ready_pods_at_their_http_port() -> None:
    pods = [pod("a"), pod("b", ip="fd00::1", port=9000), pod("loading", ready="False"), pod("no-ip", ip=None),
            pod("no-port", port=None), pod("leaving", deletionTimestamp="2026-01-01T00:00:00Z")]
    assert list(serving_endpoints(pods)) == [("a", "http://10.0.0.1:8000"), ("b", "http://[fd00::1]:9000")]


# -- status ---------------------------------------------------------------------------------------


def test_status_patch_removes_what_became_none_and_keeps_lists_clean() -> None:
    status = SpecDecodeDeploymentStatus(
        stable_revision="a", canary_revision=None, rollout=RolloutStatus(step_started_at=None),
        conditions=(Condition(type=ConditionType.READY, status=ConditionStatus.TRUE, reason="ReplicasReady"),),
        acceptance=MeasuredAcceptance(revision="b", rate=None))
    patch = status_patch(status)
    assert patch["stableRevision"] == "a" and patch["canaryRevision"] is None
    assert patch["rollout"]["stepStartedAt"] is None and patch["acceptance"]["rate"] is None
    assert patch["conditions"] == [{"type": "Ready", "status": "True", "reason": "ReplicasReady", "message": ""}]


def test_not_ready_says_why_and_keeps_the_rest() -> None:
    status = SpecDecodeDeploymentStatus(stable_revision="a", observed_generation=1)
    new = not_ready(status, INVALID_SPEC, "spec.x: wrong", NOW)
    (ready,) = new.conditions
    assert (ready.type, ready.status, ready.reason, ready.message) == (
        ConditionType.READY, ConditionStatus.FALSE, "InvalidSpec", "spec.x: wrong")
    assert new.stable_revision == "a"
    assert is_not_ready(new, INVALID_SPEC) and is_not_ready(new, INVALID_SPEC, "spec.x: wrong")
    assert not is_not_ready(new, INVALID_SPEC, "other") and not is_not_ready(new, CHILD_REFUSED)
    assert not is_not_ready(status, INVALID_SPEC)


def test_a_refused_child_is_not_ready_since_the_refusal_began() -> None:
    """The rollout's conditions say Ready=True; the refusal overrides it, its time from the stored status."""
    earlier = NOW - timedelta(minutes=5)
    stored = not_ready(SpecDecodeDeploymentStatus(), CHILD_REFUSED, "Deployment x: bad", earlier)
    ready_by_replicas = SpecDecodeDeploymentStatus(conditions=(Condition(
        type=ConditionType.READY, status=ConditionStatus.TRUE, reason="ReplicasReady", last_transition_time=NOW),))
    (ready,) = not_ready(ready_by_replicas, CHILD_REFUSED, "Deployment x: bad", NOW, before=stored).conditions
    assert (ready.status, ready.reason, ready.last_transition_time) == (ConditionStatus.FALSE, CHILD_REFUSED, earlier)


# -- configuration --------------------------------------------------------------------------------


def test_config_from_the_chart_environment() -> None:
    assert OperatorConfig.from_env({}) == OperatorConfig(webhook_port=None, webhook_cert_dir=None, metrics_port=8081)
    assert OperatorConfig.from_env({"SPECDECODE_WEBHOOK_PORT": "", "SPECDECODE_METRICS_PORT": " "}).webhook_port is None
    config = OperatorConfig.from_env({"SPECDECODE_WEBHOOK_PORT": "9443", "SPECDECODE_WEBHOOK_CERT_DIR": "/certs",
                                      "SPECDECODE_METRICS_PORT": "9000", "KUBECONFIG": "/kc"})
    assert config == OperatorConfig(9443, Path("/certs"), 9000, "/kc")
    replica = OperatorConfig.from_env({"POD_ID": "specdecode-operator-1", "POD_NAMESPACE": "ops",
                                       "SPECDECODE_LEASE_NAME": "specdecode-operator",
                                       "SPECDECODE_LEASE_DURATION_SECONDS": "20"})
    assert replica.lease == LeaseConfig("specdecode-operator", "ops", "specdecode-operator-1", LeaseTiming(20, 10, 2))
    assert config.lease is None  # no Lease: this replica leads alone


def test_kopf_settings_ask_the_api_server_for_our_children_only() -> None:
    settings = kopf.OperatorSettings()
    configure(settings, OperatorConfig(), Alone(), logging.getLogger("test"))
    selectors = {(s.group, s.plural or s.any_name): v for s, v in settings.watching.label_selectors.items()}
    workloads = "app.kubernetes.io/managed-by=specdecode-operator,app.kubernetes.io/component=runtime"
    assert selectors == {("apps", "deployments"): workloads, ("apps", "statefulsets"): workloads,
                         ("leaderworkerset.x-k8s.io", "leaderworkersets"): workloads,
                         ("", "pods"): "app.kubernetes.io/name=specdecode,app.kubernetes.io/component=runtime"}


def test_the_webhook_server_follows_the_config() -> None:
    logger = logging.getLogger("test")
    assert webhook_server(OperatorConfig(), logger) is no_webhook_server
    tls = webhook_server(OperatorConfig(webhook_port=9443, webhook_cert_dir=Path("/certs")), logger)
    assert isinstance(tls, kopf.WebhookServer) and (tls.port, tls.certfile) == (9443, Path("/certs/tls.crt"))
    assert webhook_server(OperatorConfig(webhook_port=9443), logger).insecure


# -- metrics and memory ---------------------------------------------------------------------------


def test_operator_metrics_follow_the_status_and_are_forgotten_with_the_resource() -> None:
    m = metrics.OperatorMetrics()
    rolling = SpecDecodeDeploymentStatus(stable_revision="a", canary_revision="b", canary_step=1,
                                         rollout=RolloutStatus(stable_replicas=1, canary_replicas=3),
                                         acceptance=MeasuredAcceptance(revision="b", rate=0.75))
    m.observe("llm", "demo", rolling)
    m.analysed("llm", "demo", "Pass")
    m.rolled_back("llm", "demo")
    with pytest.raises(RuntimeError), m.counting_errors("llm", "demo"):
        raise RuntimeError("API down")
    text = generate_latest(m.registry).decode()
    for line in (f'{metrics.ROLLOUT_STEP}{{name="demo",namespace="llm"}} 1.0',
                 f'{metrics.CANARY_WEIGHT}{{name="demo",namespace="llm"}} 75.0',
                 f'{metrics.ACCEPTANCE_RATE}{{name="demo",namespace="llm",revision="b"}} 0.75',
                 f'{metrics.ANALYSIS_RUNS}{{name="demo",namespace="llm",result="pass"}} 1.0',
                 f'{metrics.ROLLBACKS}{{name="demo",namespace="llm"}} 1.0',
                 f'{metrics.RECONCILE_ERRORS}{{name="demo",namespace="llm"}} 1.0'):
        assert line in text, line
    m.observe("llm", "demo", SpecDecodeDeploymentStatus(stable_revision="a"))
    assert f'{metrics.ROLLOUT_STEP}{{name="demo",namespace="llm"}} -1.0' in generate_latest(m.registry).decode()
    m.forget("llm", "demo")
    assert 'name="demo"' not in generate_latest(m.registry).decode()


def test_memory_keeps_the_samples_until_forgotten_and_a_new_canary_starts_afresh() -> None:
    memory = Memory()
    first = History("b").record("pod", NOW, MetricSnapshot(drafts=1), keep=timedelta(minutes=1))
    memory.keep("llm", "demo", Carried(history=first))
    assert memory.carried("llm", "demo").history is first
    r = resolved()
    status = SpecDecodeDeploymentStatus(stable_revision="a", canary_revision="c")
    no_pods = SimpleNamespace(serving_endpoints=lambda *_: [])
    verdict, history = analyse(no_pods, r, None, status, NOW, first, logging.getLogger("test"))
    assert verdict is None and history == History("c")  # another canary: its own samples
    memory.forget("llm", "demo")
    assert memory.carried("llm", "demo") == Carried()


@pytest.mark.parametrize(("ours", "theirs", "same"), [
    ("1024Mi", "1Gi", True), ("0.5", "500m", True), ("1000m", "1", True), (2, "2", True), ("1e3", "1k", True),
    ("1G", "1Gi", False), ("500m", "0.4", False), ("1Gi", None, False),
])
def test_quantities_compare_by_amount_where_kubernetes_keeps_quantities(ours, theirs, same) -> None:
    """The API server writes a quantity back in its canonical spelling; elsewhere strings compare as written."""
    assert quantity_value(ours) is not None
    desired = {"resources": {"limits": {"memory": ours}}, "volumes": [{"emptyDir": {"sizeLimit": ours}}]}
    actual = {"resources": {"limits": {"memory": theirs}}, "volumes": [{"emptyDir": {"sizeLimit": theirs}}]}
    assert contains(actual, desired) is same
    assert contains({"metadata": {"labels": {"size": theirs}}}, {"metadata": {"labels": {"size": ours}}}) is (
        ours == theirs)
