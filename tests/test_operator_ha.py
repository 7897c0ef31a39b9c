"""Two operator replicas as the chart runs them: kopf peering in the release's ClusterKopfPeering
(the chart's CRD and object), priorities from the StatefulSet ordinals. One reconciles, the other
stands by; killed without a word, the active one's record expires after its lifetime and the
standby takes over and reconciles. Each replica is a process of its own against the emulated API
server (kube_emulator.py)."""
from __future__ import annotations

from pathlib import Path

import kubernetes
import pytest
import yaml
from kube_emulator import ApiServer, serve
from operator_harness import (
    CHART,
    TEST_CLIENT,
    Cluster,
    OperatorProcess,
    assert_granted,
    example,
    operator_processes,
    wait_for,
    write_kubeconfig,
)

from specdecode.operator.controller import peering_priority
from specdecode.operator.crd import build_crd

pytestmark = pytest.mark.timeout(180)

PEERING = "specdecode-operator"  # the chart's ClusterKopfPeering: the release's full name
PODS = [f"{PEERING}-0", f"{PEERING}-1"]  # the chart's StatefulSet pods
LIFETIME = 3  # seconds; the chart's default is kopf's 60


def peers(client: kubernetes.client.ApiClient) -> dict[str, int]:
    """Identity → priority of the live records in the peering object."""
    peering = kubernetes.client.CustomObjectsApi(client).get_cluster_custom_object(
        "kopf.dev", "v1", "clusterkopfpeerings", PEERING)
    return {pod: record["priority"] for pod, record in (peering.get("status") or {}).items()}


def paused(replica: OperatorProcess) -> bool:
    """Whether kopf holds the replica's watches: it starts so, and logs each change of mind."""
    log = replica.log()
    return log.rfind("Pausing operations") >= log.rfind("Resuming operations")


def test_the_standby_takes_over_when_the_active_replica_is_killed(tmp_path: Path) -> None:
    server = ApiServer()
    server.install_crd(build_crd())
    server.install_crd(yaml.safe_load((CHART / "crds" / "kopf.dev_clusterkopfpeerings.yaml").read_text()))
    with serve(server) as url:
        kubeconfig = write_kubeconfig(url, tmp_path / "kubeconfig")
        with kubernetes.config.new_client_from_config(str(kubeconfig)) as client:
            client.user_agent = TEST_CLIENT
            kubernetes.client.CustomObjectsApi(client).create_cluster_custom_object(
                "kopf.dev", "v1", "clusterkopfpeerings",
                {"apiVersion": "kopf.dev/v1", "kind": "ClusterKopfPeering", "metadata": {"name": PEERING}})
            api = Cluster(client, url, 0, 0)
            env = {"SPECDECODE_PEERING_LIFETIME_SECONDS": str(LIFETIME)}
            with operator_processes(kubeconfig, PODS, PEERING, tmp_path, env) as (active, standby):
                wait_for(lambda: peers(client) == {pod: peering_priority(pod) for pod in PODS}, "both replicas peered")
                assert peers(client) == {PODS[0]: 100, PODS[1]: 99}
                wait_for(lambda: paused(standby) and not paused(active), "the standby paused, the other active")

                api.create(example())
                wait_for(lambda: api.condition("smollm2-ngram", "Ready").get("status") == "True", "Ready=True")
                assert "smollm2-ngram" not in standby.log()  # the standby never touched it

                active.kill()
                api.patch("smollm2-ngram", {"spec": {"replicas": 3}})
                wait_for(lambda: [d.spec.replicas for d in api.deployments("smollm2-ngram").values()] == [3],
                         "the standby reconciled the change", timeout=LIFETIME + 30)
                assert not paused(standby)
                assert api.status("smollm2-ngram")["replicas"] == 3
        assert_granted(server)  # peering included
