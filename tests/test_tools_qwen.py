"""Qwen2.5-Coder-0.5B-Instruct end to end (slow: a 478 MB model): its own chat template renders
the tools, and under tool_choice auto a prompt that needs the tool comes back as a parsed call,
streamed or not."""
from __future__ import annotations

import json

import openai
import pytest
from server_harness import serving

from specdecode.runtime.engine.async_engine import AsyncEngine

pytestmark = pytest.mark.slow

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
ASK = [{"role": "user", "content": "What is the weather like in Paris today? Use the tool."}]


@pytest.fixture(scope="module")
def qwen(cache_dir):
    from specdecode.runtime.config import LoadConfig
    from specdecode.runtime.models.loader import load_model

    return load_model(LoadConfig(model="qwen2.5-coder-0.5b", weight_cache_dir=cache_dir))


def test_qwen_auto_tool_call_is_parsed_streamed_or_not(qwen, make_engine):
    assert qwen.tokenizer.chat_template_renders_tools
    with serving(AsyncEngine(make_engine(qwen.model, qwen.tokenizer), "qwen", 8)) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=600)
        request = {"model": "qwen", "messages": ASK, "tools": [WEATHER], "temperature": 0, "max_tokens": 60}
        answer = client.chat.completions.create(**request).choices[0]
        with client.chat.completions.stream(**request) as stream:
            streamed = stream.get_final_completion().choices[0]
    assert answer.finish_reason == "tool_calls", answer
    (call,) = answer.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments)["city"] == "Paris"
    assert streamed.finish_reason == "tool_calls" and (streamed.message.content or None) == answer.message.content
    assert [(c.function.name, c.function.arguments) for c in streamed.message.tool_calls] == [
        (call.function.name, call.function.arguments)]
