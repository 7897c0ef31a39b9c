"""security: runtime pods meet the *restricted* Pod Security Standard out of the box.

https://kubernetes.io/docs/concepts/security/pod-security-standards/#restricted: every container
(init containers too) runs as the runtime image's non-root user, under the container runtime's
default seccomp profile, without privilege escalation and with every capability dropped. The rest
of the profile holds by what render leaves out: the operator's volumes are ``emptyDir`` and
``persistentVolumeClaim`` only, and no host namespace, host port, host path, privileged mode,
sysctl, ``procMount``, AppArmor or SELinux option is set.

``spec.pod.securityContext`` and ``spec.pod.containerSecurityContext`` are merged over these key
by key (a key given replaces the operator's whole): a cluster whose image runs as another user,
or a runtime that needs a capability, says so there, and then answers for the profile itself.
"""
from __future__ import annotations

from typing import Any

from specdecode.operator.spec import PodOverrides

Obj = dict[str, Any]

RUNTIME_UID = 10001  # the runtime image's user and group (Dockerfile: useradd --uid 10001 --user-group)


def pod_security_context(pod: PodOverrides) -> Obj:
    """The pod's ``securityContext``: the restricted defaults, then ``pod.securityContext``."""
    defaults: Obj = {
        "runAsNonRoot": True,
        "runAsUser": RUNTIME_UID,
        "runAsGroup": RUNTIME_UID,
        "fsGroup": RUNTIME_UID,  # writable claims (an hf:// cache) are the runtime's group's
        "fsGroupChangePolicy": "OnRootMismatch",  # not every file of a cache claim chowned at each start
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    return {**defaults, **(pod.security_context or {})}


def container_security_context(pod: PodOverrides) -> Obj:
    """Every container's ``securityContext``: the restricted defaults, then ``pod.containerSecurityContext``."""
    defaults: Obj = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}
    return {**defaults, **(pod.container_security_context or {})}
