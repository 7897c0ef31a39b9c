"""The operator's I/O with the cluster: the Kubernetes API (the official ``kubernetes`` client) and
Events (through kopf's poster). The analysis' HTTP reads are in ``scrape``.

Objects go in and come out as plain dicts, as ``render`` builds them. Children are written by
server-side apply (``application/apply-patch+yaml``, forced) under one field manager,
``names.MANAGER``: the API server keeps which fields we set, and an apply that no longer sets one
removes it, so what the operator renders is what runs. Every other write (scaling a revision no
longer rendered, the user's HTTPRoute, the resource's status and annotations) is a JSON merge
patch under the same manager, which leaves the fields it does not name to whoever owns them.
"""
from __future__ import annotations

import json
import math
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import kopf
import kubernetes
import urllib3

from specdecode.operator import names
from specdecode.operator.rollout import Event

Obj = dict[str, Any]
MERGE_PATCH = "application/merge-patch+json"
JSON_PATCH = "application/json-patch+json"
APPLY_PATCH = "application/apply-patch+yaml"  # its body may be JSON, which is YAML
DISCOVERY_TTL_SECONDS = 60.0  # how long the served APIs are trusted
UNSERVED_RECHECK_SECONDS = 5.0  # how soon an API the cluster lacked is looked for again
DRY_RUN = "All"  # the API's only dryRun value


@dataclass(frozen=True)
class Kind:
    api_version: str
    kind: str
    plural: str

    @property
    def group(self) -> str:
        return self.api_version.rpartition("/")[0]

    @property
    def version(self) -> str:
        return self.api_version.rpartition("/")[2]


DEPLOYMENT = Kind("apps/v1", "Deployment", "deployments")
STATEFUL_SET = Kind("apps/v1", "StatefulSet", "statefulsets")
LEADER_WORKER_SET = Kind("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet", "leaderworkersets")
SERVICE = Kind("v1", "Service", "services")
POD = Kind("v1", "Pod", "pods")
PDB = Kind("policy/v1", "PodDisruptionBudget", "poddisruptionbudgets")
SERVICE_MONITOR = Kind("monitoring.coreos.com/v1", "ServiceMonitor", "servicemonitors")
HTTP_ROUTE = Kind("gateway.networking.k8s.io/v1", "HTTPRoute", "httproutes")  # the user's; only patched
SPEC_DECODE = Kind(names.API_VERSION, names.KIND, names.PLURAL)
# What render may create; a kind the cluster does not serve is skipped when listing children.
CHILD_KINDS = (DEPLOYMENT, STATEFUL_SET, LEADER_WORKER_SET, SERVICE, PDB, SERVICE_MONITOR)
KINDS = {(k.api_version, k.kind): k for k in (*CHILD_KINDS, POD, HTTP_ROUTE, SPEC_DECODE)}


def kind_of(obj: Mapping[str, Any]) -> Kind:
    return KINDS[obj["apiVersion"], obj["kind"]]


class WriteFailed(Exception):
    """The API server did not take a write: ``status`` its HTTP status (None: no answer), the
    message its own. A 4xx is a refusal (invalid, forbidden by a policy engine or a quota, a
    conflict); anything else (a 500 from server-side apply, a webhook that is down, no answer) a
    failure that may pass."""

    def __init__(self, status: int | None, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message

    @property
    def refused(self) -> bool:
        return self.status is not None and 400 <= self.status < 500

    @classmethod
    def of(cls, exc: Exception) -> WriteFailed:
        if not isinstance(exc, kubernetes.client.ApiException):
            return cls(None, f"no answer from the API server: {exc}")
        try:
            message = json.loads(exc.body or "")["message"]
        except (ValueError, TypeError, KeyError):  # no Status object: the raw body, or the reason
            message = (exc.body or exc.reason or "").strip()
        return cls(exc.status, message)


# What a write can raise besides an API error: the connection failed or timed out.
NO_ANSWER = (urllib3.exceptions.HTTPError, OSError)


@contextmanager
def _as_write_failed() -> Iterator[None]:
    try:
        yield
    except (kubernetes.client.ApiException, *NO_ANSWER) as exc:
        raise WriteFailed.of(exc) from exc


@contextmanager
def _gone_is_fine() -> Iterator[None]:
    """Let a 404 (the object does not exist) pass; any other API error goes on."""
    try:
        yield
    except kubernetes.client.ApiException as exc:
        if exc.status != 404:
            raise


def connect(kubeconfig: str | None) -> kubernetes.client.ApiClient:
    """A client for the in-cluster service account, else for ``kubeconfig`` (default ~/.kube/config)."""
    config = kubernetes.client.Configuration()
    try:
        kubernetes.config.load_incluster_config(client_configuration=config)
    except kubernetes.config.ConfigException:
        kubernetes.config.load_kube_config(config_file=kubeconfig, client_configuration=config)
    return kubernetes.client.ApiClient(config)


class Cluster:
    """The Kubernetes API as the operator uses it; connects on first use (after kopf's login)."""

    def __init__(self, kubeconfig: str | None = None) -> None:
        self._kubeconfig = kubeconfig
        self._served: tuple[float, frozenset[str]] | None = None

    @cached_property
    def api(self) -> kubernetes.client.ApiClient:
        return connect(self._kubeconfig)

    @cached_property
    def _custom(self) -> kubernetes.client.CustomObjectsApi:
        return kubernetes.client.CustomObjectsApi(self.api)

    @cached_property
    def _core(self) -> kubernetes.client.CoreV1Api:
        return kubernetes.client.CoreV1Api(self.api)

    # -- the SpecDecodeDeployment ----------------------------------------------------------------

    def get(self, namespace: str, name: str) -> Obj | None:
        """The resource, or None once it is gone."""
        with _gone_is_fine():
            return self._custom.get_namespaced_custom_object(
                SPEC_DECODE.group, SPEC_DECODE.version, namespace, SPEC_DECODE.plural, name)
        return None

    def patch_status(self, namespace: str, name: str, status: Obj) -> None:
        with _gone_is_fine():  # deleted since it was read: nothing left to report on
            self._custom.patch_namespaced_custom_object_status(
                SPEC_DECODE.group, SPEC_DECODE.version, namespace, SPEC_DECODE.plural, name, {"status": status},
                field_manager=names.MANAGER, _content_type=MERGE_PATCH)

    def remove_annotations(self, namespace: str, name: str, keys: Iterable[str]) -> None:
        annotations = {key: None for key in keys}
        if annotations:
            with _gone_is_fine():
                self._custom.patch_namespaced_custom_object(
                    SPEC_DECODE.group, SPEC_DECODE.version, namespace, SPEC_DECODE.plural, name,
                    {"metadata": {"annotations": annotations}}, field_manager=names.MANAGER, _content_type=MERGE_PATCH)

    # -- discovery -------------------------------------------------------------------------------

    def serves(self, api_version: str) -> bool:
        """Whether the cluster serves ``group/version``: discovery, trusted for a minute, except that
        an API it lacked is looked for again after a few seconds, so that one installed mid-life
        (LeaderWorkerSet) is used from the next reconciliation on."""
        now = time.monotonic()
        age = now - self._served[0] if self._served else math.inf
        if age > DISCOVERY_TTL_SECONDS or (age > UNSERVED_RECHECK_SECONDS and api_version not in self._served[1]):
            groups = kubernetes.client.ApisApi(self.api).get_api_versions().groups
            self._served = (now, frozenset({"v1"} | {v.group_version for g in groups for v in g.versions}))
        return api_version in self._served[1]

    # -- children --------------------------------------------------------------------------------

    def children(self, namespace: str, name: str) -> list[Obj]:
        """Every object the operator made for resource ``name`` (by label), of the kinds served."""
        selector = names.label_selector(names.common_labels(name))
        out: list[Obj] = []
        for kind in CHILD_KINDS:
            if self.serves(kind.api_version):
                out += self.list(kind, namespace, selector)
        return out

    def list(self, kind: Kind, namespace: str, selector: str) -> list[Obj]:
        if kind.group:
            listed = self._custom.list_namespaced_custom_object(
                kind.group, kind.version, namespace, kind.plural, label_selector=selector)
        else:
            listing = {SERVICE: self._core.list_namespaced_service, POD: self._core.list_namespaced_pod}[kind]
            listed = self.api.sanitize_for_serialization(listing(namespace, label_selector=selector))
        # typed lists leave apiVersion and kind out of their items
        return [{**item, "apiVersion": kind.api_version, "kind": kind.kind} for item in listed["items"]]

    def read(self, kind: Kind, namespace: str, name: str) -> Obj | None:
        """One object of a custom API (an HTTPRoute), or None if there is none."""
        with _gone_is_fine():
            return self._custom.get_namespaced_custom_object(kind.group, kind.version, namespace, kind.plural, name)
        return None

    # Writes raise ``WriteFailed``; with ``dry_run`` the API server validates and admits the write
    # (webhooks, policies, quotas) and stores nothing.

    def apply(self, obj: Obj, *, dry_run: bool = False) -> None:
        """Server-side apply of the whole ``obj`` (created if missing)."""
        self._patch(obj, obj, APPLY_PATCH, force=True, dry_run=dry_run)

    def patch(self, obj: Obj, *, dry_run: bool = False) -> None:
        """Merge ``obj`` (a partial object with apiVersion, kind and metadata) in."""
        self._patch(obj, obj, MERGE_PATCH, dry_run=dry_run)

    def hand_over(self, live: Mapping[str, Any], managed: list[Obj], *, dry_run: bool = False) -> None:
        """Set ``live``'s managedFields to ``managed`` unless it changed since it was read."""
        meta = live["metadata"]
        self._patch(live, [{"op": "test", "path": "/metadata/resourceVersion", "value": meta["resourceVersion"]},
                           {"op": "replace", "path": "/metadata/managedFields", "value": managed}], JSON_PATCH,
                    dry_run=dry_run)

    def _patch(self, obj: Mapping[str, Any], body: Any, content_type: str, *, force: bool | None = None,
               dry_run: bool = False) -> None:
        kind, meta = kind_of(obj), obj["metadata"]
        options = {"field_manager": names.MANAGER, "force": force, "_content_type": content_type,
                   "dry_run": DRY_RUN if dry_run else None}
        with _as_write_failed():
            if kind.group:
                self._custom.patch_namespaced_custom_object(
                    kind.group, kind.version, meta["namespace"], kind.plural, meta["name"], body, **options)
            else:
                self._core.patch_namespaced_service(meta["name"], meta["namespace"], body, **options)

    def patch_unless_changed(self, obj: Obj) -> bool:
        """``patch`` with ``obj``'s metadata.resourceVersion; False if the object changed since (409)."""
        try:
            self.patch(obj)
        except WriteFailed as exc:
            if exc.status != 409:
                raise
            return False
        return True

    def delete(self, obj: Mapping[str, Any], *, dry_run: bool = False) -> None:
        """Delete ``obj`` (a child, or a runtime pod); its answer is not parsed (an API server
        before 1.23 answers a Service DELETE with a Status, which the client would fail to read as
        a Service)."""
        kind, meta = kind_of(obj), obj["metadata"]
        options = {"dry_run": DRY_RUN if dry_run else None, "_preload_content": False}
        with _as_write_failed(), _gone_is_fine():  # already gone is what we wanted
            if kind.group:
                answer = self._custom.delete_namespaced_custom_object(
                    kind.group, kind.version, meta["namespace"], kind.plural, meta["name"], **options)
            else:
                remove = {SERVICE: self._core.delete_namespaced_service, POD: self._core.delete_namespaced_pod}[kind]
                answer = remove(meta["name"], meta["namespace"], **options)
            answer.drain_conn()

    def pods(self, namespace: str, labels: Mapping[str, str]) -> list[Obj]:
        return self.list(POD, namespace, names.label_selector(dict(labels)))

    def events(self, namespace: str, reason: str) -> list[Obj]:
        """The core/v1 Events of ``namespace`` with ``reason`` (the API server selects them)."""
        listed = self._core.list_namespaced_event(namespace, field_selector=f"reason={reason}")
        return self.api.sanitize_for_serialization(listed)["items"]


def post_events(owner: Mapping[str, Any], events: Sequence[Event]) -> None:
    for event in events:
        kopf.event(owner, type=event.type.value, reason=event.reason, message=event.message)
