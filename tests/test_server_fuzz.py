"""Hostile requests while greedy requests stream on the same server (issue 20): malformed JSON,
wrong types, huge numbers, lone surrogates, deep nesting, oversize bodies, bad headers, unknown
fields, bad max_tokens / n / stop / logprobs, empty messages, wrong roles. None may answer 500;
every error is OpenAI-shaped and names the field where there is one; and every greedy output
produced meanwhile equals that request's output on a quiet server.
"""
from __future__ import annotations

import gzip
import json
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from server_harness import TIMEOUT, serve, started, tiny_engine

CHAT = [{"role": "user", "content": "hello there"}]
DEEP = 800  # parsed by json (under its recursion limit), refused by validation


def chat(**fields) -> dict:
    return {"messages": CHAT, "max_tokens": 4, **fields}


def completion(**fields) -> dict:
    return {"prompt": "hello", "max_tokens": 4, **fields}


def message(**fields) -> dict:
    return {"messages": [fields], "max_tokens": 4}


# (id, path, body: dict | bytes, extra headers, status, param) — param None: the error names no field.
C, CH, TOK, DETOK = "/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"
CASES = [
    # malformed JSON
    ("truncated", CH, b'{"messages": [', {}, 400, None),
    ("empty body", C, b"", {}, 400, None),
    ("null", C, b"null", {}, 400, None),
    ("a bare string", C, b'"hello"', {}, 400, None),
    ("an array", CH, b"[1, 2]", {}, 400, None),
    ("trailing comma", C, b'{"prompt": "x",}', {}, 400, None),
    ("single quotes", C, b"{'prompt': 'x'}", {}, 400, None),
    ("invalid UTF-8", C, b'{"prompt": "\xff\xfe"}', {}, 400, None),
    ("garbage after the object", C, b'{"prompt": "x"} trailing', {}, 400, None),
    ("NaN as the body", C, b"NaN", {}, 400, None),
    # wrong types
    ("prompt is a number", C, completion(prompt=123), {}, 400, "prompt"),
    ("prompt is an object", C, completion(prompt={"a": 1}), {}, 400, "prompt"),
    ("messages is a string", CH, {"messages": "hello"}, {}, 400, "messages"),
    ("content is a number", CH, message(role="user", content=123), {}, 400, "messages[0].content"),
    ("max_tokens is a word", C, completion(max_tokens="ten"), {}, 400, "max_tokens"),
    ("temperature is a word", C, completion(temperature="hot"), {}, 400, "temperature"),
    ("stream is a word", C, completion(stream="perhaps"), {}, 400, "stream"),
    ("n is a fraction", C, completion(n=1.5), {}, 400, "n"),
    ("model is a number", C, completion(model=12345), {}, 400, "model"),
    ("user is a number", CH, chat(user=5), {}, 400, "user"),
    ("tokenize prompt is a number", TOK, {"prompt": 123}, {}, 400, "prompt"),
    ("detokenize tokens is a string", DETOK, {"tokens": "abc"}, {}, 400, "tokens"),
    # huge numbers
    ("5000-digit max_tokens", C, b'{"prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}", {}, 400, None),
    ("max_tokens 10**30", C, completion(max_tokens=10**30), {}, 400, "max_tokens"),
    ("max_tokens 2**63", CH, chat(max_tokens=2**63), {}, 400, "max_tokens"),
    ("seed 10**30", C, completion(seed=10**30), {}, 400, "seed"),
    ("seed -2**64", C, completion(seed=-2**64), {}, 400, "seed"),
    ("top_k 10**20", C, completion(top_k=10**20), {}, 400, "top_k"),
    ("n 10**9", C, completion(n=10**9), {}, 400, "n"),
    ("temperature 1e308", C, completion(temperature=1e308), {}, 400, "temperature"),
    ("temperature Infinity", C, b'{"prompt": "x", "temperature": Infinity}', {}, 400, "temperature"),
    ("top_p NaN", C, b'{"prompt": "x", "top_p": NaN}', {}, 400, "top_p"),
    ("detokenize a huge id", DETOK, {"tokens": [10**30]}, {}, 400, "tokens"),
    # lone surrogates
    ("surrogate in prompt", C, b'{"prompt": "a\\ud800b"}', {}, 400, "prompt"),
    ("surrogate in content", CH, b'{"messages": [{"role": "user", "content": "\\udc00"}]}', {}, 400,
     "messages[0].content"),
    ("surrogate in a text part", CH,
     b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud83d"}]}]}', {}, 400,
     "messages[0].content[0].text"),
    ("surrogate in stop", C, b'{"prompt": "x", "stop": ["\\ud800"]}', {}, 400, "stop[0]"),
    ("surrogate in model", C, b'{"prompt": "x", "model": "\\udfff"}', {}, 400, "model"),
    ("surrogate in tokenize", TOK, b'{"prompt": "\\ud800"}', {}, 400, "prompt"),
    # deep nesting
    ("100000 nested [", CH, b"[" * 100_000, {}, 400, None),
    ("5000-deep object", C, b'{"a":' * 5000 + b"1" + b"}" * 5000, {}, 400, None),
    ("deep prompt list", C, b'{"prompt": ' + b"[" * DEEP + b"]" * DEEP + b"}", {}, 400, "prompt"),
    ("deep content", CH, b'{"messages": [{"role": "user", "content": ' + b"[" * DEEP + b"]" * DEEP + b"}]}", {},
     400, "messages[0].content[0]"),
    ("deep unknown field", C, b'{"prompt": "x", "deep": ' + b'{"a":' * DEEP + b"1" + b"}" * DEEP + b"}", {}, 400,
     "deep"),
    # oversize (the default limit: 1 MiB for this 2048-token model)
    ("2 MiB prompt", C, completion(prompt="x" * (2 << 20)), {}, 413, None),
    ("1 MiB of token ids", C, completion(prompt=[5] * (1 << 19)), {}, 413, None),
    ("2 MiB tokenize", TOK, {"prompt": "y" * (2 << 20)}, {}, 413, None),
    # bad headers
    ("a 10 KB request id", C, completion(max_tokens=-1), {"X-Request-Id": "r" * 10_000}, 400, "max_tokens"),
    ("a text/plain body", C, completion(n=0), {"Content-Type": "text/plain"}, 400, "n"),
    ("a form body", C, b"prompt=x&max_tokens=3", {"Content-Type": "application/x-www-form-urlencoded"}, 400, None),
    ("gzip the server does not decode", C, gzip.compress(b'{"prompt": "x"}'), {"Content-Encoding": "gzip"}, 400,
     None),
    ("an unused bearer token", C, completion(top_p=0), {"Authorization": "Bearer \x7f"}, 400, "top_p"),
    # unknown fields
    ("unknown top-level field", C, completion(frobnicate=1), {}, 400, "frobnicate"),
    ("unknown field in stream_options", C, completion(stream=True, stream_options={"include_usage": True, "x": 1}),
     {}, 400, "stream_options.x"),
    ("unknown field in a message", CH, message(role="user", content="x", foo=1), {}, 400, "messages[0].foo"),
    ("unknown field in speculative", C, completion(speculative={"num_speculative_tokens": 1, "bogus": 2}), {}, 400,
     "speculative.bogus"),
    # negative / huge max_tokens
    ("max_tokens -1", C, completion(max_tokens=-1), {}, 400, "max_tokens"),
    ("max_tokens 0", CH, chat(max_tokens=0), {}, 400, "max_tokens"),
    ("max_completion_tokens -5", CH, chat(max_completion_tokens=-5), {}, 400, "max_completion_tokens"),
    ("max_tokens past the context", C, completion(max_tokens=5000), {}, 400, "max_tokens"),
    # bad n
    ("n 0", C, completion(n=0), {}, 400, "n"),
    ("n -1", CH, chat(n=-1), {}, 400, "n"),
    ("n 17", C, completion(n=17), {}, 400, "n"),
    ("n a word", CH, chat(n="two"), {}, 400, "n"),
    # bad stop lists
    ("an empty stop", C, completion(stop=[""]), {}, 400, "stop"),
    ("stop of numbers", C, completion(stop=[1, 2]), {}, 400, "stop[0]"),
    ("stop of lists", CH, chat(stop=[[]]), {}, 400, "stop[0]"),
    ("stop an object", C, completion(stop={"a": 1}), {}, 400, "stop"),
    ("negative stop token", C, completion(stop_token_ids=[-1]), {}, 400, "stop_token_ids[0]"),
    # bad logprobs
    ("logprobs -1", C, completion(logprobs=-1), {}, 400, "logprobs"),
    ("logprobs 21", C, completion(logprobs=21), {}, 400, "logprobs"),
    ("chat logprobs a word", CH, chat(logprobs="perhaps"), {}, 400, "logprobs"),
    ("top_logprobs without logprobs", CH, chat(top_logprobs=5), {}, 400, "top_logprobs"),
    ("top_logprobs -1", CH, chat(logprobs=True, top_logprobs=-1), {}, 400, "top_logprobs"),
    # empty messages, wrong roles, empty prompts
    ("no messages", CH, {"messages": []}, {}, 400, "messages"),
    ("an empty message", CH, {"messages": [{}]}, {}, 400, "messages[0].role"),
    ("a null message", CH, {"messages": [None]}, {}, 400, "messages[0]"),
    ("a tool message answering no call", CH, message(role="tool", content="x"), {}, 400, "messages[0].tool_call_id"),
    ("role robot", CH, message(role="robot", content="x"), {}, 400, "messages[0].role"),
    ("no content", CH, message(role="user"), {}, 400, "messages[0].content"),
    ("an empty prompt", C, completion(prompt=""), {}, 400, "prompt"),
    ("no prompt ids", C, completion(prompt=[]), {}, 400, "prompt"),
    ("a prompt id past the vocabulary", C, completion(prompt=[1, 99999]), {}, 400, "prompt"),
    ("tokenize no messages", TOK, {"messages": []}, {}, 400, "messages"),
    ("detokenize a negative id", DETOK, {"tokens": [-1]}, {}, 400, "tokens[0]"),
    # other ranges, models, routes
    ("too many speculative tokens", C, completion(speculative={"num_speculative_tokens": 1000}), {}, 400,
     "speculative.num_speculative_tokens"),
    ("an unknown model", CH, chat(model="nope"), {}, 404, "model"),
    ("an unknown route", "/v1/nothing", completion(), {}, 404, None),
]
GREEDY = [("hello there", 48), ("the quick brown fox", 40)]


def send(url: str, path: str, body: dict | bytes, headers: dict[str, str]) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(url + path, content=content, timeout=TIMEOUT,
                      headers={"Content-Type": "application/json", **headers})


def greedy(client: openai.OpenAI, model: str, prompt: str, max_tokens: int) -> tuple[str, str]:
    """A streamed greedy completion through the openai client: (text, finish reason)."""
    chunks = list(client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                            stream=True, extra_body={"ignore_eos": True}))
    return "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason


@pytest.fixture(scope="module")
def engine(tiny_hf_model_dir):
    with started(tiny_engine(tiny_hf_model_dir)) as engine:
        yield engine


def test_hostile_requests_during_greedy_streams(engine):
    assert len(CASES) >= 50 and len({case[0] for case in CASES}) == len(CASES)
    with serve(engine) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        quiet = {prompt: greedy(client, engine.model_name, prompt, n) for prompt, n in GREEDY}
        fuzzing = threading.Event()
        fuzzing.set()
        streamed: dict[str, list[tuple[str, str]]] = {prompt: [] for prompt, _ in GREEDY}

        def stream_while_fuzzing(prompt: str, max_tokens: int) -> None:
            while fuzzing.is_set() or not streamed[prompt]:
                streamed[prompt].append(greedy(client, engine.model_name, prompt, max_tokens))

        with ThreadPoolExecutor(len(GREEDY) + 4) as pool:
            streams = [pool.submit(stream_while_fuzzing, prompt, n) for prompt, n in GREEDY]
            try:
                answers = list(pool.map(lambda case: send(url, case[1], case[2], case[3]), CASES))
            finally:
                fuzzing.clear()
            for stream in streams:
                stream.result()
        assert httpx.get(url + "/health", timeout=TIMEOUT).status_code == 200
        metrics = httpx.get(url + "/metrics", timeout=TIMEOUT).text
    wrong = [f"{case[0]}: {failure}" for case, answer in zip(CASES, answers)
             if (failure := error_failure(answer, status=case[4], param=case[5]))]
    assert not wrong, "\n".join(wrong)
    assert 'code="500"' not in metrics
    for prompt, outputs in streamed.items():
        assert outputs and all(out == quiet[prompt] for out in outputs), (prompt, quiet[prompt], outputs)


def error_failure(r: httpx.Response, status: int, param: str | None) -> str | None:
    """What is wrong with ``r`` as an OpenAI error of ``status`` naming ``param`` (None: nothing)."""
    try:
        error = r.json()["error"]
    except (ValueError, KeyError, TypeError):
        return f"{r.status_code} without an OpenAI error body: {r.text[:200]!r}"
    if r.status_code != status:
        return f"status {r.status_code}, expected {status}: {error}"
    if set(error) != {"message", "type", "param", "code"} or not error["message"]:
        return f"not OpenAI-shaped: {error}"
    if error["param"] != param:
        return f"param {error['param']!r}, expected {param!r}: {error['message']}"
    if param is not None and param.split("[")[0].split(".")[0] not in error["message"]:
        return f"the message does not name {param!r}: {error['message']}"
    return None
