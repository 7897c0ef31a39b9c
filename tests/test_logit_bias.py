"""``logit_bias``: added to the target's logits at every verified position, so speculation is
lossless under it — greedy output with every proposer × lossless strategy equals no-spec greedy
output with the same bias, token for token, and seeded sampling keeps the biased distribution past
the first token. Logprobs stay the model's raw ones. Over HTTP: chat and completions take it, and
bad keys or values are 400s naming the field."""
import pytest
import torch

from specdecode.runtime.engine.sampler import sampling_probs
from specdecode.runtime.engine.sequence import SamplingParams

PROPOSERS = ["ngram", "suffix", "draft", "mtp"]
LOSSLESS = ["greedy", "target_match", "rejection"]


@pytest.fixture(scope="module")
def prompt(sharp, full_forward) -> list[int]:
    """A prompt followed by the model's own greedy continuation: plausible n-gram drafts."""
    model, tok = sharp
    ids = tok.encode("a b a b a b")
    for _ in range(7):
        ids.append(int(full_forward(model, ids)[-1].argmax()))
    return ids


@pytest.fixture(scope="module")
def bias(sharp, prompt, full_forward) -> tuple[tuple[int, float], ...]:
    """Bans the token the unbiased model loops on and lifts a lesser one by 3: the output changes."""
    logits = full_forward(sharp[0], prompt)[-1]
    top = logits.topk(4).indices.tolist()
    return ((top[0], -100.0), (top[3], 3.0))


def greedy_biased(full_forward, model, prompt: list[int], bias, num_tokens: int) -> list[int]:
    """The argmax of the biased logits, token by token, each by a full recompute."""
    ids, weights = [t for t, _ in bias], torch.tensor([b for _, b in bias])
    out: list[int] = []
    for _ in range(num_tokens):
        logits = full_forward(model, prompt + out)[-1].clone()
        logits[ids] += weights
        out.append(int(logits.argmax()))
    return out


def run(engine, prompts: list[list[int]], params: list[SamplingParams]):
    """Run requests together: each one's output tokens and logprobs."""
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(str(i), p, sp)
    tokens = {str(i): [] for i in range(len(prompts))}
    logprobs = {str(i): [] for i in range(len(prompts))}
    while engine.has_unfinished():
        for o in engine.step():
            for d in o.deltas:
                tokens[o.request_id] += d.token_ids
                logprobs[o.request_id] += d.logprobs
    return [tokens[str(i)] for i in range(len(prompts))], [logprobs[str(i)] for i in range(len(prompts))]


def test_no_spec_greedy_follows_the_biased_logits_and_logprobs_stay_raw(sharp, make_engine, full_forward, prompt, bias):
    model, tok = sharp
    biased = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logit_bias=bias, logprobs=2)
    plain = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    (out, unbiased), (logprobs, _) = run(make_engine(model, tok), [prompt, prompt], [biased, plain])
    assert out == greedy_biased(full_forward, model, prompt, bias, 12)
    assert out != unbiased and len(set(out)) > 1
    raw = full_forward(model, prompt + out).log_softmax(-1)[len(prompt) - 1 : -1]  # [12, V] before any bias
    assert [lp.logprob for lp in logprobs] == pytest.approx(raw.gather(1, torch.tensor(out)[:, None])[:, 0].tolist(), abs=1e-4)
    assert [[t for t, _ in lp.top] for lp in logprobs] == raw.topk(2, dim=-1).indices.tolist()


@pytest.fixture(scope="module")
def mtp_head(sharp, write_random_mtp_head, tmp_path_factory) -> str:
    return write_random_mtp_head(sharp[0], tmp_path_factory.mktemp("bias-head"))


@pytest.mark.parametrize("verify", LOSSLESS)
@pytest.mark.parametrize("proposer", PROPOSERS)
def test_greedy_with_logit_bias_equals_no_spec(sharp, make_engine, prompt, bias, tiny_draft_dir, mtp_head, proposer, verify):
    """A biased and an unbiased request in one batch: each equals its no-spec greedy output."""
    model, tok = sharp
    spec = {"method": proposer, "num_speculative_tokens": 3, "verify": verify,
            "draft_model": tiny_draft_dir if proposer == "draft" else None,
            "mtp_path": mtp_head if proposer == "mtp" else None}
    params = [SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logit_bias=bias),
              SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)]
    expected, _ = run(make_engine(model, tok), [prompt, prompt], params)
    engine = make_engine(model, tok, spec=spec)
    got, _ = run(engine, [prompt, prompt], params)
    assert got == expected
    assert engine.stats().spec_decode_num_draft_tokens > 0
    if proposer in ("ngram", "suffix"):
        assert engine.stats().spec_decode_num_accepted_tokens > 0


@pytest.mark.parametrize("verify", ["rejection", "target_match"])
def test_ngram_speculation_keeps_the_biased_distribution_of_the_first_three_output_tokens(
    sharp, make_engine, full_forward, run_seeded, assert_follows, prompt, verify
):
    """Many seeded requests with a bias (the runner-up banned, the third lifted; the token the model
    loops on, which n-gram drafts, kept), drafts verified from the second output token on: the
    first, second and third output tokens, given the most frequent preceding output, follow the
    *biased* target distribution (chi-square, fixed seeds); some drafts were accepted, some not."""
    from collections import Counter

    model, tok = sharp
    top = full_forward(model, prompt)[-1].topk(3).indices.tolist()
    bias = ((top[1], -100.0), (top[2], 1.5))
    n = 2000
    params = SamplingParams(max_tokens=4, temperature=0.8, top_k=6, ignore_eos=True, logit_bias=bias)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "verify": verify}
    engine = make_engine(model, tok, spec=spec, max_seqs=n, budget=8 * n, num_blocks=3 * n)
    outputs, counts = run_seeded(engine, prompt, params, n)
    assert 0 < counts.num_accepted_tokens < counts.num_draft_tokens, counts
    ids, weights = [t for t, _ in bias], torch.tensor([b for _, b in bias])
    for position in (0, 1, 2):
        prefix = list(Counter(tuple(o[:position]) for o in outputs).most_common(1)[0][0])
        following = [o[position] for o in outputs if o[:position] == prefix]
        assert len(following) >= 300, (position, prefix, len(following))
        logits = full_forward(model, prompt + prefix)[-1:].clone()  # [1, V]
        logits[:, ids] += weights
        probs = sampling_probs(logits, [params])[0]  # [V]
        assert_follows(torch.bincount(torch.tensor(following), minlength=len(probs)).float(), probs)


# ------------------------------------------------------------------------------------ HTTP


@pytest.fixture(scope="module")
def url(sharp, make_engine):
    from server_harness import serving_with_ngram

    with serving_with_ngram(make_engine, *sharp) as url:
        yield url


def test_chat_and_completions_take_logit_bias(url, sharp):
    from server_harness import post

    tok = sharp[1]
    forced = tok.encode(" capital")
    assert len(forced) == 1
    body = {"max_tokens": 6, "temperature": 0, "ignore_eos": True, "logit_bias": {str(forced[0]): 100}}
    chat = post(url, "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": "hi"}]}).json()
    text = post(url, "/v1/completions", {**body, "prompt": "a b a b"}).json()
    assert chat["choices"][0]["message"]["content"] == " capital" * 6
    assert text["choices"][0]["text"] == " capital" * 6
    unbiased = post(url, "/v1/completions", {**body, "logit_bias": {}, "prompt": "a b a b"}).json()
    assert unbiased["choices"][0]["text"] != " capital" * 6


@pytest.mark.parametrize("logit_bias, what", [
    ({"cat": 1}, "keys must be token ids"),
    ({"-1": 1}, "keys must be token ids"),
    ({"1": 101}, "[-100, 100]"),
    ({"1": "high"}, "[-100, 100]"),
    ({"99999": 1}, "not in the vocabulary"),
    ([1, 2], "object from token ids"),
])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_bad_logit_bias_is_a_400_naming_the_field(url, path, logit_bias, what):
    from server_harness import check_error, post

    body = {"max_tokens": 2, "logit_bias": logit_bias}
    body |= {"prompt": "hi"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}]}
    r = post(url, path, body)
    check_error(r, 400, "logit_bias", "invalid_value")
    assert what in r.json()["error"]["message"]
