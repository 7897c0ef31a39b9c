"""The validating webhook as the API server calls it: kopf's webhook server in the running
operator, configured from the chart's environment (port, certificate directory), answering
AdmissionReviews (admission.k8s.io/v1) over TLS on the path the chart's
ValidatingWebhookConfiguration names."""
from __future__ import annotations

import copy
import json
import shutil
import ssl
import subprocess
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
import jsonschema
from kube_emulator import ApiServer, serve, strict_schema
from local_process import free_port
from operator_harness import running_operator, wait_for, write_kubeconfig

from specdecode.operator import names
from specdecode.operator.crd import build_crd
from specdecode.operator.handlers import WEBHOOK_ID
from specdecode.runtime.cli import main
from specdecode.runtime.config import MTP_PIPELINE_GATE, MTP_PIPELINE_WARNING, mtp_pipeline_gate_refusal

pytestmark = pytest.mark.timeout(90)

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
WEBHOOK_PATH = "/validate-specdecodedeployment"  # what charts/specdecode/templates/_helpers.tpl names


def self_signed(directory: Path) -> Path:
    """tls.crt and tls.key for 127.0.0.1, as the chart mounts them; returns the directory."""
    directory.mkdir()
    subprocess.run(
        [shutil.which("openssl") or "openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt",
         "ec_paramgen_curve:prime256v1", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
         "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(directory / "tls.key"),
         "-out", str(directory / "tls.crt")],
        check=True, capture_output=True, timeout=60)
    return directory


class Webhook:
    def __init__(self, port: int, ca: Path) -> None:
        self.url = f"https://127.0.0.1:{port}{WEBHOOK_PATH}"
        self.tls = ssl.create_default_context(cafile=str(ca))

    def review(self, operation: str, obj: dict[str, Any], old: dict[str, Any] | None = None) -> dict[str, Any]:
        """POST one AdmissionReview as the API server would; the response's ``response``."""
        uid = str(uuid.uuid4())
        review = {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {
            "uid": uid, "operation": operation, "namespace": "llm", "name": obj["metadata"]["name"],
            "kind": {"group": names.GROUP, "version": names.VERSION, "kind": names.KIND},
            "resource": {"group": names.GROUP, "version": names.VERSION, "resource": names.PLURAL},
            "userInfo": {"username": "alice", "groups": ["system:authenticated"]},
            "object": obj, "oldObject": old, "dryRun": False}}
        request = urllib.request.Request(self.url, data=json.dumps(review).encode(), method="POST",
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, context=self.tls, timeout=10) as answer:
            body = json.loads(answer.read())
        assert body["apiVersion"] == "admission.k8s.io/v1" and body["kind"] == "AdmissionReview"
        assert body["response"]["uid"] == uid
        return body["response"]

    def up(self) -> bool:
        try:
            self.review("CREATE", example())
        except OSError:
            return False
        return True


@pytest.fixture(scope="module")
def webhook(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Webhook]:
    """One operator for the module: its webhook is stateless."""
    tmp_path = tmp_path_factory.mktemp("webhook")
    certs, port = self_signed(tmp_path / "certs"), free_port()
    server = ApiServer()
    server.install_crd(build_crd())
    with serve(server) as url, pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setenv("KUBECONFIG", str(write_kubeconfig(url, tmp_path / "kubeconfig")))
        monkeypatch.setenv("SPECDECODE_METRICS_PORT", str(free_port()))
        monkeypatch.setenv("SPECDECODE_WEBHOOK_PORT", str(port))
        monkeypatch.setenv("SPECDECODE_WEBHOOK_CERT_DIR", str(certs))
        with running_operator(url, free_port()):
            hook = Webhook(port, certs / "tls.crt")
            wait_for(hook.up, "the webhook server listening")
            yield hook


def example(name: str = "smollm2-ngram") -> dict[str, Any]:
    body = yaml.safe_load((EXAMPLES / "smollm2-ngram.yaml").read_text())
    body["metadata"] = {"name": name, "namespace": "llm", "uid": str(uuid.uuid4())}
    return body


def test_the_path_is_the_handler_id() -> None:
    assert WEBHOOK_PATH == f"/{WEBHOOK_ID}"


def test_a_good_resource_is_allowed(webhook: Webhook) -> None:
    answer = webhook.review("CREATE", example())
    assert answer["allowed"] is True and "status" not in answer and "warnings" not in answer


def test_a_lossy_strategy_is_allowed_with_a_warning(webhook: Webhook) -> None:
    body = example()
    body["spec"]["speculative"]["verify"] = "topp"
    answer = webhook.review("CREATE", body)
    assert answer["allowed"] is True
    assert any("'topp' is lossy" in warning for warning in answer["warnings"])


def test_an_invalid_resource_is_refused_with_what_to_change(webhook: Webhook) -> None:
    body = yaml.safe_load((EXAMPLES / "invalid-mtp.yaml").read_text())
    answer = webhook.review("CREATE", body)
    assert answer["allowed"] is False
    assert answer["status"]["code"] == 422
    message = answer["status"]["message"]
    assert message.startswith(f'{names.KIND} "invalid-mtp" is invalid: ')
    assert "spec.parallelism.pipeline: method 'mtp' with pipeline parallelism" in message
    assert "add the gate 'mtp-pipeline-parallel'" in message
    assert "spec.speculative.numSpeculativeTokens" in message


def test_mtp_under_pipeline_parallelism_gets_the_same_answer_from_runtime_validate_and_webhook(
        webhook: Webhook, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The gate rule lives once (the shared config): without the gate the runtime refuses to start,
    ``specdecode validate`` and the webhook deny, all with its sentence; with it both warn."""
    sentence = mtp_pipeline_gate_refusal("mtp", 2, ())
    termination = tmp_path / "termination-log"
    serve = ["serve", "--model", "smollm2-135m", "--pipeline-parallel-size", "2",
             "--termination-message-path", str(termination), "--speculative-config"]
    assert main([*serve, '{"method":"mtp"}']) == 2
    assert termination.read_text() == f"specdecode serve: invalid configuration: {sentence}\n"

    body, path = example("mtp-pp"), tmp_path / "mtp-pp.yaml"
    body["spec"] |= {"parallelism": {"pipeline": 2}, "speculative": {"method": "mtp"}}
    path.write_text(yaml.safe_dump(body))
    capsys.readouterr()
    denied = f'{names.KIND} "mtp-pp" is invalid: spec.parallelism.pipeline: {sentence}'
    assert main(["validate", str(path)]) == 1
    assert capsys.readouterr().out == f"denied: {denied}\n"
    answer = webhook.review("CREATE", body)
    assert answer["allowed"] is False and answer["status"]["message"] == denied

    body["spec"]["gates"] = [MTP_PIPELINE_GATE]
    path.write_text(yaml.safe_dump(body))
    warning = f"spec.parallelism.pipeline: {MTP_PIPELINE_WARNING}"
    assert main(["validate", str(path)]) == 0
    assert f"Warning: {warning}" in capsys.readouterr().err.splitlines()
    answer = webhook.review("CREATE", body)
    assert answer["allowed"] is True and warning in answer["warnings"]


def test_an_update_may_not_change_the_parallel_group(webhook: Webhook) -> None:
    old, new = example(), example()
    new["spec"]["parallelism"] = {"tensor": 2}
    answer = webhook.review("UPDATE", new, old)
    assert answer["allowed"] is False and "the parallel group is immutable" in answer["status"]["message"]
    assert webhook.review("UPDATE", example(), old)["allowed"] is True


def test_scale_then_annotate_then_delete_is_never_refused(webhook: Webhook) -> None:
    """/scale changes spec.replicas without admission (within the schema's bound); the promote
    annotation after it and kopf's finalizer removal on delete are metadata-only updates."""
    stored = example("a" * names.MAX_RESOURCE_NAME_LENGTH)
    stored["metadata"]["finalizers"] = ["specdecode.io/finalizer"]
    stored["spec"]["replicas"] = names.MAX_REPLICAS  # what kubectl scale / an HPA wrote
    annotated = copy.deepcopy(stored)
    annotated["metadata"]["annotations"] = {names.ANNOTATION_PROMOTE: "true"}
    answer = webhook.review("UPDATE", annotated, stored)
    assert answer["allowed"] is True and "warnings" not in answer
    deleting = copy.deepcopy(annotated)
    deleting["metadata"]["deletionTimestamp"] = "2025-01-01T00:00:00Z"
    released = copy.deepcopy(deleting)
    released["metadata"]["finalizers"] = []
    answer = webhook.review("UPDATE", released, deleting)
    assert answer["allowed"] is True and "warnings" not in answer


def test_a_stored_invalid_resource_still_takes_metadata_updates_and_its_deletion(webhook: Webhook) -> None:
    """Invalid without admission having seen it (a rule added by an upgrade): annotations and the
    finalizer removal get in, with the refusal as a warning; a change of spec is refused."""
    stored = example("older")
    stored["metadata"]["finalizers"] = ["specdecode.io/finalizer"]
    stored["spec"]["speculative"] = {"method": "draft"}  # needs draftModel
    annotated = copy.deepcopy(stored)
    annotated["metadata"]["annotations"] = {names.ANNOTATION_ABORT: "true"}
    answer = webhook.review("UPDATE", annotated, stored)
    assert answer["allowed"] is True
    assert any("method 'draft' needs draftModel" in w and w.endswith("(allowed: this update leaves spec as it was)")
               for w in answer["warnings"])
    changed = copy.deepcopy(annotated)
    changed["spec"]["replicas"] += 1
    assert webhook.review("UPDATE", changed, annotated)["allowed"] is False
    deleting = copy.deepcopy(annotated)
    deleting["metadata"]["deletionTimestamp"] = "2025-01-01T00:00:00Z"
    released = copy.deepcopy(deleting)
    released["metadata"]["finalizers"] = []
    assert webhook.review("UPDATE", released, deleting)["allowed"] is True


def test_a_typoed_field_reaches_the_webhook_and_is_refused_for_every_client(webhook: Webhook) -> None:
    """The CRD keeps unknown fields, so the API server neither prunes a typo (what Helm, Argo CD and
    Flux would get) nor refuses it with strict field validation (kubectl): both reach admission,
    which refuses it with its path."""
    body = example("typo")
    body["spec"]["rollout"]["analysis"]["minAcceptanceRat"] = 0.5
    body["spec"]["replicaz"] = 3
    schema = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    jsonschema.Draft4Validator(strict_schema(schema)).validate(body)  # as a strict API server validates it
    answer = webhook.review("CREATE", body)
    assert answer["allowed"] is False
    message = answer["status"]["message"]
    assert "spec.rollout.analysis.minAcceptanceRat: unknown field; remove it" in message
    assert "spec.replicaz: unknown field; remove it" in message


def test_what_admission_refuses_in_pod_fields_resources_and_extra_args(webhook: Webhook) -> None:
    body = example("pods")
    body["spec"]["resources"]["limits"]["nvidia.com/gpu"] = 1
    body["spec"]["extraArgs"] = ["--tensor-parallel", "2"]
    body["spec"]["pod"] = {"labels": {names.LABEL_COMPONENT: "llm"}}
    answer = webhook.review("CREATE", body)
    assert answer["allowed"] is False
    message = answer["status"]["message"]
    assert "spec.resources.limits[nvidia.com/gpu]: set from spec.resources.gpusPerPod" in message
    assert "spec.extraArgs[0]: --tensor-parallel is no `specdecode serve` flag" in message
    assert answer["warnings"] == [f"spec.pod.labels[{names.LABEL_COMPONENT}]: every runtime pod gets this label set "
                                  "to 'runtime' (the operator finds and ranks its pods by it), so 'llm' is replaced; "
                                  "use another key"]
    body["spec"]["pod"]["tolerations"] = [{"key": "gpu", "operator": "Exists", "efect": "NoSchedule"}]
    answer = webhook.review("CREATE", body)
    assert "spec.pod.tolerations[0].efect: unknown field" in answer["status"]["message"]


def test_a_memory_limit_under_shm_is_a_warning_and_cluster_pod_fields_are_checked(webhook: Webhook) -> None:
    body = example("shm")
    body["spec"]["resources"]["limits"]["memory"] = "3Gi"  # /dev/shm 2Gi + the 2Gi floor: 4Gi
    answer = webhook.review("CREATE", body)
    assert answer["allowed"] is True
    (warning,) = answer["warnings"]
    assert warning.startswith("spec.resources.limits.memory: 3Gi leaves the runtime less than 2Gi beside /dev/shm")
    body["spec"]["pod"] = {"securityContext": {"seccompProfile": {"type": "Default"}}, "runtimeClassName": "NVIDIA"}
    answer = webhook.review("CREATE", body)
    assert answer["allowed"] is False
    message = answer["status"]["message"]
    assert "spec.pod.securityContext.seccompProfile.type: 'Default' is not one of 'RuntimeDefault'" in message
    assert "spec.pod.runtimeClassName: must be a DNS subdomain" in message
