"""Tool calling: tools in the prompt, tool calls out of the text, and forced calls as a grammar.

*Format.* Calls are Hermes/Qwen2.5 blocks, each holding one JSON object::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Text before the first block is the message's ``content``; whitespace around blocks is dropped.
Unconstrained, an output that is nothing but one call's JSON object (no tags: small Qwen2.5-Coder
models often drop them) is that call too.

*Prompt.* A chat template that reads ``tools`` renders them itself (Hugging Face convention: it
receives the tool list and messages with ``tool_calls`` and ``role: "tool"``). For a template that
never mentions tools, ``prompt_messages`` writes ``DEFAULT_TOOL_PROMPT`` (Qwen2.5's own tool
prompt) into the system message, an assistant's calls as the blocks above, and tool results as a
user message of ``<tool_response>`` blocks, so any template can show a whole tool loop.

*Parsing.* ``ToolCallParser`` reads the output text delta by delta and emits content, call starts
and argument fragments; a non-streamed answer is the same parser fed in one piece, so streaming
and not streaming agree by construction. Content never shows block markup, even when a tag is
split across deltas: a text tail that may begin a tag is held back until it can be told apart.
Unconstrained (``auto``), a block is emitted whole when it closes (or when the output ends), and
a block that is not a call of a known tool with JSON-object arguments becomes content. Under a
forced choice the grammar (``tool_choice_lark``) guarantees every block, so the name goes out as
soon as it is complete and the arguments stream as they are generated.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
NAME_PATTERN = re.compile(r"[a-zA-Z0-9_-]{1,64}")  # OpenAI's rule for function names
EMPTY_PARAMETERS = {"type": "object", "properties": {}}

DEFAULT_TOOL_PROMPT = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


# ------------------------------------------------------------------------------------- prompt


def template_arguments(arguments: str) -> dict[str, Any] | str:
    """A call's arguments as chat templates expect them: a mapping (they ``tojson`` it), unless the
    client's text is not a JSON object, which is then passed on as sent."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return arguments
    return value if isinstance(value, dict) else arguments


def call_block(name: str, arguments: dict[str, Any] | str) -> str:
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return f'{TOOL_CALL_START}\n{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": {args}}}\n{TOOL_CALL_END}'


def default_tool_prompt(tools: list[dict[str, Any]]) -> str:
    return DEFAULT_TOOL_PROMPT.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))


def prompt_messages(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, template_renders_tools: bool
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(messages, tools) for the chat template: as they are for a template that renders tools;
    else plain-text messages, the tools in the system message (see the module's docstring)."""
    if template_renders_tools:
        return messages, tools or None
    out: list[dict[str, Any]] = []
    for message in messages:
        if message["role"] == "tool":
            response = f"<tool_response>\n{message['content']}\n</tool_response>"
            if out and out[-1].get("tool_responses"):
                out[-1]["content"] += "\n" + response
            else:
                out.append({"role": "user", "content": response, "tool_responses": True})
        elif message.get("tool_calls"):
            blocks = [call_block(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]]
            text = "\n".join(filter(None, [message.get("content") or "", *blocks]))
            out.append({k: v for k, v in message.items() if k != "tool_calls"} | {"content": text})
        else:
            out.append(message)
    out = [{k: v for k, v in m.items() if k != "tool_responses"} for m in out]
    if tools:
        out = _with_system_text(out, default_tool_prompt(tools))
    return out, None


def _with_system_text(messages: list[dict[str, Any]], text: str) -> list[dict[str, Any]]:
    if messages and messages[0]["role"] == "system":
        first = messages[0]
        return [{**first, "content": f"{first['content']}\n\n{text}" if first["content"] else text}, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


# ------------------------------------------------------------------------------------ grammar


def tool_choice_lark(tools: list[dict[str, Any]], one_call: bool) -> str:
    """llguidance lark for a forced choice: one block (``one_call``) or several, each a call of one
    of ``tools`` (``{"name", "parameters"}``) whose arguments match that tool's JSON schema, closed
    (``closed_schema``)."""
    alternatives, rules = [], []
    for i, tool in enumerate(tools):
        head = f'{TOOL_CALL_START}\n{{"name": "{tool["name"]}", "arguments": '
        alternatives.append(f"{json.dumps(head)} args_{i} {json.dumps(chr(125) + chr(10) + TOOL_CALL_END)}")
        schema = json.dumps(closed_schema(tool.get("parameters") or EMPTY_PARAMETERS), ensure_ascii=False)
        rules.append(f"args_{i}: %json {schema}")
    start = "start: call" if one_call else 'start: call ("\\n" call)*'
    return "\n".join([start, "call: " + " | ".join(alternatives), *rules])


_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")


def closed_schema(schema: Any) -> Any:
    """``schema`` with ``additionalProperties: false`` on every object that does not say: a forced
    call then has only the arguments its function declares (a small model otherwise goes on adding
    keys until max_tokens), and still matches the client's schema."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    if (out.get("type") == "object" or "properties" in out) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: closed_schema(sub) for name, sub in out[key].items()}
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [closed_schema(sub) for sub in out[key]]
    if "items" in out:
        out["items"] = closed_schema(out["items"])
    return out


# ------------------------------------------------------------------------------------ parsing


@dataclass(frozen=True)
class ContentDelta:
    text: str


@dataclass(frozen=True)
class CallStart:
    index: int  # of the call in this message
    id: str
    name: str


@dataclass(frozen=True)
class ArgumentsDelta:
    index: int
    text: str


ToolEvent = ContentDelta | CallStart | ArgumentsDelta

_CALL_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')


@dataclass
class _JsonValueEnd:
    """Finds where one JSON object or array ends, char by char (strings and escapes respected)."""

    depth: int = 0
    in_string: bool = False
    escaped: bool = False

    def feed(self, text: str) -> int | None:
        """The length of ``text`` up to and including the value's last char, or None if it goes on."""
        for i, char in enumerate(text):
            if self.in_string:
                self.escaped, self.in_string = (False, True) if self.escaped else (char == "\\", char != '"')
            elif char == '"':
                self.in_string = True
            elif char in "{[":
                self.depth += 1
            elif char in "}]":
                self.depth -= 1
                if self.depth == 0:
                    return i + 1
        return None


@dataclass
class ToolCallParser:
    """Output text in, ``ToolEvent``s out (see the module's docstring). ``tool_names``: the calls
    accepted unconstrained; ``guaranteed``: the output follows ``tool_choice_lark`` (stream the
    arguments); ``max_calls``: blocks past it are dropped (``parallel_tool_calls: false``)."""

    tool_names: frozenset[str]
    guaranteed: bool = False
    max_calls: int | None = None
    num_calls: int = 0
    _pending: str = ""  # content held back: trailing whitespace, and a tail that may start a tag
    _after_call: bool = False  # no content emitted since the last call (its leading whitespace goes)
    _block: str | None = None  # the open block's text; None outside blocks
    _gap: str = ""  # the whitespace before the open block (content again if the block is no call)
    _arguments: _JsonValueEnd | None = None  # guaranteed: the arguments being streamed
    _streamed: int = 0  # guaranteed: how much of the block has been read
    _call_done: bool = False  # guaranteed: this block's arguments have ended
    _bare: _JsonValueEnd | None = None  # the output so far is a JSON value that may be a bare call
    _bare_text: str = ""
    _bare_end: int | None = None  # where that value ended in ``_bare_text``
    _started: bool = False  # some content or a block has been seen: no bare call any more

    def feed(self, text: str) -> list[ToolEvent]:
        events: list[ToolEvent] = []
        while text:
            if self._block is not None:
                text = self._feed_block(text, events)
            elif self._bare is not None:
                text = self._feed_bare(text, events)
            else:
                text = self._feed_content(text, events)
        return events

    def finish(self) -> list[ToolEvent]:
        """The output ended: an unclosed block is read as it stands, held-back text is content."""
        events: list[ToolEvent] = []
        if self._block is not None and not self.guaranteed:
            self._close_block(events, closed=False)
        elif self._bare is not None:
            self._close_bare(events)
        elif self._block is None:
            self._content(self._pending, events)
        self._pending, self._block = "", None
        return events

    @property
    def full(self) -> bool:
        return self.max_calls is not None and self.num_calls >= self.max_calls

    # -- outside blocks -------------------------------------------------------------------------
    def _feed_content(self, text: str, events: list[ToolEvent]) -> str:
        """Consume content up to a block's start tag; returns the text after the tag."""
        pending = self._pending + text
        if not self._started and not self.guaranteed and pending.lstrip()[:1] == "{":
            self._pending, self._bare = "", _JsonValueEnd()
            return pending
        start = pending.find(TOOL_CALL_START)
        if start >= 0:
            self._started = True
            before = pending[:start]
            self._content(before.rstrip(), events)
            self._gap = before[len(before.rstrip()):]
            self._pending, self._block, self._streamed = "", "", 0
            return pending[start + len(TOOL_CALL_START):]
        body = pending[: len(pending) - _tag_prefix_len(pending)]
        emitted = body.rstrip()
        self._content(emitted, events)
        self._pending = pending[len(emitted):]
        return ""

    def _content(self, text: str, events: list[ToolEvent]) -> None:
        text = text.lstrip() if self._after_call else text
        if text:
            events.append(ContentDelta(text))
            self._after_call, self._started = False, True

    # -- a bare call ----------------------------------------------------------------------------
    def _feed_bare(self, text: str, events: list[ToolEvent]) -> str:
        """Hold a leading JSON value until it ends: a call if only whitespace follows it to the end
        of the output; else content, and what follows is read as usual. Returns text to read on."""
        self._bare_text += text
        if self._bare_end is None:
            end = self._bare.feed(text)
            if end is None:
                return ""
            self._bare_end = len(self._bare_text) - len(text) + end
            if self._parse_call(self._bare_text) is not None:
                return ""
        elif not self._bare_text[self._bare_end:].strip():
            return ""
        held, self._bare, self._bare_text, self._bare_end, self._started = self._bare_text, None, "", None, True
        return held

    def _close_bare(self, events: list[ToolEvent]) -> None:
        call = self._parse_call(self._bare_text) if self._bare_end is not None else None
        if call is None:
            self._started, self._bare = True, None
            events += self.feed(self._bare_text) + self.finish()
            return
        events += [CallStart(0, new_call_id(), call[0]), ArgumentsDelta(0, call[1])]
        self.num_calls = 1

    # -- inside a block -------------------------------------------------------------------------
    def _feed_block(self, text: str, events: list[ToolEvent]) -> str:
        """Consume block text up to the end tag; returns the text after the tag."""
        searched = max(0, len(self._block) - len(TOOL_CALL_END))
        self._block += text
        end = self._block.find(TOOL_CALL_END, searched)
        after = self._block[end + len(TOOL_CALL_END):] if end >= 0 else ""
        if end >= 0:
            self._block = self._block[:end]
        if self.guaranteed:
            self._stream_block(events)
        if end < 0:
            return ""
        if not self.guaranteed:
            self._close_block(events, closed=True)
        self._block, self._arguments, self._call_done = None, None, False
        return after

    def _stream_block(self, events: list[ToolEvent]) -> None:
        """Guaranteed output: the call's start once its name is complete, then argument text as it comes."""
        if self.full or self._call_done:
            return
        if self._arguments is None:
            head = _CALL_HEAD.match(self._block)
            if head is None:
                return
            events.append(CallStart(self.num_calls, new_call_id(), json.loads(f'"{head.group(1)}"')))
            self.num_calls += 1
            self._arguments, self._streamed, self._after_call = _JsonValueEnd(), head.end(), True
        new, self._streamed = self._block[self._streamed:], len(self._block)
        if self._arguments.depth == 0:  # the value has not begun
            new = new.lstrip()
        end = self._arguments.feed(new)
        if end is not None:
            new, self._call_done = new[:end], True
        if new:
            events.append(ArgumentsDelta(self.num_calls - 1, new))

    def _close_block(self, events: list[ToolEvent], closed: bool) -> None:
        call = None if self.full else self._parse_call(self._block)
        if call is None and not self.full:
            self._content(self._gap + TOOL_CALL_START + self._block + (TOOL_CALL_END if closed else ""), events)
            return
        if call is not None:
            events += [CallStart(self.num_calls, new_call_id(), call[0]), ArgumentsDelta(self.num_calls, call[1])]
            self.num_calls += 1
        self._after_call = True

    def _parse_call(self, block: str) -> tuple[str, str] | None:
        """(name, arguments as JSON text) when ``block`` is a call of a known tool, else None."""
        try:
            call = json.loads(block)
        except ValueError:
            return None
        if not isinstance(call, dict) or call.get("name") not in self.tool_names:
            return None
        arguments = call.get("arguments", call.get("parameters", {}))
        if not isinstance(arguments, dict):
            return None
        return call["name"], json.dumps(arguments, ensure_ascii=False)


def _tag_prefix_len(text: str) -> int:
    """The length of the longest tail of ``text`` that is a proper prefix of the start tag."""
    for length in range(min(len(text), len(TOOL_CALL_START) - 1), 0, -1):
        if TOOL_CALL_START.startswith(text[-length:]):
            return length
    return 0


@dataclass
class ParsedMessage:
    """A whole output's content and calls (``[(id, name, arguments)]``)."""

    content: str | None
    calls: list[tuple[str, str, str]] = field(default_factory=list)

    @classmethod
    def of(cls, events: list[ToolEvent]) -> "ParsedMessage":
        content, calls = "", []
        for event in events:
            if isinstance(event, ContentDelta):
                content += event.text
            elif isinstance(event, CallStart):
                calls.append([event.id, event.name, ""])
            else:
                calls[event.index][2] += event.text
        return cls(content or None, [tuple(c) for c in calls])
