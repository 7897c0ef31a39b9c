"""Canary rollouts on the real control plane (realk8s.py), driven as a user drives them: a spec
change starts a canary beside the stable revision; the analysis of the canary pods' ``/metrics``
(operator_harness.RuntimeStandIn) rolls it back on low acceptance and pauses it when no data
comes (an idle runtime, or none answering); the command annotations (metadata-only updates,
through the API server's webhook call) promote, abort and pause it; and an operator stopped
mid-rollout resumes at the step in status. The emulator tier's counterparts are in
test_operator_integration.py.
"""
from __future__ import annotations

import json
from typing import Any

import pytest
from local_process import free_port
from operator_harness import NS, HttpStandIn, RuntimeStandIn, example
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from realk8s_cluster import RealCluster, Workloads, owned_by
from realk8s_operator import Operator

from specdecode.operator import metrics, names

# An operator restart drains its analysis daemons (kopf's cancellation timeout: 30 s).
pytestmark = [pytest.mark.realk8s, pytest.mark.timeout(300, func_only=True)]

Obj = dict[str, Any]
NEW_SPECULATIVE_TOKENS = 3  # the example runs 4: the spec change that starts each canary
APPLY_PATCH = "application/apply-patch+yaml"  # server-side apply, as Argo CD and Flux write


# -- helpers --------------------------------------------------------------------------------------


def running(cluster: RealCluster, workloads: Workloads, name: str) -> str:
    """The example as ``name``, its workloads ready; its stable revision once Ready."""
    workloads.ready.add(name)
    cluster.create(example(name))
    cluster.until(lambda: cluster.condition(name, "Ready").get("status") == "True", f"{name} Ready=True")
    return cluster.status(name)["stableRevision"]


def change_spec(cluster: RealCluster, name: str) -> str:
    """Change what the pods run; the canary revision the operator starts for it."""
    cluster.patch(name, {"spec": {"speculative": {"numSpeculativeTokens": NEW_SPECULATIVE_TOKENS}}})
    return cluster.until(lambda: cluster.status(name).get("canaryRevision"), f"a canary of {name}")


def annotate(cluster: RealCluster, name: str, key: str, value: str | None) -> None:
    """Set (or with None remove) a command annotation: a metadata-only update."""
    cluster.patch(name, {"metadata": {"annotations": {key: value}}})


def annotations(cluster: RealCluster, name: str) -> dict[str, str]:
    return cluster.get(name)["metadata"].get("annotations") or {}


def reasons(cluster: RealCluster, name: str) -> list[str]:
    return [reason for _, reason, _ in cluster.events(name)]


def workload_names(name: str, *revisions: str) -> set[str]:
    return {names.workload_name(name, revision) for revision in revisions}


def speculative_config(deployment: Any) -> Obj:
    (container,) = deployment.spec.template.spec.containers
    return json.loads(container.args[container.args.index("--speculative-config") + 1])


def analyses(cluster: RealCluster, name: str, result: str) -> float:
    """How many analyses of ``name``'s canary gave ``result`` (pass, fail, inconclusive), from the
    operator's metrics."""
    for family in text_string_to_metric_families(cluster.operator_metrics()):
        for sample in family.samples:
            if sample.name == metrics.ANALYSIS_RUNS and sample.labels == {
                    "namespace": NS, "name": name, "result": result}:
                return sample.value
    return 0.0


def delete(cluster: RealCluster, name: str) -> None:
    """Delete ``name`` (its analysis daemon stops), once it is gone."""
    cluster.custom.delete_namespaced_custom_object(names.GROUP, names.VERSION, NS, names.PLURAL, name)
    cluster.until(lambda: cluster.gone(name), f"{name} deleted")


def idle_runtime() -> HttpStandIn:
    """A canary pod's runtime that no request reached: its ``/metrics`` answers with nothing
    counted (no analysis series; absent ones read as 0)."""
    exposition = generate_latest(CollectorRegistry())
    return HttpStandIn(lambda _: ("text/plain; version=0.0.4", exposition))


# -- a spec change --------------------------------------------------------------------------------


def test_a_spec_change_starts_a_canary_beside_the_unchanged_stable(cluster: RealCluster,
                                                                  workloads: Workloads) -> None:
    stable = running(cluster, workloads, "ro-canary")
    before = cluster.deployments("ro-canary")[names.workload_name("ro-canary", stable)]
    canary = change_spec(cluster, "ro-canary")

    def both() -> dict[str, Any] | None:
        found = cluster.deployments("ro-canary")
        return found if set(found) == workload_names("ro-canary", stable, canary) else None

    deployments = cluster.until(both, "the canary's Deployment beside the stable one")
    after, beside = deployments[names.workload_name("ro-canary", stable)], deployments[
        names.workload_name("ro-canary", canary)]
    assert after.metadata.uid == before.metadata.uid and after.spec.template == before.spec.template
    assert speculative_config(beside)["num_speculative_tokens"] == NEW_SPECULATIVE_TOKENS
    assert beside.spec.template.metadata.labels[names.LABEL_REVISION] == canary
    owner = cluster.get("ro-canary")
    assert owned_by(cluster.apps.api_client.sanitize_for_serialization(beside), owner)
    status = cluster.status("ro-canary")
    assert (status["stableRevision"], status["canaryStep"], status["rollout"]["phase"]) == (stable, 0, "Progressing")
    cluster.until(lambda: "RolloutStarted" in reasons(cluster, "ro-canary"), "the RolloutStarted Event")
    cluster.settled("ro-canary")
    delete(cluster, "ro-canary")


# -- the analysis decides -------------------------------------------------------------------------


def test_low_acceptance_rolls_the_canary_back_with_the_reason(cluster: RealCluster, workloads: Workloads,
                                                             stand_ins: list[HttpStandIn]) -> None:
    stable = running(cluster, workloads, "ro-rollback")
    canary = change_spec(cluster, "ro-rollback")
    stand_ins.append(runtime := RuntimeStandIn(acceptance=0.1))
    cluster.stand_in_pod("ro-rollback", canary, runtime.port)

    rolled_back = cluster.until(lambda: (c := cluster.condition("ro-rollback", "RolledBack")).get("status") == "True"
                                and c, "RolledBack=True")
    assert rolled_back["reason"] == "AnalysisFailed"
    assert "acceptance rate 0.1 < minAcceptanceRate 0.5" in rolled_back["message"]
    status = cluster.status("ro-rollback")
    assert status["stableRevision"] == stable and "canaryRevision" not in status
    assert status["rollout"]["rolledBackRevision"] == canary
    cluster.until(lambda: set(cluster.deployments("ro-rollback")) == workload_names("ro-rollback", stable),
                  "the canary's Deployment deleted")
    cluster.until(lambda: any((t, r) == ("Warning", "RolledBack") and "minAcceptanceRate" in m
                              for t, r, m in cluster.events("ro-rollback")), "the RolledBack Warning Event")
    cluster.settled("ro-rollback")


@pytest.mark.parametrize(("name", "answering", "why"), [("ro-idle", True, "no requests reached revision"),
                                                     ("ro-unreachable", False, "no canary pod answered /metrics")],
                         ids=["an idle runtime", "no runtime answering"])
def test_a_canary_without_data_pauses_and_says_why(cluster: RealCluster, workloads: Workloads,
                                                   stand_ins: list[HttpStandIn], name: str, answering: bool,
                                                   why: str) -> None:
    """A ready canary pod whose runtime no request reaches, or whose ``/metrics`` nothing answers:
    every window is inconclusive, and inconclusiveLimit (3) of them in a row pause the rollout,
    saying why; it neither promotes nor rolls back."""
    stable = running(cluster, workloads, name)
    canary = change_spec(cluster, name)
    if answering:
        stand_ins.append(runtime := idle_runtime())
    cluster.stand_in_pod(name, canary, runtime.port if answering else free_port())

    paused = cluster.until(lambda: (c := cluster.condition(name, "Paused")).get("status") == "True" and c,
                           "Paused=True")
    assert paused["reason"] == "InconclusiveAnalysis"
    assert "3 inconclusive analyses in a row" in paused["message"] and names.ANNOTATION_RESUME in paused["message"]
    assert why in paused["message"]
    status = cluster.status(name)
    assert status["rollout"]["phase"] == "Paused" and status["rollout"]["pausedBy"] == "InconclusiveAnalysis"
    cluster.until(lambda: ("Warning", "InconclusiveAnalysis") in {(t, r) for t, r, _ in cluster.events(name)},
                  "the InconclusiveAnalysis Warning Event")

    held = analyses(cluster, name, "inconclusive") + 3
    cluster.until(lambda: analyses(cluster, name, "inconclusive") >= held, "three more analyses while paused")
    status = cluster.status(name)
    assert (status["stableRevision"], status["canaryRevision"], status["canaryStep"]) == (stable, canary, 0)
    assert status["rollout"]["phase"] == "Paused"
    assert cluster.condition(name, "RolledBack").get("status") != "True"
    assert set(cluster.deployments(name)) == workload_names(name, stable, canary)
    cluster.settled(name)
    delete(cluster, name)


# -- commands by annotation -----------------------------------------------------------------------


def test_the_promote_annotation_promotes_without_analysis(cluster: RealCluster, workloads: Workloads) -> None:
    """No canary pod answers, so no analysis can decide: only the command does."""
    stable = running(cluster, workloads, "ro-promote")
    canary = change_spec(cluster, "ro-promote")
    annotate(cluster, "ro-promote", names.ANNOTATION_PROMOTE, "true")

    cluster.until(lambda: cluster.status("ro-promote").get("stableRevision") == canary, "the canary promoted")
    cluster.until(lambda: set(cluster.deployments("ro-promote")) == workload_names("ro-promote", canary),
                  f"the Deployment of {stable} deleted")
    cluster.until(lambda: names.ANNOTATION_PROMOTE not in annotations(cluster, "ro-promote"),
                  "the one-shot annotation removed")
    cluster.until(lambda: {"Promoting", "Promoted"} <= set(reasons(cluster, "ro-promote")), "the promotion's Events")
    assert "StepPassed" not in reasons(cluster, "ro-promote")
    cluster.settled("ro-promote")


def test_the_abort_annotation_rolls_back(cluster: RealCluster, workloads: Workloads) -> None:
    stable = running(cluster, workloads, "ro-abort")
    canary = change_spec(cluster, "ro-abort")
    annotate(cluster, "ro-abort", names.ANNOTATION_ABORT, "true")

    rolled_back = cluster.until(lambda: (c := cluster.condition("ro-abort", "RolledBack")).get("reason")
                                == "ManualAbort" and c, "RolledBack, reason ManualAbort")
    assert rolled_back["status"] == "True"
    assert cluster.status("ro-abort")["rollout"]["rolledBackRevision"] == canary
    cluster.until(lambda: names.ANNOTATION_ABORT not in annotations(cluster, "ro-abort"),
                  "the one-shot annotation removed")
    cluster.until(lambda: set(cluster.deployments("ro-abort")) == workload_names("ro-abort", stable),
                  "only the stable Deployment left")
    cluster.settled("ro-abort")


def test_the_pause_annotation_holds_the_step_until_removed(cluster: RealCluster, workloads: Workloads,
                                                           stand_ins: list[HttpStandIn]) -> None:
    """Paused before any analysis: passing analyses move nothing while the annotation is there;
    removing it resumes the rollout, which then promotes."""
    running(cluster, workloads, "ro-pause")
    canary = change_spec(cluster, "ro-pause")
    annotate(cluster, "ro-pause", names.ANNOTATION_PAUSE, "true")
    paused = cluster.until(lambda: (c := cluster.condition("ro-pause", "Paused")).get("reason") == "ManualPause" and c,
                           "Paused, reason ManualPause")
    assert paused["status"] == "True" and names.ANNOTATION_PAUSE in paused["message"]

    stand_ins.append(runtime := RuntimeStandIn(acceptance=0.8))
    cluster.stand_in_pod("ro-pause", canary, runtime.port)
    cluster.until(lambda: analyses(cluster, "ro-pause", "pass") >= 3, "three passing analyses while paused")
    status = cluster.status("ro-pause")
    assert (status["canaryRevision"], status["canaryStep"], status["rollout"]["phase"]) == (canary, 0, "Paused")
    assert names.ANNOTATION_PAUSE in annotations(cluster, "ro-pause")  # held while present, not consumed

    annotate(cluster, "ro-pause", names.ANNOTATION_PAUSE, None)
    cluster.until(lambda: cluster.status("ro-pause").get("stableRevision") == canary, "the canary promoted")
    cluster.until(lambda: {"ManualPause", "Resumed", "Promoted"} <= set(reasons(cluster, "ro-pause")),
                  "the pause's, resume's and promotion's Events")
    cluster.settled("ro-pause")


def test_a_command_re_applied_by_another_field_manager_does_nothing(cluster: RealCluster,
                                                                    workloads: Workloads) -> None:
    """GitOps keeps a command in Git: Argo CD applies the manifest server-side with an abort, the
    operator obeys it once and leaves the annotation there; Flux (another field manager) applies
    the same annotation again with the next edit, and again after: the new canary runs on."""
    name = "ro-gitops"
    running(cluster, workloads, name)
    canary = change_spec(cluster, name)

    def applied(tokens: int, manager: str) -> None:
        manifest = example(name)
        manifest["metadata"]["annotations"] = {names.ANNOTATION_ABORT: "change-4711"}
        manifest["spec"]["speculative"]["numSpeculativeTokens"] = tokens
        cluster.custom.patch_namespaced_custom_object(names.GROUP, names.VERSION, NS, names.PLURAL, name, manifest,
                                                      field_manager=manager, force=True, _content_type=APPLY_PATCH)

    applied(NEW_SPECULATIVE_TOKENS, "argocd-controller")
    cluster.until(lambda: cluster.condition(name, "RolledBack").get("reason") == "ManualAbort", "the abort obeyed")
    cluster.until(lambda: cluster.status(name).get("commands", {}).get("abort") == "change-4711", "the value recorded")
    assert cluster.status(name)["rollout"]["rolledBackRevision"] == canary
    assert annotations(cluster, name)[names.ANNOTATION_ABORT] == "change-4711"  # left in place

    applied(2, "kustomize-controller")  # the next edit, the abort still in the manifest
    newer = cluster.until(lambda: (c := cluster.status(name).get("canaryRevision")) not in (None, canary) and c,
                          "the next canary")
    cluster.settled(name)
    applied(2, "argocd-controller")  # and applied once more by the first manager
    cluster.settled(name)
    status = cluster.status(name)
    assert (status["canaryRevision"], status["rollout"]["phase"]) == (newer, "Progressing")
    assert reasons(cluster, name).count("RolledBack") == 1
    assert annotations(cluster, name)[names.ANNOTATION_ABORT] == "change-4711"
    delete(cluster, name)


# -- an operator restart --------------------------------------------------------------------------


def test_a_restarted_operator_resumes_the_rollout_at_the_step_in_status(
        cluster: RealCluster, workloads: Workloads, operator: Operator, stand_ins: list[HttpStandIn]) -> None:
    """The canary passes step 1 (50 %); step 2 (100 %) is held unreached (the workloads stand-in
    no longer reports the scaled canary ready) while the operator is stopped and started again.
    The restarted operator goes on at step 2, as status says: it neither starts the rollout over
    nor passes step 1 again, and promotes once step 2 is reached and its analysis passes."""
    stable = running(cluster, workloads, "ro-restarted")
    canary = change_spec(cluster, "ro-restarted")
    cluster.until(lambda: cluster.status("ro-restarted")["rollout"].get("stepStartedAt"), "step 1 reached")
    workloads.ready.discard("ro-restarted")  # step 1's replicas stay ready as reported; step 2's never are
    stand_ins.append(runtime := RuntimeStandIn(acceptance=0.8))
    cluster.stand_in_pod("ro-restarted", canary, runtime.port)
    cluster.until(lambda: cluster.status("ro-restarted").get("canaryStep") == 1, "step 1 passed")
    cluster.settled("ro-restarted")
    before = cluster.status("ro-restarted")
    assert "stepStartedAt" not in before["rollout"]  # step 2 not reached

    operator.stop()
    operator.start()
    cluster.until(lambda: "[llm/ro-restarted] Handler 'reconcile' succeeded" in operator.log()[operator.run_from:],
                  "the restarted operator's reconciliation of ro-restarted")
    cluster.until(lambda: analyses(cluster, "ro-restarted", "pass") >= 2, "the restarted operator's analyses")
    after = cluster.status("ro-restarted")
    assert (after["stableRevision"], after["canaryRevision"], after["canaryStep"]) == (stable, canary, 1)
    assert after["rollout"]["phase"] == "Progressing"

    workloads.ready.add("ro-restarted")
    cluster.until(lambda: cluster.status("ro-restarted").get("stableRevision") == canary, "the canary promoted")
    cluster.until(lambda: "Promoted" in reasons(cluster, "ro-restarted"), "the Promoted Event")
    events = reasons(cluster, "ro-restarted")
    assert events.count("RolloutStarted") == 1 and events.count("StepPassed") == 1
    assert "RolloutRestarted" not in events
    cluster.settled("ro-restarted")
