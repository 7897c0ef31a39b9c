"""Completions and chat completions: request → prompt ids + SamplingParams → engine → response.

Errors the engine raises before its first output (queue full, invalid request) become proper HTTP
errors; a stream therefore starts (status 200) with the first output in hand. A client that goes
away — while waiting, mid-stream, or before a non-streaming answer — closes the engine's
generator, which aborts the request and frees its KV blocks. Requests still running when a drain's
deadline passes are cut (the engine raises ``DrainDeadlinePassed`` to each), and so are those in
flight when a parallel group loses a rank (``EngineDead``, saying which): a stream ends with an
error event and ``[DONE]``, a non-streaming request gets a 503.

Tokenizing a prompt runs in a worker thread (the tokenizer releases the GIL), so a huge prompt
never stalls the event loop, other streams or ``/health``. Response ids are the server's own; the
client's ``X-Request-Id`` names the request in the logs only.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import jinja2
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from specdecode.runtime.engine.async_engine import EngineDead, EngineOverloaded
from specdecode.runtime.engine.grammar import StructuredOutput
from specdecode.runtime.engine.sequence import (
    CompletionDelta,
    FinishReason,
    RequestOutput,
    SamplingParams,
    TokenLogprob,
)
from specdecode.runtime.server.errors import (
    CLIENT_CLOSED_REQUEST,
    APIError,
    bad_request,
    internal_error,
    overloaded,
)
from specdecode.runtime.server.logprobs import CompletionLogprobBuilder, Echo, TokenTexts
from specdecode.runtime.server.metrics import RequestTimer, ServerMetrics
from specdecode.runtime.server.protocol import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatResponseMessage,
    ChatStreamChoice,
    CompletionChoice,
    CompletionChunk,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamChoice,
    ConflictingConstraints,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    PromptTokensDetails,
    SpeculativeUsage,
    ToolCall,
    UsageInfo,
)
from specdecode.runtime.server.tools import (
    ArgumentsDelta,
    CallStart,
    ContentDelta,
    ParsedMessage,
    ToolCallParser,
    ToolEvent,
    prompt_messages,
)

log = logging.getLogger(__name__)
T = TypeVar("T")


class ClientGone(Exception):
    """The client disconnected before its answer was ready."""


class DrainDeadlinePassed(Exception):
    """The drain's deadline passed with this request still running: the server cut it."""

    def __init__(self) -> None:
        super().__init__("the server shut down before this request finished")


@dataclass
class ServingState:
    """Drain and load bookkeeping shared with the uvicorn runner."""

    draining: bool = False
    inflight: int = 0


@dataclass
class _Choice:
    text: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    prompt_logprobs: list[TokenLogprob] | None = None  # when echo asked for them


@dataclass
class _Run:
    """One generation request in flight: its engine stream, timeline and accumulated choices."""

    chat: bool  # a chat completion (else a text completion)
    response_id: str
    request_id: str  # the client's X-Request-Id (or one made up for it): for the logs
    model: str
    n: int
    stream: AsyncIterator[RequestOutput]
    first: RequestOutput
    timer: RequestTimer
    created: int = field(default_factory=lambda: int(time.time()))
    choices: dict[int, _Choice] = field(default_factory=dict)
    last: RequestOutput | None = None
    prompt_ids: list[int] = field(default_factory=list)
    echo_text: str | None = None  # the prompt a completion with ``echo`` returns before its text
    echoed: set[int] = field(default_factory=set)  # the choices whose stream has had the echo
    new_tool_parser: Callable[[], ToolCallParser | None] = lambda: None
    tool_parsers: dict[int, ToolCallParser | None] = field(default_factory=dict)  # per streamed choice

    def tool_parser(self, index: int) -> ToolCallParser | None:
        if index not in self.tool_parsers:
            self.tool_parsers[index] = self.new_tool_parser()
        return self.tool_parsers[index]

    def observe(self, out: RequestOutput) -> None:
        self.timer.on_output(out)
        self.last = out
        for d in out.deltas:
            choice = self.choices.setdefault(d.index, _Choice())
            choice.text.append(d.text)
            choice.logprobs.extend(d.logprobs)
            if d.prompt_logprobs is not None:
                choice.prompt_logprobs = d.prompt_logprobs
            if d.finish_reason is not None:
                choice.finish_reason, choice.stop_reason = d.finish_reason, d.stop_reason

    def echo(self, prompt_logprobs: list[TokenLogprob] | None) -> Echo | None:
        """The echoed prompt's logprob entries, when echo asked for them."""
        return Echo(self.prompt_ids, prompt_logprobs) if prompt_logprobs is not None else None

    def take_echo_text(self, index: int) -> str:
        """The echoed prompt text for choice ``index``'s first stream chunk; "" after it."""
        if self.echo_text is None or index in self.echoed:
            return ""
        self.echoed.add(index)
        return self.echo_text

    def finish_reasons(self) -> list[str]:
        """One per choice; a choice that never finished was aborted."""
        return [
            (c.finish_reason or FinishReason.ABORT).value
            for c in (self.choices.get(i, _Choice()) for i in range(self.n))
        ]

    def usage(self) -> UsageInfo:
        out = self.last or self.first
        return UsageInfo(
            prompt_tokens=out.num_prompt_tokens,
            completion_tokens=out.num_output_tokens,
            total_tokens=out.num_prompt_tokens + out.num_output_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=out.num_cached_tokens),
            speculative=SpeculativeUsage(
                num_drafts=out.spec.num_drafts,
                num_draft_tokens=out.spec.num_draft_tokens,
                num_accepted_tokens=out.spec.num_accepted_tokens,
                acceptance_rate=out.spec.num_accepted_tokens / out.spec.num_draft_tokens if out.spec.num_draft_tokens else None,
                accepted_per_position=out.spec.accepted_per_position,
            ),
        )


async def _next(stream: AsyncIterator[T]) -> T:
    return await anext(stream)


class _SSEResponse(StreamingResponse):
    """Closes its body iterator however the stream ends, so the engine request is always released."""

    def __init__(self, content: AsyncIterator[str]):
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


def _sse(payload: Any) -> str:
    return f"data: {payload}\n\n"


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _unless_disconnected(work: Awaitable[T], request: Request) -> T:
    """Await ``work``; if the client disconnects first, cancel it and raise ``ClientGone``."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
            await asyncio.wait({task})
    if task.cancelled():
        raise ClientGone()
    return task.result()


class OpenAIServing:
    def __init__(self, engine, served_model_name: str, metrics: ServerMetrics, state: ServingState, block_size: int):
        self.engine = engine
        self.served_model_name = served_model_name
        self.metrics = metrics
        self.state = state
        self.block_size = block_size
        self.texts = TokenTexts(engine.tokenizer)

    # -- request → engine inputs ----------------------------------------------------------------
    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.served_model_name:
            raise APIError(404, f"The model `{name}` does not exist.", param="model", code="model_not_found")

    def chat_prompt_ids(self, messages: list[dict[str, Any]], add_generation_prompt: bool,
                        tools: list[dict[str, Any]] | None = None) -> list[int]:
        tokenizer = self.engine.tokenizer
        messages, tools = prompt_messages(messages, tools, tokenizer.chat_template_renders_tools)
        try:
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tools=tools)
        except (ValueError, jinja2.TemplateError) as exc:
            raise bad_request(f"could not apply the chat template: {exc}", "messages") from None
        return self.engine.tokenizer.encode(text, add_special_tokens=False)

    def _prompt_ids(self, req: CompletionRequest | ChatCompletionRequest) -> list[int]:
        if isinstance(req, ChatCompletionRequest):
            return self.chat_prompt_ids(req.template_messages(), req.add_generation_prompt, req.template_tools())
        if isinstance(req.prompt, str):
            ids = self.engine.tokenizer.encode(req.prompt, add_special_tokens=True)
        else:
            vocab = self.engine.tokenizer.vocab_size
            if any(t >= vocab for t in req.prompt):
                raise bad_request(f"prompt: token ids must be in [0, {vocab})", "prompt")
            ids = list(req.prompt)
        if not ids:
            raise bad_request("prompt: the prompt is empty", "prompt")
        return ids

    def _max_tokens(self, req: CompletionRequest | ChatCompletionRequest, prompt_len: int) -> int:
        """The request's max_tokens, or what is left of the context (and of the KV pool)."""
        max_len = self.engine.max_model_len
        what = "messages" if isinstance(req, ChatCompletionRequest) else "prompt"
        requested = req.requested_max_tokens
        if requested == 0 and not (isinstance(req, CompletionRequest) and req.echo):
            raise bad_request("max_tokens: 0 (the prompt alone) is only allowed with echo", "max_tokens")
        if prompt_len >= max_len:
            raise bad_request(
                f"This model's maximum context length is {max_len} tokens. However, your {what} resulted in "
                f"{prompt_len} tokens. Please reduce the length of the {what}.", what, "context_length_exceeded")
        if requested is not None and prompt_len + requested > max_len:
            name = "max_completion_tokens" if getattr(req, "max_completion_tokens", None) else "max_tokens"
            raise bad_request(
                f"This model's maximum context length is {max_len} tokens. However, you requested "
                f"{prompt_len + requested} tokens ({prompt_len} in the {what}, {requested} in the completion). "
                f"Please reduce the length of the {what} or {name}.", name, "context_length_exceeded")
        if requested is not None:
            return requested
        pool_tokens = self.engine.stats().num_total_blocks * self.block_size
        return max(1, min(max_len, pool_tokens) - prompt_len)

    async def _engine_inputs(self, req: CompletionRequest | ChatCompletionRequest) -> tuple[list[int], SamplingParams]:
        """Prompt ids (tokenized in a worker thread), the output's constraint (compiled in a worker
        thread) and sampling parameters."""
        prompt_ids = await asyncio.to_thread(self._prompt_ids, req)
        self._check_logit_bias(req)
        structured = await self._structured_output(req)
        try:
            return prompt_ids, req.sampling_params(self._max_tokens(req, len(prompt_ids)), structured)
        except ValueError as exc:  # SamplingParams re-checks ranges the protocol already enforces
            raise bad_request(str(exc)) from None

    async def _structured_output(self, req: CompletionRequest | ChatCompletionRequest) -> StructuredOutput | None:
        """The request's constraint, compiled (and kept by the engine) off the event loop; 400s name the field."""
        try:
            found = req.structured_output()
        except ConflictingConstraints as exc:
            raise bad_request(str(exc), exc.fields[0]) from None
        if found is None:
            return None
        structured, field_name = found
        for name in ("ignore_eos", "stop", "stop_token_ids"):
            if getattr(req, name):
                raise bad_request(f"{name} cannot be combined with {field_name}: the output ends where its "
                                  "grammar is complete (finish_reason 'stop' means it is valid)", name)
        try:
            await asyncio.to_thread(self.engine.grammars.compile, structured)
        except ValueError as exc:
            raise bad_request(f"{field_name}: {exc}", field_name) from None
        return structured

    def _check_logit_bias(self, req: CompletionRequest | ChatCompletionRequest) -> None:
        vocab = self.engine.tokenizer.vocab_size
        outside = [token_id for token_id in req.logit_bias if token_id >= vocab]
        if outside:
            raise bad_request(f"logit_bias: token id {outside[0]} is not in the vocabulary [0, {vocab})", "logit_bias")

    async def _echo_text(self, req: CompletionRequest | ChatCompletionRequest, prompt_ids: list[int]) -> str | None:
        """The prompt a completion with ``echo`` returns: as sent, or decoded from its token ids
        (special tokens kept, so the text matches the echoed tokens) in a worker thread."""
        if not isinstance(req, CompletionRequest) or not req.echo:
            return None
        if isinstance(req.prompt, str):
            return req.prompt
        return await asyncio.to_thread(self.engine.tokenizer.decode, prompt_ids, False)

    def _check_serving(self) -> None:
        if self.state.draining:
            raise self._overloaded("the server is shutting down")
        if not self.engine.ready:
            raise self._overloaded("the model is still loading")

    def _overloaded(self, message: str) -> APIError:
        """503, with a Retry-After of how long the waiting queue takes to drain at the recent pace."""
        return overloaded(message, self.engine.expected_wait_s())

    # -- run ------------------------------------------------------------------------------------
    async def generate(self, req: CompletionRequest | ChatCompletionRequest, request: Request) -> Response:
        """Answer a (chat) completion request: JSON, or an SSE stream when ``req.stream``."""
        self._check_serving()
        self.check_model(req.model)
        self.state.inflight += 1  # from here: a drain waits for this request, tokenizing included
        handed_off = False
        try:
            prompt_ids, params = await self._engine_inputs(req)
            echo_text = await self._echo_text(req, prompt_ids)
            chat = isinstance(req, ChatCompletionRequest)
            response_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
            timer = RequestTimer()
            stream = self.engine.generate(response_id, prompt_ids, params)
            try:
                first = await _unless_disconnected(_next(stream), request)
            except ClientGone:
                self.metrics.record_finished(timer, [FinishReason.ABORT.value] * req.n)
                return Response(status_code=CLIENT_CLOSED_REQUEST)
            except (EngineOverloaded, EngineDead, DrainDeadlinePassed) as exc:
                raise self._overloaded(str(exc)) from None
            except ValueError as exc:  # the engine refused the request (its message is for the user)
                raise bad_request(str(exc)) from None
            run = _Run(chat, response_id, request.state.request_id, self.served_model_name, req.n, stream, first,
                       timer, prompt_ids=prompt_ids, echo_text=echo_text)
            if chat:
                run.new_tool_parser = req.tool_call_parser
            if req.stream:
                handed_off = True
                return _SSEResponse(self._stream(run, req))
            return await self._complete(run, req, request)
        finally:
            if not handed_off:
                self.state.inflight -= 1

    async def _complete(self, run: _Run, req, request: Request) -> Response:
        try:
            await _unless_disconnected(self._drain(run), request)
        except ClientGone:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        except (DrainDeadlinePassed, EngineDead) as exc:  # cut by the drain, or the group lost a rank
            raise self._overloaded(str(exc)) from None
        finally:
            await run.stream.aclose()
            self.metrics.record_finished(run.timer, run.finish_reasons())
        body = self._chat_response(run, req) if run.chat else self._completion_response(run, req)
        return JSONResponse(body.model_dump(mode="json"))

    async def _drain(self, run: _Run) -> None:
        out = run.first
        run.observe(out)
        while not out.finished:
            out = await anext(run.stream)
            run.observe(out)

    async def _stream(self, run: _Run, req) -> AsyncIterator[str]:
        builders = [CompletionLogprobBuilder(self.texts) for _ in range(run.n)]
        try:
            if run.chat:
                for i in range(run.n):
                    role = ChatStreamChoice(index=i, delta=DeltaMessage(role="assistant", content=""))
                    yield self._chat_chunk(run, req, [role])
            out = run.first
            while True:
                run.observe(out)
                for delta in out.deltas:
                    if delta.text or delta.finish_reason or delta.logprobs or delta.prompt_logprobs:
                        chunk = self._stream_chunk(run, req, delta, builders)
                        if chunk is not None:
                            yield chunk
                if out.finished:
                    break
                out = await anext(run.stream)
            if req.include_usage:
                chunk_type = ChatCompletionChunk if run.chat else CompletionChunk
                chunk = chunk_type(id=run.response_id, created=run.created, model=run.model, choices=[],
                                   usage=run.usage())
                yield _sse(chunk.model_dump_json())
            yield _sse("[DONE]")
        except (DrainDeadlinePassed, EngineDead) as exc:  # headers are sent: say so in the stream, then end it
            log.warning("request %s (%s) cut: %s", run.request_id, run.response_id, exc)
            self.metrics.record_error(503)
            yield _sse(json.dumps(self._overloaded(str(exc)).body()))
            yield _sse("[DONE]")
        except Exception:  # headers are sent: report the failure in the stream, not as a status
            log.exception("request %s (%s) failed mid-stream", run.request_id, run.response_id)
            self.metrics.record_error(500)
            yield _sse(json.dumps(internal_error().body()))
        finally:
            await run.stream.aclose()
            self.metrics.record_finished(run.timer, run.finish_reasons())
            self.state.inflight -= 1

    def _stream_chunk(self, run: _Run, req, delta: CompletionDelta,
                      builders: list[CompletionLogprobBuilder]) -> str | None:
        if run.chat:
            choice = self._chat_stream_choice(run, delta, req)
            return self._chat_chunk(run, req, [choice]) if choice is not None else None
        return self._completion_chunk(run, req, [self._completion_stream_choice(run, delta, req, builders)])

    # -- response shapes ----------------------------------------------------------------------
    def _chat_logprobs(self, logprobs: list[TokenLogprob], req) -> ChatLogprobs | None:
        return ChatLogprobs(content=self.texts.chat(logprobs)) if req.logprobs else None

    def _chat_response(self, run: _Run, req: ChatCompletionRequest) -> ChatCompletionResponse:
        choices = []
        for i, c in sorted(run.choices.items()):
            message, parser = ChatResponseMessage(content="".join(c.text)), req.tool_call_parser()
            if parser is not None:
                parsed = ParsedMessage.of(parser.feed(message.content) + parser.finish())
                message = ChatResponseMessage(content=parsed.content, tool_calls=[
                    ToolCall(id=call_id, function=FunctionCall(name=name, arguments=arguments))
                    for call_id, name, arguments in parsed.calls])
            choices.append(ChatChoice(
                index=i,
                message=message,
                logprobs=self._chat_logprobs(c.logprobs, req),
                finish_reason=_chat_finish_reason(c.finish_reason, parser),
                stop_reason=c.stop_reason,
            ))
        return ChatCompletionResponse(id=run.response_id, created=run.created, model=run.model, choices=choices,
                                      usage=run.usage())

    def _completion_response(self, run: _Run, req: CompletionRequest) -> CompletionResponse:
        choices = [
            CompletionChoice(
                index=i,
                text=(run.echo_text or "") + "".join(c.text),
                logprobs=(CompletionLogprobBuilder(self.texts).build(c.logprobs, run.echo(c.prompt_logprobs))
                          if req.logprobs is not None else None),
                finish_reason=c.finish_reason.value if c.finish_reason else None,
                stop_reason=c.stop_reason,
            )
            for i, c in sorted(run.choices.items())
        ]
        return CompletionResponse(id=run.response_id, created=run.created, model=run.model, choices=choices,
                                  usage=run.usage())

    def _chat_stream_choice(self, run: _Run, delta: CompletionDelta,
                            req: ChatCompletionRequest) -> ChatStreamChoice | None:
        """The choice's chunk; None when it carries nothing (text held back by the tool-call parser)."""
        message, parser = DeltaMessage(content=delta.text), run.tool_parser(delta.index)
        if parser is not None:
            events = parser.feed(delta.text) + (parser.finish() if delta.finish_reason else [])
            message = _tool_delta(events)
            if message.content is None and message.tool_calls is None and not delta.logprobs and not delta.finish_reason:
                return None
        return ChatStreamChoice(
            index=delta.index,
            delta=message,
            logprobs=self._chat_logprobs(delta.logprobs, req),
            finish_reason=_chat_finish_reason(delta.finish_reason, parser),
            stop_reason=delta.stop_reason,
        )

    def _completion_stream_choice(self, run: _Run, delta: CompletionDelta, req: CompletionRequest,
                                  builders: list[CompletionLogprobBuilder]) -> CompletionStreamChoice:
        builder = builders[delta.index]
        logprobs = builder.build(delta.logprobs, run.echo(delta.prompt_logprobs)) if req.logprobs is not None else None
        return CompletionStreamChoice(
            index=delta.index,
            text=run.take_echo_text(delta.index) + delta.text,
            logprobs=logprobs,
            finish_reason=delta.finish_reason.value if delta.finish_reason else None,
            stop_reason=delta.stop_reason,
        )

    def _chat_chunk(self, run: _Run, req, choices: list[ChatStreamChoice]) -> str:
        chunk = ChatCompletionChunk(id=run.response_id, created=run.created, model=run.model, choices=choices)
        return _sse(chunk.model_dump_json(exclude=None if req.include_usage else {"usage"}))

    def _completion_chunk(self, run: _Run, req, choices: list[CompletionStreamChoice]) -> str:
        chunk = CompletionChunk(id=run.response_id, created=run.created, model=run.model, choices=choices)
        return _sse(chunk.model_dump_json(exclude=None if req.include_usage else {"usage"}))


def _chat_finish_reason(reason: FinishReason | None, parser: ToolCallParser | None) -> str | None:
    """``tool_calls`` for an answer that ended by itself after calling tools."""
    if reason is FinishReason.STOP and parser is not None and parser.num_calls:
        return "tool_calls"
    return reason.value if reason else None


def _tool_delta(events: list[ToolEvent]) -> DeltaMessage:
    """Parser events as one delta: content, then calls (a call's first entry has its id and name)."""
    content, calls = "", []
    for event in events:
        if isinstance(event, ContentDelta):
            content += event.text
        elif isinstance(event, CallStart):
            calls.append(DeltaToolCall(index=event.index, id=event.id, type="function",
                                       function=DeltaFunctionCall(name=event.name, arguments="")))
        elif isinstance(event, ArgumentsDelta) and calls and calls[-1].index == event.index:
            calls[-1].function.arguments += event.text
        else:
            calls.append(DeltaToolCall(index=event.index, function=DeltaFunctionCall(arguments=event.text)))
    return DeltaMessage(content=content or None, tool_calls=calls or None)
