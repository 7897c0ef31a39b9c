"""Tool calling without a model: the Hermes/Qwen2.5 parser (whole and streamed at every split),
the prompt (a template that renders tools, and the default prompt), the forced-choice grammar and
the request checks."""
from __future__ import annotations

import json

import pytest
from llguidance import LLMatcher

from specdecode.runtime.engine.grammar import StructuredKind, llguidance_tokenizer
from specdecode.runtime.server.errors import APIError, validate_body
from specdecode.runtime.server.protocol import ChatCompletionRequest, ConflictingConstraints
from specdecode.runtime.server.tools import (
    DEFAULT_TOOL_PROMPT,
    ParsedMessage,
    ToolCallParser,
    default_tool_prompt,
    prompt_messages,
    tool_choice_lark,
)
from specdecode.runtime.tokenizer import Tokenizer

NAMES = frozenset({"get_weather", "get_time"})
WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris \\"FR\\"", "days": [1, {"x": "}"}]}}'
TWO_CALLS = f'Let me check.\n\n<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>\n{{"name": "get_time", "arguments": {{}}}}\n</tool_call>'
WEATHER_ARGS = json.dumps(json.loads(WEATHER)["arguments"])
CALLS = [("get_weather", WEATHER_ARGS), ("get_time", "{}")]


def parse(text: str, **options) -> ParsedMessage:
    parser = ToolCallParser(NAMES, **options)
    return ParsedMessage.of(parser.feed(text) + parser.finish())


def named(message: ParsedMessage) -> list[tuple[str, str]]:
    return [(name, json.dumps(json.loads(arguments))) for _, name, arguments in message.calls]


# ------------------------------------------------------------------------------------- parsing


def test_qwen_calls_after_content_are_parsed_with_server_ids():
    message = parse(TWO_CALLS)
    assert message.content == "Let me check."
    assert named(message) == CALLS
    ids = [call_id for call_id, _, _ in message.calls]
    assert all(i.startswith("call_") for i in ids) and len(set(ids)) == 2


def test_text_without_calls_is_content_unchanged():
    for text in ("plain answer\n", "a <tool_ b", "ends in a tag prefix <tool_c", "x < y and </tool_call>"):
        assert parse(text) == ParsedMessage(text)


@pytest.mark.parametrize("block", [
    '{"name": "get_weather", "arguments": {city: Paris}}',  # not JSON
    '{"name": "delete_everything", "arguments": {}}',  # not a tool of the request
    '{"name": "get_weather", "arguments": "Paris"}',  # arguments not an object
    '["get_weather"]',
])
def test_a_block_that_is_no_call_is_content(block):
    text = f"Sure.\n<tool_call>\n{block}\n</tool_call>"
    assert parse(text) == ParsedMessage(text)


def test_an_unclosed_block_at_the_end_is_a_call_when_complete_else_content():
    assert named(parse(f"<tool_call>\n{WEATHER}\n")) == CALLS[:1]
    assert parse('<tool_call>\n{"name": "get_weather", "argu') == ParsedMessage('<tool_call>\n{"name": "get_weather", "argu')


def test_an_output_that_is_only_a_calls_json_is_that_call():
    """Small Qwen2.5-Coder models drop the tags; a bare JSON value that is no call stays content."""
    bare = WEATHER
    assert parse(f"\n{bare}\n").content is None and named(parse(f"\n{bare}\n")) == CALLS[:1]
    for text in (f"{bare} is what I would call", '{"answer": 42}', '{"name": "get_weather", "arg'):
        assert parse(text) == ParsedMessage(text)
    for i in range(len(bare) + 1):  # held back whole, whatever the cut
        parser = ToolCallParser(NAMES)
        assert named(ParsedMessage.of(parser.feed(bare[:i]) + parser.feed(bare[i:]) + parser.finish())) == CALLS[:1]


def test_parallel_tool_calls_false_keeps_the_first_call():
    message = parse(TWO_CALLS, max_calls=1)
    assert message.content == "Let me check." and named(message) == CALLS[:1]


def test_guaranteed_output_streams_arguments_as_generated():
    parser = ToolCallParser(NAMES, guaranteed=True)
    events = parser.feed('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa')
    assert [type(e).__name__ for e in events] == ["CallStart", "ArgumentsDelta"]
    assert events[0].name == "get_weather" and events[1].text == '{"city": "Pa'
    assert [e.text for e in parser.feed('ris"}}\n</tool_')] == ['ris"}']
    assert parser.feed("call>") + parser.finish() == []


@pytest.mark.parametrize("guaranteed", [False, True], ids=["auto", "guaranteed"])
def test_streaming_split_at_every_offset_equals_the_whole(guaranteed):
    """Three deltas, the middle one up to 12 chars (a token or a few) starting at every offset:
    every cut inside the tags, the JSON and its strings. The events add up to the whole text's
    (so no content delta ever shows markup), char-by-char deltas included."""
    whole = parse(TWO_CALLS, guaranteed=guaranteed)
    assert whole.content == "Let me check." and named(whole) == CALLS
    cuts = [(i, j) for i in range(len(TWO_CALLS) + 1) for j in range(i, min(i + 12, len(TWO_CALLS)) + 1)]
    for i, j in cuts:
        parser = ToolCallParser(NAMES, guaranteed=guaranteed)
        events = [e for part in (TWO_CALLS[:i], TWO_CALLS[i:j], TWO_CALLS[j:]) for e in parser.feed(part)]
        events += parser.finish()
        streamed = ParsedMessage.of(events)
        assert streamed.content == whole.content and named(streamed) == CALLS, (i, j)
        assert [c[1:] for c in streamed.calls] == [c[1:] for c in whole.calls], (i, j)
    parser = ToolCallParser(NAMES, guaranteed=guaranteed)
    by_char = ParsedMessage.of([e for char in TWO_CALLS for e in parser.feed(char)] + parser.finish())
    assert (by_char.content, named(by_char)) == (whole.content, CALLS)


# -------------------------------------------------------------------------------------- prompt

QWEN_LIKE_TEMPLATE = (  # the shape of Qwen2.5's: tools in the system turn, calls and results as blocks
    "{% if tools %}<|im_start|>system\nTools:{% for t in tools %}\n{{ t | tojson }}{% endfor %}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function.name }} {{ c.function.arguments | tojson }}</tool_call>"
    "{% endfor %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
LOOP = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "content": "22 C", "tool_call_id": "call_1"},
    {"role": "tool", "content": "sunny", "tool_call_id": "call_1"},
]


def test_a_template_that_reads_tools_renders_them_and_the_calls():
    tokenizer = Tokenizer(backend=None, eos_token_ids=frozenset(), chat_template=QWEN_LIKE_TEMPLATE)
    assert tokenizer.chat_template_renders_tools
    messages, tools = prompt_messages(LOOP, [TOOL], tokenizer.chat_template_renders_tools)
    text = tokenizer.apply_chat_template(messages, tools=tools)
    assert messages == LOOP and tools == [TOOL]
    assert json.dumps(TOOL) in text
    assert '<tool_call>get_weather {"city": "Paris"}</tool_call>' in text
    assert "<|im_start|>tool\n22 C<|im_end|>" in text


def test_smollm2_template_gets_the_default_tool_prompt(smollm2):
    tokenizer = smollm2.tokenizer
    assert not tokenizer.chat_template_renders_tools
    messages, tools = prompt_messages(LOOP, [TOOL], tokenizer.chat_template_renders_tools)
    assert tools is None
    text = tokenizer.apply_chat_template(messages)
    assert text.startswith("<|im_start|>system\n" + default_tool_prompt([TOOL]) + "<|im_end|>\n")
    assert DEFAULT_TOOL_PROMPT.splitlines()[0] in text and json.dumps(TOOL) in text
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert f"<|im_start|>assistant\n{call}<|im_end|>" in text
    responses = "<tool_response>\n22 C\n</tool_response>\n<tool_response>\nsunny\n</tool_response>"
    assert f"<|im_start|>user\n{responses}<|im_end|>\n<|im_start|>assistant\n" in text
    # a system message of the client's keeps its text first; no tools: no tool prompt
    with_system, _ = prompt_messages([{"role": "system", "content": "Be brief."}, *LOOP[:1]], [TOOL], False)
    assert with_system[0]["content"] == "Be brief.\n\n" + default_tool_prompt([TOOL])
    assert prompt_messages(LOOP[:1], None, False) == (LOOP[:1], None)


# ------------------------------------------------------------------------------------- grammar


def test_forced_choice_grammar_accepts_valid_calls_and_refuses_others(tiny):
    _, tokenizer = tiny
    ll = llguidance_tokenizer(tokenizer, tokenizer.vocab_size)
    tools = [{"name": "get_weather", **{k: v for k, v in TOOL["function"].items() if k == "parameters"}},
             {"name": "get_time"}]
    tools[0]["parameters"] = {**tools[0]["parameters"], "required": ["city"]}

    def accepts(lark: str, text: str) -> bool:
        matcher = LLMatcher(ll, LLMatcher.grammar_from_lark(lark), log_level=0)
        assert not matcher.is_error(), matcher.get_error()
        ids = tokenizer.encode(text, add_special_tokens=False)
        return matcher.validate_tokens(ids) == len(ids) and matcher.consume_tokens(ids) and matcher.is_accepting()

    good = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    time_call = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    several, one = tool_choice_lark(tools, one_call=False), tool_choice_lark(tools, one_call=True)
    assert accepts(several, good) and accepts(several, f"{good}\n{time_call}") and accepts(one, good)
    assert not accepts(one, f"{good}\n{time_call}")
    assert not accepts(several, good.replace('"city"', '"town"'))  # misses the required city
    assert not accepts(several, good.replace('"Paris"}', '"Paris", "country": "FR"}'))  # closed: declared keys only
    assert not accepts(several, good.replace("get_weather", "get_wether"))
    assert not accepts(several, "Sure! " + good)


# ------------------------------------------------------------------------------------ requests

CHAT = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("body,param", [
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "tool_choice"),
    ({"tools": [TOOL], "tool_choice": "always"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "bogus"}}}]},
     "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
     "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "no spaces"}}]}, "tools[0].function.name"),
    ({"tools": [TOOL, TOOL]}, "tools"),
    ({"messages": [{"role": "tool", "content": "22 C"}]}, "messages[0].tool_call_id"),
    ({"messages": [{"role": "user", "content": "x", "tool_call_id": "call_1"}]}, "messages[0].tool_call_id"),
    ({"messages": [{"role": "assistant"}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]}, "messages[0].tool_calls"),
])
def test_bad_tool_requests_name_the_field(body, param):
    with pytest.raises(APIError) as refused:
        validate_body(ChatCompletionRequest, {"messages": CHAT, **body})
    assert refused.value.status == 400 and refused.value.param == param, refused.value.message


def test_tool_choice_defaults_and_a_tool_loop_request():
    assert validate_body(ChatCompletionRequest, {"messages": CHAT}).tool_mode == "none"
    req = validate_body(ChatCompletionRequest, {"messages": [
        *CHAT,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "content": [{"type": "text", "text": "22 C"}], "tool_call_id": "call_1"},
    ], "tools": [TOOL]})
    assert req.tool_mode == "auto" and req.template_messages()[1:] == LOOP[1:3]
    none = validate_body(ChatCompletionRequest, {"messages": CHAT, "tools": [TOOL], "tool_choice": "none"})
    assert none.template_tools() is None and none.tool_call_parser() is None


def test_forced_choices_constrain_the_output_and_conflict_with_response_format():
    time_tool = {"type": "function", "function": {"name": "get_time"}}
    named = validate_body(ChatCompletionRequest, {"messages": CHAT, "tools": [TOOL, time_tool],
                                                  "tool_choice": {"type": "function", "function": {"name": "get_time"}}})
    constraint, field_name = named.structured_output()
    assert field_name == "tool_choice" and constraint.kind is StructuredKind.LARK
    assert "get_time" in constraint.text and "get_weather" not in constraint.text
    assert validate_body(ChatCompletionRequest, {"messages": CHAT, "tools": [TOOL]}).structured_output() is None
    both = validate_body(ChatCompletionRequest, {"messages": CHAT, "tools": [TOOL], "tool_choice": "required",
                                                 "response_format": {"type": "json_object"}})
    with pytest.raises(ConflictingConstraints) as refused:
        both.structured_output()
    assert refused.value.fields == ["response_format", "tool_choice"]
