"""The Pod Security Standards' *restricted* profile as checks over a pod template, control by control.

https://kubernetes.io/docs/concepts/security/pod-security-standards/ (Kubernetes v1.30 and later):
restricted is every *baseline* control plus its own. Each check takes a pod template (``metadata``
and ``spec``) and returns what in it breaks its control, [] when it holds; ``CONTROLS`` names each
as the page does. A field the page allows "undefined/nil" is allowed absent here too.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

Obj = dict[str, Any]

# Baseline § Capabilities: what may be added beyond the runtime's default set.
BASELINE_CAPABILITIES = frozenset({"AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD",
                                   "NET_BIND_SERVICE", "SETFCAP", "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT"})
# Baseline § SELinux: allowed seLinuxOptions.type.
SELINUX_TYPES = frozenset({"", "container_t", "container_init_t", "container_kvm_t", "container_engine_t"})
# Baseline § Sysctls: the safe set.
SAFE_SYSCTLS = frozenset({"kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range",
                          "net.ipv4.ip_unprivileged_port_start", "net.ipv4.tcp_syncookies", "net.ipv4.ping_group_range", "net.ipv4.ip_local_reserved_ports",
                          "net.ipv4.tcp_keepalive_time", "net.ipv4.tcp_fin_timeout", "net.ipv4.tcp_keepalive_intvl",
                          "net.ipv4.tcp_keepalive_probes"})
# Restricted § Volume Types: the only volume sources allowed.
VOLUME_TYPES = frozenset({"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim",
                          "projected", "secret"})


def containers(template: Obj) -> Iterator[Obj]:
    spec = template["spec"]
    for field in ("initContainers", "containers", "ephemeralContainers"):
        yield from spec.get(field) or []


def _pod_context(template: Obj) -> Obj:
    return template["spec"].get("securityContext") or {}


def _contexts(template: Obj) -> Iterator[tuple[str, Obj]]:
    """(where, securityContext) of the pod and of each container."""
    yield "pod", _pod_context(template)
    for c in containers(template):
        yield f"container {c['name']}", c.get("securityContext") or {}


def _effective(template: Obj, container: Obj, key: str) -> Any:
    """A container's ``key``: its own securityContext's, else the pod's."""
    own = container.get("securityContext") or {}
    return own[key] if own.get(key) is not None else _pod_context(template).get(key)


def host_process(template: Obj) -> list[str]:
    """Baseline § HostProcess: windowsOptions.hostProcess undefined/nil or false."""
    return [where for where, ctx in _contexts(template) if (ctx.get("windowsOptions") or {}).get("hostProcess")]


def host_namespaces(template: Obj) -> list[str]:
    """Baseline § Host Namespaces: spec.hostNetwork, hostPID, hostIPC undefined/nil or false."""
    return [field for field in ("hostNetwork", "hostPID", "hostIPC") if template["spec"].get(field)]


def privileged_containers(template: Obj) -> list[str]:
    """Baseline § Privileged Containers: securityContext.privileged undefined/nil or false."""
    return [c["name"] for c in containers(template) if (c.get("securityContext") or {}).get("privileged")]


def _added(container: Obj) -> set[str]:
    return set(((container.get("securityContext") or {}).get("capabilities") or {}).get("add") or [])


def baseline_capabilities(template: Obj) -> list[str]:
    """Baseline § Capabilities: capabilities.add only from the default set (BASELINE_CAPABILITIES)."""
    return [c["name"] for c in containers(template) if _added(c) - BASELINE_CAPABILITIES]


def host_path_volumes(template: Obj) -> list[str]:
    """Baseline § HostPath Volumes: spec.volumes[*].hostPath undefined/nil."""
    return [v["name"] for v in template["spec"].get("volumes") or [] if "hostPath" in v]


def host_ports(template: Obj) -> list[str]:
    """Baseline § Host Ports: ports[*].hostPort undefined/nil or 0."""
    return [c["name"] for c in containers(template) if any(p.get("hostPort") for p in c.get("ports") or [])]


def app_armor(template: Obj) -> list[str]:
    """Baseline § AppArmor: appArmorProfile.type undefined/nil, RuntimeDefault or Localhost; the
    annotations container.apparmor.security.beta.kubernetes.io/* runtime/default or localhost/*."""
    out = [where for where, ctx in _contexts(template)
           if (ctx.get("appArmorProfile") or {}).get("type") not in (None, "RuntimeDefault", "Localhost")]
    annotations = template.get("metadata", {}).get("annotations") or {}
    return out + [k for k, v in annotations.items() if k.startswith("container.apparmor.security.beta.kubernetes.io/")
                  and v != "runtime/default" and not v.startswith("localhost/")]


def selinux(template: Obj) -> list[str]:
    """Baseline § SELinux: seLinuxOptions.type undefined/"" or a container type (SELINUX_TYPES);
    seLinuxOptions.user and .role undefined/""."""
    out = []
    for where, ctx in _contexts(template):
        options = ctx.get("seLinuxOptions") or {}
        if options.get("type", "") not in SELINUX_TYPES or options.get("user") or options.get("role"):
            out.append(where)
    return out


def proc_mount(template: Obj) -> list[str]:
    """Baseline § /proc Mount Type: securityContext.procMount undefined/nil or Default."""
    return [c["name"] for c in containers(template)
            if (c.get("securityContext") or {}).get("procMount") not in (None, "Default")]


def baseline_seccomp(template: Obj) -> list[str]:
    """Baseline § Seccomp: seccompProfile.type undefined/nil, RuntimeDefault or Localhost (not Unconfined)."""
    return [where for where, ctx in _contexts(template)
            if (ctx.get("seccompProfile") or {}).get("type") == "Unconfined"]


def sysctls(template: Obj) -> list[str]:
    """Baseline § Sysctls: spec.securityContext.sysctls[*].name only from the safe set (SAFE_SYSCTLS)."""
    return [s["name"] for s in _pod_context(template).get("sysctls") or [] if s["name"] not in SAFE_SYSCTLS]


def volume_types(template: Obj) -> list[str]:
    """Restricted § Volume Types: every volume one of configMap, csi, downwardAPI, emptyDir,
    ephemeral, persistentVolumeClaim, projected, secret."""
    return [v["name"] for v in template["spec"].get("volumes") or [] if not set(v) - {"name"} <= VOLUME_TYPES]


def privilege_escalation(template: Obj) -> list[str]:
    """Restricted § Privilege Escalation: securityContext.allowPrivilegeEscalation false (set)."""
    return [c["name"] for c in containers(template)
            if (c.get("securityContext") or {}).get("allowPrivilegeEscalation") is not False]


def running_as_non_root(template: Obj) -> list[str]:
    """Restricted § Running as Non-root: runAsNonRoot true on the pod (no container false), or on
    every container."""
    return [c["name"] for c in containers(template) if _effective(template, c, "runAsNonRoot") is not True]


def running_as_non_root_user(template: Obj) -> list[str]:
    """Restricted § Running as Non-root user: runAsUser undefined/nil or non-zero."""
    return [where for where, ctx in _contexts(template) if ctx.get("runAsUser") == 0]


def restricted_seccomp(template: Obj) -> list[str]:
    """Restricted § Seccomp: seccompProfile.type RuntimeDefault or Localhost, on the pod or on every
    container (a container's undefined only where the pod's is set)."""
    return [c["name"] for c in containers(template)
            if (_effective(template, c, "seccompProfile") or {}).get("type") not in ("RuntimeDefault", "Localhost")]


def restricted_capabilities(template: Obj) -> list[str]:
    """Restricted § Capabilities: capabilities.drop includes ALL; .add only NET_BIND_SERVICE."""
    def drops_all(c: Obj) -> bool:
        return "ALL" in (((c.get("securityContext") or {}).get("capabilities") or {}).get("drop") or [])

    return [c["name"] for c in containers(template) if not drops_all(c) or _added(c) - {"NET_BIND_SERVICE"}]


CONTROLS: dict[str, Callable[[Obj], list[str]]] = {
    "baseline/HostProcess": host_process,
    "baseline/Host Namespaces": host_namespaces,
    "baseline/Privileged Containers": privileged_containers,
    "baseline/Capabilities": baseline_capabilities,
    "baseline/HostPath Volumes": host_path_volumes,
    "baseline/Host Ports": host_ports,
    "baseline/AppArmor": app_armor,
    "baseline/SELinux": selinux,
    "baseline/proc Mount Type": proc_mount,
    "baseline/Seccomp": baseline_seccomp,
    "baseline/Sysctls": sysctls,
    "restricted/Volume Types": volume_types,
    "restricted/Privilege Escalation": privilege_escalation,
    "restricted/Running as Non-root": running_as_non_root,
    "restricted/Running as Non-root user": running_as_non_root_user,
    "restricted/Seccomp": restricted_seccomp,
    "restricted/Capabilities": restricted_capabilities,
}
