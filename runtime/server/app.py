"""The FastAPI app: OpenAI routes, vLLM-style tokenize/detokenize, health, readiness, metrics.

Bodies are parsed here, not by FastAPI's signature magic, so malformed JSON, unknown fields and
out-of-range values all become OpenAI-style 400s naming the field (see ``errors``), and a body past
``--max-request-bytes`` a 413 (see ``body``). The API key, when set, guards ``/v1/*``,
``/tokenize`` and ``/detokenize``; the probes and ``/metrics`` stay open. Tokenizing and
detokenizing run in worker threads, off the event loop. The outer middleware echoes
``X-Request-Id`` (generating one when absent), counts every error response by status, and turns an
unexpected exception into a bare 500.
"""
from __future__ import annotations

import asyncio
import logging
import secrets
import uuid

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.datastructures import Headers, MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from specdecode.runtime.config import ServerConfig
from specdecode.runtime.server.body import default_max_request_bytes, read_json
from specdecode.runtime.server.errors import (
    CLIENT_CLOSED_REQUEST,
    APIError,
    bad_request,
    install_error_handlers,
    internal_error,
    validate_body,
)
from specdecode.runtime.server.metrics import ServerMetrics
from specdecode.runtime.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
)
from specdecode.runtime.server.serving import OpenAIServing, ServingState

log = logging.getLogger(__name__)
MAX_REQUEST_ID_LEN = 128


class RequestContextMiddleware:
    """X-Request-Id in and out, error responses counted by status (not a client's own disconnect),
    unexpected exceptions → 500."""

    def __init__(self, app: ASGIApp, metrics: ServerMetrics):
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = (Headers(scope=scope).get("x-request-id") or uuid.uuid4().hex)[:MAX_REQUEST_ID_LEN]
        scope.setdefault("state", {})["request_id"] = request_id
        started = False

        async def send_with_id(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                MutableHeaders(scope=message)["X-Request-Id"] = request_id
                if message["status"] >= 400 and message["status"] != CLIENT_CLOSED_REQUEST:
                    self.metrics.record_error(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except Exception:
            log.exception("unhandled error in %s %s (request %s)", scope.get("method"), scope.get("path"), request_id)
            if not started:
                await internal_error().response()(scope, receive, send_with_id)


def build_app(engine, server_cfg: ServerConfig) -> FastAPI:
    """The HTTP face of ``engine`` (an ``AsyncEngine``, started by the caller)."""
    served_name = server_cfg.served_model_name or engine.model_name
    metrics = ServerMetrics(engine.stats)
    state = ServingState()
    serving = OpenAIServing(engine, served_name, metrics, state, server_cfg.engine.cache.block_size)
    max_bytes = server_cfg.max_request_bytes or default_max_request_bytes(engine.max_model_len)

    async def body(request: Request) -> object:
        return await read_json(request, max_bytes)

    app = FastAPI(title="SpecDecode", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.serving = state
    app.state.metrics = metrics
    install_error_handlers(app)
    app.add_middleware(RequestContextMiddleware, metrics=metrics)

    async def require_api_key(request: Request) -> None:
        if server_cfg.api_key is None:
            return
        given = request.headers.get("authorization", "")
        if not secrets.compare_digest(given.encode(), f"Bearer {server_cfg.api_key}".encode()):
            raise APIError(401, "Incorrect API key provided.", code="invalid_api_key")

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(require_api_key)])
    tokens = APIRouter(dependencies=[Depends(require_api_key)])

    @v1.get("/models")
    async def models() -> dict:
        card = ModelCard(id=served_name, root=engine.model_name, max_model_len=engine.max_model_len)
        return ModelList(data=[card]).model_dump()

    @v1.post("/completions")
    async def completions(request: Request) -> Response:
        req = validate_body(CompletionRequest, await body(request))
        return await serving.generate(req, request)

    @v1.post("/chat/completions")
    async def chat_completions(request: Request) -> Response:
        req = validate_body(ChatCompletionRequest, await body(request))
        return await serving.generate(req, request)

    def tokenized(req: TokenizeChatRequest | TokenizeCompletionRequest) -> TokenizeResponse:
        if isinstance(req, TokenizeChatRequest):
            ids = serving.chat_prompt_ids([m.for_template() for m in req.messages], req.add_generation_prompt,
                                          [t.for_template() for t in req.tools] or None)
        else:
            ids = engine.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        strs = [engine.tokenizer.id_to_token(i) for i in ids] if req.return_token_strs else None
        return TokenizeResponse(count=len(ids), max_model_len=engine.max_model_len, tokens=ids, token_strs=strs)

    def detokenized(req: DetokenizeRequest) -> DetokenizeResponse:
        vocab = engine.tokenizer.vocab_size
        if any(t >= vocab for t in req.tokens):
            raise bad_request(f"tokens: token ids must be in [0, {vocab})", "tokens")
        return DetokenizeResponse(prompt=engine.tokenizer.decode(req.tokens))

    @tokens.post("/tokenize")
    async def tokenize(request: Request) -> dict:
        raw = await body(request)
        is_chat = isinstance(raw, dict) and "messages" in raw
        req = validate_body(TokenizeChatRequest if is_chat else TokenizeCompletionRequest, raw)
        serving.check_model(req.model)
        return (await asyncio.to_thread(tokenized, req)).model_dump()

    @tokens.post("/detokenize")
    async def detokenize(request: Request) -> dict:
        req = validate_body(DetokenizeRequest, await body(request))
        serving.check_model(req.model)
        return (await asyncio.to_thread(detokenized, req)).model_dump()

    app.include_router(v1)
    app.include_router(tokens)

    @app.get("/health")
    async def health() -> JSONResponse:
        return JSONResponse({}, status_code=503 if engine.dead else 200)

    @app.get("/ready")
    async def ready() -> JSONResponse:
        is_ready = bool(engine.ready) and not state.draining and not engine.dead
        status = "ready" if is_ready else ("dead" if engine.dead else "draining" if state.draining else "loading")
        return JSONResponse({"status": status}, status_code=200 if is_ready else 503)

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app
