"""OpenAI-style errors: ``{"error": {"message", "type", "param", "code"}}``.

Handlers raise ``APIError``; the handlers installed here turn it, pydantic validation errors and
Starlette's own HTTP errors (unknown route, wrong method) into that body. Unexpected exceptions
become a bare 500 (``internal_error``) in the app's outer middleware: no traceback ever leaves
the server.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from specdecode.runtime.server.protocol import UnsupportedField

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
          405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
          503: "service_unavailable_error"}
_UNION_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}
CLIENT_CLOSED_REQUEST = 499  # nginx's status for a client that left; nobody receives it
# A 503's Retry-After, in seconds: never "at once" (a full server is hammered), never so long that a
# client gives up on a server that is only briefly full.
MIN_RETRY_AFTER_S = 1
MAX_RETRY_AFTER_S = 60


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict:
        kind = _TYPES.get(self.status, "server_error" if self.status >= 500 else "invalid_request_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None, code: str = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)


def internal_error() -> APIError:
    return APIError(500, "The server had an error while processing your request.", code="internal_error")


def overloaded(message: str, expected_wait_s: float) -> APIError:
    """503 with a Retry-After of the expected wait, in whole seconds, clamped to
    [``MIN_RETRY_AFTER_S``, ``MAX_RETRY_AFTER_S``]."""
    retry_after_s = min(MAX_RETRY_AFTER_S, max(MIN_RETRY_AFTER_S, math.ceil(expected_wait_s)))
    return APIError(503, message, code="overloaded", headers={"Retry-After": str(retry_after_s)})


def param_from_loc(loc: Sequence[str | int]) -> str | None:
    """``('messages', 0, 'content', 'str')`` → ``messages[0].content`` (pydantic's union tags dropped)."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part.isidentifier() and part not in _UNION_TAGS and part != "body":
            out += f".{part}" if out else part
    return out or None


def from_validation_error(errors: list[dict]) -> APIError:
    """The first error names the field; the message lists them all."""
    messages = []
    for err in errors:
        param = param_from_loc(err["loc"])
        if err["type"] == "extra_forbidden":
            text = f"Unrecognized request argument supplied: {param}"
        else:
            text = f"{param}: {err['msg']}" if param else err["msg"]
        messages.append(text.replace("Value error, ", ""))
    first = errors[0]
    code = "unknown_parameter" if first["type"] == "extra_forbidden" else "invalid_value"
    return bad_request("; ".join(dict.fromkeys(messages)), param_from_loc(first["loc"]), code)


def from_unsupported(exc: UnsupportedField) -> APIError:
    return bad_request(str(exc), exc.field, "unsupported_parameter")


def validate_body(model: type, raw: object):
    """``model.parse(raw)`` with its failures as 400 ``APIError``s naming the field."""
    try:
        return model.parse(raw)
    except UnsupportedField as exc:
        raise from_unsupported(exc) from None
    except ValidationError as exc:
        raise from_validation_error(exc.errors()) from None


def install_error_handlers(app: FastAPI) -> None:
    async def on_api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    async def on_request_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return from_validation_error(list(exc.errors())).response()

    async def on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else HTTPStatus(exc.status_code).phrase
        return APIError(exc.status_code, message, headers=dict(exc.headers or {})).response()

    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(RequestValidationError, on_request_validation)
    app.add_exception_handler(StarletteHTTPException, on_http_error)
