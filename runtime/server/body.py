"""Reading a request body: a size limit enforced while reading, then JSON, then valid Unicode.

A body over the limit is refused with 413 from its ``Content-Length`` before a byte is read, or,
sent in chunks, as soon as the bytes counted pass the limit: a client never makes the server
buffer more than the limit. Everything ``json.loads`` can raise on hostile input is a 400 naming
what is wrong — an integer past Python's int-string limit (ValueError), nesting deeper than the
parser's recursion limit (RecursionError) — and so is a string holding a lone UTF-16 surrogate
(``"\\ud800"`` is valid JSON but not Unicode text: the tokenizer cannot take it).
"""
from __future__ import annotations

import json
import re
from collections.abc import Iterator

from fastapi import Request
from starlette.requests import ClientDisconnect

from specdecode.runtime.server.errors import CLIENT_CLOSED_REQUEST, APIError, bad_request

MIN_MAX_REQUEST_BYTES = 1 << 20
# A token of JSON text takes a few bytes, up to ~20 escaped (``\\u00e9`` per character) or as a
# token id with its separator; 64 leaves room for chat framing and the other fields.
REQUEST_BYTES_PER_TOKEN = 64
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
_SURROGATE = re.compile("[\ud800-\udfff]")


def default_max_request_bytes(max_model_len: int) -> int:
    """Room for a prompt that fills the context, and never less than 1 MiB."""
    return max(MIN_MAX_REQUEST_BYTES, REQUEST_BYTES_PER_TOKEN * max_model_len)


def too_large(limit: int) -> APIError:
    return APIError(413, f"The request body is larger than this server accepts ({limit} bytes).",
                    code="request_too_large")


async def read_body(request: Request, limit: int) -> bytes:
    """The body, refused (413) once it is known to pass ``limit`` bytes."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_large(limit)
    chunks: list[bytes] = []
    size = 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_large(limit)
            chunks.append(chunk)
    except ClientDisconnect:
        raise APIError(CLIENT_CLOSED_REQUEST, "the client disconnected while sending its request") from None
    return b"".join(chunks)


async def read_json(request: Request, limit: int) -> object:
    """The body as JSON: 413 past ``limit``, 400 for anything that is not JSON of valid text."""
    body = await read_body(request, limit)
    try:
        value = json.loads(body)
    except RecursionError:
        raise bad_request("The JSON body of your request is nested too deeply.", code="invalid_json") from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, an integer past the int-string limit
        raise bad_request(
            f"We could not parse the JSON body of your request ({exc}). The body must be a JSON object.",
            code="invalid_json",
        ) from None
    if _SURROGATE_ESCAPE.search(body):  # only escapes can make one: the UTF-8 decode refuses encoded ones
        _refuse_lone_surrogates(value)
    return value


def _refuse_lone_surrogates(value: object) -> None:
    for path, text in _strings(value):
        if _SURROGATE.search(text):
            raise bad_request(f"{path or 'body'}: the string contains a lone UTF-16 surrogate, which is not "
                              "valid Unicode text", path or None, "invalid_unicode")


def _strings(value: object) -> Iterator[tuple[str, str]]:
    """Every string in a decoded JSON value (keys too) with its path (``messages[0].content``);
    walked without recursion, since the value may nest as deep as the parser allowed."""
    stack: list[tuple[str, object]] = [("", value)]
    while stack:
        path, item = stack.pop()
        if isinstance(item, str):
            yield path, item
        elif isinstance(item, list):
            stack.extend((f"{path}[{i}]", v) for i, v in enumerate(item))
        elif isinstance(item, dict):
            for key, v in item.items():
                shown = key.encode("utf-8", "backslashreplace").decode()  # the path goes into the error
                child = f"{path}.{shown}" if path else shown
                yield child, key
                stack.append((child, v))
