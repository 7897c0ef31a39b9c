"""Running the operator under test, and the HTTP servers it talks to besides the API server.

``running_operator`` runs the operator with the chart's arguments (one replica: no Lease in its
environment, so it leads alone), ``kopf run --standalone --all-namespaces -m
specdecode.operator.handlers``, with kopf's ``KopfRunner``, against the
emulated API server (kube_emulator.py): kopf logs in through a login handler in a fresh
registry, the operator's own ``kubernetes`` client through the kubeconfig ``write_kubeconfig``
writes (the caller points ``KUBECONFIG`` at it). ``emulated_cluster`` starts both and yields a
``Cluster``: the official ``kubernetes`` client's view of the emulator, with the operator's
start and stop. ``RuntimeStandIn`` is a runtime pod (``/metrics``, chat completions with logprobs),
``PrometheusStandIn`` a Prometheus answering the analysis' queries.
"""
from __future__ import annotations

import collections
import functools
import json
import re
import ssl
import sys
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, TypeVar

import helm_python as helm
import kmock
import kopf
import kubernetes
import pytest
import yaml
from kopf.testing import KopfRunner
from kube_emulator import APPLY_PATCH, ApiServer, serve
from local_process import free_port
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from specdecode.operator import names
from specdecode.operator.crd import build_crd

HANDLERS = "specdecode.operator.handlers"
T = TypeVar("T")
Obj = dict[str, Any]
EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
CHART = Path(__file__).resolve().parents[1] / "charts" / "specdecode"
NS = "llm"
FAST_ANALYSIS = {"interval": "1s", "window": "2s", "minAcceptanceRate": 0.5, "maxP95InterTokenLatencyMs": 250,
                 "failureLimit": 2}


# -- the operator ---------------------------------------------------------------------------------


def wait_for(check: Callable[[], T], what: str, timeout: float = 30.0, every: float = 0.1) -> T:
    """``check()``'s first truthy value; fails naming ``what`` (and the last value) after ``timeout``."""
    deadline, value = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}; last: {value!r}")


def write_kubeconfig(url: str, path: Path) -> Path:
    """A kubeconfig for ``url`` (plain HTTP, no credentials)."""
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "emulator",
        "clusters": [{"name": "emulator", "cluster": {"server": url}}],
        "users": [{"name": "tester", "user": {}}],
        "contexts": [{"name": "emulator", "context": {"cluster": "emulator", "user": "tester"}}],
    }))
    return path


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1) as response:
            return response.status == 200
    except OSError:
        return False


@contextmanager
def running_operator(url: str, liveness_port: int) -> Iterator[KopfRunner]:
    """The operator against the emulator at ``url``, until its liveness endpoint answers.

    The handlers module is imported afresh (``-m``) so that its decorators fill this run's
    registry; the operator's configuration comes from the environment the caller set."""
    registry = kopf.OperatorRegistry()

    @kopf.on.login(registry=registry)
    def login(**_: Any) -> kopf.ConnectionInfo:
        return kopf.ConnectionInfo(server=url, insecure=True)

    sys.modules.pop(HANDLERS, None)
    liveness = f"http://127.0.0.1:{liveness_port}/healthz"
    args = ["run", "--standalone", "--all-namespaces", f"--liveness={liveness}", "--verbose", "-m", HANDLERS]
    with KopfRunner(args, registry=registry, timeout=60) as runner:
        wait_for(lambda: healthy(liveness), "the operator's liveness endpoint")
        yield runner


# -- a cluster the tests drive ----------------------------------------------------------------------


class Cluster:
    """The kubernetes client's view of the emulator at ``url``, and the operator run against it."""

    def __init__(self, client: kubernetes.client.ApiClient, url: str, metrics_port: int, liveness_port: int,
                 server: ApiServer | None = None) -> None:
        self.server = server
        self.custom = kubernetes.client.CustomObjectsApi(client)
        self.apps = kubernetes.client.AppsV1Api(client)
        self.core = kubernetes.client.CoreV1Api(client)
        self.url, self.liveness_port = url, liveness_port
        self.metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
        self.liveness_url = f"http://127.0.0.1:{liveness_port}/healthz"
        self.operator_logs: list[str] = []
        self._operator: ExitStack | None = None

    def start_operator(self) -> None:
        self._operator = ExitStack()
        self._runner = self._operator.enter_context(running_operator(self.url, self.liveness_port))

    def stop_operator(self) -> None:
        if self._operator is not None:
            self._operator.close()
            self._operator = None
            self.operator_logs.append(self._runner.output)

    def create(self, body: dict[str, Any]) -> None:
        self.custom.create_namespaced_custom_object(names.GROUP, names.VERSION, NS, names.PLURAL, body)

    def get(self, name: str) -> dict[str, Any]:
        return self.custom.get_namespaced_custom_object(names.GROUP, names.VERSION, NS, names.PLURAL, name)

    def patch(self, name: str, patch: dict[str, Any]) -> None:
        self.custom.patch_namespaced_custom_object(names.GROUP, names.VERSION, NS, names.PLURAL, name, patch)

    def status(self, name: str) -> dict[str, Any]:
        return self.get(name).get("status") or {}

    def condition(self, name: str, type_: str) -> dict[str, Any]:
        return next((c for c in self.status(name).get("conditions", []) if c["type"] == type_), {})

    def deployments(self, name: str) -> dict[str, Any]:
        listed = self.apps.list_namespaced_deployment(NS, label_selector=f"{names.LABEL_INSTANCE}={name}")
        return {d.metadata.name: d for d in listed.items}

    def events(self, name: str) -> list[tuple[str, str, str]]:
        return [(e.type, e.reason, e.message) for e in self.core.list_namespaced_event(NS).items
                if e.involved_object.name == name]

    def operator_metrics(self) -> str:
        with urllib.request.urlopen(self.metrics_url, timeout=5) as response:
            return response.read().decode()

    def stand_in_pod(self, name: str, revision: str, port: int) -> None:
        """A ready pod of ``revision`` whose runtime listens on 127.0.0.1:``port``."""
        self.runtime_pod(name, revision, {"phase": "Running", "podIP": "127.0.0.1",
                                          "conditions": [{"type": "Ready", "status": "True"}]}, port)

    def runtime_pod(self, name: str, revision: str, status: dict[str, Any], port: int = names.HTTP_PORT) -> str:
        """A runtime pod of ``revision`` with ``status``, as the kubelet reports it; its name."""
        labels = {**names.runtime_pod_labels(name), names.LABEL_REVISION: revision}
        pod = f"{name}-{revision}-stand-in"
        self.core.create_namespaced_pod(NS, {
            "apiVersion": "v1", "kind": "Pod", "metadata": {"name": pod, "labels": labels},
            "spec": {"containers": [{"name": names.CONTAINER, "image": "stand-in",
                                     "ports": [{"name": names.HTTP_PORT_NAME, "containerPort": port}]}]}})
        self.core.patch_namespaced_pod_status(pod, NS, {"status": status})
        return pod


def example(name: str = "smollm2-ngram") -> dict[str, Any]:
    body = yaml.safe_load((EXAMPLES / "smollm2-ngram.yaml").read_text())
    body["metadata"] = {"name": name, "namespace": NS}
    body["spec"]["rollout"]["analysis"] = dict(FAST_ANALYSIS)
    return body


def running_stable(cluster: Cluster, name: str = "smollm2-ngram", **spec: Any) -> str:
    """Create the example (with ``spec`` merged in) and wait until its one revision is ready; that revision."""
    body = example(name)
    body["spec"] |= spec
    cluster.create(body)
    wait_for(lambda: cluster.condition(name, "Ready").get("status") == "True", "Ready=True")
    return cluster.status(name)["stableRevision"]


def start_canary(cluster: Cluster, name: str = "smollm2-ngram") -> str:
    """Change what the pods run (3 speculative tokens instead of 4); the canary revision."""
    cluster.patch(name, {"spec": {"speculative": {"numSpeculativeTokens": 3}}})
    return wait_for(lambda: cluster.status(name).get("canaryRevision"), "a canary revision")


@contextmanager
def emulated_cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Cluster]:
    """A fresh API server with the CRD installed and the operator running against it (what the
    ``cluster`` fixtures yield; the operator's environment is set through ``monkeypatch``)."""
    server = ApiServer()
    server.install_crd(build_crd())
    with serve(server) as url:
        kubeconfig = write_kubeconfig(url, tmp_path / "kubeconfig")
        metrics_port, liveness_port = free_port(), free_port()
        monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
        monkeypatch.setenv("SPECDECODE_METRICS_PORT", str(metrics_port))
        monkeypatch.delenv("SPECDECODE_WEBHOOK_PORT", raising=False)
        with kubernetes.config.new_client_from_config(str(kubeconfig)) as client:
            client.user_agent = TEST_CLIENT
            cluster = Cluster(client, url, metrics_port, liveness_port, server)
            cluster.start_operator()
            try:
                yield cluster
            finally:
                cluster.stop_operator()
                print("\n".join(cluster.operator_logs)[-20000:])  # the operator's log, shown when the test fails
            assert_granted(server)


# -- RBAC: what the operator asked the emulator for, against the chart's ClusterRole -------------

TEST_CLIENT = "specdecode-tests"  # the tests' own User-Agent; the operator's are kopf's and OpenAPI-Generator's
Permission = tuple[str, str, str]  # (API group, resource[/subresource], verb)
_VERBS = {"POST": "create", "PATCH": "patch", "PUT": "update", "DELETE": "delete"}


def requested_permissions(server: ApiServer) -> set[Permission]:
    """What each request of the operator to ``server`` needs from RBAC (discovery needs nothing)."""
    needed: set[Permission] = set()
    for request in server:
        if request.resource is None or request.resource.plural is None or request.headers.get(
                "User-Agent", "").startswith(TEST_CLIENT):
            continue
        resource = request.resource.plural + (f"/{request.subresource}" if request.subresource else "")
        needed |= {(request.resource.group, resource, verb) for verb in _rbac_verbs(request)}
    return needed


def _rbac_verbs(request: kmock.Request) -> set[str]:
    if request.method == "GET":
        return {"watch" if request.action == kmock.action.WATCH else "get" if request.name else "list"}
    if request.headers.get("Content-Type", "").startswith(APPLY_PATCH):
        return {"patch", "create"}  # an apply creates what does not exist
    return {_VERBS[request.method]}


@functools.cache
def chart_permissions() -> frozenset[Permission]:
    """What the chart's ClusterRole grants, as it renders with its default values."""
    manifests = helm.Chart.load(CHART).render({}, name="specdecode", namespace="specdecode-system", is_install=True)
    (role,) = [o for text in manifests.values() for o in yaml.safe_load_all(text) if o and o["kind"] == "ClusterRole"]
    return frozenset((group, resource, verb) for rule in role["rules"] for group in rule["apiGroups"]
                     for resource in rule["resources"] for verb in rule["verbs"])


def assert_granted(server: ApiServer) -> None:
    """Every request the operator made would have passed the chart's RBAC."""
    denied = requested_permissions(server) - chart_permissions()
    assert not denied, f"the chart's ClusterRole does not grant what the operator asked for: {sorted(denied)}"


def crd_of(group: str, version: str, kind: str, plural: str) -> Obj:
    """A namespaced CRD with an open schema: another project's API (HTTPRoute, LeaderWorkerSet) as
    a cluster with it installed serves it."""
    return {"apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
            "metadata": {"name": f"{plural}.{group}"},
            "spec": {"group": group, "scope": "Namespaced",
                     "names": {"kind": kind, "plural": plural, "singular": kind.lower()},
                     "versions": [{"name": version, "served": True, "storage": True, "schema": {
                         "openAPIV3Schema": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}}}]}}


# -- what else it talks to ------------------------------------------------------------------------


class HttpStandIn:
    """A real HTTP server on a free localhost port; ``respond(path)`` → (content type, body) for a
    GET, ``post(path, JSON body)`` → a JSON answer for a POST (404 without it); HTTPS with ``tls``
    (certificate, key)."""

    def __init__(self, respond: Callable[[str], tuple[str, bytes]],
                 post: Callable[[str, Any], Any] | None = None, tls: tuple[Path, Path] | None = None) -> None:
        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's spelling
                self.answer(*respond(self.path))

            def do_POST(self) -> None:  # noqa: N802
                sent = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if post is None:
                    self.send_error(404)
                else:
                    self.answer("application/json", json.dumps(post(self.path, sent)).encode())

            def answer(self, content_type: str, body: bytes) -> None:
                self.send_response(200)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.url = f"http{'s' if tls else ''}://127.0.0.1:{self.port}"
        if tls is not None:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.load_cert_chain(*tls)
            self.server.socket = context.wrap_socket(self.server.socket, server_side=True)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


Answer = Callable[[str, int], list[tuple[str, float]]]  # (prompt, its nth call) → (token, top-2 gap) a position


def echo(prompt: str, _: int) -> list[tuple[str, float]]:
    """A greedy answer: the prompt's words, each far ahead of the runner-up (2 nats)."""
    return [(word, 2.0) for word in prompt.split()]


class RuntimeStandIn(HttpStandIn):
    """A runtime pod: ``/metrics`` as the runtime names them, every scrape first adding one slice
    of traffic whose drafts are accepted at ``acceptance``; and chat completions with logprobs,
    the tokens and top-2 gaps ``answer`` gives (``calls``: the requests it answered, in order)."""

    def __init__(self, acceptance: float, answer: Answer = echo) -> None:
        self.acceptance, self.answer, self.calls = acceptance, answer, []
        self.seen: collections.Counter[str] = collections.Counter()
        self.lock = threading.Lock()
        self.registry = registry = CollectorRegistry()
        self.drafts = Counter("specdecode:spec_decode_num_drafts", "drafts", registry=registry)
        self.draft_tokens = Counter("specdecode:spec_decode_num_draft_tokens", "draft tokens", registry=registry)
        self.accepted = Counter("specdecode:spec_decode_num_accepted_tokens", "accepted", registry=registry)
        self.successes = Counter("specdecode:request_success", "requests", ["finished_reason"], registry=registry)
        self.generated = Counter("specdecode:generation_tokens", "tokens", registry=registry)
        self.itl = Histogram("specdecode:inter_token_latency_seconds", "itl", registry=registry,
                             buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0))
        super().__init__(self.scrape, self.complete)

    def complete(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        prompt = body["messages"][-1]["content"]
        with self.lock:
            nth = self.seen[prompt]
            self.seen[prompt] += 1
            self.calls.append(body)
        content = [{"token": token, "logprob": -0.1,
                    "top_logprobs": [{"token": token, "logprob": -0.1}, {"token": "~", "logprob": -0.1 - gap}]}
                   for token, gap in self.answer(prompt, nth)[:body["max_tokens"]]]
        return {"choices": [{"index": 0, "message": {"role": "assistant", "content": " ".join(t["token"] for t in content)},
                             "logprobs": {"content": content}, "finish_reason": "length"}]}

    def scrape(self, path: str) -> tuple[str, bytes]:
        self.drafts.inc(25)
        self.draft_tokens.inc(100)
        self.accepted.inc(100 * self.acceptance)
        self.successes.labels("stop").inc(5)
        self.generated.inc(125)
        for _ in range(20):
            self.itl.observe(0.02)
        return "text/plain; version=0.0.4", generate_latest(self.registry)


class PrometheusStandIn(HttpStandIn):
    """``/api/v1/query``: the increase of the runtime's series over the window, for the series of
    ``revision`` only (as its ServiceMonitor labels them); records every query."""

    INCREASE = {"spec_decode_num_drafts_total": 25.0, "spec_decode_num_draft_tokens_total": 100.0,
                "spec_decode_num_accepted_tokens_total": 90.0, "generation_tokens_total": 125.0}

    def __init__(self) -> None:
        self.revision, self.queries = "", []
        super().__init__(self.query)

    def query(self, path: str) -> tuple[str, bytes]:
        (query,) = urllib.parse.parse_qs(urllib.parse.urlsplit(path).query)["query"]
        self.queries.append(query)
        answer = {"status": "success", "data": {"resultType": "vector", "result": self.vector(query)}}
        return "application/json", json.dumps(answer).encode()

    def vector(self, query: str) -> list[dict[str, Any]]:
        series = re.search(r"specdecode:(\w+)\{", query)
        if series is None or f'revision="{self.revision}"' not in query:
            return []
        if series[1] == "request_success_total":
            return [{"metric": {"finished_reason": "stop"}, "value": [0, "5"]}]
        return [{"metric": {}, "value": [0, str(self.INCREASE[series[1]])]}] if series[1] in self.INCREASE else []
