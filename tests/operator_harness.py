"""Running the operator under test, and the HTTP servers it talks to besides the API server.

``running_operator`` runs the operator as the Helm chart does (``kopf run --standalone
--all-namespaces -m specdecode.operator.handlers``) with kopf's ``KopfRunner``, against the
emulated API server (kube_emulator.py): kopf logs in through a login handler in a fresh
registry, the operator's own ``kubernetes`` client through the kubeconfig ``write_kubeconfig``
writes (the caller points ``KUBECONFIG`` at it). ``RuntimeStandIn`` is a canary pod's runtime
(``/metrics``), ``PrometheusStandIn`` a Prometheus answering the analysis' queries.
"""
from __future__ import annotations

import json
import re
import sys
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, TypeVar

import kopf
import yaml
from kopf.testing import KopfRunner
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

HANDLERS = "specdecode.operator.handlers"
T = TypeVar("T")


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


# -- what else it talks to ------------------------------------------------------------------------


class HttpStandIn:
    """A real HTTP server on a free localhost port; ``respond(path)`` → (content type, body)."""

    def __init__(self, respond: Callable[[str], tuple[str, bytes]]) -> None:
        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's spelling
                content_type, body = respond(self.path)
                self.send_response(200)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class RuntimeStandIn(HttpStandIn):
    """A canary pod's ``/metrics`` as the runtime names them; every scrape first adds one slice
    of traffic whose drafts are accepted at ``acceptance``."""

    def __init__(self, acceptance: float) -> None:
        self.acceptance = acceptance
        self.registry = registry = CollectorRegistry()
        self.drafts = Counter("specdecode:spec_decode_num_drafts", "drafts", registry=registry)
        self.draft_tokens = Counter("specdecode:spec_decode_num_draft_tokens", "draft tokens", registry=registry)
        self.accepted = Counter("specdecode:spec_decode_num_accepted_tokens", "accepted", registry=registry)
        self.successes = Counter("specdecode:request_success", "requests", ["finished_reason"], registry=registry)
        self.generated = Counter("specdecode:generation_tokens", "tokens", registry=registry)
        self.itl = Histogram("specdecode:inter_token_latency_seconds", "itl", registry=registry,
                             buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0))
        super().__init__(self.scrape)

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
