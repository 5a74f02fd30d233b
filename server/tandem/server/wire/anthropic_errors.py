"""Errors on the Messages routes in Anthropic's shape. Every error a server answers (the
credential check, the body limit, validation, the route, the engine) is written in OpenAI's
shape first; this middleware, outermost but for the request id, rewrites the ones on
``/v1/messages*`` so the ``anthropic`` SDK raises its typed errors, with the same status."""

from __future__ import annotations

import json
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .messages_api import MESSAGES_PATH, error_body


def anthropic_body(openai_body: bytes, status: int) -> bytes:
    """An OpenAI error body as Anthropic's (anything else: a message naming the status)."""
    try:
        error: Any = json.loads(openai_body).get("error")
    except (ValueError, AttributeError):
        error = None
    message = error.get("message") if isinstance(error, dict) else None
    return json.dumps(error_body(status, message or f"HTTP {status}")).encode()


class AnthropicErrors:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(MESSAGES_PATH):
            await self.app(scope, receive, send)
            return
        start: Message | None = None
        body = b""

        async def rewrite(message: Message) -> None:
            nonlocal start, body
            if message["type"] == "http.response.start" and message["status"] >= 400:
                start = message
                return
            if start is None:
                await send(message)
                return
            body += message.get("body", b"")
            if message.get("more_body"):
                return
            new = anthropic_body(body, start["status"])
            headers = [(k, v) for k, v in start.get("headers", []) if k != b"content-length"]
            headers.append((b"content-length", str(len(new)).encode()))
            await send({**start, "headers": headers})
            await send({"type": "http.response.body", "body": new})

        await self.app(scope, receive, rewrite)
