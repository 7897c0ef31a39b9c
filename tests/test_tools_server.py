"""Tool calling through real clients against SmolLM2 served with n-gram speculation: the openai
client (forced choices give calls whose arguments match the schema; a stream reassembles to the
non-streamed answer; a whole tool loop is accepted) and langchain-openai (bind_tools,
with_structured_output both ways, stream)."""
from __future__ import annotations

import json
from typing import Literal

import jsonschema
import openai
import pytest
from langchain_core.messages import AIMessageChunk
from langchain_openai import ChatOpenAI
from pydantic import BaseModel
from server_harness import post, serving

from specdecode.runtime.engine.async_engine import AsyncEngine

WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20},
                   "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME_PARAMETERS = {"type": "object", "properties": {"timezone": {"type": "string", "maxLength": 30}},
                   "required": ["timezone"], "additionalProperties": False}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Get the current weather in a city",
                                      "parameters": WEATHER_PARAMETERS}},
    {"type": "function", "function": {"name": "get_time", "description": "Get the current time in a timezone",
                                      "parameters": TIME_PARAMETERS}},
]
SCHEMAS = {"get_weather": WEATHER_PARAMETERS, "get_time": TIME_PARAMETERS}
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]
GREEDY = {"temperature": 0, "max_tokens": 60}


@pytest.fixture(scope="module")
def url(smollm2, make_engine):
    spec = {"method": "ngram", "num_speculative_tokens": 4}
    with serving(AsyncEngine(make_engine(smollm2.model, smollm2.tokenizer, spec=spec), "smollm2", 8)) as url:
        yield url


@pytest.fixture
def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)


def valid_calls(message) -> list[tuple[str, dict]]:
    """(name, arguments) of each call, after checking the arguments against the tool's schema."""
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls]
    for name, arguments in calls:
        jsonschema.validate(arguments, SCHEMAS[name])
    assert all(c.id.startswith("call_") and c.type == "function" for c in message.tool_calls)
    return calls


def test_named_tool_choice_gives_a_valid_call_and_its_stream_reassembles_to_it(client):
    named = {"type": "function", "function": {"name": "get_time"}}
    answer = client.chat.completions.create(model="smollm2", messages=ASK, tools=TOOLS, tool_choice=named, **GREEDY)
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (name, _), = valid_calls(choice.message)
    assert name == "get_time"
    fragments = []
    with client.chat.completions.stream(model="smollm2", messages=ASK, tools=TOOLS, tool_choice=named,
                                        **GREEDY) as stream:
        for event in stream:
            if event.type == "tool_calls.function.arguments.delta":
                fragments.append(event.arguments_delta)
        streamed = stream.get_final_completion().choices[0]
    assert streamed.finish_reason == "tool_calls"
    assert valid_calls(streamed.message) == valid_calls(choice.message)
    assert len(fragments) > 1  # the arguments stream as they are generated


def test_required_tool_choice_gives_valid_calls(client):
    answer = client.chat.completions.create(model="smollm2", messages=ASK, tools=TOOLS, tool_choice="required",
                                            parallel_tool_calls=False, **GREEDY)
    assert answer.choices[0].finish_reason == "tool_calls"
    assert len(valid_calls(answer.choices[0].message)) == 1


def test_a_tool_loop_is_accepted_and_answered(client, url):
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}
    loop = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 22, "sky": "sunny"}'}]
    answer = client.chat.completions.create(model="smollm2", messages=loop, tools=TOOLS, tool_choice="none",
                                            temperature=0, max_tokens=8)
    assert answer.choices[0].message.content and not answer.choices[0].message.tool_calls
    shown = post(url, "/tokenize", {"messages": loop, "tools": TOOLS, "return_token_strs": True}).json()
    text = "".join(shown["token_strs"]).replace("Ġ", " ").replace("Ċ", "\n")
    assert '"name": "get_weather"' in text and "<tool_response>" in text and "<tools>" in text


# -------------------------------------------------------------------------------- langchain


class Weather(BaseModel):
    """Get the current weather in a city"""

    city: str
    unit: Literal["celsius", "fahrenheit"]


@pytest.fixture
def llm(url):
    return ChatOpenAI(base_url=f"{url}/v1", api_key="unused", model="smollm2", temperature=0, max_tokens=60,
                      max_retries=0, timeout=300)


def test_langchain_bind_tools_invoke_and_stream_give_the_same_valid_call(llm):
    bound = llm.bind_tools([Weather], tool_choice="Weather")
    message = bound.invoke("What is the weather like in Paris today?")
    (call,) = message.tool_calls
    assert call["name"] == "Weather" and Weather.model_validate(call["args"])
    chunks = list(bound.stream("What is the weather like in Paris today?"))
    merged = sum(chunks[1:], chunks[0])
    assert isinstance(merged, AIMessageChunk) and len(chunks) > 2
    assert [(c["name"], c["args"]) for c in merged.tool_calls] == [(call["name"], call["args"])]
    assert llm.bind_tools([Weather], tool_choice="any").invoke("Weather in Paris?").tool_calls


@pytest.mark.parametrize("method", ["function_calling", "json_schema"])
def test_langchain_structured_output_is_a_validated_instance(llm, method):
    weather = llm.with_structured_output(Weather, method=method).invoke("What is the weather like in Paris today?")
    assert isinstance(weather, Weather)
