"""Prompt logprobs (``SamplingParams.prompt_logprobs``, what ``echo`` with ``logprobs`` returns):
they equal a full forward of the model at every prompt position, with speculation on, with the
prompt in chunks, after a prefix-cache hit was possible, after preemption, and with
``max_tokens=0`` (the prompt only)."""
import pytest
import torch

from specdecode.runtime.engine.sequence import SamplingParams

TEXT = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n"


def run_one(engine, prompt: list[int], params: SamplingParams, request_id: str = "r"):
    """(output token ids, prompt logprobs of each completion, its finish reasons) of one request."""
    engine.add_request(request_id, prompt, params)
    tokens, prompt_logprobs, finish = {}, {}, {}
    while engine.has_unfinished():
        for o in engine.step():
            for d in o.deltas:
                tokens.setdefault(d.index, []).extend(d.token_ids)
                if d.prompt_logprobs is not None:
                    assert d.index not in prompt_logprobs, "prompt logprobs came twice"
                    prompt_logprobs[d.index] = d.prompt_logprobs
                finish[d.index] = d.finish_reason
    return tokens, prompt_logprobs, finish


def assert_prompt_logprobs(full_forward, model, prompt: list[int], logprobs, num_top: int) -> None:
    """One per prompt token after the first: the token's logprob and the top ``num_top`` of a full forward."""
    expected = full_forward(model, prompt).log_softmax(-1)[:-1]  # [P-1, V]: row i predicts prompt[i + 1]
    assert [lp.token_id for lp in logprobs] == prompt[1:]
    chosen = expected.gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]
    assert [lp.logprob for lp in logprobs] == pytest.approx(chosen.tolist(), abs=1e-4)
    top_vals, top_ids = expected.topk(num_top, dim=-1) if num_top else (None, None)
    for i, lp in enumerate(logprobs):
        assert len(lp.top) == num_top
        if num_top:
            assert [t for t, _ in lp.top] == top_ids[i].tolist()
            assert [v for _, v in lp.top] == pytest.approx(top_vals[i].tolist(), abs=1e-4)


SPECS = [None, {"method": "ngram", "num_speculative_tokens": 4}, {"method": "suffix", "num_speculative_tokens": 3}]


@pytest.mark.parametrize("spec", SPECS, ids=["plain", "ngram", "suffix"])
def test_prompt_logprobs_equal_a_full_forward_with_chunked_prefill(tiny, make_engine, full_forward, spec):
    """A 9-token step budget cuts the prompt into chunks; the output is generated after it (with
    drafts where a proposer is on) and is the same as without prompt logprobs."""
    model, tok = tiny
    prompt = tok.encode(TEXT)
    assert len(prompt) > 20
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=1, prompt_logprobs=3)
    tokens, prompt_logprobs, _ = run_one(make_engine(model, tok, spec=spec, budget=9), prompt, params)
    assert_prompt_logprobs(full_forward, model, prompt, prompt_logprobs[0], 3)
    plain, _, _ = run_one(make_engine(model, tok, spec=spec), prompt, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    assert tokens == plain


def test_max_tokens_0_returns_the_prompt_logprobs_only(tiny, make_engine, full_forward):
    model, tok = tiny
    prompt = tok.encode("The capital of France is Paris.")
    engine = make_engine(model, tok, spec={"method": "ngram", "num_speculative_tokens": 4})
    tokens, prompt_logprobs, finish = run_one(engine, prompt, SamplingParams(max_tokens=0, logprobs=0, prompt_logprobs=0))
    assert tokens == {0: []} and finish == {0: "length"}
    assert_prompt_logprobs(full_forward, model, prompt, prompt_logprobs[0], 0)
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


def test_a_cached_prefix_does_not_skip_asked_positions_and_each_of_n_completions_gets_them(tiny, make_engine, full_forward):
    """The prompt is in the prefix cache (an earlier request computed it): a request asking for
    prompt logprobs computes every position anyway; one that does not ask still hits the cache."""
    model, tok = tiny
    prompt = tok.encode(TEXT)
    engine = make_engine(model, tok, block_size=4)
    run_one(engine, prompt, SamplingParams(max_tokens=2, temperature=0.0), "warm")
    hits = engine.stats().prefix_cache_hit_tokens
    params = SamplingParams(max_tokens=2, temperature=0.8, seed=3, n=2, prompt_logprobs=1)
    _, prompt_logprobs, _ = run_one(engine, prompt, params, "asked")
    assert engine.stats().prefix_cache_hit_tokens == hits
    for index in (0, 1):
        assert_prompt_logprobs(full_forward, model, prompt, prompt_logprobs[index], 1)
    run_one(engine, prompt, SamplingParams(max_tokens=2, temperature=0.0), "not asked")
    assert engine.stats().prefix_cache_hit_tokens > hits


def test_prompt_logprobs_survive_preemption(tiny, make_engine, full_forward):
    """A pool too small for four long requests preempts some after their prompts were scored (or
    part-way through); each still reports every prompt position exactly once, equal to a full forward."""
    model, tok = tiny
    prompts = [tok.encode(TEXT + "#" * i) for i in range(4)]
    engine = make_engine(model, tok, num_blocks=14, block_size=8, budget=24)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, prompt_logprobs=2)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    got = {}
    while engine.has_unfinished():
        for o in engine.step():
            for d in o.deltas:
                if d.prompt_logprobs is not None:
                    got[o.request_id] = d.prompt_logprobs
    assert engine.stats().num_preemptions > 0
    for i, prompt in enumerate(prompts):
        assert_prompt_logprobs(full_forward, model, prompt, got[str(i)], 2)


# ----------------------------------------------------------------- /v1/completions with echo


@pytest.fixture(scope="module")
def spec_url(tiny, make_engine):
    """The tiny model served with n-gram speculation on."""
    from server_harness import serving_with_ngram

    with serving_with_ngram(make_engine, *tiny) as url:
        yield url


def completion(url: str, **body) -> dict:
    from server_harness import post

    r = post(url, "/v1/completions", {"model": "tiny", **body})
    assert r.status_code == 200, r.text
    return r.json()


def assert_echoed_logprobs(full_forward, model, tok, prompt: list[int], logprobs: dict, num_top: int) -> None:
    """The response's first ``len(prompt)`` entries are the prompt's: null first, then a full forward's."""
    n = len(prompt)
    assert logprobs["tokens"][:n] == [tok.decode([t], skip_special_tokens=False) for t in prompt]
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    expected = full_forward(model, prompt).log_softmax(-1)[:-1]  # [P-1, V]
    chosen = expected.gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]
    assert logprobs["token_logprobs"][1:n] == pytest.approx(chosen.tolist(), abs=1e-4)
    top = expected.topk(num_top, dim=-1)
    for i in range(1, n):
        row = logprobs["top_logprobs"][i]
        assert len(row) == num_top
        assert sorted(row.values(), reverse=True) == pytest.approx(top.values[i - 1].tolist(), abs=1e-4)
    assert logprobs["text_offset"][:n] == [len(tok.decode(prompt[:i], skip_special_tokens=False)) for i in range(n)]


def test_echo_of_a_text_prompt_with_logprobs_under_speculation(spec_url, tiny, full_forward):
    model, tok = tiny
    text = "the cat the cat the cat"
    out = completion(spec_url, prompt=text, echo=True, logprobs=2, max_tokens=12, temperature=0, ignore_eos=True)
    choice = out["choices"][0]
    prompt = tok.encode(text)
    generated = out["usage"]["completion_tokens"]
    assert generated == 12 and out["usage"]["prompt_tokens"] == len(prompt)
    assert choice["text"].startswith(text) and len(choice["logprobs"]["tokens"]) == len(prompt) + generated
    assert_echoed_logprobs(full_forward, model, tok, prompt, choice["logprobs"], 2)
    plain = completion(spec_url, prompt=text, logprobs=2, max_tokens=12, temperature=0, ignore_eos=True)["choices"][0]
    assert choice["text"] == text + plain["text"]
    assert choice["logprobs"]["token_logprobs"][len(prompt):] == plain["logprobs"]["token_logprobs"]


def test_echo_of_token_ids_with_max_tokens_0_returns_the_prompt_only(spec_url, tiny, full_forward):
    """What lm-eval's loglikelihood requests need, with ``max_tokens: 0`` (OpenAI's prompt-only form)."""
    model, tok = tiny
    prompt = tok.encode("Once upon a time there was a small model")
    out = completion(spec_url, prompt=[prompt], echo=True, logprobs=1, max_tokens=0)
    choice = out["choices"][0]
    assert choice["text"] == tok.decode(prompt, skip_special_tokens=False) and choice["finish_reason"] == "length"
    assert len(choice["logprobs"]["tokens"]) == len(prompt) and out["usage"]["completion_tokens"] == 0
    assert_echoed_logprobs(full_forward, model, tok, prompt, choice["logprobs"], 1)


def test_lm_eval_request_shape_and_a_streamed_echo(spec_url, tiny, full_forward):
    """lm-eval 0.4.13's loglikelihood body (``echo, logprobs 1, max_tokens 1, temperature 0, seed``
    and a batch of one token-id prompt); the same echoed as a stream: the prompt comes first, once."""
    import httpx
    from server_harness import TIMEOUT, sse_payloads

    model, tok = tiny
    prompt = tok.encode("The capital of France is Paris.")
    body = {"model": "tiny", "prompt": [prompt], "temperature": 0, "max_tokens": 1, "logprobs": 1, "seed": 1234,
            "echo": True}
    whole = completion(spec_url, **body)["choices"][0]
    assert len(whole["logprobs"]["tokens"]) == len(prompt) + 1
    assert_echoed_logprobs(full_forward, model, tok, prompt, whole["logprobs"], 1)
    chunks = []
    with httpx.stream("POST", spec_url + "/v1/completions", json={**body, "max_tokens": 6, "stream": True},
                      timeout=TIMEOUT) as r:
        for payload in sse_payloads(r.iter_lines()):
            if payload != "[DONE]":
                chunks.append(payload["choices"][0])
    text = "".join(c["text"] for c in chunks)
    assert chunks[0]["text"].startswith(tok.decode(prompt, skip_special_tokens=False))
    streamed = {key: sum((c["logprobs"][key] for c in chunks), []) for key in ("tokens", "token_logprobs", "text_offset")}
    assert text.count(tok.decode(prompt, skip_special_tokens=False)) == 1
    assert streamed["tokens"][: len(prompt) + 1] == whole["logprobs"]["tokens"]
    assert streamed["token_logprobs"][0] is None
    assert streamed["token_logprobs"][1 : len(prompt) + 1] == pytest.approx(whole["logprobs"]["token_logprobs"][1:], abs=1e-5)
    assert streamed["text_offset"] == sorted(streamed["text_offset"])
