"""The operator end to end: the real kopf runtime (as the chart runs it) against the emulated API
server (kube_emulator.py), driven through the official ``kubernetes`` client.

Canary pods are stand-ins the tests create: labelled with the canary revision, ``podIP``
127.0.0.1 and an ``http`` port where a real HTTP server serves the runtime's Prometheus metrics,
advancing its counters at a chosen acceptance rate on every scrape. Analysis runs every second
over a two-second window, so a whole rollout takes a few seconds.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import kubernetes
import pytest
import yaml
from kube_emulator import ApiServer, serve
from operator_harness import (
    EXAMPLES,
    FAST_ANALYSIS,
    NS,
    Cluster,
    HttpStandIn,
    PrometheusStandIn,
    RuntimeStandIn,
    crd_of,
    emulated_cluster,
    example,
    healthy,
    running_stable,
    start_canary,
    wait_for,
    write_kubeconfig,
)

from specdecode.operator import metrics, names
from specdecode.operator.crd import build_crd
from specdecode.operator.handlers import interval_passed
from specdecode.operator.render import revision
from specdecode.operator.resolve import resolve

pytestmark = pytest.mark.timeout(120)

@pytest.fixture
def cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Cluster]:
    """A fresh API server with the CRD installed, and the operator running against it."""
    with emulated_cluster(tmp_path, monkeypatch) as running:
        yield running


# -- tests ---------------------------------------------------------------------------------------


def test_the_emulator_keeps_the_api_servers_bookkeeping(tmp_path: Path) -> None:
    """What the operator and kopf rely on, without them (see kube_emulator.py)."""
    server = ApiServer()
    server.install_crd(build_crd())
    with serve(server) as url, kubernetes.config.new_client_from_config(
            str(write_kubeconfig(url, tmp_path / "kubeconfig"))) as client:
        api = Cluster(client, url, 0, 0)
        body = example()
        body["status"] = {"replicas": 7}
        api.create(body)
        created = api.get("smollm2-ngram")
        meta = created["metadata"]
        assert meta["generation"] == 1 and meta["uid"] and meta["creationTimestamp"] and "status" not in created
        api.custom.patch_namespaced_custom_object_status(names.GROUP, names.VERSION, NS, names.PLURAL,
                                                         "smollm2-ngram", {"status": {"replicas": 2}, "spec": None})
        api.patch("smollm2-ngram", {"metadata": {"labels": {"team": "ml"}}, "status": {"replicas": 9}})
        after = api.get("smollm2-ngram")
        assert after["metadata"]["generation"] == 1 and after["status"] == {"replicas": 2} and after["spec"]
        assert int(after["metadata"]["resourceVersion"]) > int(meta["resourceVersion"])
        api.patch("smollm2-ngram", {"spec": {"replicas": 3}})
        assert api.get("smollm2-ngram")["metadata"]["generation"] == 2

        with pytest.raises(kubernetes.client.ApiException) as refused:
            api.patch("smollm2-ngram", {"spec": {"replicas": -1}})
        assert refused.value.status == 422 and "replicas" in refused.value.body
        api.patch("smollm2-ngram", {"spec": {"colour": "blue"}})  # the CRD keeps unknown fields for admission
        assert api.get("smollm2-ngram")["spec"]["colour"] == "blue"
        with pytest.raises(kubernetes.client.ApiException) as stale:
            api.patch("smollm2-ngram", {"metadata": {"resourceVersion": "1", "labels": {"team": "x"}}})
        assert stale.value.status == 409

        for name, tier in (("a", "gold"), ("b", "silver")):
            api.core.create_namespaced_pod(NS, {"metadata": {"name": name, "labels": {"tier": tier}},
                                                "spec": {"containers": [{"name": "c", "image": "i"}]}})
        event = api.core.create_namespaced_event(NS, {"metadata": {"generateName": "e-"}, "reason": "R",
                                                      "involvedObject": {"name": "a"}})
        assert event.metadata.name.startswith("e-") and len(event.metadata.name) == 7
        assert [p.metadata.name for p in api.core.list_namespaced_pod(NS, label_selector="tier=gold").items] == ["a"]
        assert [p.metadata.name for p in api.core.list_namespaced_pod(NS, label_selector="tier!=gold").items] == ["b"]
        assert NS in [n.metadata.name for n in api.core.list_namespace().items]


def test_the_emulator_applies_server_side_and_keeps_field_owners(tmp_path: Path) -> None:
    """Server-side apply and managedFields as the operator relies on them (see kube_fields.py)."""
    server = ApiServer()
    with serve(server) as url, kubernetes.config.new_client_from_config(
            str(write_kubeconfig(url, tmp_path / "kubeconfig"))) as client:
        core = kubernetes.client.CoreV1Api(client)
        apply = {"field_manager": "op", "force": True, "_content_type": "application/apply-patch+yaml"}
        svc = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "s", "labels": {"a": "1", "b": "2"}},
               "spec": {"selector": {"app": "s", "old": "x"}, "ports": [{"name": "http", "port": 80, "protocol": "TCP"}]}}
        created = core.patch_namespaced_service("s", NS, svc, **apply)  # an apply creates what is missing
        assert created.metadata.uid and [(m.manager, m.operation) for m in created.metadata.managed_fields] == [
            ("op", "Apply")]
        core.patch_namespaced_service("s", NS, {"metadata": {"annotations": {"note": "n"}}}, field_manager="user",
                                      _content_type="application/merge-patch+json")
        fewer = {**svc, "metadata": {"name": "s", "labels": {"a": "1"}}, "spec": {**svc["spec"], "selector": {"app": "s"}}}
        applied = core.patch_namespaced_service("s", NS, fewer, **apply)
        assert applied.metadata.labels == {"a": "1"} and applied.spec.selector == {"app": "s"}  # no longer applied: gone
        assert applied.metadata.annotations == {"note": "n"}  # another manager's field stays
        again = core.patch_namespaced_service("s", NS, fewer, **apply)
        assert again.metadata.resource_version == applied.metadata.resource_version  # changed nothing, wrote nothing
        with pytest.raises(kubernetes.client.ApiException) as conflict:  # another manager's value, not forced
            core.patch_namespaced_service("s", NS, {**fewer, "metadata": {"name": "s", "annotations": {"note": "m"}}},
                                          field_manager="other", _content_type="application/apply-patch+yaml")
        assert conflict.value.status == 409 and "user" in conflict.value.body and ".metadata.annotations.note" in (
            conflict.value.body)
        legacy = core.create_namespaced_service(NS, {**svc, "metadata": {"name": "t"}})  # no fieldManager
        assert [(m.manager, m.operation) for m in legacy.metadata.managed_fields] == [("OpenAPI-Generator", "Update")]


def test_create_renders_owned_children_and_typed_status(cluster: Cluster) -> None:
    stable = running_stable(cluster, serviceMonitor={"enabled": True},
                            rollout={"analysis": FAST_ANALYSIS, "trafficRouting": {"httpRoute": "gateway"}})
    body, status = cluster.get("smollm2-ngram"), cluster.status("smollm2-ngram")
    assert status["observedGeneration"] == body["metadata"]["generation"] == 1
    assert status["warnings"] == ["ServiceMonitor smollm2-ngram not created: the cluster does not serve "
                                  "monitoring.coreos.com/v1",
                                  "HTTPRoute gateway: the cluster does not serve gateway.networking.k8s.io/v1; "
                                  "traffic follows the replica ratio"]
    assert status["replicas"] == status["readyReplicas"] == 2
    assert status["selector"] == f"{names.LABEL_NAME}=specdecode,{names.LABEL_INSTANCE}=smollm2-ngram"
    assert status["rollout"]["phase"] == "Stable" and "canaryRevision" not in status
    assert status["layout"] == "TP1×PP1"

    (deployment,) = cluster.deployments("smollm2-ngram").values()
    cluster.apps.delete_namespaced_deployment(deployment.metadata.name, NS)  # the operator makes it again
    wait_for(lambda: [d.metadata.uid for d in cluster.deployments("smollm2-ngram").values()
                      if d.metadata.uid != deployment.metadata.uid], "the deleted Deployment made again")
    (deployment,) = cluster.deployments("smollm2-ngram").values()
    service = cluster.core.read_namespaced_service(names.service_name("smollm2-ngram"), NS)
    pdb = kubernetes.client.PolicyV1Api(cluster.apps.api_client).read_namespaced_pod_disruption_budget(
        names.pdb_name("smollm2-ngram"), NS)
    assert deployment.metadata.name == names.workload_name("smollm2-ngram", stable)
    assert deployment.spec.replicas == 2
    for child in (deployment, service, pdb):
        (owner,) = child.metadata.owner_references
        assert (owner.kind, owner.name, owner.uid, owner.controller) == (
            names.KIND, "smollm2-ngram", body["metadata"]["uid"], True)
    wait_for(lambda: ("Normal", "Deployed") in {(t, r) for t, r, _ in cluster.events("smollm2-ngram")},
             "the Deployed Event")

    # the chart's probes and the dashboard's series
    assert healthy(cluster.liveness_url)
    exposed = cluster.operator_metrics()
    for metric in metrics.ALL:
        assert f"# TYPE {metric} " in exposed, metric
    assert f'{metrics.ROLLOUT_STEP}{{name="smollm2-ngram",namespace="{NS}"}} -1.0' in exposed


def test_a_pipeline_layout_runs_a_statefulset_group_per_replica_and_shows_in_status(cluster: Cluster) -> None:
    """TP2×PP2 on CPU: a pod per stage, two pods per replica; ``kubectl get sdd`` reads status.layout."""
    stable = running_stable(cluster, parallelism={"tensor": 2, "pipeline": 2})
    assert cluster.status("smollm2-ngram")["layout"] == "TP2×PP2"
    groups = cluster.apps.list_namespaced_stateful_set(NS, label_selector=f"{names.LABEL_INSTANCE}=smollm2-ngram")
    assert sorted(s.metadata.name for s in groups.items) == [names.group_name("smollm2-ngram", stable, g)
                                                             for g in (0, 1)]
    for sts in groups.items:
        (container,) = sts.spec.template.spec.containers
        assert sts.spec.replicas == 2 and {e.name: e.value for e in container.env}["NNODES"] == "2"
        assert "--pipeline-parallel-size" in container.args and "--tensor-parallel-size" in container.args


def test_schema_violations_are_refused_by_the_api_server(cluster: Cluster) -> None:
    body = yaml.safe_load((EXAMPLES / "invalid-mtp.yaml").read_text())
    body["metadata"]["namespace"] = NS
    with pytest.raises(kubernetes.client.ApiException) as refused:
        cluster.create(body)
    assert refused.value.status == 422
    assert "spec.speculative.numSpeculativeTokens" in refused.value.body  # the schema's part; the rest is resolve's


def test_invalid_spec_past_admission_is_reported_not_retried(cluster: Cluster) -> None:
    """What the schema allows but resolve refuses (the webhook was down or not installed)."""
    body = example("too-many-gpus")
    body["spec"]["resources"] = {"gpusPerPod": 2}  # more than parallelism.tensor (1)
    cluster.create(body)
    ready = wait_for(lambda: cluster.condition("too-many-gpus", "Ready").get("reason") == "InvalidSpec"
                     and cluster.condition("too-many-gpus", "Ready"), "Ready=False InvalidSpec")
    assert ready["status"] == "False" and "gpusPerPod: 2 is more than parallelism.tensor" in ready["message"]
    assert cluster.deployments("too-many-gpus") == {}
    wait_for(lambda: ("Warning", "InvalidSpec") in {(t, r) for t, r, _ in cluster.events("too-many-gpus")},
             "the InvalidSpec Warning Event")

    cluster.patch("too-many-gpus", {"spec": {"resources": {"gpusPerPod": 0}}})  # fixed: the operator goes on
    wait_for(lambda: cluster.condition("too-many-gpus", "Ready").get("status") == "True", "Ready=True once fixed")
    assert len(cluster.deployments("too-many-gpus")) == 1


def test_a_runtime_that_refuses_to_start_shows_in_status(cluster: Cluster) -> None:
    """The runtime's termination message (its one-line refusal) becomes Degraded=True, RuntimeRefused."""
    stable = running_stable(cluster, replicas=1)
    (deployment,) = cluster.deployments("smollm2-ngram").values()
    cluster.apps.patch_namespaced_deployment_status(deployment.metadata.name, NS, {"status": {"readyReplicas": 0}})
    refused = "specdecode serve: cannot start: /mnt/models/smol has no MTP layers; train heads with specdecode train-mtp"
    crashed = {"name": names.CONTAINER, "image": "stand-in", "imageID": "", "ready": False, "restartCount": 2,
               "state": {"waiting": {"reason": "CrashLoopBackOff"}},
               "lastState": {"terminated": {"exitCode": 1, "reason": "Error", "message": refused + "\n"}}}
    pod = cluster.runtime_pod("smollm2-ngram", stable, {"phase": "Running", "containerStatuses": [crashed]})

    degraded = wait_for(lambda: (c := cluster.condition("smollm2-ngram", "Degraded")).get("reason") == "RuntimeRefused"
                        and c, "Degraded=True, reason RuntimeRefused")
    assert degraded["status"] == "True"
    assert degraded["message"] == f"pod {pod} (revision {stable}): runtime exited with code 1: {refused}"
    # a reconciliation that listed the workloads before the test's status patch may still say Ready
    wait_for(lambda: cluster.condition("smollm2-ngram", "Ready")["status"] == "False", "Ready=False")
    wait_for(lambda: ("Warning", "RuntimeRefused", degraded["message"]) in cluster.events("smollm2-ngram"),
             "the RuntimeRefused Warning Event")

    running = {**crashed, "state": {"running": {}}, "ready": True}
    cluster.core.patch_namespaced_pod_status(pod, NS, {"status": {"containerStatuses": [running]}})  # fixed
    wait_for(lambda: cluster.condition("smollm2-ngram", "Degraded").get("reason") == "AsExpected", "Degraded cleared")


PENDING = yaml.safe_load((Path(__file__).parent / "fixtures" / "pending_failures.yaml").read_text())


def test_pods_that_never_come_show_in_status(cluster: Cluster) -> None:
    """Failures that make no container exit, in the shapes a real cluster gives them
    (fixtures/pending_failures.yaml): a Deployment whose ReplicaSet a quota forbids to create pods
    is Degraded=True, FailedCreate, with the quota's words; then a pod no node can take is
    Unschedulable, with the scheduler's; both clear once the pod runs."""
    stable = running_stable(cluster, replicas=1)
    (workload,) = cluster.deployments("smollm2-ngram")
    (quota,) = PENDING["deployment_quota"]["workloads"][0]["status"]["conditions"][1:2]
    cluster.apps.patch_namespaced_deployment_status(workload, NS, {"status": {"readyReplicas": 0,
                                                                              "conditions": [quota]}})
    degraded = wait_for(lambda: (c := cluster.condition("smollm2-ngram", "Degraded")).get("reason") == "FailedCreate"
                        and c, "Degraded=True, reason FailedCreate")
    assert degraded["message"] == f"Deployment {workload} (revision {stable}): {' '.join(quota['message'].split())}"
    wait_for(lambda: ("Warning", "FailedCreate", degraded["message"]) in cluster.events("smollm2-ngram"),
             "a FailedCreate Warning Event")  # kopf posts Events after the status

    (pending,) = PENDING["unschedulable_gpu"]["pods"]
    cluster.apps.patch_namespaced_deployment_status(workload, NS, {"status": {"conditions": []}})  # created now
    pod = cluster.runtime_pod("smollm2-ngram", stable, pending["status"])
    unschedulable = wait_for(lambda: (c := cluster.condition("smollm2-ngram", "Degraded")).get("reason") == (
        "Unschedulable") and c, "Degraded=True, reason Unschedulable")
    assert unschedulable["message"].startswith(f"pod {pod} (revision {stable}): unschedulable: 0/3 nodes are "
                                               "available: 3 Insufficient nvidia.com/gpu.")
    cluster.core.patch_namespaced_pod_status(pod, NS, {"status": {"phase": "Running", "conditions": [
        {"type": "PodScheduled", "status": "True"}, {"type": "Ready", "status": "True"}]}})
    wait_for(lambda: cluster.condition("smollm2-ngram", "Degraded").get("reason") == "AsExpected", "Degraded cleared")


def test_good_canary_is_promoted_step_by_step(cluster: Cluster, stand_ins: list[HttpStandIn]) -> None:
    stable = running_stable(cluster)
    canary = start_canary(cluster)
    assert set(cluster.deployments("smollm2-ngram")) == {names.workload_name("smollm2-ngram", rev)
                                                         for rev in (stable, canary)}
    stand_ins.append(runtime := RuntimeStandIn(acceptance=0.8))
    cluster.stand_in_pod("smollm2-ngram", canary, runtime.port)

    wait_for(lambda: cluster.status("smollm2-ngram").get("stableRevision") == canary, "the canary promoted")
    status = cluster.status("smollm2-ngram")
    assert "canaryRevision" not in status and status["rollout"]["phase"] == "Stable"
    assert status["acceptance"]["revision"] == canary and status["acceptance"]["rate"] == pytest.approx(0.8)
    (deployment,) = cluster.deployments("smollm2-ngram").values()
    assert deployment.metadata.name == names.workload_name("smollm2-ngram", canary) and deployment.spec.replicas == 2
    wanted = {"RolloutStarted", "StepReached", "StepPassed", "Promoted"}  # kopf posts Events after the status
    wait_for(lambda: wanted <= {r for _, r, _ in cluster.events("smollm2-ngram")}, "the rollout's Events")
    exposed = cluster.operator_metrics()
    assert f'{metrics.ANALYSIS_RUNS}{{name="smollm2-ngram",namespace="{NS}",result="pass"}}' in exposed
    assert (f'{metrics.ACCEPTANCE_RATE}{{name="smollm2-ngram",namespace="{NS}",revision="{canary}"}} 0.8'
            in exposed)


def test_low_acceptance_rolls_back_with_the_reason(cluster: Cluster, stand_ins: list[HttpStandIn]) -> None:
    stable = running_stable(cluster)
    canary = start_canary(cluster)
    stand_ins.append(runtime := RuntimeStandIn(acceptance=0.1))
    cluster.stand_in_pod("smollm2-ngram", canary, runtime.port)

    rolled_back = wait_for(lambda: cluster.condition("smollm2-ngram", "RolledBack").get("status") == "True"
                           and cluster.condition("smollm2-ngram", "RolledBack"), "RolledBack=True")
    assert rolled_back["reason"] == "AnalysisFailed"
    assert "acceptance rate 0.1 < minAcceptanceRate 0.5" in rolled_back["message"]
    status = cluster.status("smollm2-ngram")
    assert status["stableRevision"] == stable and "canaryRevision" not in status
    assert status["rollout"]["rolledBackRevision"] == canary
    wait_for(lambda: set(cluster.deployments("smollm2-ngram")) == {names.workload_name("smollm2-ngram", stable)},
             "the canary's Deployment deleted")
    assert cluster.deployments("smollm2-ngram")[names.workload_name("smollm2-ngram", stable)].spec.replicas == 2
    warnings = wait_for(lambda: [m for t, r, m in cluster.events("smollm2-ngram")
                                 if (t, r) == ("Warning", "RolledBack")], "the RolledBack Warning Event")
    assert len(warnings) == 1 and "minAcceptanceRate" in warnings[0]
    assert f'{metrics.ROLLBACKS}{{name="smollm2-ngram",namespace="{NS}"}} 1.0' in cluster.operator_metrics()


def test_an_httproute_moves_traffic_by_step_weight(cluster: Cluster, stand_ins: list[HttpStandIn]) -> None:
    """With the Gateway API served: the user's route gets the stable and canary Services as
    backends, weighted by the step the canary last reached; another application's rule stays."""
    assert cluster.server is not None
    cluster.server.install_crd(crd_of("gateway.networking.k8s.io", "v1", "HTTPRoute", "httproutes"))
    routes = ("gateway.networking.k8s.io", "v1", NS, "httproutes")
    admin = {"matches": [{"path": {"type": "PathPrefix", "value": "/admin"}}],
             "backendRefs": [{"name": "admin-ui", "port": 80}]}
    cluster.custom.create_namespaced_custom_object(*routes, {
        "apiVersion": "gateway.networking.k8s.io/v1", "kind": "HTTPRoute", "metadata": {"name": "gateway"},
        "spec": {"parentRefs": [{"name": "public"}], "rules": [
            {"backendRefs": [{"name": "smollm2-ngram", "port": 8000}]}, admin]}})

    def weights() -> dict[str, int]:
        rules = cluster.custom.get_namespaced_custom_object(*routes, "gateway")["spec"]["rules"]
        assert rules[1] == admin
        return {ref["name"]: ref["weight"] for ref in rules[0]["backendRefs"] if "weight" in ref}

    def selects(service: str) -> str:
        return cluster.core.read_namespaced_service(service, NS).spec.selector[names.LABEL_REVISION]

    stable = running_stable(cluster, rollout={"analysis": FAST_ANALYSIS, "trafficRouting": {"httpRoute": "gateway"}})
    wait_for(lambda: weights() == {"smollm2-ngram-stable": 100, "smollm2-ngram-canary": 0}, "all traffic to stable")
    assert selects("smollm2-ngram-stable") == selects("smollm2-ngram-canary") == stable
    assert "warnings" not in cluster.status("smollm2-ngram") or cluster.status("smollm2-ngram")["warnings"] == []

    canary = start_canary(cluster)
    stand_ins.append(runtime := RuntimeStandIn(acceptance=0.8))
    cluster.stand_in_pod("smollm2-ngram", canary, runtime.port)
    # The route is patched before the status in one reconciliation: wait for both.
    wait_for(lambda: weights() == {"smollm2-ngram-stable": 50, "smollm2-ngram-canary": 50}
             and cluster.status("smollm2-ngram")["rollout"]["canaryWeight"] == 50, "half to the canary")
    assert cluster.status("smollm2-ngram")["rollout"]["analysisSince"]  # windows count once the route took it
    assert (selects("smollm2-ngram-stable"), selects("smollm2-ngram-canary")) == (stable, canary)

    wait_for(lambda: cluster.status("smollm2-ngram").get("stableRevision") == canary, "the canary promoted")
    wait_for(lambda: weights() == {"smollm2-ngram-stable": 100, "smollm2-ngram-canary": 0}, "all traffic to stable")
    assert selects("smollm2-ngram-stable") == selects("smollm2-ngram-canary") == canary
    assert f'{metrics.CANARY_WEIGHT}{{name="smollm2-ngram",namespace="{NS}"}} 0.0' in cluster.operator_metrics()


def test_prometheus_source_judges_the_canary_without_scraping_pods(cluster: Cluster,
                                                                   stand_ins: list[HttpStandIn]) -> None:
    stable = running_stable(cluster)
    stand_ins.append(prometheus := PrometheusStandIn())
    cluster.patch("smollm2-ngram", {"spec": {"speculative": {"numSpeculativeTokens": 3}, "rollout": {"analysis": {
        "maxP95InterTokenLatencyMs": None,  # this Prometheus has no latency histogram
        "prometheus": {"url": prometheus.url}}}}})
    prometheus.revision = canary = wait_for(lambda: cluster.status("smollm2-ngram").get("canaryRevision"), "a canary")

    wait_for(lambda: cluster.status("smollm2-ngram").get("stableRevision") == canary, "the canary promoted")
    assert canary != stable and cluster.status("smollm2-ngram")["acceptance"]["rate"] == pytest.approx(0.9)
    assert any(f'namespace="{NS}",service="smollm2-ngram",revision="{canary}"' in q for q in prometheus.queries)


def test_a_restarted_operator_resumes_the_rollout_from_status(cluster: Cluster,
                                                              stand_ins: list[HttpStandIn]) -> None:
    running_stable(cluster)
    canary = start_canary(cluster)
    wait_for(lambda: cluster.status("smollm2-ngram")["rollout"].get("stepStartedAt"), "step 1 reached")
    cluster.stop_operator()
    cluster.start_operator()  # the analysis samples are gone; the step, its start and the counters are not
    assert cluster.status("smollm2-ngram")["canaryRevision"] == canary
    stand_ins.append(runtime := RuntimeStandIn(acceptance=0.8))
    cluster.stand_in_pod("smollm2-ngram", canary, runtime.port)
    wait_for(lambda: cluster.status("smollm2-ngram").get("stableRevision") == canary, "the canary promoted")
    assert [r for _, r, _ in cluster.events("smollm2-ngram")].count("RolloutStarted") == 1


def test_the_analysis_daemon_waits_its_interval_or_until_stopped() -> None:
    """interval_passed: True once the interval is over; False once the stop flag is raised (well
    before a long interval ends), leaving no task of its own behind for kopf to re-raise at exit."""

    class StopFlag:  # what the daemon reads of kopf.DaemonStopped: its truth
        raised = False

        def __bool__(self) -> bool:
            return self.raised

    async def scenario() -> tuple[bool, bool, int]:
        flag = StopFlag()
        passed = await interval_passed(flag, 0.05)  # type: ignore[arg-type]
        asyncio.get_running_loop().call_later(0.1, setattr, flag, "raised", True)
        stopped_early = not await interval_passed(flag, 60)  # type: ignore[arg-type]
        return passed, stopped_early, len(asyncio.all_tasks())

    assert asyncio.run(scenario()) == (True, True, 1)  # the only task left is the scenario itself


def test_abort_annotation_rolls_back_by_hand(cluster: Cluster) -> None:
    stable = running_stable(cluster)
    canary = start_canary(cluster)  # no canary pod: no analysis verdict, only the command decides
    cluster.patch("smollm2-ngram", {"metadata": {"annotations": {names.ANNOTATION_ABORT: "true"}}})

    wait_for(lambda: cluster.condition("smollm2-ngram", "RolledBack").get("reason") == "ManualAbort", "ManualAbort")
    assert cluster.status("smollm2-ngram")["rollout"]["rolledBackRevision"] == canary
    wait_for(lambda: names.ANNOTATION_ABORT not in cluster.get("smollm2-ngram")["metadata"].get("annotations", {}),
             "the one-shot annotation removed")
    wait_for(lambda: set(cluster.deployments("smollm2-ngram")) == {names.workload_name("smollm2-ngram", stable)},
             "only the stable Deployment left")


def test_an_abort_at_the_full_step_keeps_the_canary_serving_until_the_stable_does(cluster: Cluster) -> None:
    """At 100 % with maxSurge 0 the stable has no replica. Aborted, the canary gives its replicas
    up one at a time, each once a stable replica is ready (maxUnavailable 1 of 2); the abort
    annotation, valued with the canary's revision, stays and is obeyed once."""
    stable = running_stable(cluster, rollout={"analysis": FAST_ANALYSIS, "steps": [{"weight": 100}]})
    canary = start_canary(cluster)  # no canary pod: no verdict moves it on
    wait_for(lambda: cluster.status("smollm2-ngram")["rollout"].get("stepStartedAt"), "the 100 % step reached")
    stable_workload, canary_workload = (names.workload_name("smollm2-ngram", rev) for rev in (stable, canary))
    assert cluster.deployments("smollm2-ngram")[stable_workload].spec.replicas == 0
    assert cluster.server is not None
    cluster.server.loading.add(stable_workload)  # the stable's replicas load until the test says so
    cluster.patch("smollm2-ngram", {"metadata": {"annotations": {names.ANNOTATION_ABORT: canary}}})

    def replicas() -> dict[str, tuple[int, int]]:
        return {rev: (d.spec.replicas, d.status.ready_replicas or 0)
                for rev, d in cluster.deployments("smollm2-ngram").items()}

    wait_for(lambda: replicas() == {stable_workload: (1, 0), canary_workload: (1, 1)}, "one canary replica retired")
    assert cluster.status("smollm2-ngram")["rollout"]["retiring"] == [{"revision": canary, "replicas": 1}]
    assert cluster.condition("smollm2-ngram", "Progressing")["reason"] == "Restoring"
    cluster.apps.patch_namespaced_deployment_status(stable_workload, NS, {"status": {"readyReplicas": 1}})
    wait_for(lambda: replicas() == {stable_workload: (2, 1)}, "the canary's last replica gone once the stable serves")
    cluster.server.loading.discard(stable_workload)
    cluster.apps.patch_namespaced_deployment_status(stable_workload, NS, {"status": {"readyReplicas": 2}})
    wait_for(lambda: cluster.condition("smollm2-ngram", "Progressing").get("reason") == "RolledBack", "restored")
    body = cluster.get("smollm2-ngram")
    assert body["metadata"]["annotations"][names.ANNOTATION_ABORT] == canary  # never removed
    assert body["status"]["commands"]["abort"] == canary
    wait_for(lambda: "RolledBack" in {r for _, r, _ in cluster.events("smollm2-ngram")}, "the RolledBack Event")
    assert [r for _, r, _ in cluster.events("smollm2-ngram")].count("RolledBack") == 1


def test_a_canary_that_stops_serving_at_its_step_rolls_back_and_is_retried(cluster: Cluster) -> None:
    """A canary whose pod crash-loops after its step was reached fails each analysis interval
    (CanaryNotReady, with the pod's reason) and is rolled back; the retry annotation starts it
    again."""
    running_stable(cluster)
    canary = start_canary(cluster)
    wait_for(lambda: cluster.status("smollm2-ngram")["rollout"].get("stepStartedAt"), "step 1 reached")
    cluster.apps.patch_namespaced_deployment_status(names.workload_name("smollm2-ngram", canary), NS,
                                                    {"status": {"readyReplicas": 0}})
    crashed = {"name": names.CONTAINER, "image": "stand-in", "imageID": "", "ready": False, "restartCount": 3,
               "state": {"waiting": {"reason": "CrashLoopBackOff"}},
               "lastState": {"terminated": {"exitCode": 1, "reason": "Error", "message": "CUDA out of memory\n"}}}
    cluster.runtime_pod("smollm2-ngram", canary, {"phase": "Running", "containerStatuses": [crashed]})

    rolled_back = wait_for(lambda: (c := cluster.condition("smollm2-ngram", "RolledBack")).get("status") == "True"
                           and c, "RolledBack=True")
    assert rolled_back["reason"] == "CanaryNotReady"
    assert "0 of 1 canary replicas ready at step 1" in rolled_back["message"]
    assert "CUDA out of memory" in rolled_back["message"]
    cluster.patch("smollm2-ngram", {"metadata": {"annotations": {names.ANNOTATION_RETRY: "after-the-fix"}}})
    wait_for(lambda: cluster.status("smollm2-ngram").get("canaryRevision") == canary, "the canary started again")
    wait_for(lambda: "RolloutRetried" in {r for _, r, _ in cluster.events("smollm2-ngram")}, "the RolloutRetried Event")
    assert cluster.status("smollm2-ngram")["commands"]["retry"] == "after-the-fix"


def test_the_progress_deadline_is_time_without_progress(cluster: Cluster) -> None:
    """Three canary replicas loading one after another take longer than progressDeadline (5 s),
    but each turns ready well within it: the step is reached. A replica that never loads rolls
    the next rollout back once the deadline passes without progress."""
    rollout = {"analysis": FAST_ANALYSIS, "steps": [{"weight": 100}], "progressDeadline": "5s"}
    running_stable(cluster, replicas=3, rollout=rollout)
    assert cluster.server is not None

    def canary_loading(tokens: int) -> str:
        """Start a canary (``tokens`` speculative tokens) whose replicas load until reported ready."""
        body = cluster.get("smollm2-ngram")
        body["spec"]["speculative"]["numSpeculativeTokens"] = tokens
        canary = revision(resolve(body).resolved)
        cluster.server.loading.add(names.workload_name("smollm2-ngram", canary))
        cluster.patch("smollm2-ngram", {"spec": {"speculative": {"numSpeculativeTokens": tokens}}})
        return canary

    canary = canary_loading(3)
    workload = names.workload_name("smollm2-ngram", canary)

    def canary_replicas() -> int:
        found = cluster.deployments("smollm2-ngram").get(workload)
        return found.spec.replicas if found else 0

    started = time.monotonic()
    for n in range(1, 4):
        wait_for(lambda: canary_replicas() >= n, f"canary replica {n} set")
        time.sleep(2)  # its model loads
        cluster.apps.patch_namespaced_deployment_status(workload, NS, {"status": {"readyReplicas": n}})
    wait_for(lambda: cluster.status("smollm2-ngram")["rollout"].get("stepStartedAt"), "the 100 % step reached")
    assert time.monotonic() - started > 5 and cluster.condition("smollm2-ngram", "RolledBack").get("status") != "True"

    stuck = canary_loading(2)  # the next canary's first replica never loads
    rolled_back = wait_for(lambda: (c := cluster.condition("smollm2-ngram", "RolledBack")).get("status") == "True"
                           and c, "rolled back at the deadline", timeout=60)
    assert rolled_back["reason"] == "ProgressDeadlineExceeded" and "without progress" in rolled_back["message"]
    assert cluster.status("smollm2-ngram")["rollout"]["rolledBackRevision"] == stuck


def test_delete_leaves_cleanup_to_owner_references(cluster: Cluster) -> None:
    running_stable(cluster)
    start_canary(cluster)  # the analysis daemon runs, so kopf holds a finalizer to stop it
    wait_for(lambda: cluster.get("smollm2-ngram")["metadata"].get("finalizers"), "kopf's finalizer")
    uid = cluster.get("smollm2-ngram")["metadata"]["uid"]
    cluster.custom.delete_namespaced_custom_object(names.GROUP, names.VERSION, NS, names.PLURAL, "smollm2-ngram")

    def gone() -> bool:
        try:
            cluster.get("smollm2-ngram")
        except kubernetes.client.ApiException as exc:
            return exc.status == 404
        return False

    wait_for(gone, "the resource deleted (finalizer released)")
    # No garbage collector here: the children stay, each pointing at the deleted owner.
    children = cluster.deployments("smollm2-ngram")
    assert len(children) == 2
    assert {d.metadata.owner_references[0].uid for d in children.values()} == {uid}
    assert healthy(cluster.liveness_url)
    cluster.create(example("again"))
    wait_for(lambda: cluster.condition("again", "Ready").get("status") == "True", "a new resource served")
