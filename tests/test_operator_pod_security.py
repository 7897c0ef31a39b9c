"""Runtime pods meet the restricted Pod Security Standard out of the box: each control of the
profile (tests/pod_security.py, one parametrized case per control, its id the control's name on
https://kubernetes.io/docs/concepts/security/pod-security-standards/) over the pods of every
admissible layout: one pod (Deployment), a multi-pod group as StatefulSets, and as a LeaderWorkerSet."""
from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from typing import Any

import pytest
from pod_security import CONTROLS

from specdecode.operator import names
from specdecode.operator.render import render
from specdecode.operator.resolve import resolve

Obj = dict[str, Any]

# Each with init containers (hf:// fetches) and claims, so every kind of container and volume the
# operator renders is checked.
LAYOUTS: dict[str, tuple[Obj, bool]] = {
    "one-pod-tp-deployment": (dict(parallelism={"tensor": 2}, model={"uri": "pvc://weights/qwen"},
                                   speculative={"method": "mtp", "mtpPath": "hf://org/qwen-mtp"}), False),
    "multi-pod-statefulset": (dict(parallelism={"tensor": 2, "pipeline": 2},
                                   model={"uri": "hf://Qwen/Qwen2.5-7B", "cacheClaim": "hf-cache"}), False),
    "multi-pod-leaderworkerset": (dict(parallelism={"tensor": 4}, resources={"gpusPerPod": 2},
                                       model={"uri": "hf://Qwen/Qwen2.5-7B"}), True),
}


@functools.cache
def _templates(layout: str) -> tuple[Obj, ...]:
    spec, lws = LAYOUTS[layout]
    body = {"apiVersion": names.API_VERSION, "kind": names.KIND, "metadata": {"name": "demo", "namespace": "llm"},
            "spec": {"image": "specdecode/runtime:test", **spec}}
    answer = resolve(body)
    assert answer.allowed, answer.message
    workloads = [o for o in render(answer.resolved, leader_worker_set=lws) if o["kind"] != "Service"]
    return tuple((o["spec"].get("template") or o["spec"]["leaderWorkerTemplate"]["workerTemplate"]) for o in workloads)


def templates(layout: str) -> list[Obj]:
    """The pod templates of ``layout``'s workloads (a copy: checks may not share state)."""
    return copy.deepcopy(list(_templates(layout)))


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("control", CONTROLS)
def test_every_runtime_pod_holds_the_restricted_control(control: str, layout: str) -> None:
    found = templates(layout)
    assert found and all(t["spec"].get("initContainers") for t in found), "every layout has init containers"
    for template in found:
        assert CONTROLS[control](template) == [], control


def _first(template: Obj) -> Obj:
    return template["spec"]["containers"][0]


def _set(container_field: str, value: Any) -> Callable[[Obj], None]:
    return lambda t: _first(t).setdefault("securityContext", {}).__setitem__(container_field, value)


# One way to break each control, so that no check passes for want of looking.
BREAKS: dict[str, Callable[[Obj], None]] = {
    "baseline/HostProcess": _set("windowsOptions", {"hostProcess": True}),
    "baseline/Host Namespaces": lambda t: t["spec"].__setitem__("hostIPC", True),
    "baseline/Privileged Containers": _set("privileged", True),
    "baseline/Capabilities": _set("capabilities", {"drop": ["ALL"], "add": ["SYS_ADMIN"]}),
    "baseline/HostPath Volumes": lambda t: t["spec"]["volumes"].append({"name": "h", "hostPath": {"path": "/"}}),
    "baseline/Host Ports": lambda t: _first(t)["ports"][0].__setitem__("hostPort", 8000),
    "baseline/AppArmor": _set("appArmorProfile", {"type": "Unconfined"}),
    "baseline/SELinux": _set("seLinuxOptions", {"user": "system_u"}),
    "baseline/proc Mount Type": _set("procMount", "Unmasked"),
    "baseline/Seccomp": _set("seccompProfile", {"type": "Unconfined"}),
    "baseline/Sysctls": lambda t: t["spec"]["securityContext"].__setitem__("sysctls", [{"name": "kernel.msgmax",
                                                                                          "value": "1"}]),
    "restricted/Volume Types": lambda t: t["spec"]["volumes"].append({"name": "n", "nfs": {"server": "s",
                                                                                           "path": "/"}}),
    "restricted/Privilege Escalation": lambda t: _first(t)["securityContext"].pop("allowPrivilegeEscalation"),
    "restricted/Running as Non-root": lambda t: t["spec"]["securityContext"].pop("runAsNonRoot"),
    "restricted/Running as Non-root user": _set("runAsUser", 0),
    "restricted/Seccomp": lambda t: t["spec"]["securityContext"].pop("seccompProfile"),
    "restricted/Capabilities": _set("capabilities", {"drop": ["NET_RAW"]}),
}


@pytest.mark.parametrize("control", CONTROLS)
def test_each_check_finds_a_pod_that_breaks_its_control(control: str) -> None:
    assert BREAKS.keys() == CONTROLS.keys()
    template = templates("one-pod-tp-deployment")[0]
    BREAKS[control](template)
    assert CONTROLS[control](template), control


def test_security_contexts_given_in_the_spec_are_merged_over_the_operators() -> None:
    """A cluster that needs another uid, or the runtime a capability, says so in spec.pod; the rest
    of the restricted defaults stay."""
    body = {"apiVersion": names.API_VERSION, "kind": names.KIND, "metadata": {"name": "demo"},
            "spec": {"image": "i", "model": {"uri": "hf://org/m"}, "pod": {
                "securityContext": {"runAsUser": 2000, "runAsGroup": 2000, "fsGroup": 2000},
                "containerSecurityContext": {"capabilities": {"drop": ["ALL"], "add": ["IPC_LOCK"]}}}}}
    template = render(resolve(body).resolved)[0]["spec"]["template"]
    assert template["spec"]["securityContext"] == {"runAsNonRoot": True, "runAsUser": 2000, "runAsGroup": 2000,
                                                   "fsGroup": 2000, "fsGroupChangePolicy": "OnRootMismatch",
                                                   "seccompProfile": {"type": "RuntimeDefault"}}
    for container in (*template["spec"]["initContainers"], *template["spec"]["containers"]):
        assert container["securityContext"] == {"allowPrivilegeEscalation": False,
                                                "capabilities": {"drop": ["ALL"], "add": ["IPC_LOCK"]}}
    failing = {name for name, check in CONTROLS.items() if check(template)}
    assert failing == {"baseline/Capabilities", "restricted/Capabilities"}  # IPC_LOCK is no default capability
