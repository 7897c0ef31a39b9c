"""The HTTP server through a real uvicorn on a free port: the OpenAI client, SSE, every bad input,
disconnects, backpressure, auth, metrics. The tiny random model serves; one test uses SmolLM2.

Every network call has a timeout and every wait is bounded, so a broken server fails, never hangs.
"""
from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_harness import (
    CHAT,
    TIMEOUT,
    all_blocks_free,
    check_error,
    post,
    serve,
    sse_payloads,
    started,
    tiny_engine,
    wait_until,
)

from specdecode.runtime.config import CacheConfig, EngineConfig, LoadConfig
from specdecode.runtime.engine.async_engine import AsyncEngine

SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


@pytest.fixture(scope="module")
def engine(tiny_hf_model_dir):
    with started(tiny_engine(tiny_hf_model_dir)) as engine:
        yield engine


@pytest.fixture(scope="module")
def url(engine):
    with serve(engine) as url:
        yield url


@pytest.fixture
def client(url) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    text = httpx.get(url + "/metrics", timeout=TIMEOUT).text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def strip_special(text: str) -> str:
    for token in SPECIAL:
        text = text.replace(token, "")
    return text


# ------------------------------------------------------------------------------ happy paths


def test_models_health_ready_tokenize(url, engine):
    models = httpx.get(url + "/v1/models", timeout=TIMEOUT).json()
    assert [m["id"] for m in models["data"]] == [engine.model_name]
    assert models["data"][0]["max_model_len"] == engine.max_model_len
    assert httpx.get(url + "/health", timeout=TIMEOUT).status_code == 200
    assert httpx.get(url + "/ready", timeout=TIMEOUT).status_code == 200

    tok = post(url, "/tokenize", {"prompt": "hello there", "return_token_strs": True}).json()
    assert tok["tokens"] == engine.tokenizer.encode("hello there") and tok["count"] == len(tok["tokens"])
    assert len(tok["token_strs"]) == tok["count"]
    assert post(url, "/detokenize", {"tokens": tok["tokens"]}).json() == {"prompt": "hello there"}
    chat_tok = post(url, "/tokenize", {"messages": CHAT}).json()
    usage = post(url, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 1}).json()["usage"]
    assert chat_tok["count"] == usage["prompt_tokens"]


def test_chat_stream_equals_non_stream_through_openai_client(client, engine):
    kwargs = dict(model=engine.model_name, messages=CHAT, max_tokens=12, temperature=0)
    full = client.chat.completions.create(**kwargs)
    choice = full.choices[0]
    assert full.object == "chat.completion" and choice.message.role == "assistant"
    assert choice.finish_reason in ("stop", "length")
    assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens
    assert 1 <= full.usage.completion_tokens <= 12

    chunks = list(client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert text == choice.message.content
    assert finish == [choice.finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])
    assert len({c.id for c in chunks}) == 1 and chunks[0].object == "chat.completion.chunk"


def test_completions_stream_and_logprobs_through_openai_client(client, engine):
    kwargs = dict(model=engine.model_name, prompt="hello", max_tokens=8, temperature=0, logprobs=2,
                  extra_body={"ignore_eos": True})
    full = client.completions.create(**kwargs)
    choice = full.choices[0]
    assert full.object == "text_completion" and choice.finish_reason == "length"
    assert full.usage.completion_tokens == 8
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 8
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    for chosen, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert 1 <= len(top) <= 2 and logprob <= 0
        assert max(top.values()) == pytest.approx(logprob, abs=1e-5)  # greedy: the chosen token is the best

    chunks = list(client.completions.create(**kwargs, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == choice.text
    streamed_tokens = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    streamed_offsets = [o for c in chunks if c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset]
    assert streamed_tokens == lp.tokens and streamed_offsets == lp.text_offset


def test_chat_logprobs_bytes_spell_the_content(client, engine):
    out = client.chat.completions.create(model=engine.model_name, messages=CHAT, max_tokens=6, temperature=0,
                                         logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    content = out.choices[0].logprobs.content
    assert len(content) == 6 == out.usage.completion_tokens
    for item in content:
        assert len(item.top_logprobs) == 3
        assert [t.logprob for t in item.top_logprobs] == sorted((t.logprob for t in item.top_logprobs), reverse=True)
        assert item.top_logprobs[0].token == item.token and item.top_logprobs[0].logprob == pytest.approx(item.logprob)
    spelled = b"".join(bytes(item.bytes) for item in content).decode("utf-8", errors="replace")
    assert strip_special(spelled) == out.choices[0].message.content


def test_n_seed_and_stop(client, engine):
    kwargs = dict(model=engine.model_name, prompt="the", max_tokens=5, temperature=1.0, seed=7, n=2,
                  extra_body={"ignore_eos": True})
    a, b = client.completions.create(**kwargs), client.completions.create(**kwargs)
    assert [c.index for c in a.choices] == [0, 1]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]  # seeded
    assert a.usage.completion_tokens == 10

    greedy = dict(model=engine.model_name, prompt="hello", max_tokens=16, temperature=0,
                  extra_body={"ignore_eos": True})
    full = client.completions.create(**greedy).choices[0].text
    k = next(i for i in range(2, len(full) - 2) if full.find(full[i:i + 2]) == i)
    stop = full[k:k + 2]
    cut = client.completions.create(**greedy, stop=[stop]).choices[0]
    assert cut.text == full[:k] and cut.finish_reason == "stop"
    assert cut.model_extra["stop_reason"] == stop


def test_request_id_is_honoured_and_generated(url):
    r = post(url, "/v1/completions", {"prompt": "hi", "max_tokens": 1}, headers={"X-Request-Id": "trace-42"})
    assert r.headers["x-request-id"] == "trace-42"
    r2 = post(url, "/v1/completions", {"prompt": "hi", "max_tokens": 1})
    assert len(r2.headers["x-request-id"]) == 32
    bad = post(url, "/v1/completions", {"prompt": "hi", "temperature": 9}, headers={"X-Request-Id": "bad-1"})
    assert bad.status_code == 400 and bad.headers["x-request-id"] == "bad-1"


# --------------------------------------------------------------------------------- bad input

LONG = "hello " * 2500  # > max_model_len (2048) tokens
BAD_REQUESTS = [
    # (path, body, status, param, code)
    ("/v1/chat/completions", {"model": "nope", "messages": CHAT}, 404, "model", "model_not_found"),
    ("/v1/completions", {"model": "nope", "prompt": "x"}, 404, "model", "model_not_found"),
    ("/v1/completions", {"prompt": LONG}, 400, "prompt", "context_length_exceeded"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": LONG}]}, 400, "messages",
     "context_length_exceeded"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 5000}, 400, "max_tokens", "context_length_exceeded"),
    ("/v1/chat/completions", {"messages": CHAT, "max_completion_tokens": 5000}, 400, "max_completion_tokens",
     "context_length_exceeded"),
    ("/v1/completions", {"prompt": "x", "temperature": 2.5}, 400, "temperature", "invalid_value"),
    ("/v1/completions", {"prompt": "x", "temperature": -0.1}, 400, "temperature", "invalid_value"),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, 400, "top_p", "invalid_value"),
    ("/v1/completions", {"prompt": "x", "top_p": 1.5}, 400, "top_p", "invalid_value"),
    ("/v1/completions", {"prompt": "x", "top_k": -2}, 400, "top_k", "invalid_value"),
    ("/v1/completions", {"prompt": "x", "n": 0}, 400, "n", "invalid_value"),
    ("/v1/completions", {"prompt": "x", "n": 17}, 400, "n", "invalid_value"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens", "invalid_value"),
    ("/v1/completions", {"prompt": "x", "presence_penalty": 2.5}, 400, "presence_penalty", "invalid_value"),
    ("/v1/completions", {"prompt": "x", "frequency_penalty": -3}, 400, "frequency_penalty", "invalid_value"),
    ("/v1/completions", {"prompt": "x", "logprobs": 21}, 400, "logprobs", "invalid_value"),
    ("/v1/completions", {"prompt": "x", "seed": "abc"}, 400, "seed", "invalid_value"),
    ("/v1/completions", {"prompt": "x", "stop": [""]}, 400, "stop", "invalid_value"),
    ("/v1/completions", {"prompt": "x", "stop_token_ids": [-1]}, 400, "stop_token_ids[0]", "invalid_value"),
    ("/v1/completions", {"prompt": [1, 2, 99999]}, 400, "prompt", "invalid_value"),
    ("/v1/completions", {"prompt": ["a", "b"]}, 400, "prompt", "invalid_value"),
    ("/v1/completions", {}, 400, "prompt", "invalid_value"),
    ("/v1/chat/completions", {"messages": CHAT, "top_logprobs": 21, "logprobs": True}, 400, "top_logprobs",
     "invalid_value"),
    ("/v1/chat/completions", {"messages": CHAT, "top_logprobs": 2}, 400, "top_logprobs", "invalid_value"),
    ("/v1/chat/completions", {"messages": CHAT, "stream_options": {"include_usage": True}}, 400,
     "stream_options", "invalid_value"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages", "invalid_value"),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages[0].role",
     "invalid_value"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     400, "messages[0].content[0].type", "invalid_value"),
    ("/v1/chat/completions", {"messages": CHAT, "logit_bias": {"5": 101}}, 400, "logit_bias", "invalid_value"),
    ("/v1/chat/completions", {"messages": CHAT, "tools": [{"type": "function"}]}, 400, "tools[0].function",
     "invalid_value"),
    ("/v1/chat/completions", {"messages": CHAT, "functions": [{"name": "f"}]}, 400, "functions",
     "unsupported_parameter"),
    ("/v1/chat/completions", {"messages": CHAT, "response_format": {"type": "json_schema"}}, 400,
     "response_format", "invalid_value"),
    ("/v1/completions", {"prompt": "x", "best_of": 3}, 400, "best_of", "unsupported_parameter"),
    ("/v1/completions", {"prompt": "x", "frobnicate": 1}, 400, "frobnicate", "unknown_parameter"),
    ("/v1/chat/completions", {"messages": CHAT, "stream_option": {}}, 400, "stream_option", "unknown_parameter"),
    ("/v1/chat/completions", b'{"messages": [', 400, None, "invalid_json"),
    ("/v1/completions", b"\xff\xfe", 400, None, "invalid_json"),
    ("/v1/completions", b"[1, 2]", 400, None, "invalid_value"),
    ("/tokenize", {"prompt": "x", "model": "nope"}, 404, "model", "model_not_found"),
    ("/detokenize", {"tokens": [99999]}, 400, "tokens", "invalid_value"),
]


@pytest.mark.parametrize("path,body,status,param,code", BAD_REQUESTS,
                         ids=[f"{i}-{case[3] or case[4]}" for i, case in enumerate(BAD_REQUESTS)])
def test_bad_request(url, path, body, status, param, code):
    check_error(post(url, path, body), status, param, code)


def test_bad_requests_do_not_disturb_a_request_in_flight(url, engine):
    """Every bad request while a long greedy stream runs; its tokens equal the same request run alone."""
    body = {"prompt": "hello there", "temperature": 0, "ignore_eos": True, "logprobs": 0}
    alone = post(url, "/v1/completions", {**body, "max_tokens": 100}).json()["choices"][0]["logprobs"]["tokens"]
    streamed: list[str] = []
    with httpx.stream("POST", url + "/v1/completions", json={**body, "max_tokens": 2000, "stream": True},
                      timeout=TIMEOUT) as r:
        payloads = sse_payloads(r.iter_lines())
        streamed += next(payloads)["choices"][0]["logprobs"]["tokens"]
        for path, bad, status, param, code in BAD_REQUESTS:
            check_error(post(url, path, bad), status, param, code)
        assert engine.stats().num_running == 1, "the stream should still be generating"
        while len(streamed) < len(alone):
            streamed += next(payloads)["choices"][0]["logprobs"]["tokens"]
    assert streamed[: len(alone)] == alone
    wait_until(lambda: all_blocks_free(engine), 60, "the closed stream to be aborted")


def test_openai_client_raises_typed_errors(client, engine):
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="nope", messages=CHAT)
    assert e.value.param == "model"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=engine.model_name, messages=CHAT, temperature=3)
    assert e.value.param == "temperature"


def test_unknown_route_and_method_get_openai_errors(url):
    r = httpx.get(url + "/v1/nothing", timeout=TIMEOUT)
    assert r.status_code == 404 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    r = httpx.get(url + "/v1/completions", timeout=TIMEOUT)
    assert r.status_code == 405 and "error" in r.json()


def test_unexpected_error_is_a_bare_500(engine, monkeypatch):
    from specdecode.runtime.server.serving import OpenAIServing

    def boom(self, req):
        raise RuntimeError("secret internals")

    monkeypatch.setattr(OpenAIServing, "_prompt_ids", boom)
    with serve(engine) as url:
        r = post(url, "/v1/completions", {"prompt": "x"}, headers={"X-Request-Id": "oops"})
        check_error(r, 500, None, "internal_error")
        assert "secret" not in r.text and r.headers["x-request-id"] == "oops"
        assert scrape(url)[("specdecode:request_errors_total", (("code", "500"),))] == 1


def test_engine_failure_mid_stream_ends_the_stream_with_an_error(tiny_hf_model_dir, monkeypatch):
    engine = tiny_engine(tiny_hf_model_dir)
    engine.start()
    real_step = engine.engine.step

    def failing_step():
        raise RuntimeError("secret kaboom")

    body = {"prompt": "hello", "max_tokens": 2000, "ignore_eos": True, "stream": True}
    try:
        with serve(engine) as url:
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=TIMEOUT) as r:
                payloads = sse_payloads(r.iter_lines())
                next(payloads)
                monkeypatch.setattr(engine.engine, "step", failing_step)
                last = list(payloads)[-1]
            assert last["error"]["code"] == "internal_error" and "kaboom" not in json.dumps(last)
            monkeypatch.setattr(engine.engine, "step", real_step)
            wait_until(lambda: all_blocks_free(engine), 30, "the failed request to be released")
            ok = post(url, "/v1/completions", {"prompt": "hello", "max_tokens": 3, "ignore_eos": True})
            assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3
    finally:
        engine.shutdown()


# ------------------------------------------------------------------ disconnects, load, auth


def test_stream_disconnect_aborts_and_frees_blocks(engine):
    body = {"prompt": "hello", "max_tokens": 2000, "ignore_eos": True, "stream": True}
    with serve(engine) as url:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=TIMEOUT) as r:
            payloads = sse_payloads(r.iter_lines())
            next(payloads), next(payloads)
            assert engine.stats().num_running == 1
        wait_until(lambda: all_blocks_free(engine), 60, "the aborted request's blocks to be freed")
        wait_until(lambda: scrape(url)[("specdecode:request_success_total", (("finished_reason", "abort"),))] == 1,
                   10, "the abort to be counted")


def test_non_stream_disconnect_aborts_and_frees_blocks(engine):
    body = {"prompt": "hello", "max_tokens": 2000, "ignore_eos": True}
    with serve(engine) as url:
        with pytest.raises(httpx.ReadTimeout):
            post(url, "/v1/completions", body, timeout=httpx.Timeout(10.0, read=0.5))
        wait_until(lambda: all_blocks_free(engine), 60, "the aborted request's blocks to be freed")
        abort = ("specdecode:request_success_total", (("finished_reason", "abort"),))
        wait_until(lambda: scrape(url)[abort] == 1, 10, "the abort to be counted")
        assert not [key for key in scrape(url) if key[0] == "specdecode:request_errors_total"]


def test_full_waiting_queue_answers_503(tiny_hf_model_dir):
    engine = tiny_engine(tiny_hf_model_dir, max_num_seqs=1, max_waiting_requests=1)
    long = {"prompt": "hello", "max_tokens": 2000, "ignore_eos": True}
    try:
        with serve(engine) as url:
            # not warmed up yet: not ready, and generation is refused rather than queued
            assert httpx.get(url + "/ready", timeout=TIMEOUT).status_code == 503
            check_error(post(url, "/v1/completions", {"prompt": "x"}), 503, None, "overloaded")
            engine.start()
            assert httpx.get(url + "/ready", timeout=TIMEOUT).status_code == 200

            async def scenario() -> httpx.Response:
                async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as http:
                    running = asyncio.create_task(http.post("/v1/completions", json={**long, "stream": True}))
                    await wait_async(lambda: engine.stats().num_running == 1)
                    waiting = asyncio.create_task(http.post("/v1/completions", json=long))
                    await wait_async(lambda: engine.stats().num_waiting == 1)
                    refused = await http.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
                    for task in (running, waiting):
                        task.cancel()
                    await asyncio.gather(running, waiting, return_exceptions=True)
                    return refused

            refused = asyncio.run(asyncio.wait_for(scenario(), 120))
            check_error(refused, 503, None, "overloaded")
            assert 1 <= int(refused.headers["retry-after"]) <= 60  # its figure: test_server_hardening.py
            wait_until(lambda: all_blocks_free(engine), 60, "cancelled requests to be aborted")
            assert post(url, "/v1/completions", {"prompt": "x", "max_tokens": 2}).status_code == 200
    finally:
        engine.shutdown()


async def wait_async(condition: Callable[[], bool], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


def test_api_key_guards_v1_tokenize_and_detokenize(engine):
    with serve(engine, api_key="sekrit") as url:
        wrong = openai.OpenAI(base_url=f"{url}/v1", api_key="nope", max_retries=0, timeout=60)
        with pytest.raises(openai.AuthenticationError):
            wrong.models.list()
        check_error(httpx.get(url + "/v1/models", timeout=TIMEOUT), 401, None, "invalid_api_key")
        right = openai.OpenAI(base_url=f"{url}/v1", api_key="sekrit", max_retries=0, timeout=60)
        assert right.completions.create(model=engine.model_name, prompt="hi", max_tokens=2).usage.completion_tokens
        key = {"Authorization": "Bearer sekrit"}
        for path, body in (("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [1, 2]})):
            check_error(post(url, path, body), 401, None, "invalid_api_key")
            check_error(post(url, path, body, headers={"Authorization": "Bearer nope"}), 401, None, "invalid_api_key")
            assert post(url, path, body, headers=key).status_code == 200
        for path in ("/health", "/ready", "/metrics"):
            assert httpx.get(url + path, timeout=TIMEOUT).status_code == 200


# ------------------------------------------------------------------------------------ metrics

DESIGN_METRICS = {
    "specdecode:request_success_total": {"finished_reason"},
    "specdecode:request_errors_total": {"code"},
    "specdecode:prompt_tokens_total": set(),
    "specdecode:generation_tokens_total": set(),
    "specdecode:time_to_first_token_seconds_count": set(),
    "specdecode:inter_token_latency_seconds_count": set(),
    "specdecode:e2e_request_latency_seconds_count": set(),
    "specdecode:num_requests_running": set(),
    "specdecode:num_requests_waiting": set(),
    "specdecode:kv_cache_usage_perc": set(),
    "specdecode:num_preemptions_total": set(),
    "specdecode:prefix_cache_hits_total": set(),
    "specdecode:spec_decode_num_drafts_total": set(),
    "specdecode:spec_decode_num_draft_tokens_total": set(),
    "specdecode:spec_decode_num_accepted_tokens_total": set(),
    "specdecode:spec_decode_enabled": set(),
}


def test_metrics_match_the_usage_of_n_requests(engine):
    base = {"max_tokens": 3, "ignore_eos": True, "temperature": 0}
    with serve(engine) as url:
        usages = [
            post(url, "/v1/completions", {"prompt": "hi there", **base}).json()["usage"],
            post(url, "/v1/chat/completions", {"messages": CHAT, **base, "n": 2}).json()["usage"],
        ]
        for path, extra in (("/v1/completions", {"prompt": "hi"}), ("/v1/chat/completions", {"messages": CHAT})):
            body = {**extra, **base, "stream": True, "stream_options": {"include_usage": True}}
            with httpx.stream("POST", url + path, json=body, timeout=TIMEOUT) as r:
                usages.append([p for p in sse_payloads(r.iter_lines()) if p != "[DONE]"][-1]["usage"])
        assert post(url, "/v1/completions", {"prompt": "x", "top_p": 7}).status_code == 400
        wait_until(lambda: scrape(url)[("specdecode:e2e_request_latency_seconds_count", ())] == 4, 10,
                   "every request to be recorded")
        m = scrape(url)

    n = len(usages)
    assert m[("specdecode:prompt_tokens_total", ())] == sum(u["prompt_tokens"] for u in usages)
    assert m[("specdecode:generation_tokens_total", ())] == sum(u["completion_tokens"] for u in usages)
    for hist in ("time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds"):
        assert m[(f"specdecode:{hist}_count", ())] == n, hist
        assert m[(f"specdecode:{hist}_bucket", (("le", "+Inf"),))] == n, hist
    assert m[("specdecode:request_success_total", (("finished_reason", "length"),))] == n + 1  # n=2 above
    assert m[("specdecode:request_errors_total", (("code", "400"),))] == 1
    assert m[("specdecode:spec_decode_enabled", ())] == 0
    assert m[("specdecode:num_requests_running", ())] == 0
    assert m[("specdecode:kv_cache_usage_perc", ())] == 0
    names = {name: {k for k, _ in labels} for name, labels in m}
    for name, labels in DESIGN_METRICS.items():
        assert name in names, name
        assert names[name] == labels, name


def test_metrics_exposition_declares_every_design_name(url):
    text = httpx.get(url + "/metrics", timeout=TIMEOUT).text
    for name in ("request_success", "request_errors", "prompt_tokens", "generation_tokens", "num_preemptions",
                 "prefix_cache_hits", "spec_decode_num_drafts", "spec_decode_num_draft_tokens",
                 "spec_decode_num_accepted_tokens", "spec_decode_num_accepted_tokens_per_pos"):
        assert f"# TYPE specdecode:{name}_total counter" in text or f"# TYPE specdecode:{name} counter" in text, name
    for name in ("time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds"):
        assert f"# TYPE specdecode:{name} histogram" in text
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "spec_decode_enabled"):
        assert f"# TYPE specdecode:{name} gauge" in text


# ------------------------------------------------------------------------------- real model


@pytest.fixture(scope="module")
def smollm2_engine(cache_dir):
    cfg = EngineConfig(load=LoadConfig(model="smollm2-135m", weight_cache_dir=cache_dir),
                       cache=CacheConfig(block_size=16, num_blocks=64))
    engine = AsyncEngine.from_config(cfg)
    engine.start()
    yield engine
    engine.shutdown()


def test_smollm2_chat_is_coherent_english(smollm2_engine):
    with serve(smollm2_engine) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)
        out = client.chat.completions.create(
            model="smollm2-135m", messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=20, temperature=0)
    text = out.choices[0].message.content
    assert "Paris" in text, text
    words = text.split()
    assert len(words) >= 3 and sum(w.strip(".,!?'\"").isalpha() for w in words) >= 0.8 * len(words), text


# ------------------------------------------------------------------------------- speculation


def test_speculation_usage_override_and_metrics(sharp, make_engine):
    model, tok = sharp  # a random model whose greedy output soon repeats itself: n-grams match
    engine = make_engine(model, tok, spec={"method": "ngram", "num_speculative_tokens": 3})
    spec_engine = AsyncEngine(engine, "tiny", max_waiting_requests=8)
    spec_engine.start()
    body = {"model": "tiny", "prompt": "hello hello hello", "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    try:
        with serve(spec_engine) as url:
            on = post(url, "/v1/completions", body).json()["usage"]["speculative"]
            off = post(url, "/v1/completions", {**body, "speculative": {"num_speculative_tokens": 0}}).json()
            bad = post(url, "/v1/completions", {**body, "speculative": {"num_speculative_tokens": 99}})
            m = scrape(url)
    finally:
        spec_engine.shutdown()
    assert on["num_draft_tokens"] > 0 and on["num_drafts"] > 0
    assert on["num_accepted_tokens"] == sum(on["accepted_per_position"])
    assert off["usage"]["speculative"]["num_draft_tokens"] == 0
    assert bad.status_code == 400 and "num_speculative_tokens" in bad.json()["error"]["param"]
    assert m[("specdecode:spec_decode_num_draft_tokens_total", ())] == on["num_draft_tokens"]
    assert m[("specdecode:spec_decode_num_accepted_tokens_total", ())] == on["num_accepted_tokens"]
    assert m[("specdecode:spec_decode_num_drafts_total", ())] == on["num_drafts"]
    assert m[("specdecode:spec_decode_enabled", ())] == 1
    for position, count in enumerate(on["accepted_per_position"]):
        assert m[("specdecode:spec_decode_num_accepted_tokens_per_pos_total", (("position", str(position)),))] == count


def test_a_starting_engine_is_never_seen_dead(tiny_hf_model_dir, monkeypatch):
    """``serve`` starts the engine in a thread while uvicorn asks ``dead`` every tick: at no point
    of the start, the stepping thread's own included, may it answer True (the server would exit)."""
    engine = tiny_engine(tiny_hf_model_dir)
    seen: list[bool] = []
    real_start = threading.Thread.start

    def start_watched(thread: threading.Thread) -> None:
        seen.append(engine.dead)
        real_start(thread)
        seen.append(engine.dead)

    monkeypatch.setattr(threading.Thread, "start", start_watched)
    try:
        engine.start()
        seen.append(engine.dead)
    finally:
        monkeypatch.undo()
        engine.shutdown()
    assert seen and not any(seen)
