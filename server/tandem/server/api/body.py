"""JSON request bodies admitted at the edge, by engine and proxy alike.

Python's ``json`` accepts what JSON does not (``NaN``, ``Infinity``), decodes ``"\\ud800"``
into a string no encoder can write back, and recurses once per nesting level. Each of these
surfaced as a 500 somewhere downstream (a tokenizer, a re-encoding, a ``RecursionError``);
here they are a 400 before any route sees the body. A body of another media type is a 415.
"""

from __future__ import annotations

import json
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .errors import APIError, send_error

MAX_DEPTH = 64  # JSON schemas and tool parameters nest a dozen levels; nothing real nests 64


def _no_constant(name: str) -> Any:
    raise APIError(400, f"{name} is not a JSON number", code="invalid_json")


def parse_json(raw: bytes) -> Any:
    """The body's JSON value, or an APIError (400) saying what is wrong with it."""
    try:
        value = json.loads(raw, parse_constant=_no_constant)
    except RecursionError:
        raise APIError(400, "the request body nests too deeply", code="invalid_json") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise APIError(
            400, f"the request body is not valid JSON: {exc}", code="invalid_json"
        ) from None
    _check(value)
    return value


def _check(value: Any) -> None:
    """Nesting within MAX_DEPTH and every string encodable as UTF-8 (no lone surrogates)."""
    stack = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, str):
            _check_text(v)
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
                if content_type and not is_json_type(content_type):
                    raise APIError(
                        415,
                        f"the request body must be application/json, not {content_type}",
                        code="unsupported_media_type",
                    )
                parse_json(raw)
            except APIError as err:
                await send_error(send, err)
                return
        await self.app(scope, _replay([{"type": "http.request", "body": raw}], receive), send)


def _replay(messages: list[Message], receive: Receive) -> Receive:
    async def replay() -> Message:
        return messages.pop(0) if messages else await receive()

    return replay
