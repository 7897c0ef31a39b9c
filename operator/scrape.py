"""scrape: the HTTP reads of an analysis — a runtime's ``/metrics`` and Prometheus' query API.
Plain ``urllib``: both backends (the operator's pods, ``specdecode up``'s processes) read them alike."""
from __future__ import annotations

import json
import urllib.parse
import urllib.request
from collections.abc import Mapping
from typing import Any

Obj = dict[str, Any]


class ScrapeError(OSError):
    """A pod's /metrics or Prometheus could not be read."""


def fetch(url: str, timeout: float) -> str:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:  # noqa: S310 - http(s) URLs we built
            return response.read().decode("utf-8")
    except (OSError, ValueError) as exc:  # URLError, HTTPError, timeouts (OSErrors); a bad URL (ValueError)
        raise ScrapeError(f"{url}: {exc}") from exc


def query_prometheus(base_url: str, queries: Mapping[str, str], timeout: float) -> dict[str, list[Obj]]:
    """Each instant query's ``data.result`` vector, by key."""
    results: dict[str, list[Obj]] = {}
    for key, query in queries.items():
        url = f"{base_url.rstrip('/')}/api/v1/query?" + urllib.parse.urlencode({"query": query})
        try:
            answer = json.loads(fetch(url, timeout))
        except json.JSONDecodeError as exc:
            raise ScrapeError(f"{base_url}: not a Prometheus answer: {exc}") from exc
        if answer.get("status") != "success":
            raise ScrapeError(f"{base_url}: {query}: {answer.get('error', answer)}")
        results[key] = answer["data"]["result"]
    return results
