"""The operator shell's pure parts: the child plan, readiness, scrape targets, the status patch,
the configuration from the environment, the operator's metrics and its per-resource memory."""
from __future__ import annotations

import logging
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import kopf
import pytest
from prometheus_client import generate_latest

from specdecode.operator import metrics, names
from specdecode.operator.analysis import MetricSnapshot
from specdecode.operator.controller import Memory, OperatorConfig, no_webhook_server, webhook_server
from specdecode.operator.reconcile import (
    MAX_REFUSAL_CHARS,
    contains,
    invalid_status,
    is_invalid,
    plan,
    ready_replicas,
    runtime_refusal,
    scrape_targets,
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
)

NOW = datetime(2026, 1, 1, tzinfo=timezone.utc)


def resolved(**spec: Any) -> Resolved:
    body = {"apiVersion": names.API_VERSION, "kind": names.KIND, "metadata": {"name": "demo", "namespace": "llm"},
            "spec": {"model": {"uri": "smollm2-135m"}, "image": "specdecode/runtime:test", "replicas": 2, **spec}}
    answer = resolve(body)
    assert answer.allowed, answer.message
    return answer.resolved


def live(objs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``objs`` as the API server returns them: with server-filled fields."""
    out = []
    for obj in objs:
        copy = {**obj, "metadata": {**obj["metadata"], "uid": "u", "resourceVersion": "7"}}
        if obj["kind"] in ("Deployment", "StatefulSet"):
            copy["status"] = {"readyReplicas": obj["spec"]["replicas"]}
        out.append(copy)
    return out


def names_of(objs: tuple[dict[str, Any], ...]) -> set[tuple[str, str]]:
    return {(o["kind"], o["metadata"]["name"]) for o in objs}


# -- plan -----------------------------------------------------------------------------------------


def test_a_fresh_resource_creates_its_revision_and_the_shared_objects() -> None:
    r = resolved(podDisruptionBudget={"enabled": True})
    changes = plan(r, "rev1", {"rev1": 2}, [], stable="rev1", leader_worker_set=False)
    assert names_of(changes.create) == {("Deployment", "demo-rev1"), ("Service", "demo"),
                                        ("PodDisruptionBudget", "demo")}
    assert not changes.patch and not changes.delete


def test_what_already_runs_is_left_alone() -> None:
    r = resolved()
    existing = live([*build_workloads(r, "rev1", 2), *build_shared(r, "rev1")])
    assert not plan(r, "rev1", {"rev1": 2}, existing, stable="rev1", leader_worker_set=False)


def test_the_stable_revision_is_only_scaled_during_a_rollout() -> None:
    r = resolved()
    old_template = build_workloads(resolved(image="specdecode/runtime:old"), "stable", 2)
    existing = live([*old_template, *build_shared(r, "stable")])
    changes = plan(r, "canary", {"stable": 1, "canary": 1}, existing, stable="stable", canary="canary",
                   leader_worker_set=False)
    assert names_of(changes.create) == {("Deployment", "demo-canary")}
    assert changes.patch == ({"apiVersion": "apps/v1", "kind": "Deployment",
                              "metadata": {"name": "demo-stable", "namespace": "llm"}, "spec": {"replicas": 1}},)
    assert not changes.delete


def test_revisions_and_shared_objects_no_longer_wanted_are_deleted() -> None:
    before = resolved(podDisruptionBudget={"enabled": True})
    existing = live([*build_workloads(before, "old", 2), *build_workloads(before, "new", 2), *build_shared(before, "new")])
    changes = plan(resolved(), "new", {"new": 2}, existing, stable="new", leader_worker_set=False)
    assert names_of(changes.delete) == {("Deployment", "demo-old"), ("PodDisruptionBudget", "demo")}
    assert not changes.create and not changes.patch


def test_a_changed_desired_object_is_patched_whole() -> None:
    r = resolved()
    existing = live([*build_workloads(r, "rev1", 2), *build_shared(resolved(service={"port": 9000}), "rev1")])
    (service,) = plan(r, "rev1", {"rev1": 2}, existing, stable="rev1", leader_worker_set=False).patch
    assert service["kind"] == "Service" and service["spec"]["ports"][0]["port"] == 8000


def test_statefulset_groups_of_an_older_revision_scale_to_zero_and_back() -> None:
    layout = dict(parallelism={"tensor": 4}, resources={"gpusPerPod": 2})  # 2 pods per group
    r = resolved(**layout)
    existing = live([*build_workloads(resolved(image="x:old", **layout), "old", 2), *build_shared(r, "old")])
    shrink = plan(r, "new", {"old": 1, "new": 1}, existing, stable="old", canary="new", leader_worker_set=False)
    assert [(p["metadata"]["name"], p["spec"]["replicas"]) for p in shrink.patch] == [("demo-old-1", 0)]
    assert names_of(shrink.create) == {("StatefulSet", "demo-new-0"), ("Service", "demo-new-0")}
    assert not shrink.delete  # a rollback scales the group back instead of re-rendering an old spec

    scaled = [o if o["metadata"]["name"] != "demo-old-1" else {**o, "spec": {**o["spec"], "replicas": 0}}
              for o in existing]
    back = plan(r, "new", {"old": 2}, scaled, stable="old", leader_worker_set=False)
    assert [(p["metadata"]["name"], p["spec"]["replicas"]) for p in back.patch] == [("demo-old-1", 2)]  # pods per group


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


def test_scrape_targets_are_ready_pods_at_their_http_port() -> None:
    pods = [pod("a"), pod("b", ip="fd00::1", port=9000), pod("loading", ready="False"), pod("no-ip", ip=None),
            pod("no-port", port=None), pod("leaving", deletionTimestamp="2026-01-01T00:00:00Z")]
    assert list(scrape_targets(pods)) == [("a", "http://10.0.0.1:8000/metrics"), ("b", "http://[fd00::1]:9000/metrics")]


def runtime_pod(name: str, *containers: dict[str, Any], init: tuple[dict[str, Any], ...] = (),
                **meta: Any) -> dict[str, Any]:
    """A pod of revision rev1 with these container statuses."""
    labels = {**names.runtime_pod_labels("demo"), names.LABEL_REVISION: "rev1"}
    status = {"phase": "Running", "containerStatuses": list(containers), "initContainerStatuses": list(init)}
    return {"metadata": {"name": name, "labels": labels, **meta}, "status": status}


def crash_looping(message: str = "", name: str = names.CONTAINER, **terminated: Any) -> dict[str, Any]:
    return {"name": name, "state": {"waiting": {"reason": "CrashLoopBackOff"}}, "restartCount": 3,
            "lastState": {"terminated": {"exitCode": 1, "reason": "Error", "message": message, **terminated}}}


REFUSED = "specdecode serve: cannot start: /mnt/models/qwen has no MTP layers (looked for mtp.*); set mtpPath"
RUNNING = {"name": names.CONTAINER, "state": {"running": {}}, "ready": True}


def test_a_runtime_refusal_is_its_termination_message() -> None:
    assert runtime_refusal([runtime_pod("demo-rev1-a", crash_looping(REFUSED + "\n"))]) == (
        f"pod demo-rev1-a (revision rev1): runtime exited with code 1: {REFUSED}")
    stopped = {"name": names.CONTAINER, "state": {"terminated": {"exitCode": 2, "message": "invalid configuration"}}}
    assert runtime_refusal([runtime_pod("p", stopped)]).endswith("runtime exited with code 2: invalid configuration")


def test_healthy_starting_or_drained_pods_refuse_nothing() -> None:
    recovered = {**RUNNING, "lastState": crash_looping(REFUSED)["lastState"]}  # crashed once, running now
    creating = {"name": names.CONTAINER, "state": {"waiting": {"reason": "ContainerCreating"}}}
    drained = {"name": names.CONTAINER, "state": {"terminated": {"exitCode": 0, "message": "drained"}}}
    sidecar = crash_looping("proxy down", name="istio-proxy")
    leaving = runtime_pod("old", crash_looping(REFUSED), deletionTimestamp="2026-01-01T00:00:00Z")
    pods = [runtime_pod(n, c) for n, c in (("a", RUNNING), ("b", recovered), ("c", creating), ("d", drained))]
    assert runtime_refusal([*pods, runtime_pod("e", RUNNING, sidecar), leaving, runtime_pod("f")]) is None
    assert runtime_refusal([]) is None


def test_a_log_tail_counts_by_its_last_line_and_long_messages_are_cut() -> None:
    traceback = "Traceback (most recent call last):\n  File \"x.py\", line 1\nRuntimeError: CUDA out of memory\n\n"
    assert runtime_refusal([runtime_pod("p", crash_looping(traceback))]).endswith(": RuntimeError: CUDA out of memory")
    oom = crash_looping(exitCode=137, reason="OOMKilled")
    assert runtime_refusal([runtime_pod("p", oom)]).endswith("runtime exited with code 137: OOMKilled")
    cut = runtime_refusal([runtime_pod("p", crash_looping("x" * 5000))])
    assert cut.endswith("x…") and len(cut.split(": ", 1)[1]) < MAX_REFUSAL_CHARS + 40


def test_a_failed_fetch_counts_and_the_first_pod_by_name_is_named() -> None:
    fetch = crash_looping("huggingface_hub.errors.RepositoryNotFoundError: 404 org/heads", name=names.FETCH_MTP_CONTAINER)
    waiting = {"name": names.CONTAINER, "state": {"waiting": {"reason": "PodInitializing"}}}
    pods = [runtime_pod("demo-rev1-b", crash_looping(REFUSED)), runtime_pod("demo-rev1-a", waiting, init=(fetch,))]
    assert runtime_refusal(pods) == ("pod demo-rev1-a (revision rev1): fetch-mtp exited with code 1: "
                                     "huggingface_hub.errors.RepositoryNotFoundError: 404 org/heads (and 1 more pods)")


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


def test_an_invalid_spec_sets_ready_false_and_keeps_the_rest() -> None:
    status = SpecDecodeDeploymentStatus(stable_revision="a", observed_generation=1)
    new = invalid_status(status, "spec.x: wrong", 2, NOW)
    (ready,) = new.conditions
    assert (ready.type, ready.status, ready.reason, ready.message) == (
        ConditionType.READY, ConditionStatus.FALSE, "InvalidSpec", "spec.x: wrong")
    assert new.stable_revision == "a" and new.observed_generation == 2
    assert is_invalid(new) and is_invalid(new, "spec.x: wrong") and not is_invalid(new, "other")
    assert not is_invalid(status)


# -- configuration --------------------------------------------------------------------------------


def test_config_from_the_chart_environment() -> None:
    assert OperatorConfig.from_env({}) == OperatorConfig(webhook_port=None, webhook_cert_dir=None, metrics_port=8081)
    assert OperatorConfig.from_env({"SPECDECODE_WEBHOOK_PORT": "", "SPECDECODE_METRICS_PORT": " "}).webhook_port is None
    config = OperatorConfig.from_env({"SPECDECODE_WEBHOOK_PORT": "9443", "SPECDECODE_WEBHOOK_CERT_DIR": "/certs",
                                      "SPECDECODE_METRICS_PORT": "9000", "KUBECONFIG": "/kc"})
    assert config == OperatorConfig(9443, Path("/certs"), 9000, "/kc")


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


def test_memory_starts_a_new_history_for_a_new_canary() -> None:
    memory = Memory()
    first = memory.history("llm", "demo", "b").record("pod", NOW, MetricSnapshot(drafts=1), keep=timedelta(minutes=1))
    memory.keep("llm", "demo", first)
    assert memory.history("llm", "demo", "b") is first
    assert memory.history("llm", "demo", "c").samples == {}
    assert memory.lock("llm", "demo") is memory.lock("llm", "demo")
    memory.forget("llm", "demo")
    assert memory.history("llm", "demo", "b").samples == {}
