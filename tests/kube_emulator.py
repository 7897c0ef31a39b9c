"""An in-memory Kubernetes API server for the operator's integration tests.

kmock's ``KubernetesEmulator`` stores objects and serves list/watch/create/patch/delete; ``ApiServer``
adds what a real API server does that kopf, the operator and these tests rely on:

- ``metadata.uid``, ``resourceVersion`` (one increasing counter), ``creationTimestamp``,
  ``generateName``, and ``generation`` (1 on create, +1 when anything but metadata and status
  changes);
- status subresources: ``PATCH …/status`` changes only ``status``, a main-resource patch never
  does, and ``status`` is dropped on create;
- discovery of the built-in resources used here and of installed CRDs (with their subresources;
  groups in ``hidden_from_kopf`` left out of what kopf reads);
- custom resources validated against the CRD's ``openAPIV3Schema`` (jsonschema): a violation or an
  unknown field is a 422 ``Invalid`` (a real server with ``fieldValidation=Strict``; by default it
  would prune unknown fields silently); the built-in kinds the operator writes (``VALIDATED``)
  against Kubernetes' own schema (kubernetes_validate, ``K8S_VERSION``): a required field missing
  (an env entry without a name) or an enum or type broken is a 422 too, but the server's further
  rules (quantities, name formats, cross-field checks) are not;
- Deployments, StatefulSets and LeaderWorkerSets are ready as soon as they are created or their
  spec changes (a stand-in for their controllers and the kubelet: no pods are made; tests create
  the pods they need), except those named in ``loading``, whose added replicas stay unready until
  a test reports them ready (a scale-down drops unready ones first); a write that changes nothing
  leaves their status as it is;
- ``labelSelector`` on lists and watches (equality, inequality, existence),
  ``GET /api/v1/namespaces[/name]`` and ``GET /apis/`` (kmock cannot route them), 409 on a stale
  ``metadata.resourceVersion`` in a patch;
- ``metadata.managedFields`` and server-side apply (``application/apply-patch+yaml`` with
  ``fieldManager`` and ``force``; it creates what does not exist), as kube_fields.py models them:
  every write records who owns which field (a request without ``fieldManager`` counts under its
  User-Agent's product, as a real server names it), an apply removes what its manager applied
  before and applies no more, and an apply that changes nothing writes nothing;
- ``dryRun=All`` on a create, patch, apply or delete: the answer the write would get (validated,
  admitted) and nothing stored;
- ``admission``: callables a test adds that see every create, patch, apply and delete (dry runs
  too) and may refuse it with a ``kmock.KubernetesError``, standing in for a validating webhook, a
  policy engine or a ResourceQuota.

Other patches are JSON merge patches (kmock applies strategic-merge patches as merge patches too)
or JSON patches (kopf's finalizers, with a failed ``test`` answered 422 as kopf expects);
``serve`` runs the server over real HTTP in its own thread and event loop, so clients in any
thread (kopf's, the ``kubernetes`` client's) reach it and shutting it down does not stall
(operator_harness.py runs the operator against it). What it still lacks is in tests/README.md.
"""
from __future__ import annotations

import asyncio
import copy
import datetime
import json
import re
import secrets
import string
import threading
import uuid
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import aiohttp.web
import jsonpatch
import jsonpointer
import jsonschema
import kmock
import kube_fields
import kubernetes_validate
import yaml

Obj = dict[str, Any]

# (group/version/plural): (kind, namespaced, subresources) — what the operator and kopf touch.
BUILTINS: dict[str, tuple[str, bool, tuple[str, ...]]] = {
    "v1/pods": ("Pod", True, ("status",)),
    "v1/services": ("Service", True, ("status",)),
    "v1/events": ("Event", True, ()),
    "v1/namespaces": ("Namespace", False, ("status",)),
    "apps/v1/deployments": ("Deployment", True, ("status", "scale")),
    "apps/v1/statefulsets": ("StatefulSet", True, ("status", "scale")),
    "policy/v1/poddisruptionbudgets": ("PodDisruptionBudget", True, ("status",)),
    "apiextensions.k8s.io/v1/customresourcedefinitions": ("CustomResourceDefinition", False, ("status",)),
}
VERBS = ("create", "delete", "get", "list", "patch", "watch")
# Stand-in for the workload controllers and the kubelet: these are ready as soon as written
# (LeaderWorkerSets once a test installs their CRD).
INSTANTLY_READY = {kmock.resource(r) for r in ("apps/v1/deployments", "apps/v1/statefulsets",
                                               "leaderworkerset.x-k8s.io/v1/leaderworkersets")}
CRDS = kmock.resource("apiextensions.k8s.io/v1/customresourcedefinitions")
KOPF_AGENT = "kopf/"  # the User-Agent prefix of kopf's requests
_NAMESPACE_PATH = re.compile(r"^/api/v1/namespaces/?(?P<name>[^/]+)?$")
APPLY_PATCH = "application/apply-patch+yaml"
_WRITES = (kmock.action.CREATE, kmock.action.UPDATE, kmock.action.DELETE)
# Built-in kinds checked against Kubernetes' schema on every write: what the operator writes.
VALIDATED = {kmock.resource(r) for r in ("apps/v1/deployments", "apps/v1/statefulsets", "v1/services",
                                         "policy/v1/poddisruptionbudgets")}
K8S_VERSION = "1.30"
_SELECTOR_TERM = re.compile(r"^(?P<neg>!)?(?P<key>[A-Za-z0-9._/-]+)(?:(?P<op>==|!=|=)(?P<value>[A-Za-z0-9._-]*))?$")


def invalid(res: kmock.resource, kind: str, name: str, causes: list[str]) -> kmock.KubernetesError:
    """A 422 as a real server words it: ``Deployment.apps "x" is invalid: …``."""
    qualified = f"{kind}.{res.group}" if res.group else kind
    message = f'{qualified} "{name}" is invalid: ' + "; ".join(causes)
    return kmock.KubernetesError(status=422, reason="Invalid", message=message, details={
        "name": name, "group": res.group, "kind": kind, "causes": [{"message": c} for c in causes]})


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386: mappings merge recursively, ``null`` removes a key, anything else replaces."""
    if not isinstance(patch, Mapping):
        return copy.deepcopy(patch)
    out = dict(target) if isinstance(target, Mapping) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge_patch(out.get(key), value)
    return out


def merge_diff(before: Any, after: Any) -> Any:
    """The JSON merge patch that turns ``before`` into ``after`` (lists are replaced whole)."""
    if not isinstance(before, Mapping) or not isinstance(after, Mapping):
        return copy.deepcopy(after)
    patch: Obj = {key: None for key in before if key not in after}
    for key, value in after.items():
        if key not in before:
            patch[key] = copy.deepcopy(value)
        elif before[key] != value:
            patch[key] = merge_diff(before[key], value)
    return patch


def strict_schema(root: Obj) -> Obj:
    """A CRD's OpenAPI v3 structural schema as JSON schema that also refuses unknown fields
    (``apiVersion``, ``kind`` and ``metadata`` are always allowed at the root)."""
    implicit = {"apiVersion": {"type": "string"}, "kind": {"type": "string"}, "metadata": {"type": "object"}}
    if "properties" in root:
        root = {**root, "properties": {**implicit, **root["properties"]}}
    return _strict(root)


def _strict(node: Any) -> Any:
    if isinstance(node, list):
        return [_strict(n) for n in node]
    if not isinstance(node, Mapping):
        return node
    out = {k: _strict(v) for k, v in node.items()}
    if "properties" in out and not node.get("x-kubernetes-preserve-unknown-fields"):
        out.setdefault("additionalProperties", False)
    return out


def field_manager(request: kmock.Request) -> str:
    """Who writes: ``fieldManager``, else the User-Agent's product (``OpenAPI-Generator/37.0.2/python``
    → ``OpenAPI-Generator``), as a real API server names the manager of a request without one."""
    return request.params.get("fieldManager") or request.headers.get("User-Agent", "").split("/")[0]


def parse_selector(text: str) -> list[tuple[str, str, str | None]]:
    """``a=b,c!=d,e,!f`` → ``[(key, op, value)]`` with op one of ``=``, ``!=``, ``exists``, ``!exists``."""
    terms = []
    for raw in filter(None, (t.strip() for t in text.split(","))):
        m = _SELECTOR_TERM.match(raw)
        if m is None or (m["neg"] and m["op"]):
            raise kmock.KubernetesError(status=400, reason="BadRequest",
                                        message=f"label selector term {raw!r}: the emulator takes k=v, k!=v, k, !k")
        if m["op"]:
            terms.append((m["key"], "!=" if m["op"] == "!=" else "=", m["value"]))
        else:
            terms.append((m["key"], "!exists" if m["neg"] else "exists", None))
    return terms


def selected(labels: Mapping[str, str], terms: list[tuple[str, str, str | None]]) -> bool:
    checks = {"=": lambda k, v: labels.get(k) == v, "!=": lambda k, v: labels.get(k) != v,
              "exists": lambda k, v: k in labels, "!exists": lambda k, v: k not in labels}
    return all(checks[op](key, value) for key, op, value in terms)


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


class ApiServer(kmock.KubernetesEmulator):
    """``KubernetesEmulator`` with the API-server behaviour listed in the module docstring."""

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        self._version = 0
        self._schemas: dict[kmock.resource, jsonschema.Draft4Validator] = {}
        self._kinds: dict[kmock.resource, str] = {}
        self._writes = asyncio.Lock()
        # API groups kopf's discovery reads do not list (a test sets it): a real API server can send
        # a new CRD's last event before discovery lists its group, and kopf, which reads discovery
        # on that event only, then never watches the group
        self.hidden_from_kopf: set[str] = set()
        # workloads (by name) whose new replicas load until a test patches their status ready
        self.loading: set[str] = set()
        # stand-ins for validating webhooks and quotas: each may raise kmock.KubernetesError
        self.admission: list[Callable[[kmock.Request], None]] = []
        for key, (kind, namespaced, subresources) in BUILTINS.items():
            self.resources[key] = kmock.ResourceInfo(kind=kind, namespaced=namespaced, verbs=VERBS,
                                                     subresources=subresources)
            self._kinds[kmock.resource(key)] = kind

    def install_crd(self, crd: Obj) -> None:
        """Serve the CRD's resource (discovery, schema) and store the CRD object itself."""
        spec, crd_names = crd["spec"], crd["spec"]["names"]
        for version in spec["versions"]:
            res = kmock.resource(spec["group"], version["name"], crd_names["plural"])
            self.resources[res] = kmock.ResourceInfo(
                kind=crd_names["kind"], singular=crd_names["singular"], namespaced=spec["scope"] == "Namespaced",
                shortnames=crd_names.get("shortNames", ()), categories=crd_names.get("categories", ()), verbs=VERBS,
                subresources=version.get("subresources", {}).keys())
            self._kinds[res] = crd_names["kind"]
            schema = strict_schema(version["schema"]["openAPIV3Schema"])
            self._schemas[res] = jsonschema.Draft4Validator(schema)
        stored = copy.deepcopy(crd)
        stored["metadata"] |= self._new_metadata()
        self.objects[CRDS, None, crd["metadata"]["name"]] = stored

    # -- requests ---------------------------------------------------------------------------------

    async def __call__(self, raw_request: aiohttp.web.BaseRequest) -> aiohttp.web.StreamResponse:
        match = _NAMESPACE_PATH.match(raw_request.path)
        if match and raw_request.method == "GET" and raw_request.query.get("watch") != "true":
            body = self._namespaces(match["name"])  # kmock cannot parse these paths
            return aiohttp.web.json_response(body, status=body.get("code", 200))
        if raw_request.path in ("/api/", "/apis/"):  # the kubernetes client asks for /apis/
            raw_request = raw_request.clone(rel_url=raw_request.rel_url.with_path(raw_request.path.rstrip("/")))
        if raw_request.path == "/apis" and raw_request.headers.get("User-Agent", "").startswith(KOPF_AGENT):
            return await self._kopfs_discovery(raw_request)
        return await super().__call__(raw_request)

    async def _kopfs_discovery(self, raw_request: aiohttp.web.BaseRequest) -> aiohttp.web.StreamResponse:
        """The API groups, less those ``hidden_from_kopf``."""
        response = await super().__call__(raw_request)
        if not self.hidden_from_kopf or not isinstance(response, aiohttp.web.Response) or response.body is None:
            return response
        listing = json.loads(response.body)
        listing["groups"] = [g for g in listing["groups"] if g["name"] not in self.hidden_from_kopf]
        return aiohttp.web.json_response(listing, status=response.status)

    async def _handle(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        if request.resource is None or request.action not in _WRITES:
            return await super()._handle(request)
        for admit in self.admission:
            admit(request)
        if request.params.get("dryRun") == "All":
            return await self._dry_run(request)
        if request.action == kmock.action.DELETE:
            return await super()._handle(request)
        async with self._writes:  # one write at a time, as etcd's compare-and-swap orders them
            if request.action == kmock.action.CREATE:
                self._prepare_create(request)
            elif request.headers.get("Content-Type", "").startswith(APPLY_PATCH):
                return await self._apply(request)
            else:
                self._prepare_patch(request)
            return await super()._handle(request)

    async def _dry_run(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        """The answer a write would get, validated as it would be, with nothing stored."""
        async with self._writes:
            current = self._stored(request)
            if request.action == kmock.action.CREATE:
                self._prepare_create(request)
                return aiohttp.web.json_response(request.data, status=201)
            if request.headers.get("Content-Type", "").startswith(APPLY_PATCH):
                after = self._applied(request, current)
                self._validate(request.resource, after)
                return aiohttp.web.json_response(after, status=200 if current else 201)
            if current is None:
                raise kmock.KubernetesObjectNotFoundError()
            if request.action == kmock.action.DELETE:
                return aiohttp.web.json_response(current)
            self._prepare_patch(request)
            if isinstance(request.data, list):
                return aiohttp.web.json_response(jsonpatch.apply_patch(current, request.data))
            return aiohttp.web.json_response(merge_patch(current, request.data))

    def _stored(self, request: kmock.Request) -> Obj | None:
        key = (request.resource, request.namespace, request.name)
        return self.objects[key].raw if key in self.objects and not self.objects[key].deleted else None

    def _applied(self, request: kmock.Request, current: Obj | None) -> Obj:
        """What a server-side apply makes of the stored object (``current``; None: it creates)."""
        config = request.data if request.data is not None else yaml.safe_load(request.text)
        manager = request.params.get("fieldManager")
        if not isinstance(config, dict) or not manager:
            raise kmock.KubernetesError(status=400, reason="BadRequest",
                                        message="an apply needs an object and a fieldManager")
        try:
            return kube_fields.apply(current, config, manager, force=request.params.get("force") == "true", now=_now())
        except kube_fields.Conflict as exc:
            raise kmock.KubernetesError(status=409, reason="Conflict", message=str(exc)) from exc

    async def _apply(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        """Server-side apply: a create when the object does not exist, else the merge patch that
        makes the stored object what kube_fields.apply computes; nothing at all if it changes nothing."""
        key = (request.resource, request.namespace, request.name)
        current = self._stored(request)
        after = self._applied(request, current)
        if current is not None and _unchanged(current, after):
            return aiohttp.web.json_response(current)
        request.data.clear()
        if current is not None:
            request.data.update(merge_diff(current, after))
            self._prepare_merge_patch(request, current, applied=True)
            return await super()._handle(request)
        request.data.update(after)
        self._prepare_create(request, applied=True)
        async with self._lock:  # what kmock does on create, which it does not route for a PATCH
            if key in self.objects:
                self.objects[key].create(request.data)
            else:
                self.objects[key] = request.data
            created = self.objects[key].raw
            await self._buses[request.resource].put({"type": "ADDED", "object": created})
        return aiohttp.web.json_response(created, status=201)

    def _prepare_create(self, request: kmock.Request, *, applied: bool = False) -> None:
        """Fill in what the server sets on create; the creator owns every field (an apply has
        set managedFields already)."""
        body = request.data
        if not isinstance(body, dict):
            raise kmock.KubernetesError(status=400, reason="BadRequest", message="the body is no JSON object")
        if not applied:
            body.setdefault("metadata", {})["managedFields"] = kube_fields.updated(
                None, body, field_manager(request), _now())
        meta = body.setdefault("metadata", {})
        if request.namespace:
            meta["namespace"] = request.namespace
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = meta["generateName"] + "".join(secrets.choice(string.ascii_lowercase + string.digits)
                                                          for _ in range(5))
        meta |= self._new_metadata()
        if "status" in self._subresources(request.resource):
            body.pop("status", None)
        self._validate(request.resource, body)
        if request.resource in INSTANTLY_READY:
            body["status"] = self._controller_status(body, None)

    def _prepare_patch(self, request: kmock.Request) -> None:
        """Rewrite the patch into the one a real server would effectively apply."""
        key = (request.resource, request.namespace, request.name)
        if key not in self.objects or self.objects[key].deleted:
            return  # kmock answers 404
        current = self.objects[key].raw
        if isinstance(request.data, list):
            self._prepare_json_patch(request, current)
        elif isinstance(request.data, dict):
            self._prepare_merge_patch(request, current)
        else:
            raise kmock.KubernetesError(status=415, reason="UnsupportedMediaType", message="not a JSON (merge) patch")

    def _prepare_merge_patch(self, request: kmock.Request, current: Obj, *, applied: bool = False) -> None:
        """(An apply's patch carries its managedFields already.)"""
        patch = dict(request.data)
        stale = (patch.get("metadata") or {}).get("resourceVersion")
        if stale is not None and stale != current["metadata"].get("resourceVersion"):
            raise kmock.KubernetesError(status=409, reason="Conflict", message="the object has been modified; "
                                        "apply your changes to the latest version and try again")
        if request.subresource == "status":
            patch = {"status": patch.get("status")}
        elif "status" in self._subresources(request.resource):
            patch.pop("status", None)
        after = merge_patch(current, patch)
        self._validate(request.resource, after)
        meta = patch.setdefault("metadata", {})
        if not applied:
            meta["managedFields"] = kube_fields.updated(current, after, field_manager(request), _now())
        meta["resourceVersion"] = self._next_version()
        if changed := _essence(after) != _essence(current):
            meta["generation"] = current["metadata"].get("generation", 0) + 1
        if request.resource in INSTANTLY_READY and request.subresource is None and changed:
            patch["status"] = self._controller_status(merge_patch(current, patch), current.get("status"))
        request.data.clear()
        request.data.update(patch)

    def _prepare_json_patch(self, request: kmock.Request, current: Obj) -> None:
        """RFC 6902, as kopf sends it for finalizers (a ``test`` of resourceVersion first)."""
        ops = request.data
        if request.subresource == "status" or "status" in self._subresources(request.resource):
            ops[:] = [op for op in ops if op.get("op") == "test"
                      or _is_status(op.get("path", "")) == (request.subresource == "status")]
        try:
            after = jsonpatch.apply_patch(current, ops)
        except (jsonpatch.JsonPatchException, jsonpointer.JsonPointerException) as exc:
            raise kmock.KubernetesError(status=422, reason="Invalid", message=f"the JSON patch does not apply: {exc}")
        self._validate(request.resource, after)
        managed = kube_fields.updated(current, after, field_manager(request), _now())
        ops.append({"op": "add", "path": "/metadata/managedFields", "value": managed})
        ops.append({"op": "add", "path": "/metadata/resourceVersion", "value": self._next_version()})
        if _essence(after) != _essence(current):
            generation = current["metadata"].get("generation", 0) + 1
            ops.append({"op": "add", "path": "/metadata/generation", "value": generation})

    def _controller_status(self, workload: Obj, before: Obj | None) -> Obj:
        """Its controller's answer to a new generation: every replica ready, or for a workload in
        ``loading`` only those that were ready before, as far as they are still wanted."""
        if workload["metadata"].get("name") not in self.loading:
            return _ready(workload)
        n = workload.get("spec", {}).get("replicas", 1)
        ready = min((before or {}).get("readyReplicas") or 0, n)
        return {"observedGeneration": workload["metadata"].get("generation", 1), "replicas": n, "readyReplicas": ready,
                "availableReplicas": ready, "updatedReplicas": n}

    def _next_version(self) -> str:
        self._version += 1
        return str(self._version)

    def _new_metadata(self) -> Obj:
        return {"uid": str(uuid.uuid4()), "resourceVersion": self._next_version(),
                "creationTimestamp": _now(), "generation": 1}

    def _subresources(self, res: kmock.resource | None) -> set[str]:
        return set(self.resources[res].subresources) if res in self.resources else set()

    def _validate(self, res: kmock.resource, body: Obj) -> None:
        validator = self._schemas.get(res)
        if validator is not None:
            errors: list[jsonschema.ValidationError] = sorted(validator.iter_errors(body),
                                                              key=lambda e: list(e.absolute_path))
        elif res in VALIDATED:
            try:
                kubernetes_validate.validate(body, K8S_VERSION, strict=True)
                errors = []
            except kubernetes_validate.ValidationError as exc:
                errors = [exc]
        else:
            return
        if errors:
            name = body.get("metadata", {}).get("name", "")
            causes = [f"{'.'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}" for e in errors]
            raise invalid(res, self._kinds[res], name, causes)

    async def _serve_list(self, request: kmock.Request) -> Obj:
        if request.resource not in set(self._get_resources()):
            raise kmock.KubernetesResourceNotFoundError()
        terms = parse_selector(request.params.get("labelSelector", ""))
        async with self._lock:
            items = [obj.raw for (res, ns, _), obj in self.objects.items()
                     if res == request.resource and not obj.deleted
                     and request.namespace in (None, ns)
                     and selected(obj.raw.get("metadata", {}).get("labels") or {}, terms)]
        return {"kind": "List", "apiVersion": "v1", "metadata": {"resourceVersion": str(self._version)},
                "items": items}

    async def _serve_watch(self, request: kmock.Request) -> Any:
        """kmock's watch, with the ``labelSelector`` a real server applies to every event."""
        terms = parse_selector(request.params.get("labelSelector", ""))
        async for event in super()._serve_watch(request):
            if not isinstance(event, dict) or selected(event["object"]["metadata"].get("labels") or {}, terms):
                yield event

    def _namespaces(self, name: str | None) -> Obj:
        known = sorted({"default", *(ns for _, ns, _ in self.objects if ns)})
        items = [{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": n},
                  "status": {"phase": "Active"}} for n in known]
        if name is None:
            return {"kind": "NamespaceList", "apiVersion": "v1", "metadata": {}, "items": items}
        return next((i for i in items if i["metadata"]["name"] == name),
                    {"kind": "Status", "apiVersion": "v1", "code": 404, "status": "Failure", "reason": "NotFound"})


def _ready(workload: Mapping[str, Any]) -> Obj:
    """The status of a workload whose every replica runs and is ready."""
    n = workload.get("spec", {}).get("replicas", 1)
    return {"observedGeneration": workload["metadata"].get("generation", 1), "replicas": n, "readyReplicas": n,
            "availableReplicas": n, "updatedReplicas": n}


def _is_status(path: str) -> bool:
    return path == "/status" or path.startswith("/status/")


def _unchanged(before: Mapping[str, Any], after: Mapping[str, Any]) -> bool:
    """Whether a write changes nothing but the times in managedFields."""
    def timeless(obj: Mapping[str, Any]) -> Obj:
        meta = obj.get("metadata", {})
        managed = sorted(({k: v for k, v in e.items() if k != "time"} for e in meta.get("managedFields", [])),
                         key=lambda e: (e["manager"], e["operation"]))
        return {**obj, "metadata": {**meta, "managedFields": managed}}
    return timeless(before) == timeless(after)


def _essence(obj: Mapping[str, Any]) -> Obj:
    """What ``generation`` counts changes of: everything but metadata and status."""
    return {k: v for k, v in obj.items() if k not in ("metadata", "status")}


@contextmanager
def serve(server: ApiServer) -> Iterator[str]:
    """Run ``server`` on a free localhost port in its own thread; yields its base URL."""
    ready = threading.Event()
    state: dict[str, Any] = {}

    async def main() -> None:
        stop = asyncio.Event()
        state["loop"], state["stop"] = asyncio.get_running_loop(), stop
        async with server, kmock.Server(server) as http:
            state["url"] = str(http.url).rstrip("/")
            ready.set()
            await stop.wait()

    def run() -> None:
        try:
            asyncio.run(main())
        finally:
            ready.set()

    thread = threading.Thread(target=run, name="kube-emulator", daemon=True)
    thread.start()
    ready.wait(timeout=30)
    if "url" not in state:
        raise RuntimeError("the Kubernetes emulator did not start")
    try:
        yield state["url"]
    finally:
        state["loop"].call_soon_threadsafe(state["stop"].set)
        thread.join(timeout=30)

