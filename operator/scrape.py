"""scrape: the HTTP calls of an analysis — a runtime's ``/metrics``, Prometheus' query API, and
the equivalence probe's completions. Plain ``urllib``: both backends (the operator's pods,
``specdecode up``'s processes) are called alike."""
from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

Obj = dict[str, Any]


class ScrapeError(OSError):
    """A pod's /metrics, Prometheus or a completion could not be read."""


def fetch(url: str, timeout: float) -> str:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:  # noqa: S310 - http(s) URLs we built
            return response.read().decode("utf-8")
    except (OSError, ValueError) as exc:  # URLError, HTTPError, timeouts (OSErrors); a bad URL (ValueError)
        raise ScrapeError(f"{url}: {exc}") from exc


def fetch_all(urls: Sequence[str], timeout: float) -> list[str | ScrapeError]:
    """Each URL's body (or why not), in order, fetched all at once and within ``timeout`` of the
    start: one that has not answered by then counts as a ScrapeError. However many pods do not
    answer (a NetworkPolicy dropping the operator's packets, a pod trickling bytes), a round of
    scrapes lasts at most ``timeout``; the fetches left behind end on their own socket timeout."""
    if not urls:
        return []
    pool = ThreadPoolExecutor(max_workers=len(urls), thread_name_prefix="scrape")
    futures = [pool.submit(fetch, url, timeout) for url in urls]
    wait(futures, timeout=timeout)
    pool.shutdown(wait=False, cancel_futures=True)
    return [_answer(future, url, timeout) for future, url in zip(futures, urls)]


def _answer(future: Future[str], url: str, timeout: float) -> str | ScrapeError:
    if not future.done():
        return ScrapeError(f"{url}: no answer within {timeout:g}s")
    error = future.exception()
    return error if isinstance(error, ScrapeError) else future.result()


def post_json(url: str, body: Obj, timeout: float) -> Obj:
    """POST ``body`` as JSON; the JSON answer. An HTTP error's message carries the body it sent."""
    request = urllib.request.Request(url, data=json.dumps(body).encode("utf-8"),
                                     headers={"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:  # noqa: S310 - http(s) URLs we built
            return json.loads(response.read().decode("utf-8"))
    except urllib.error.HTTPError as exc:
        raise ScrapeError(f"{url}: HTTP {exc.code}: {exc.read().decode('utf-8', 'replace')[:200]}") from exc
    except (OSError, ValueError) as exc:  # URLError, timeouts; a bad URL or an answer that is not JSON
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
