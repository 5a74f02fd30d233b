"""JSON request bodies admitted at the edge, by engine and proxy alike, parsed once.

Python's ``json`` accepts what JSON does not (``NaN``, ``Infinity``), decodes ``"\\ud800"``
into a string no encoder can write back, and recurses once per nesting level. Each of these
surfaced as a 500 somewhere downstream (a tokenizer, a re-encoding, a ``RecursionError``);
here they are a 400 before any route sees the body. A body of another media type is a 415,
except on Ollama's routes (``/api/*``), which read any body as JSON as Ollama does: ``curl -d``
sends ``application/x-www-form-urlencoded`` and some clients send no Content-Type at all.

The guard parses with pydantic-core, which refuses all three and releases the GIL: a large
body is parsed on a worker thread so ``/health`` and every stream on the event loop keep
going (``json.loads`` holds the GIL for ~0.1 s on 20 MB). The parsed value rides in the ASGI
scope, and ``ParsedJSONRoute`` hands it to FastAPI, so no body is parsed twice.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Coroutine
from typing import Any

import anyio.to_thread
import pydantic_core
from fastapi import Request, Response
from fastapi.routing import APIRoute
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .errors import APIError, send_error

MAX_DEPTH = 64  # JSON schemas and tool parameters nest a dozen levels; nothing real nests 64
# Bodies up to this size are parsed on the event loop (a thread hop costs more than parsing).
_INLINE_BYTES = 64 * 1024
_SCOPE_KEY = "tandem.json_body"
OLLAMA_PREFIX = "/api/"  # Ollama's routes: any body is JSON, whatever its Content-Type


def _from_json(raw: bytes) -> Any:
    return pydantic_core.from_json(raw, allow_inf_nan=False)


async def parse_json(raw: bytes) -> Any:
    """The body's JSON value, or an APIError (400) saying what is wrong with it."""
    try:
        if len(raw) <= _INLINE_BYTES:
            value = _from_json(raw)
        else:
            value = await anyio.to_thread.run_sync(_from_json, raw)
    except ValueError as exc:
        raise APIError(
            400, f"the request body is not valid JSON: {exc}", code="invalid_json"
        ) from None
    _check(value)
    return value


def parsed_body(request: Request) -> Any:
    """The value ``JSONBodyGuard`` parsed for this request (None for an empty body)."""
    return request.scope.get(_SCOPE_KEY)


def _check(value: Any) -> None:
    """Nesting within MAX_DEPTH, every string encodable as UTF-8 (no lone surrogates) and
    every number finite: JSON's ``1e999`` parses as infinity, which no encoder writes back
    (the proxy re-encodes bodies for the engines)."""
    stack = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, str):
            _check_text(v)
        elif isinstance(v, float) and not math.isfinite(v):
            raise APIError(400, "a number in the request body is out of range", code="invalid_json")
        elif isinstance(v, dict | list):
            if depth > MAX_DEPTH:
                raise APIError(
                    400, f"the request body nests deeper than {MAX_DEPTH}", code="invalid_json"
                )
            items = v.items() if isinstance(v, dict) else enumerate(v)
            for k, item in items:
                if isinstance(k, str):
                    _check_text(k)
                stack.append((item, depth + 1))


def _check_text(s: str) -> None:
    if not s.isascii():
        try:
            s.encode("utf-8")
        except UnicodeEncodeError:
            raise APIError(
                400, "the request body holds a lone UTF-16 surrogate", code="invalid_unicode"
            ) from None


def is_json_type(content_type: str) -> bool:
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or (
        media.startswith("application/") and media.endswith("+json")
    )


class JSONBodyGuard:
    """Pure ASGI: reads a request's body once, refuses what ``parse_json`` refuses, and replays
    it unchanged to the app (streaming responses and disconnect detection untouched)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH", "DELETE"):
            await self.app(scope, receive, send)
            return
        chunks, more = [], True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                await self.app(scope, _replay([message], receive), send)
                return
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        raw = b"".join(chunks)
        if raw:
            headers = dict(scope.get("headers") or ())
            content_type = headers.get(b"content-type", b"").decode("latin-1")
            try:
                if not is_json_type(content_type) and scope["path"].startswith(OLLAMA_PREFIX):
                    scope["headers"] = _as_json(scope.get("headers") or ())
                elif not is_json_type(content_type):
                    raise APIError(
                        415,
                        "the request body must be sent with Content-Type: application/json"
                        + (f", not {content_type}" if content_type else ""),
                        code="unsupported_media_type",
                    )
                scope[_SCOPE_KEY] = await parse_json(raw)
            except APIError as err:
                await send_error(send, err)
                return
        await self.app(scope, _replay([{"type": "http.request", "body": raw}], receive), send)


def _as_json(headers: Any) -> list[tuple[bytes, bytes]]:
    """The request's headers with its Content-Type made ``application/json``."""
    kept = [(k, v) for k, v in headers if k.lower() != b"content-type"]
    return [*kept, (b"content-type", b"application/json")]


def _replay(messages: list[Message], receive: Receive) -> Receive:
    async def replay() -> Message:
        return messages.pop(0) if messages else await receive()

    return replay


class _ParsedJSONRequest(Request):
    async def json(self) -> Any:
        return parsed_body(self)


class ParsedJSONRoute(APIRoute):
    """The route class of every router that takes a JSON body: FastAPI reads the body through
    ``Request.json``, which this answers with the guard's parsed value."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def route(request: Request) -> Response:
            return await handler(_ParsedJSONRequest(request.scope, request.receive))

        return route
