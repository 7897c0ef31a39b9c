"""reconcile: pure glue between the rollout state machine and the cluster.

- ``plan``: a ``Transition``'s replicas per revision + the children that exist → what to create,
  patch and delete. The desired revision (the current spec's) is rendered in full; any other
  revision still wanted (the stable one during a rollout) can only be *scaled*: its pod template
  came from an older spec that is no longer at hand. A StatefulSet group of such a revision is
  scaled to zero pods rather than deleted, so that a rollback can scale it back.
- ``ready_replicas``: ready model replicas (whole parallel groups) per revision, as ``advance``
  takes them; ``scrape_targets``: the canary pods' ``/metrics`` addresses; ``runtime_refusal``:
  why a runtime pod will not start (its termination message), as ``advance`` takes it.
- ``status_patch`` / ``invalid_status``: the typed status as the merge patch the API takes.

No I/O; ``controller`` does it.
"""
from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from specdecode.operator import names
from specdecode.operator.render import build_shared, build_workloads
from specdecode.operator.resolve import Resolved
from specdecode.operator.rollout import set_condition
from specdecode.operator.spec import ConditionStatus, ConditionType, SpecDecodeDeploymentStatus

Obj = dict[str, Any]
Key = tuple[str, str, str]  # apiVersion, kind, name
INVALID_SPEC = "InvalidSpec"
# Containers whose non-zero exit is a refusal to serve: the runtime, and the fetch of an hf:// source.
_OURS = (names.CONTAINER, names.FETCH_CONTAINER, names.FETCH_MTP_CONTAINER)
MAX_REFUSAL_CHARS = 400  # of the termination message, in a condition message
_SCALABLE = {"Deployment", "LeaderWorkerSet"}  # one object per revision, replicas = model replicas


def key(obj: Mapping[str, Any]) -> Key:
    return obj["apiVersion"], obj["kind"], obj["metadata"]["name"]


def contains(actual: Any, desired: Any) -> bool:
    """Whether ``actual`` already holds everything ``desired`` says (server-filled extras allowed)."""
    if isinstance(desired, Mapping):
        return isinstance(actual, Mapping) and all(k in actual and contains(actual[k], v) for k, v in desired.items())
    if isinstance(desired, list):
        return (isinstance(actual, list) and len(actual) == len(desired)
                and all(contains(a, d) for a, d in zip(actual, desired)))
    return actual == desired


@dataclass(frozen=True)
class Plan:
    create: tuple[Obj, ...] = ()
    patch: tuple[Obj, ...] = ()  # merge patches carrying apiVersion, kind, metadata.name/namespace
    delete: tuple[Obj, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.create or self.patch or self.delete)


def plan(r: Resolved, desired: str, replicas: Mapping[str, int], existing: Sequence[Obj], *,
         stable: str, canary: str | None = None, leader_worker_set: bool) -> Plan:
    """The changes that make the children match ``replicas`` (revision → model replicas), with
    the route Services (``rollout.trafficRouting``) selecting ``stable`` and ``canary``."""
    wanted = {key(o): o for o in build_shared(r, stable, canary, leader_worker_set=leader_worker_set)}
    if desired in replicas:
        for obj in build_workloads(r, desired, replicas[desired], leader_worker_set=leader_worker_set):
            wanted[key(obj)] = obj
    live = {key(o): o for o in existing}
    create = tuple(obj for k, obj in wanted.items() if k not in live)
    patch = [obj for k, obj in wanted.items() if k in live and not contains(live[k], obj)]
    delete = []
    for k, obj in live.items():
        if k in wanted:
            continue
        rev = _labels(obj).get(names.LABEL_REVISION)
        if rev is None or rev == desired or rev not in replicas:
            delete.append(obj)
        elif (scaled := _scaled(obj, replicas[rev], r.layout.pods_per_group)) is not None:
            patch.append(scaled)
    return Plan(create, tuple(patch), tuple(delete))


def _labels(obj: Mapping[str, Any]) -> Mapping[str, str]:
    return obj.get("metadata", {}).get("labels") or {}


def _scaled(obj: Obj, count: int, pods_per_group: int) -> Obj | None:
    """A patch scaling a workload of a revision that is not rendered any more; None if nothing to do."""
    if obj["kind"] in _SCALABLE:
        want = count
    elif obj["kind"] == "StatefulSet":
        want = pods_per_group if int(_labels(obj).get(names.LABEL_GROUP, 0)) < count else 0
    else:
        return None  # a headless Service follows its StatefulSet
    if obj.get("spec", {}).get("replicas") == want:
        return None
    meta = obj["metadata"]
    return {"apiVersion": obj["apiVersion"], "kind": obj["kind"],
            "metadata": {"name": meta["name"], "namespace": meta["namespace"]}, "spec": {"replicas": want}}


def ready_replicas(existing: Sequence[Obj], pods_per_group: int) -> dict[str, int]:
    """Ready model replicas per revision: ready pods of a Deployment, ready groups of a
    LeaderWorkerSet, StatefulSet groups with every pod ready."""
    ready: dict[str, int] = {}
    for obj in existing:
        rev = _labels(obj).get(names.LABEL_REVISION)
        if rev is None or obj["kind"] not in (*_SCALABLE, "StatefulSet"):
            continue
        count = min((obj.get("status") or {}).get("readyReplicas") or 0, obj.get("spec", {}).get("replicas") or 0)
        if obj["kind"] == "StatefulSet":
            count = int(count >= pods_per_group > 0)
        ready[rev] = ready.get(rev, 0) + count
    return ready


def scrape_targets(pods: Sequence[Obj]) -> Iterator[tuple[str, str]]:
    """(pod name, ``/metrics`` URL) of each ready pod (its model loaded): its IP and the runtime's
    ``http`` port."""
    for pod in pods:
        status, meta = pod.get("status") or {}, pod["metadata"]
        ip, port = status.get("podIP"), _http_port(pod)
        ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])
        if ip and port and ready and not meta.get("deletionTimestamp"):
            host = f"[{ip}]" if ":" in ip else ip
            yield meta["name"], f"http://{host}:{port}/metrics"


def runtime_refusal(pods: Sequence[Obj]) -> str | None:
    """Why runtime pods will not start, or None: the termination message of the first (by name) of
    our containers that exited non-zero and is not running again (terminated, or waiting to
    restart: CrashLoopBackOff). The runtime writes one line; a log tail (terminationMessagePolicy
    FallbackToLogsOnError) counts by its last line, where a traceback names the error."""
    refusals = [line for pod in sorted(pods, key=lambda p: p["metadata"]["name"])
                if not pod["metadata"].get("deletionTimestamp") and (line := _pod_refusal(pod))]
    if not refusals:
        return None
    more = f" (and {len(refusals) - 1} more pods)" if len(refusals) > 1 else ""
    return refusals[0] + more


def _pod_refusal(pod: Obj) -> str | None:
    status, meta = pod.get("status") or {}, pod["metadata"]
    for container in [*status.get("initContainerStatuses", []), *status.get("containerStatuses", [])]:
        exited = _failed_exit(container)
        if container.get("name") in _OURS and exited is not None:
            revision = _labels(pod).get(names.LABEL_REVISION, "?")
            return (f"pod {meta['name']} (revision {revision}): {container['name']} exited with code "
                    f"{exited['exitCode']}: {_said(exited)}")
    return None


def _failed_exit(container: Obj) -> Obj | None:
    """A container status' last termination, if it failed and the container is not running again."""
    state = container.get("state") or {}
    before = (container.get("lastState") or {}).get("terminated") if "waiting" in state else None
    exited = state.get("terminated") or before
    return exited if exited and exited.get("exitCode", 0) != 0 else None


def _said(exited: Obj) -> str:
    """The last line of a termination message (or its reason, e.g. OOMKilled), cut to fit a condition."""
    lines = [line.strip() for line in (exited.get("message") or "").splitlines() if line.strip()]
    said = lines[-1] if lines else exited.get("reason") or "no message"
    return said if len(said) <= MAX_REFUSAL_CHARS else said[:MAX_REFUSAL_CHARS - 1] + "…"


def _http_port(pod: Obj) -> int | None:
    for container in pod.get("spec", {}).get("containers", []):
        if container.get("name") == names.CONTAINER:
            for port in container.get("ports", []):
                if port.get("name") == names.HTTP_PORT_NAME:
                    return int(port["containerPort"])
    return None


# -- status -------------------------------------------------------------------------------------


def read_status(body: Mapping[str, Any]) -> SpecDecodeDeploymentStatus:
    return SpecDecodeDeploymentStatus.model_validate(body.get("status") or {}, by_alias=True, by_name=False)


def invalid_status(status: SpecDecodeDeploymentStatus, message: str, generation: int | None,
                   now: datetime) -> SpecDecodeDeploymentStatus:
    """``Ready=False, reason=InvalidSpec``; the rest (what still runs) as it was."""
    conditions = set_condition(status.conditions, ConditionType.READY, ConditionStatus.FALSE, INVALID_SPEC,
                               message, now)
    return status.model_copy(update={"conditions": conditions, "observed_generation": generation})


def is_invalid(status: SpecDecodeDeploymentStatus, message: str | None = None) -> bool:
    """Whether ``status`` says the spec is invalid (for this very reason, if ``message`` is given)."""
    return any(c.type == ConditionType.READY and c.reason == INVALID_SPEC and message in (None, c.message)
               for c in status.conditions)


def status_patch(status: SpecDecodeDeploymentStatus) -> Obj:
    """``status`` as a JSON merge patch: a field that is None removes the stored one; inside
    lists (conditions), None fields are left out, as the schema has no nullable fields."""
    return _marked(status.model_dump(mode="json", by_alias=True))


def _marked(value: dict[str, Any]) -> dict[str, Any]:
    return {k: _marked(v) if isinstance(v, dict) else _stripped(v) for k, v in value.items()}


def _stripped(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _stripped(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_stripped(v) for v in value]
    return value
