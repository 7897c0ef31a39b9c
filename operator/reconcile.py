"""reconcile: pure glue between the rollout state machine and the cluster.

- ``plan``: a ``Transition``'s replicas per revision + the children that exist → what to apply,
  scale and delete. The desired revision (the current spec's) is rendered in full; any other
  revision still wanted (the stable one during a rollout) can only be *scaled*: its pod template
  came from an older spec that is no longer at hand. A StatefulSet group of such a revision is
  scaled to zero pods rather than deleted, so that a rollback can scale it back.
- Children are written by server-side apply under one field manager (``names.MANAGER``): each
  rendered object is applied whole, owned by the resource (a controller owner reference) and
  stamped with a hash of itself (``names.ANNOTATION_APPLIED``), so that an object is applied
  again exactly when what we render changed or what runs lost some of it, and the API server
  removes whatever we rendered before and render no more. ``handed_over``: a child that an
  earlier operator version wrote (create and merge patches, operation ``Update`` under the
  ``kubernetes`` client's default manager) first has those fields handed to our ``Apply`` entry,
  as kubectl's ``csaupgrade`` does, so that the first apply can remove them too.
- ``running_kind`` / ``desired_kind``: what runs a multi-pod layout is chosen once per resource
  (LeaderWorkerSet when the cluster serves it then) and recorded in ``status.workloadKind``;
  only the ``names.ANNOTATION_WORKLOAD_KIND`` annotation changes it, through a rollout.
- ``ready_replicas``: ready model replicas (whole parallel groups) per revision, as ``advance``
  takes them; ``serving_endpoints``: the ready pods' addresses (their ``/metrics``, the probe's completions). Why a runtime pod
  will not start (``pods.runtime_refusal``) or is not ready is read in ``pods``.
- ``status_patch`` / ``not_ready``: the typed status as the merge patch the API takes;
  ``Ready=False`` for an invalid spec (``InvalidSpec``) or writes the API server did not take
  (``ChildRefused``, ``ApplyFailed``, ``RouteRefused``, with its message).

No I/O; ``controller`` does it.
"""
from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import kopf

from specdecode.operator import names
from specdecode.operator.kubeschema import quantity_value
from specdecode.operator.pods import is_ready
from specdecode.operator.render import build_shared, build_workloads
from specdecode.operator.resolve import Resolved
from specdecode.operator.rollout import set_condition
from specdecode.operator.spec import ConditionStatus, ConditionType, SpecDecodeDeploymentStatus, WorkloadKind

Obj = dict[str, Any]
Key = tuple[str, str, str]  # apiVersion, kind, name
INVALID_SPEC = "InvalidSpec"
CHILD_REFUSED = "ChildRefused"  # the API server refused a write (4xx: invalid, a policy, a quota)
APPLY_FAILED = "ApplyFailed"  # a write failed otherwise (5xx: a webhook down; no answer)
ROUTE_REFUSED = "RouteRefused"  # the user's HTTPRoute refused the canary's weights (4xx)
_SCALABLE = {"Deployment", "LeaderWorkerSet"}  # one object per revision, replicas = model replicas
_WORKLOADS = {kind.value for kind in WorkloadKind}
# Who wrote children before they were applied: earlier operator versions sent no fieldManager,
# so the API server named them after the kubernetes client's User-Agent (OpenAPI-Generator/…).
LEGACY_MANAGERS = frozenset({"OpenAPI-Generator"})
APPLIED_HASH_LENGTH = 16
QUANTITY_FIELDS = frozenset({"requests", "limits", "sizeLimit"})  # a quantity, or quantities by resource name


def key(obj: Mapping[str, Any]) -> Key:
    return obj["apiVersion"], obj["kind"], obj["metadata"]["name"]


def contains(actual: Any, desired: Any, *, quantity: bool = False) -> bool:
    """Whether ``actual`` already holds everything ``desired`` says (server-filled extras allowed).
    Quantities (under ``QUANTITY_FIELDS``) compare by amount: the API server writes them back in its
    canonical spelling (``1024Mi`` as ``1Gi``, ``0.5`` as ``500m``)."""
    if isinstance(desired, Mapping):
        return isinstance(actual, Mapping) and all(
            k in actual and contains(actual[k], v, quantity=quantity or k in QUANTITY_FIELDS) for k, v in desired.items())
    if isinstance(desired, list):
        return (isinstance(actual, list) and len(actual) == len(desired)
                and all(contains(a, d) for a, d in zip(actual, desired)))
    if quantity and (amount := quantity_value(desired)) is not None:
        return quantity_value(actual) == amount
    return actual == desired


@dataclass(frozen=True)
class Plan:
    apply: tuple[Obj, ...] = ()  # whole rendered objects, owned and stamped (server-side apply)
    scale: tuple[Obj, ...] = ()  # merge patches of replicas, for revisions no longer rendered
    delete: tuple[Obj, ...] = ()
    hand_over: tuple[tuple[Obj, list[Obj]], ...] = ()  # (live child, its managedFields for us): before applying

    def __bool__(self) -> bool:
        return bool(self.apply or self.scale or self.delete or self.hand_over)


def plan(r: Resolved, desired: str, replicas: Mapping[str, int], existing: Sequence[Obj], *, owner: Mapping[str, Any],
         stable: str, canary: str | None = None, kind: WorkloadKind, stable_kind: WorkloadKind) -> Plan:
    """The changes that make the children match ``replicas`` (revision → model replicas): the
    desired revision's workloads of ``kind``, the traffic Service selecting the leaders of
    ``stable_kind`` (the stable revision's), the route Services (``rollout.trafficRouting``)
    selecting ``stable`` and ``canary``; every child owned by ``owner``."""
    lws = kind is WorkloadKind.LEADER_WORKER_SET
    rendered = build_shared(r, stable, canary, leader_worker_set=stable_kind is WorkloadKind.LEADER_WORKER_SET,
                            canary_leader_worker_set=lws)
    if desired in replicas:
        rendered += build_workloads(r, desired, replicas[desired], leader_worker_set=lws)
    wanted = {key(o): applied_form(o, owner) for o in rendered}
    live = {key(o): o for o in existing}
    apply = tuple(obj for k, obj in wanted.items() if not contains(live.get(k), obj))
    hand_over = tuple((live[k], fields) for k in map(key, apply)
                      if k in live and (fields := handed_over(live[k])) is not None)
    scale, delete = [], []
    for k, obj in live.items():
        if k in wanted:
            continue
        rev = _labels(obj).get(names.LABEL_REVISION)
        if rev is None or rev == desired or rev not in replicas:
            delete.append(obj)
        elif (scaled := _scaled(obj, replicas[rev], r.layout.pods_per_group)) is not None:
            scale.append(scaled)
    return Plan(apply, tuple(scale), tuple(delete), hand_over)


def children_of(listed: Sequence[Obj], owner: Mapping[str, Any]) -> list[Obj]:
    """The objects listed by ``owner``'s labels that are its children: those it controls (an owner
    reference with ``controller``) or nothing does. Another controller's object that copies the
    labels of what it was made from (the StatefulSets of a LeaderWorkerSet) is that controller's,
    not one to scale or delete."""
    uid = owner["metadata"].get("uid")
    return [obj for obj in listed
            if all(ref.get("uid") == uid for ref in obj["metadata"].get("ownerReferences") or [] if ref.get("controller"))]


def applied_form(obj: Obj, owner: Mapping[str, Any]) -> Obj:
    """``obj`` as it is applied: adopted by ``owner`` (a controller owner reference that blocks
    its deletion until the child is gone; the owner's labels where ours do not say otherwise)
    and stamped with a hash of all that."""
    out = json.loads(json.dumps(obj))
    kopf.adopt(out, owner=dict(owner))
    digest = hashlib.sha256(json.dumps(out, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    out["metadata"].setdefault("annotations", {})[names.ANNOTATION_APPLIED] = digest[:APPLIED_HASH_LENGTH]
    return out


def handed_over(live: Mapping[str, Any]) -> list[Obj] | None:
    """``live``'s managedFields with what earlier operator versions wrote (the ``Update`` entries of
    ``LEGACY_MANAGERS``) handed to our ``Apply`` entry; None if there is nothing to hand over: we
    applied it before, or no earlier version wrote it."""
    managed = live["metadata"].get("managedFields") or []
    if any(e.get("manager") == names.MANAGER and e.get("operation") == "Apply" for e in managed):
        return None
    legacy = [e for e in managed
              if e.get("manager") in LEGACY_MANAGERS and e.get("operation") == "Update" and not e.get("subresource")]
    if not legacy:
        return None
    fields: Obj = {}
    for entry in legacy:
        _union(fields, entry.get("fieldsV1") or {})
    ours = {"manager": names.MANAGER, "operation": "Apply", "apiVersion": live["apiVersion"],
            "time": legacy[-1].get("time"), "fieldsType": "FieldsV1", "fieldsV1": fields}
    return [*(e for e in managed if e not in legacy), {k: v for k, v in ours.items() if v is not None}]


def _union(into: Obj, fields: Mapping[str, Any]) -> None:
    """Merge FieldsV1 ``fields`` into ``into``."""
    for part, inner in fields.items():
        _union(into.setdefault(part, {}), inner)


# -- the workload kind --------------------------------------------------------------------------


def running_kind(status: SpecDecodeDeploymentStatus, existing: Sequence[Obj]) -> WorkloadKind | None:
    """What runs the stable revision: as recorded in status, else (a resource an earlier operator
    version made) the kind of the stable revision's workloads; None for a new resource."""
    if status.workload_kind is not None:
        return status.workload_kind
    return next((WorkloadKind(o["kind"]) for o in existing if o["kind"] in _WORKLOADS
                 and _labels(o).get(names.LABEL_REVISION) == status.stable_revision), None)


def desired_kind(r: Resolved, running: WorkloadKind | None, requested: str | None,
                 serves_leader_worker_set: Callable[[], bool]) -> tuple[WorkloadKind, list[str]]:
    """What the desired revision runs as, and warnings: one pod per replica is a Deployment; a
    multi-pod layout keeps what runs unless ``names.ANNOTATION_WORKLOAD_KIND`` asks for another
    kind the cluster serves; a new resource gets LeaderWorkerSet if the cluster serves it (the
    only time discovery decides)."""
    if r.layout.single_pod:
        return WorkloadKind.DEPLOYMENT, []
    multi_pod = (WorkloadKind.STATEFUL_SET, WorkloadKind.LEADER_WORKER_SET)
    fallback = running if running in multi_pod else None
    if requested is not None:
        asked = next((k for k in multi_pod if k.value == requested.strip()), None)
        if asked is None:
            return _chosen(fallback, serves_leader_worker_set), [
                f"{names.ANNOTATION_WORKLOAD_KIND}: {requested!r} is neither StatefulSet nor LeaderWorkerSet; ignored"]
        if asked is WorkloadKind.STATEFUL_SET or serves_leader_worker_set():
            return asked, []
        return _chosen(fallback, serves_leader_worker_set), [
            f"{names.ANNOTATION_WORKLOAD_KIND}: LeaderWorkerSet asked for, but the cluster does not serve "
            "leaderworkerset.x-k8s.io/v1; ignored"]
    return _chosen(fallback, serves_leader_worker_set), []


def _chosen(running: WorkloadKind | None, serves_leader_worker_set: Callable[[], bool]) -> WorkloadKind:
    if running is not None:
        return running
    return WorkloadKind.LEADER_WORKER_SET if serves_leader_worker_set() else WorkloadKind.STATEFUL_SET


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


def serving_endpoints(pods: Sequence[Obj]) -> Iterator[tuple[str, str]]:
    """(pod name, base URL) of each ready pod (its model loaded): its IP and the runtime's ``http``
    port."""
    for pod in pods:
        status, meta = pod.get("status") or {}, pod["metadata"]
        ip, port = status.get("podIP"), _http_port(pod)
        if ip and port and is_ready(pod) and not meta.get("deletionTimestamp"):
            host = f"[{ip}]" if ":" in ip else ip
            yield meta["name"], f"http://{host}:{port}"


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


def not_ready(status: SpecDecodeDeploymentStatus, reason: str, message: str, now: datetime, *,
              before: SpecDecodeDeploymentStatus | None = None) -> SpecDecodeDeploymentStatus:
    """``status`` with ``Ready=False`` for ``reason``, the rest (what still runs, the rollout) as it
    was; not ready since ``before`` (the stored status) says so, if given, else since ``now``."""
    ready, false = ConditionType.READY, ConditionStatus.FALSE
    since = next(c.last_transition_time for c in set_condition((before or status).conditions, ready, false, reason,
                                                                message, now) if c.type == ready)
    conditions = set_condition(status.conditions, ready, false, reason, message, since or now)
    return status.model_copy(update={"conditions": conditions})


def is_not_ready(status: SpecDecodeDeploymentStatus, reason: str, message: str | None = None) -> bool:
    """Whether ``status`` says ``Ready=False`` for ``reason`` (and ``message``, if given)."""
    return any(c.type == ConditionType.READY and c.status == ConditionStatus.FALSE and c.reason == reason
               and message in (None, c.message) for c in status.conditions)


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
