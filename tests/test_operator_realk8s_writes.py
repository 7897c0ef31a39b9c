"""Writes the real API server does not take (issue 30 item 2): every write of a pass is dry-run
first, so a denied one changes nothing — the stable keeps its replicas even where the pass would
scale it down first (maxSurge 0) — and the resource says why (``Ready=False``, ``ChildRefused``,
the server's message, a Warning Event) until the writes are admitted.

Two deniers a production cluster has: a validating webhook (here a small HTTPS server of the test,
registered like Gatekeeper's or Kyverno's, ``sideEffects: None`` so it answers dry runs too) and a
ResourceQuota (enforced by the API server's own admission plugin; no quota controller runs in this
tier, so the test writes the quota's ``status.used`` itself, as that controller would).
"""
from __future__ import annotations

import base64
import uuid
from pathlib import Path
from typing import Any

import kubernetes
import pytest
from operator_harness import NS, HttpStandIn, example, start_canary
from realk8s import make_ca, make_serving_cert
from realk8s_cluster import RealCluster, Workloads
from realk8s_operator import denied

from specdecode.operator import names

pytestmark = [pytest.mark.realk8s, pytest.mark.timeout(180, func_only=True)]

Obj = dict[str, Any]
NAME = "wr-denied"
POLICY = "policy.tests.specdecode.io"
REASON = "[canary-freeze] no new revisions during the freeze"
QUOTA = "one-deployment"
COUNT = "count/deployments.apps"


class PolicyWebhook:
    """A validating webhook denying every Deployment of ``NAME`` whose revision is not in ``allowed``."""

    def __init__(self, cluster: RealCluster, root: Path, allowed: set[str]) -> None:
        ca = make_ca(root, "policy-ca")
        self.allowed = allowed
        self.server = HttpStandIn(lambda _: ("text/plain", b""), post=self.review, tls=make_serving_cert(root, ca))
        self.api = kubernetes.client.AdmissionregistrationV1Api(cluster.core.api_client)
        self.api.create_validating_webhook_configuration({
            "apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingWebhookConfiguration",
            "metadata": {"name": "tests-policy"},
            "webhooks": [{"name": POLICY, "admissionReviewVersions": ["v1"], "sideEffects": "None",
                          "failurePolicy": "Fail", "timeoutSeconds": 5,
                          "clientConfig": {"url": f"{self.server.url}/validate",
                                           "caBundle": base64.b64encode(ca[0].read_bytes()).decode()},
                          "rules": [{"apiGroups": ["apps"], "apiVersions": ["v1"], "resources": ["deployments"],
                                     "operations": ["CREATE", "UPDATE"]}],
                          "objectSelector": {"matchLabels": {names.LABEL_INSTANCE: NAME}}}]})
        self.installed = True
        cluster.until(lambda: REASON in (refusal(cluster, "probe") or ""), "the webhook in effect")

    def review(self, _: str, sent: Obj) -> Obj:
        request = sent["request"]
        labels = (request.get("object") or {}).get("metadata", {}).get("labels") or {}
        allow = labels.get(names.LABEL_REVISION) in self.allowed
        return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
                "response": {"uid": request["uid"], "allowed": allow,
                             **({} if allow else {"status": {"code": 403, "message": REASON}})}}

    def remove(self) -> None:
        if self.installed:
            self.api.delete_validating_webhook_configuration("tests-policy")
            self.server.close()
            self.installed = False


def exhaust_quota(cluster: RealCluster, revision: str) -> None:
    """A ResourceQuota of one Deployment, used up; in effect for a Deployment of ``revision``."""
    cluster.core.create_namespaced_resource_quota(NS, {"metadata": {"name": QUOTA}, "spec": {"hard": {COUNT: "1"}}})
    cluster.core.patch_namespaced_resource_quota_status(QUOTA, NS, {"status": {"hard": {COUNT: "1"},
                                                                               "used": {COUNT: "1"}}})
    cluster.until(lambda: "exceeded quota" in (refusal(cluster, revision) or ""), "the quota in effect")


def remove_quota(cluster: RealCluster) -> None:
    try:
        cluster.core.delete_namespaced_resource_quota(QUOTA, NS)
    except kubernetes.client.ApiException as exc:
        if exc.status != 404:
            raise


def refusal(cluster: RealCluster, revision: str) -> str | None:
    """The API server's answer to a dry-run create of a Deployment of ``NAME``'s ``revision``."""
    name = f"probe-{uuid.uuid4().hex[:6]}"
    selector = {"app": name}
    labels = {names.LABEL_INSTANCE: NAME, names.LABEL_REVISION: revision}
    body = {"metadata": {"name": name, "labels": labels},
            "spec": {"selector": {"matchLabels": selector}, "template": {
                "metadata": {"labels": selector}, "spec": {"containers": [{"name": "c", "image": "x"}]}}}}
    try:
        cluster.apps.create_namespaced_deployment(NS, body, dry_run="All")
    except kubernetes.client.ApiException as exc:
        return exc.body
    return None


def ready_reason(cluster: RealCluster, reason: str) -> Obj:
    return cluster.until(lambda: (c := cluster.condition(NAME, "Ready")).get("reason") == reason and c,
                 f"Ready=False, reason {reason}")


def test_denied_writes_change_nothing_and_say_why_until_admitted(cluster: RealCluster, workloads: Workloads,
                                                                tmp_path: Path) -> None:
    workloads.ready.add(NAME)
    body = example(NAME)
    body["spec"]["rollout"]["maxSurge"] = 0  # the pass scales the stable down before the canary comes
    cluster.create(body)
    cluster.until(lambda: cluster.condition(NAME, "Ready").get("status") == "True", "Ready=True")
    stable = cluster.status(NAME)["stableRevision"]
    stable_workload = names.workload_name(NAME, stable)

    def unchanged() -> None:
        assert set(cluster.deployments(NAME)) == {stable_workload}
        assert cluster.deployments(NAME)[stable_workload].spec.replicas == 2

    webhook = PolicyWebhook(cluster, tmp_path, allowed={stable})
    try:
        canary = start_canary(cluster, NAME)
        canary_workload = names.workload_name(NAME, canary)
        refused = ready_reason(cluster, "ChildRefused")
        assert refused["message"] == (f'Deployment {canary_workload}: admission webhook "{POLICY}" denied the '
                                      f"request: {REASON}")
        cluster.until(lambda: ("Warning", "ChildRefused", refused["message"]) in cluster.events(NAME),
              "a ChildRefused Event")
        unchanged()

        exhaust_quota(cluster, stable)  # the webhook goes; the quota denies from then on
        webhook.remove()
        quota = cluster.until(lambda: "exceeded quota" in (c := cluster.condition(NAME, "Ready")).get(
            "message", "") and c, "Ready=False for the quota")
        assert quota["reason"] == "ChildRefused"
        assert quota["message"].startswith(f'Deployment {canary_workload}: deployments.apps "{canary_workload}" '
                                           f"is forbidden: exceeded quota: {QUOTA}")
        unchanged()
        # the webhook's and the quota's 403s are the cluster's answers, not permissions the chart lacks:
        # the privilege test tells them apart by the authorizer's decision, which every request carries
        answers = [e for e in cluster.operator_requests() if e.get("responseStatus", {}).get("code") == 403]
        assert answers and not any(denied(e) for e in answers)
        assert all(e["annotations"]["authorization.k8s.io/decision"] == "allow" for e in answers)
    finally:
        webhook.remove()
        remove_quota(cluster)

    cluster.until(lambda: canary_workload in cluster.deployments(NAME), "the canary's Deployment, once admitted")
    cluster.until(lambda: cluster.condition(NAME, "Ready").get("reason") != "ChildRefused",
          "Ready no longer about the refusal")
    cluster.custom.delete_namespaced_custom_object(names.GROUP, names.VERSION, NS, names.PLURAL, NAME)
    cluster.until(lambda: cluster.gone(NAME), f"{NAME} deleted")
    cluster.log_from = len(cluster.operator.log())  # the handler's retries above failed on purpose
