"""Structured outputs over HTTP, with the official ``openai`` client, SmolLM2 and n-gram speculation:
OpenAI's ``response_format`` (json_object, json_schema) and vLLM's ``structured_outputs`` /
``guided_*`` on chat and completions, streaming and not, n = 2; every choice that finishes with
"stop" parses and validates. Invalid constraints and two constraints at once are 400s naming the field."""
import json
import re

import jsonschema
import openai
import pytest

from server_harness import check_error, post, serving

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
ALICE = [{"role": "user", "content": "Alice is 30 years old. Give her name and age as JSON."}]
PERSON_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}


@pytest.fixture(scope="module")
def url(smollm2, make_engine):
    from specdecode.runtime.engine.async_engine import AsyncEngine

    engine = make_engine(smollm2.model, smollm2.tokenizer, spec={"method": "ngram", "num_speculative_tokens": 3})
    with serving(AsyncEngine(engine, "smollm2", 8)) as url:
        yield url


@pytest.fixture(scope="module")
def client(url) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)


def check_stopped_and_valid(choices, validate) -> None:
    for choice in choices:
        assert choice.finish_reason == "stop", choice
        validate(choice.message.content if hasattr(choice, "message") else choice.text)


def person(text: str) -> None:
    jsonschema.validate(json.loads(text), PERSON)


def test_chat_json_schema_and_json_object(client):
    out = client.chat.completions.create(model="smollm2", messages=ALICE, max_tokens=40, temperature=0,
                                         response_format=PERSON_FORMAT)
    check_stopped_and_valid(out.choices, person)
    assert out.usage.speculative["num_draft_tokens"] > 0  # the server's usage extension: speculation ran
    answer = [{"role": "user", "content": "What is the capital of France? Answer in JSON."}]
    out = client.chat.completions.create(model="smollm2", messages=answer, max_tokens=40, temperature=0,
                                         response_format={"type": "json_object"})
    check_stopped_and_valid(out.choices, lambda text: isinstance(json.loads(text), dict) or pytest.fail(text))


def test_completions_json_schema(client):
    out = client.completions.create(model="smollm2", prompt="Alice is 30 years old. As JSON: ", max_tokens=40,
                                    temperature=0, extra_body={"response_format": PERSON_FORMAT})
    check_stopped_and_valid(out.choices, person)


@pytest.mark.parametrize("form", ["structured_outputs", "guided"])
def test_vllm_forms_regex_choice_grammar(client, form):
    """vLLM's ``structured_outputs`` and its older ``guided_*`` names: regex on completions, choice
    and a GBNF grammar on chat, and a JSON schema."""
    def body(kind: str, value) -> dict:
        return {"structured_outputs": {kind: value}} if form == "structured_outputs" else {f"guided_{kind}": value}

    def chat(content: str, kind: str, value):
        return client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": content}],
                                              max_tokens=24, temperature=0, extra_body=body(kind, value))

    phone = client.completions.create(model="smollm2", prompt="Call me at", max_tokens=12, temperature=0,
                                      extra_body=body("regex", r" [0-9]{3}-[0-9]{4}"))
    check_stopped_and_valid(phone.choices, lambda text: re.fullmatch(r" [0-9]{3}-[0-9]{4}", text) or pytest.fail(text))
    yes_no = chat("Is Paris in France? Answer yes or no.", "choice", ["yes", "no"])
    check_stopped_and_valid(yes_no.choices, lambda text: text in ("yes", "no") or pytest.fail(text))
    answer = chat("What is 2+2?", "grammar", 'root ::= "The answer is " [0-9]+ "."')
    check_stopped_and_valid(answer.choices, lambda text: re.fullmatch(r"The answer is [0-9]+\.", text) or pytest.fail(text))
    check_stopped_and_valid(chat(ALICE[0]["content"], "json", PERSON).choices, person)


def test_streaming_equals_non_streaming_and_n2_choices_are_each_valid(client):
    """A greedy stream reassembles to the non-streaming answer; two sampled choices (one grammar
    state each) streamed together are each valid."""
    kwargs = {"model": "smollm2", "messages": ALICE, "max_tokens": 40, "response_format": PERSON_FORMAT}
    whole = client.chat.completions.create(temperature=0, **kwargs).choices[0].message.content
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in
                       client.chat.completions.create(temperature=0, stream=True, **kwargs) if chunk.choices)
    assert streamed == whole
    texts, finish = ["", ""], [None, None]
    for chunk in client.chat.completions.create(temperature=0.8, seed=11, n=2, stream=True, **kwargs):
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            finish[choice.index] = choice.finish_reason or finish[choice.index]
    assert finish == ["stop", "stop"], (finish, texts)
    for text in texts:
        person(text)


@pytest.mark.parametrize("body,param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frobnicate"}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"structured_outputs": {"regex": "a["}}, "structured_outputs"),
    ({"structured_outputs": {"grammar": "root ::= ("}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"guided_json": {"type": "object", "properties": {"a": {"type": "nope"}}}}, "guided_json"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a+"}, "response_format"),
    ({"response_format": {"type": "json_object"}, "ignore_eos": True}, "ignore_eos"),
    ({"guided_choice": ["a", "b"], "stop": ["x"]}, "stop"),
], ids=["bad-schema", "no-schema", "bad-regex", "bad-grammar", "two-kinds", "bad-guided-schema", "two-forms",
        "ignore-eos", "stop"])
def test_invalid_constraints_are_400s_naming_the_field(url, body, param):
    response = post(url, "/v1/chat/completions", {"messages": ALICE, "max_tokens": 4, **body})
    check_error(response, 400, param, "invalid_value")
    if "guided_regex" in body:  # two forms: the message names both
        assert "response_format" in response.json()["error"]["message"]
        assert "guided_regex" in response.json()["error"]["message"]
