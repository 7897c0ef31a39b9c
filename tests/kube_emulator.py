"""An in-memory Kubernetes API server for the operator's integration tests.

kmock's ``KubernetesEmulator`` stores objects and serves list/watch/create/patch/delete; ``ApiServer``
adds what a real API server does that kopf, the operator and these tests rely on:

- ``metadata.uid``, ``resourceVersion`` (one increasing counter), ``creationTimestamp``,
  ``generateName``, and ``generation`` (1 on create, +1 when anything but metadata and status
  changes);
- status subresources: ``PATCH …/status`` changes only ``status``, a main-resource patch never
  does, and ``status`` is dropped on create;
- discovery of the built-in resources used here and of installed CRDs (with their subresources);
- custom resources validated against the CRD's ``openAPIV3Schema`` (jsonschema): a violation or an
  unknown field is a 422 ``Invalid`` (a real server with ``fieldValidation=Strict``; by default it
  would prune unknown fields silently);
- Deployments and StatefulSets are ready as soon as they are written (a stand-in for their
  controllers and the kubelet: no pods are made; tests create the pods they need);
- ``labelSelector`` on lists (equality, inequality, existence), ``GET /api/v1/namespaces[/name]``
  and ``GET /apis/`` (kmock cannot route them), 409 on a stale ``metadata.resourceVersion`` in a
  patch.

Patches are JSON merge patches (kmock applies strategic-merge patches as merge patches too) or
JSON patches (kopf's finalizers, with a failed ``test`` answered 422 as kopf expects);
``serve`` runs the server over real HTTP in its own thread and event loop, so clients in any
thread (kopf's, the ``kubernetes`` client's) reach it and shutting it down does not stall
(operator_harness.py runs the operator against it). What it still lacks is in tests/README.md.
"""
from __future__ import annotations

import asyncio
import copy
import datetime
import re
import secrets
import string
import threading
import uuid
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import aiohttp.web
import jsonpatch
import jsonpointer
import jsonschema
import kmock

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
# Stand-in for the workload controllers and the kubelet: these are ready as soon as written.
INSTANTLY_READY = {kmock.resource("apps/v1/deployments"), kmock.resource("apps/v1/statefulsets")}
CRDS = kmock.resource("apiextensions.k8s.io/v1/customresourcedefinitions")
_NAMESPACE_PATH = re.compile(r"^/api/v1/namespaces/?(?P<name>[^/]+)?$")
_SELECTOR_TERM = re.compile(r"^(?P<neg>!)?(?P<key>[A-Za-z0-9._/-]+)(?:(?P<op>==|!=|=)(?P<value>[A-Za-z0-9._-]*))?$")


def invalid(kind: str, name: str, causes: list[str]) -> kmock.KubernetesError:
    message = f'{kind} "{name}" is invalid: ' + "; ".join(causes)
    return kmock.KubernetesError(status=422, reason="Invalid", message=message,
                                 details={"name": name, "kind": kind, "causes": [{"message": c} for c in causes]})


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


def strict_schema(node: Any) -> Any:
    """An OpenAPI v3 structural schema as JSON schema that also refuses unknown fields."""
    if isinstance(node, list):
        return [strict_schema(n) for n in node]
    if not isinstance(node, Mapping):
        return node
    out = {k: strict_schema(v) for k, v in node.items()}
    if "properties" in out and not node.get("x-kubernetes-preserve-unknown-fields"):
        out.setdefault("additionalProperties", False)
    return out


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
        return await super().__call__(raw_request)

    async def _handle(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        if request.resource is None or request.action not in (kmock.action.CREATE, kmock.action.UPDATE):
            return await super()._handle(request)
        async with self._writes:  # one write at a time, as etcd's compare-and-swap orders them
            if request.action == kmock.action.CREATE:
                self._prepare_create(request)
            else:
                self._prepare_patch(request)
            return await super()._handle(request)

    def _prepare_create(self, request: kmock.Request) -> None:
        body = request.data
        if not isinstance(body, dict):
            raise kmock.KubernetesError(status=400, reason="BadRequest", message="the body is no JSON object")
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
            body["status"] = _ready(body)

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

    def _prepare_merge_patch(self, request: kmock.Request, current: Obj) -> None:
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
        meta["resourceVersion"] = self._next_version()
        if _essence(after) != _essence(current):
            meta["generation"] = current["metadata"].get("generation", 0) + 1
        if request.resource in INSTANTLY_READY and request.subresource is None:
            patch["status"] = _ready(merge_patch(current, patch))
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
        ops.append({"op": "add", "path": "/metadata/resourceVersion", "value": self._next_version()})
        if _essence(after) != _essence(current):
            generation = current["metadata"].get("generation", 0) + 1
            ops.append({"op": "add", "path": "/metadata/generation", "value": generation})

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
        if validator is None:
            return
        errors = sorted(validator.iter_errors(body), key=lambda e: list(e.absolute_path))
        if errors:
            name = body.get("metadata", {}).get("name", "")
            causes = [f"{'.'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}" for e in errors]
            raise invalid(self._kinds[res], name, causes)

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

