"""The HTTP edge shared by the engine and the proxy: request ids, the body-size limit, CORS.

Pure ASGI middleware (no ``BaseHTTPMiddleware``), so streamed responses and the routes' own
client-disconnect watching pass through untouched.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import time
import uuid
from dataclasses import dataclass

from fastapi import FastAPI, Request
from starlette.exceptions import HTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tandem.server.logsafe import escape_controls

from .anthropic_errors import AnthropicErrors

log = logging.getLogger("tandem.http")

DEFAULT_MAX_BODY_BYTES = 32 * 1024 * 1024
DEFAULT_MAX_TOKENS = 512
REQUEST_ID_HEADER = "x-request-id"
# A client's id is used as is when it is short and printable; anything else gets a fresh one.
_VALID_ID = re.compile(r"[A-Za-z0-9._:@/+=-]{1,128}")


@dataclass(frozen=True)
class EdgeSettings:
    """``--max-body-bytes`` and ``--allowed-origins``, the same flags on engine and proxy."""

    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    allowed_origins: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.max_body_bytes <= 0:
            raise ValueError("max_body_bytes must be > 0")


def add_edge_arguments(parser: argparse.ArgumentParser) -> None:
    """The edge flags, shared by ``tandem serve`` and ``tandem proxy`` so they never drift."""
    parser.add_argument(
        "--max-body-bytes",
        type=int,
        default=DEFAULT_MAX_BODY_BYTES,
        help="refuse a request body over this many bytes with 413 (default 32 MiB)",
    )
    parser.add_argument(
        "--allowed-origins",
        nargs="*",
        default=[],
        help="origins browsers may call from (CORS); none by default (CORS off), '*' for any",
    )
    parser.add_argument(
        "--default-max-tokens",
        type=int,
        default=DEFAULT_MAX_TOKENS,
        help="max_tokens for a request that sets none (default 512, the ZedInfer seed's; "
        "0: up to the end of the context)",
    )


def edge_from_args(args: argparse.Namespace) -> EdgeSettings:
    return EdgeSettings(args.max_body_bytes, tuple(args.allowed_origins))


def install_edge(app: FastAPI, settings: EdgeSettings) -> None:
    """Outermost first: request id (so every answer, 413 included, carries one), the
    Messages routes' errors in Anthropic's shape, then the body limit, then CORS (off
    unless origins are given)."""
    if settings.allowed_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(settings.allowed_origins),
            allow_methods=["*"],
            allow_headers=["*"],
            expose_headers=["X-Request-Id"],
        )
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_body_bytes)
    app.add_middleware(AnthropicErrors)
    app.add_middleware(RequestIdMiddleware)


def request_id(request: Request) -> str:
    """This request's id: the client's ``X-Request-Id`` when it gave a usable one."""
    return request.scope.get("state", {}).get("request_id") or uuid.uuid4().hex


def request_id_header(request: Request) -> dict[str, str]:
    """The header that carries this request's id on to an engine."""
    return {"X-Request-Id": request_id(request)}


class RequestIdMiddleware:
    """Honour ``X-Request-Id`` (or make one), echo it on the response and log one line per request."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = next(
            (v.decode("latin-1") for k, v in scope["headers"] if k == REQUEST_ID_HEADER.encode()),
            "",
        )
        rid = given if _VALID_ID.fullmatch(given) else uuid.uuid4().hex
        edge = scope.setdefault("state", {})
        edge["request_id"], edge["request_id_given"] = rid, rid == given
        started = time.monotonic()
        status = 0

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                headers = [(k, v) for k, v in message.get("headers", []) if k != b"x-request-id"]
                message = {**message, "headers": [*headers, (b"x-request-id", rid.encode())]}
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            log.info(
                "%s %s %d request_id=%s %.1fms",
                escape_controls(scope["method"]),
                escape_controls(scope["path"]),
                status,
                rid,
                (time.monotonic() - started) * 1e3,
            )


class _TooLarge(HTTPException):
    """Raised from ``receive`` mid-body; an HTTPException so the app's handler answers 413."""

    def __init__(self, max_bytes: int) -> None:
        super().__init__(413, f"the request body is larger than {max_bytes} bytes")


class BodyLimitMiddleware:
    """413 for a body over ``max_bytes``: at once from ``Content-Length``, else while reading."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = next((v for k, v in scope["headers"] if k == b"content-length"), None)
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            await self._refuse(send)
            return
        seen = 0
        started = False

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise _TooLarge(self.max_bytes)
            return message

        async def watch(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted, watch)
        except _TooLarge:
            if not started:
                await self._refuse(send)

    async def _refuse(self, send: Send) -> None:
        body = json.dumps(
            {
                "error": {
                    "message": f"the request body is larger than {self.max_bytes} bytes",
                    "type": "invalid_request_error",
                    "code": "request_too_large",
                    "param": None,
                }
            }
        ).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"connection", b"close"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})
