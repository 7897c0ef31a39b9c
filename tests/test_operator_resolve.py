"""resolve: defaults, compatibility rules and gates; each refusal says what to change."""
import copy
from typing import Any

import pytest

from specdecode.operator import names
from specdecode.operator.resolve import admission_response, admit, resolve
from specdecode.runtime.config import MTP_PIPELINE_WARNING, mtp_pipeline_gate_refusal


def cr(name: str = "demo", **spec: Any) -> dict[str, Any]:
    body = {"model": {"uri": "smollm2-135m"}, "image": "specdecode/runtime:test", **spec}
    return {"apiVersion": names.API_VERSION, "kind": names.KIND, "metadata": {"name": name}, "spec": body}


def refusal(body: dict[str, Any], old: dict[str, Any] | None = None) -> str:
    answer = resolve(body, old)
    assert not answer.allowed and answer.resolved is None
    return answer.message


def test_minimal_spec_gets_every_default():
    answer = resolve(cr())
    assert answer.allowed and answer.errors == () and answer.warnings == ()
    r = answer.resolved
    assert (r.name, r.namespace) == ("demo", "default")
    assert r.spec.replicas == 1 and r.spec.speculative.method.value == "none"
    assert r.spec.rollout.max_surge == 0 and [s.weight for s in r.spec.rollout.steps] == [50, 100]
    assert (r.layout.tensor, r.layout.pipeline, r.layout.gpus_per_pod, r.layout.pods_per_group) == (1, 1, 1, 1)


@pytest.mark.parametrize(("tensor", "pipeline", "gpus", "pods"), [
    (4, 1, None, 1),  # TP in one pod
    (4, 1, 2, 2),  # a stage spread over two pods
    (8, 1, 2, 4),  # four pods of two GPUs
    (2, 1, 0, 1),  # CPU: no GPUs, both ranks in one pod
    (1, 2, None, 2),  # a pod per pipeline stage
    (2, 2, None, 2),  # a pod per stage, tensor parallelism inside it
    (2, 2, 1, 4),  # each stage spread over two pods
    (2, 2, 0, 2),  # CPU: a pod per stage
])
def test_gpus_per_pod_default_and_layout(tensor, pipeline, gpus, pods):
    resources = {} if gpus is None else {"gpusPerPod": gpus}
    answer = resolve(cr(parallelism={"tensor": tensor, "pipeline": pipeline}, resources=resources))
    assert answer.allowed and answer.warnings == (), answer.message
    r = answer.resolved
    assert r.layout.gpus_per_pod == (tensor if gpus is None else gpus)
    assert r.spec.resources.gpus_per_pod == r.layout.gpus_per_pod
    assert r.layout.pods_per_group == pods and r.layout.single_pod is (pods == 1)
    assert r.layout.notation == f"TP{tensor}×PP{pipeline}"


def test_gpus_per_pod_above_tensor_is_refused():
    message = refusal(cr(parallelism={"tensor": 2}, resources={"gpusPerPod": 4}))
    assert "spec.resources.gpusPerPod: 4 is more than parallelism.tensor (2)" in message
    assert "set gpusPerPod to 2 (or leave it unset)" in message


def test_gpus_per_pod_not_dividing_tensor_is_refused():
    message = refusal(cr(parallelism={"tensor": 8}, resources={"gpusPerPod": 3}))
    assert "spec.resources.gpusPerPod: 3 does not divide parallelism.tensor (8)" in message
    assert "use one of [1, 2, 4, 8]" in message


def test_draft_needs_a_draft_model():
    message = refusal(cr(speculative={"method": "draft"}))
    assert "spec.speculative: method 'draft' needs draftModel" in message  # CRD spelling, not draft_model


def test_draft_model_must_be_an_alias_or_a_path():
    message = refusal(cr(speculative={"method": "draft", "draftModel": "pvc://claim/draft"}))
    assert "spec.speculative.draftModel: takes a packaged alias or a path inside the pod" in message


HEAD_URIS = ["pvc://heads/smollm2-heads", "file:///heads/smollm2-heads", "hf://org/smollm2-heads"]


@pytest.mark.parametrize("uri", HEAD_URIS)
def test_mtp_with_heads_is_allowed(uri):
    answer = resolve(cr(speculative={"method": "mtp", "numSpeculativeTokens": 2, "mtpPath": uri,
                                     "draftVocabSize": 8192}))
    assert answer.allowed and answer.warnings == ()
    assert answer.resolved.spec.speculative.mtp_path == uri  # render turns it into the path inside the pod


@pytest.mark.parametrize("uri", HEAD_URIS)
def test_eagle3_with_a_head_is_allowed(uri):
    answer = resolve(cr(speculative={"method": "eagle3", "numSpeculativeTokens": 3, "eagle3Path": uri}))
    assert answer.allowed and answer.warnings == (), answer.message
    assert answer.resolved.spec.speculative.eagle3_path == uri  # render turns it into the path inside the pod


def test_eagle3_without_a_head_is_refused_naming_eagle3_path():
    message = refusal(cr(speculative={"method": "eagle3"}))
    assert "spec.speculative: method 'eagle3' needs eagle3Path (the folder of an EAGLE-3 head" in message


def test_mtp_without_heads_is_allowed_with_a_warning():
    answer = resolve(cr(speculative={"method": "mtp"}))
    assert answer.allowed
    (warning,) = answer.warnings
    assert warning.startswith("spec.speculative.mtpPath: unset, so the runtime drafts with the MTP layers")
    assert "refused when the pods start (condition Degraded, reason RuntimeRefused)" in warning
    assert admission_response(answer) == {"allowed": True, "warnings": [warning]}


@pytest.mark.parametrize(("method", "field", "folder"), [
    ("mtp", "mtpPath", "the folder `specdecode train-mtp` wrote"),
    ("eagle3", "eagle3Path", "the folder of an EAGLE-3 head: config.json and its weights"),
])
@pytest.mark.parametrize("uri", ["/heads/smollm2-mtp", "smollm2-135m", "s3://bucket/heads", "pvc://Heads/x", "hf://org"])
def test_head_paths_must_be_a_pvc_file_or_hf_uri(method, field, folder, uri):
    answer = resolve(cr(speculative={"method": method, field: uri}))
    assert not answer.allowed
    (error,) = answer.errors  # said once, naming the field
    assert error.startswith(f"spec.speculative.{field}: must be pvc://claim/path, file:///path or hf://org/name ({folder}")
    assert error.endswith("leave it unset to draft with the MTP layers of the model's own checkpoint") is (method == "mtp")


def test_an_empty_mtp_path_is_refused_as_no_uri():
    assert "spec.speculative.mtpPath: must be pvc://claim/path" in refusal(cr(speculative={"method": "mtp", "mtpPath": ""}))


def test_eagle3_path_needs_method_eagle3_and_says_so_in_crd_spelling():
    message = refusal(cr(speculative={"method": "mtp", "eagle3Path": "pvc://heads/x"}))
    assert "spec.speculative: eagle3Path is only used by method 'eagle3', not 'mtp'" in message


@pytest.mark.parametrize("field", [{"mtpPath": "pvc://heads/x"}, {"draftVocabSize": 4096}])
def test_mtp_fields_need_method_mtp_and_say_so_in_crd_spelling(field):
    message = refusal(cr(speculative={"method": "ngram", **field}))
    assert "spec.speculative: mtpPath and draftVocabSize are only used by method 'mtp', not 'ngram'" in message


def test_mtp_with_pipeline_parallelism_is_refused_with_the_runtimes_sentence_beside_schema_errors():
    answer = resolve(cr(speculative={"method": "mtp", "numSpeculativeTokens": 32}, parallelism={"pipeline": 2}))
    assert not answer.allowed
    assert answer.errors[0] == f"spec.parallelism.pipeline: {mtp_pipeline_gate_refusal('mtp', 2, ())}"
    assert "'mtp-pipeline-parallel'" in answer.errors[0]  # the gate, named
    assert "spec.speculative.numSpeculativeTokens: Input should be less than or equal to 16" in answer.message
    assert not any(MTP_PIPELINE_WARNING in w for w in answer.warnings)  # refused, not warned


@pytest.mark.parametrize("gated", [{"gates": ["mtp-pipeline-parallel"]},
                                   {"speculative": {"method": "mtp", "gates": ["mtp-pipeline-parallel"]}}])
def test_mtp_with_pipeline_parallelism_and_its_gate_is_allowed_with_the_runtimes_warning(gated):
    spec = {"speculative": {"method": "mtp"}, "parallelism": {"tensor": 2, "pipeline": 2}, **gated}
    answer = resolve(cr(**spec))
    assert answer.allowed, answer.message
    assert f"spec.parallelism.pipeline: {MTP_PIPELINE_WARNING}" in answer.warnings
    assert answer.resolved.spec.speculative.gates == ("mtp-pipeline-parallel",)  # what the runtime reads
    assert admission_response(answer)["warnings"] == list(answer.warnings)


def test_other_methods_under_pipeline_parallelism_need_no_gate():
    for method in ("none", "ngram", "suffix"):
        answer = resolve(cr(speculative={"method": method}, parallelism={"pipeline": 2}))
        assert answer.allowed and answer.warnings == (), (method, answer.message)


def test_gates_are_checked_and_merged_into_the_runtime_config():
    assert "spec.gates[0]: Input should be 'mtp-pipeline-parallel'" in refusal(cr(gates=["warp-drive"]))
    r = resolve(cr(gates=["mtp-pipeline-parallel"])).resolved
    assert r.spec.speculative.gates == ("mtp-pipeline-parallel",)


def test_topp_is_allowed_with_a_lossy_warning():
    answer = resolve(cr(speculative={"method": "ngram", "verify": "topp", "verifyTopP": 0.8}))
    assert answer.allowed
    (warning,) = answer.warnings
    assert warning.startswith("spec.speculative.verify: 'topp' is lossy") and "verifyTopP=0.8" in warning
    assert answer.resolved.warnings == answer.warnings
    assert admission_response(answer) == {"allowed": True, "warnings": [warning]}


def test_acceptance_slo_with_method_none_warns():
    answer = resolve(cr(rollout={"analysis": {"minAcceptanceRate": 0.5}}))
    assert answer.allowed and "acceptance thresholds are ignored with method 'none'" in answer.warnings[0]


def test_parallel_group_is_immutable():
    old = cr(parallelism={"tensor": 2})
    assert resolve(cr(parallelism={"tensor": 2}, replicas=3), old).allowed  # scaling is fine
    message = refusal(cr(parallelism={"tensor": 4}), old)
    assert ("spec.parallelism: the parallel group is immutable after creation "
            "(was tensor=2, pipeline=1, gpusPerPod=2; now tensor=4, pipeline=1, gpusPerPod=4)") in message
    assert "create a new SpecDecodeDeployment" in message
    assert "immutable" in refusal(cr(parallelism={"tensor": 2}, resources={"gpusPerPod": 1}), old)
    # the same group spelled with the default written out is no change
    assert resolve(cr(parallelism={"tensor": 2}, resources={"gpusPerPod": 2}), old).allowed


@pytest.mark.parametrize(("spec", "expected"), [
    ({"model": {"uri": "nosuch-model"}}, "spec.model.uri: 'nosuch-model' is not a packaged model; use one of"),
    ({"model": {"uri": "s3://bucket/model"}}, "spec.model.uri: must be pvc://claim/path, file:///path, hf://org/name"),
    ({"model": {"uri": "file:///models/x", "cacheClaim": "c"}}, "spec.model.cacheClaim: only hf:// sources (model.uri, "
     "speculative.mtpPath, speculative.eagle3Path) are downloaded; remove it"),
    ({"rollout": {"maxSurge": 0, "maxUnavailable": 0}}, "spec.rollout: maxSurge and maxUnavailable are both 0"),
    ({"rollout": {"maxSurge": "150%"}}, "spec.rollout.maxSurge: '150%' must be a whole number or a percentage"),
    ({"rollout": {"steps": [{"weight": 50}, {"weight": 20}]}}, "spec.rollout.steps: weights [50, 20] must increase"),
    ({"rollout": {"steps": [{"weight": 50}]}}, "spec.rollout.steps: weights [50] must increase strictly and end at 100"),
    ({"rollout": {"steps": []}}, "spec.rollout.steps: give at least one step"),
    ({"rollout": {"analysis": {"interval": "5m", "window": "1m"}}}, "spec.rollout.analysis.window: 1m is shorter"),
    ({"rollout": {"analysis": {"interval": "soon"}}}, "spec.rollout.analysis.interval: must be a duration"),
    ({"extraArgs": ["--max-model-len", "4096", "--model=x"]}, "spec.extraArgs[2]: --model is set from spec.model.uri"),
    ({"replicas": "2"}, "spec.replicas: Input should be a valid integer"),  # strict, as the API server is
    ({"speculative": {"num_speculative_tokens": 2}}, "spec.speculative.num_speculative_tokens: unknown field"),
    ({"speculative": {"promptLookupMin": 5}}, "spec.speculative: promptLookupMin (5) must not exceed promptLookupMax"),
    ({"image": None}, "spec.image: Input should be a valid string"),
])
def test_refusals_say_what_to_change(spec, expected):
    assert expected in refusal(cr(**spec))


UNKNOWN = "unknown field; remove it (field names are camelCase)"


@pytest.mark.parametrize(("spec", "expected"), [
    # a GPU count in resources, which render would silently replace with gpusPerPod's
    ({"resources": {"limits": {"nvidia.com/gpu": 2}}},
     "spec.resources.limits[nvidia.com/gpu]: set from spec.resources.gpusPerPod"),
    ({"resources": {"gpusPerPod": 0, "requests": {"nvidia.com/gpu": "1"}}},
     "spec.resources.requests[nvidia.com/gpu]: set from spec.resources.gpusPerPod"),
    ({"resources": {"gpuResourceName": "amd.com/gpu", "limits": {"amd.com/gpu": 1}}},
     "spec.resources.limits[amd.com/gpu]: set from spec.resources.gpusPerPod (GPUs per pod; default "
     "parallelism.tensor, 0 = CPU), which would replace this value; remove it and set gpusPerPod"),
    # extraArgs as the runtime's own parser reads them, without abbreviations
    ({"extraArgs": ["--tensor-parallel", "2"]},
     "spec.extraArgs[0]: --tensor-parallel is no `specdecode serve` flag (abbreviations are not accepted); "
     "--tensor-parallel-size is set from spec.parallelism.tensor; remove it"),
    ({"extraArgs": ["--no-overlap", "--max-num-seq=8"]},
     "spec.extraArgs[1]: --max-num-seq is no `specdecode serve` flag (abbreviations are not accepted); write the "
     "flag in full as `specdecode serve --help` lists it, or remove it"),
    ({"extraArgs": ["--max-num-seqs", "many"]},
     "spec.extraArgs: `specdecode serve` refuses them: argument --max-num-seqs: invalid int value: 'many'"),
    ({"extraArgs": ["--no-prefix-caching", "true"]}, "spec.extraArgs[1]: 'true' is a value that no flag takes"),
    ({"extraArgs": ["--help"]}, "spec.extraArgs: `specdecode serve` refuses them: --help prints help"),
    # quantities and the pod fields passed through, against Kubernetes' own schemas
    ({"resources": {"limits": {"memory": "4GB"}}},
     "spec.resources.limits.memory: '4GB' is not a Kubernetes quantity: a number with an optional suffix, e.g. 16Gi"),
    ({"resources": {"shmSize": "lots"}}, "spec.resources.shmSize: 'lots' is not a Kubernetes quantity"),
    ({"pod": {"tolerations": [{"key": "gpu", "operator": "Exists", "tolerationSecond": 30}]}},
     f"spec.pod.tolerations[0].tolerationSecond: {UNKNOWN}"),
    ({"pod": {"tolerations": [{"key": "gpu", "tolerationSeconds": "soon"}]}},
     'spec.pod.tolerations[0].tolerationSeconds: must be integer, not "soon"'),
    ({"pod": {"env": [{"name": "HF_HUB_OFFLINE", "value": 1}]}}, "spec.pod.env[0].value: must be string, not 1"),
    ({"pod": {"env": [{"value": "x"}]}}, "spec.pod.env[0].name: required"),
    ({"pod": {"volumes": [{"name": "scratch", "emptyDir": {"sizeLimit": "10GB"}}]}},
     "spec.pod.volumes[0].emptyDir.sizeLimit: '10GB' is not a Kubernetes quantity"),
    ({"pod": {"volumes": [{"name": "cfg", "configMap": {"name": "c", "items": [{"path": "a"}]}}]}},
     "spec.pod.volumes[0].configMap.items[0].key: required"),
    ({"pod": {"volumeMounts": [{"name": "scratch", "mountpath": "/scratch"}]}},
     f"spec.pod.volumeMounts[0].mountpath: {UNKNOWN}"),
    ({"pod": {"affinity": {"nodeAffinty": {}}}}, f"spec.pod.affinity.nodeAffinty: {UNKNOWN}"),
    # enum-valued pod fields (kubeschema.ENUMS), which the bundled schemas type as any string
    ({"pod": {"tolerations": [{"key": "gpu", "operator": "Exist"}]}},
     "spec.pod.tolerations[0].operator: 'Exist' is not one of 'Exists', 'Equal', ''"),
    ({"pod": {"tolerations": [{"key": "gpu", "operator": "Exists", "effect": "NoSchedulee"}]}},
     "spec.pod.tolerations[0].effect: 'NoSchedulee' is not one of 'NoSchedule', 'PreferNoSchedule', 'NoExecute', ''"),
    ({"pod": {"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": "gpu", "operator": "in", "values": ["h100"]}]}]}}}}},
     "nodeSelectorTerms[0].matchExpressions[0].operator: 'in' is not one of 'In', 'NotIn', 'Exists'"),
    ({"pod": {"volumeMounts": [{"name": "scratch", "mountPath": "/s", "mountPropagation": "Both"}]}},
     "spec.pod.volumeMounts[0].mountPropagation: 'Both' is not one of 'None', 'HostToContainer', 'Bidirectional'"),
    # the cluster fields of spec.pod (issue 33)
    ({"pod": {"securityContext": {"runAsUser": "root"}}},
     'spec.pod.securityContext.runAsUser: must be integer, not "root"'),
    ({"pod": {"securityContext": {"seccompProfile": {"type": "Default"}}}},
     "spec.pod.securityContext.seccompProfile.type: 'Default' is not one of 'RuntimeDefault', 'Localhost'"),
    ({"pod": {"containerSecurityContext": {"capabilities": {"drop": "ALL"}}}},
     'spec.pod.containerSecurityContext.capabilities.drop: must be array, not "ALL"'),
    ({"pod": {"containerSecurityContext": {"runAsNonroot": True}}},
     f"spec.pod.containerSecurityContext.runAsNonroot: {UNKNOWN}"),
    ({"pod": {"topologySpreadConstraints": [{"maxSkew": 1, "topologyKey": "zone", "whenUnsatisfiable": "Never"}]}},
     "spec.pod.topologySpreadConstraints[0].whenUnsatisfiable: 'Never' is not one of 'DoNotSchedule'"),
    ({"pod": {"topologySpreadConstraints": [{"maxSkew": 1, "whenUnsatisfiable": "DoNotSchedule"}]}},
     "spec.pod.topologySpreadConstraints[0].topologyKey: required"),
    ({"pod": {"runtimeClassName": "NVIDIA"}}, "spec.pod.runtimeClassName: must be a DNS subdomain"),
    ({"pod": {"schedulerName": "my_scheduler"}}, "spec.pod.schedulerName: must be a DNS subdomain"),
    ({"pod": {"priorityClassName": "High"}}, "spec.pod.priorityClassName: must be a DNS subdomain"),
    ({"pod": {"leaderWorkerSetAnnotations": {"a": 1}}},
     "spec.pod.leaderWorkerSetAnnotations.a: Input should be a valid string"),
    # what collides with what the operator renders into every pod, or with itself
    ({"pod": {"env": [{"name": "MASTER_PORT", "value": "29500"}]}},
     "spec.pod.env[0].name: MASTER_PORT is set by the operator (the parallel group's rendezvous port): use another name"),
    ({"pod": {"env": [{"name": "NODE_RANK", "value": "0"}]}}, "spec.pod.env[0].name: NODE_RANK is set by the operator"),
    ({"pod": {"env": [{"name": "HF_TOKEN", "value": "a"}, {"name": "HF_TOKEN", "value": "b"}]}},
     "spec.pod.env[1].name: HF_TOKEN is given already at spec.pod.env[0]: keep one"),
    ({"pod": {"volumes": [{"name": "model", "emptyDir": {}}]}},
     "spec.pod.volumes[0].name: model is the operator's volume for the model (spec.model.uri): use another name"),
    ({"pod": {"volumes": [{"name": "dshm", "emptyDir": {}}]}}, "spec.pod.volumes[0].name: dshm is the operator's"),
    ({"pod": {"volumes": [{"name": "a", "emptyDir": {}}, {"name": "a", "emptyDir": {}}]}},
     "spec.pod.volumes[1].name: a is given already at spec.pod.volumes[0]: keep one"),
    ({"pod": {"volumeMounts": [{"name": "scratch", "mountPath": "/dev/shm"}]}},
     "spec.pod.volumeMounts[0].mountPath: /dev/shm is where the operator mounts its volume dshm: mount elsewhere"),
    ({"pod": {"volumeMounts": [{"name": "mtp", "mountPath": "/mnt/mtp"}]}},
     "spec.pod.volumeMounts[0].mountPath: /mnt/mtp is where the operator mounts its volume mtp"),
    ({"pod": {"volumes": [{"name": "eagle3", "emptyDir": {}}]}},
     "spec.pod.volumes[0].name: eagle3 is the operator's volume for the EAGLE-3 head (spec.speculative.eagle3Path)"),
    ({"pod": {"volumeMounts": [{"name": "eagle3", "mountPath": "/mnt/eagle3"}]}},
     "spec.pod.volumeMounts[0].mountPath: /mnt/eagle3 is where the operator mounts its volume eagle3"),
    # unknown fields at any depth, and at the top level
    ({"rollout": {"anlysis": {"interval": "1m"}}}, f"spec.rollout.anlysis: {UNKNOWN}"),
    ({"colour": "blue"}, f"spec.colour: {UNKNOWN}"),
])
def test_what_a_user_would_expect_refused_is_refused_naming_the_field(spec, expected):
    assert expected in refusal(cr(**spec))


def test_every_part_a_pod_field_gets_wrong_is_named():
    message = refusal(cr(pod={"volumes": [{"emptyDir": {"medium": 3, "sizeLimit": "1GB"}}]}))
    assert "spec.pod.volumes[0].name: required" in message
    assert "spec.pod.volumes[0].emptyDir.medium: must be string, not 3" in message
    assert "spec.pod.volumes[0].emptyDir.sizeLimit: '1GB' is not a Kubernetes quantity" in message


def test_pod_fields_kubernetes_accepts_are_allowed_as_written():
    pod = {
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
                        {"key": "spot", "operator": "Equal", "value": "true", "tolerationSeconds": 60}],
        "env": [{"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}}],
        "volumes": [{"name": "scratch", "emptyDir": {"medium": "Memory", "sizeLimit": "8Gi"}},
                    {"name": "cfg", "configMap": {"name": "c", "items": [{"key": "a", "path": "a"}]}}],
        "volumeMounts": [{"name": "scratch", "mountPath": "/scratch", "readOnly": False}],
        "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
            {"matchExpressions": [{"key": "gpu", "operator": "In", "values": ["h100"]}]}]}}},
    }
    answer = resolve(cr(pod=pod, resources={"requests": {"cpu": "500m", "memory": "2Gi"}, "limits": {"memory": 4_000_000_000}},
                        extraArgs=["--max-num-seqs", "8", "--kv-cache-blocks=64", "--no-overlap"]))
    assert answer.allowed, answer.message
    assert answer.resolved.spec.pod.volumes[0] == pod["volumes"][0]


@pytest.mark.parametrize(("resources", "parallelism", "warned"), [
    ({"limits": {"memory": "3Gi"}}, {}, "4Gi"),  # /dev/shm 2Gi (1 + 1 rank) + 2Gi
    ({"limits": {"memory": "4Gi"}}, {}, None),
    ({"limits": {"memory": "6Gi"}}, {"tensor": 4}, "7Gi"),  # /dev/shm 5Gi (1 + 4 ranks)
    ({"limits": {"memory": "5Gi"}, "shmSize": "4096Mi"}, {"tensor": 4}, "6Gi"),  # shmSize given
    ({"limits": {"memory": "6144Mi"}, "shmSize": "4Gi"}, {"tensor": 4}, None),
    ({"limits": {"memory": "3000000000"}, "shmSize": "1Gi"}, {}, "3Gi"),
    ({"shmSize": "64Gi"}, {}, None),  # no limit: nothing to warn about
])
def test_a_memory_limit_below_shm_and_the_floor_is_allowed_with_a_warning(resources, parallelism, warned):
    answer = resolve(cr(resources=resources, parallelism=parallelism))
    assert answer.allowed, answer.message
    if warned is None:
        assert answer.warnings == ()
        return
    (warning,) = answer.warnings
    limit = resources["limits"]["memory"]
    assert warning.startswith(f"spec.resources.limits.memory: {limit} leaves the runtime less than 2Gi beside /dev/shm")
    assert f"raise the limit to at least {warned}, lower shmSize, or remove the limit" in warning
    assert admission_response(answer)["warnings"] == [warning]


def test_resources_get_the_operators_defaults_filled():
    """cpu and memory requests unless given or limited; /dev/shm sized by the ranks in a pod
    unless shmSize is given."""
    res = resolve(cr(parallelism={"tensor": 4, "pipeline": 2}, resources={"gpusPerPod": 2})).resolved.spec.resources
    assert (res.requests, res.limits, res.shm_size) == ({"cpu": "2", "memory": "8Gi"}, {}, "3Gi")
    res = resolve(cr(resources={"requests": {"cpu": "500m"}, "limits": {"memory": "16Gi"}, "shmSize": "1Gi"}))
    assert res.resolved.spec.resources.requests == {"cpu": "500m"}  # the memory limit is its request
    assert res.resolved.spec.resources.shm_size == "1Gi"


def test_a_spec_field_written_at_the_top_level_is_refused():
    body = cr()
    body["replicas"], body["colour"] = 3, "blue"
    message = refusal(body)
    assert "replicas: unknown field at the top level; move it under spec" in message
    assert f"colour: {UNKNOWN}" in message


def test_a_pod_label_the_operator_sets_is_a_warning_naming_it():
    answer = resolve(cr(pod={"labels": {"team": "ml", names.LABEL_INSTANCE: "mine", names.LABEL_REVISION: "r1"}}))
    assert answer.allowed
    assert answer.warnings == (
        f"spec.pod.labels[{names.LABEL_INSTANCE}]: every runtime pod gets this label set to 'demo' (the operator "
        "finds and ranks its pods by it), so 'mine' is replaced; use another key",
        f"spec.pod.labels[{names.LABEL_REVISION}]: every runtime pod gets this label set to its revision (the operator "
        "finds and ranks its pods by it), so 'r1' is replaced; use another key",
    )


def test_identity_and_name_rules():
    body = cr()
    body["kind"] = "Deployment"
    assert "apiVersion/kind: must be specdecode.io/v1alpha1 SpecDecodeDeployment" in refusal(body)
    assert "metadata.name: must be lowercase letters" in refusal(cr(name="Demo"))
    body = cr()
    del body["spec"]
    assert "spec: required" in refusal(body)


@pytest.mark.parametrize("replicas", [0, 1, 11, names.MAX_REPLICAS])
def test_the_name_limit_does_not_depend_on_replicas(replicas):
    """/scale changes replicas without admission: a valid resource stays valid at any replicas the
    schema allows, and its StatefulSet names fit at the largest."""
    longest = "a" * names.MAX_RESOURCE_NAME_LENGTH
    assert resolve(cr(name=longest, replicas=replicas)).allowed
    assert len(names.group_name(longest, "x" * names.REVISION_LENGTH, names.MAX_REPLICAS - 1)) == \
        names.MAX_STATEFULSET_NAME
    message = refusal(cr(name=longest + "a", replicas=replicas))
    assert f"metadata.name: at most {names.MAX_RESOURCE_NAME_LENGTH} characters" in message
    assert "shorten it" in message


def test_replicas_are_bounded_by_the_schema():
    assert "spec.replicas: Input should be less than or equal to 1000" in refusal(cr(replicas=names.MAX_REPLICAS + 1))


def stored_invalid() -> dict[str, Any]:
    """A stored resource that resolve refuses, as one created before a rule was added would be."""
    body = cr(replicas=3, speculative={"method": "draft"})
    body["metadata"] |= {"namespace": "llm", "finalizers": ["specdecode.io/finalizer"]}
    return body


def test_an_update_leaving_spec_as_it_was_is_never_refused():
    stored = stored_invalid()
    annotated = copy.deepcopy(stored)
    annotated["metadata"]["annotations"] = {names.ANNOTATION_PROMOTE: "true"}
    answer = admit(annotated, stored)
    assert answer.allowed and answer.resolved is None and admission_response(answer)["allowed"] is True
    (warning,) = answer.warnings
    assert "spec.speculative: method 'draft' needs draftModel" in warning
    assert warning.endswith("(allowed: this update leaves spec as it was)")
    assert not resolve(annotated, stored).allowed  # reconcile still reports it (Ready=False, InvalidSpec)
    changed = copy.deepcopy(annotated)
    changed["spec"]["replicas"] = 4
    assert not admit(changed, stored).allowed  # a change of spec is checked
    assert not admit(annotated).allowed  # so is a create


def test_a_resource_being_deleted_takes_every_update():
    stored = stored_invalid()
    stored["metadata"]["deletionTimestamp"] = "2025-01-01T00:00:00Z"
    released = copy.deepcopy(stored)
    released["metadata"]["finalizers"] = []  # kopf's finalizer removal
    answer = admit(released, stored)
    assert answer.allowed and answer.warnings[-1].endswith("(allowed: the resource is being deleted)")


def test_several_errors_are_reported_together_and_admission_denies():
    body = cr(parallelism={"tensor": 2}, resources={"gpusPerPod": 4}, rollout={"steps": [{"weight": 10}]})
    answer = resolve(body)
    assert len(answer.errors) == 2
    assert answer.message.startswith('SpecDecodeDeployment "demo" is invalid: spec.resources.gpusPerPod')
    response = admission_response(answer)
    assert response == {"allowed": False, "status": {"code": 422, "reason": "Invalid", "message": answer.message}}


def test_resolve_does_not_mutate_its_input():
    body = cr(gates=["mtp-pipeline-parallel"])
    before = copy.deepcopy(body)
    resolve(body, before)
    assert body == before
