"""Reading a request body: refused early and cheaply where it can be.

In order: the Content-Type (415), the size from ``Content-Length`` before a byte is read,
then while reading (413), UTF-8, JSON, the nesting depth, lone surrogates in any string
(400). The API key is checked before any of this (a route dependency), so an
unauthenticated client never gets its body parsed. Each refusal names what was wrong.
"""

from __future__ import annotations

import json
from typing import Any

from starlette.requests import Request

from pagedattn.serve.cli import DEFAULT_MAX_REQUEST_BYTES
from pagedattn.serve.protocol import APIError

# A refusal sent before the body is read closes the connection: the client may still be
# sending megabytes, and a kept-alive connection would have to read them all to find the
# next request.
UNREAD_BODY = {"Connection": "close"}

__all__ = ["DEFAULT_MAX_REQUEST_BYTES", "check_content_type", "parse_json", "read_body"]

MAX_JSON_DEPTH = 64
"""Nesting of arrays and objects allowed in a body; the deepest OpenAI field (a content
part in a message) sits at depth 4."""

_JSON_TYPES = ("application/json",)


def check_content_type(request: Request) -> None:
    """A body without a Content-Type is read as JSON (as FastAPI does); one that says it
    is something else is refused."""
    value = request.headers.get("content-type")
    if value is None:
        return
    media = value.split(";", 1)[0].strip().lower()
    if media in _JSON_TYPES or (media.startswith("application/") and media.endswith("+json")):
        return
    raise APIError(415, f"Content-Type must be application/json, got {value!r:.80}",
                   code="unsupported_media_type", headers=UNREAD_BODY)


def _too_large(limit: int, size: str) -> APIError:
    return APIError(413, f"the request body is {size}, over this server's limit of {limit} "
                         "bytes (--max-request-bytes)", code="request_too_large",
                    headers=UNREAD_BODY)


async def read_body(request: Request, limit: int) -> bytes:
    """The raw body, refused with 413 once it is known to exceed ``limit`` bytes: from
    ``Content-Length`` before reading, or while reading a chunked one."""
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            n = int(declared)
        except ValueError:
            raise APIError(400, f"Content-Length is not a number: {declared!r:.40}") from None
        if n > limit:
            raise _too_large(limit, f"{n} bytes")
    chunks, total = [], 0
    async for chunk in request.stream():
        total += len(chunk)
        if total > limit:
            raise _too_large(limit, f"more than {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _check_tree(value: Any) -> None:
    """Depth and lone surrogates, walked without recursion (the body may be deep)."""
    stack: list[tuple[Any, int, str]] = [(value, 1, "body")]
    while stack:
        node, depth, path = stack.pop()
        if isinstance(node, str):
            _check_string(node, path)
            continue
        if not isinstance(node, (dict, list)):
            continue
        if depth > MAX_JSON_DEPTH:
            raise APIError(400, f"the request body nests arrays and objects more than "
                                f"{MAX_JSON_DEPTH} deep (at {path})", code="body_too_deep")
        if isinstance(node, dict):
            for key, child in node.items():
                _check_string(key, f"{path} key")
                stack.append((child, depth + 1, key if path == "body" else f"{path}.{key}"))
        else:
            stack.extend((child, depth + 1, f"{path}[{i}]") for i, child in enumerate(node))


def _check_string(text: str, path: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise APIError(400, f"{path}: the text holds a lone surrogate "
                            f"(U+{ord(text[exc.start]):04X}) at character {exc.start}; "
                            "send valid Unicode", param=None if path == "body" else path,
                       code="invalid_unicode") from None


def parse_json(raw: bytes) -> Any:
    """The body's JSON value, checked; 400 naming the problem otherwise."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise APIError(400, f"the request body is not valid UTF-8: byte 0x{raw[exc.start]:02x} "
                            f"at offset {exc.start}", code="invalid_utf8") from None
    if not text.strip():
        raise APIError(400, "the request body is empty; send a JSON object")
    try:
        value = json.loads(text, parse_constant=_refuse_constant)
    except RecursionError:
        raise APIError(400, f"the request body nests arrays and objects more than "
                            f"{MAX_JSON_DEPTH} deep", code="body_too_deep") from None
    except ValueError as exc:  # JSONDecodeError, NaN/Infinity, ints over 4300 digits
        raise APIError(400, f"the request body is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise APIError(400, f"the request body must be a JSON object, got "
                            f"{type(value).__name__}")
    _check_tree(value)
    return value
