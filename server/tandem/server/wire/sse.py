"""Wire framing for streams: Server-Sent Events (OpenAI, LMDeploy; typed events for the
Responses and Messages APIs) and NDJSON (Ollama), and the streaming response that notices
a client leaving."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import anyio
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

DONE = b"data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def sse_event(payload: dict[str, Any]) -> bytes:
    """One ``data:`` event; compact JSON with non-ASCII kept as is (as OpenAI does)."""
    return (
        b"data: "
        + json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode()
        + b"\n\n"
    )


def error_event(body: dict[str, Any]) -> bytes:
    """An error in the OpenAI shape as the stream's last event, then ``[DONE]``: the tokens
    already sent cannot be unsent, and the ``openai`` client raises on this event."""
    return sse_event(body) + DONE


def ndjson_line(payload: dict[str, Any]) -> bytes:
    return json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode() + b"\n"


def typed_event(kind: str, payload: dict[str, Any]) -> bytes:
    """One event with its type named (``event: <kind>``): the Responses and Messages APIs'
    framing, whose SDKs dispatch on it."""
    return f"event: {kind}\n".encode() + sse_event(payload)


async def sse_payloads(stream: AsyncIterator[bytes]) -> AsyncIterator[dict[str, Any]]:
    """The JSON ``data:`` payloads of an event stream (``[DONE]`` ends it), however its bytes
    were split: how the Responses and Messages routes read a chat completion's stream."""
    buffer = b""
    try:
        async for piece in stream:
            buffer += piece if isinstance(piece, bytes) else piece.encode()
            *events, buffer = buffer.split(b"\n\n")
            for event in events:
                for line in event.split(b"\n"):
                    if not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        return
                    yield json.loads(data)
    finally:  # a reader that stops early closes the stream it reads, at once
        await close(stream)


class DisconnectAwareStreamingResponse(StreamingResponse):
    """A StreamingResponse that always watches for the client leaving, whatever ASGI spec
    version the server reports, so the stream it relays is closed (and the engine aborts)
    at once rather than at the next chunk: the proxy's relayed streams, and the Responses
    and Messages streams on both servers."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as tg:

                async def stream() -> None:
                    with contextlib.suppress(OSError):
                        await self.stream_response(send)
                    tg.cancel_scope.cancel()

                tg.start_soon(stream)
                await self.listen_for_disconnect(receive)
                tg.cancel_scope.cancel()
        finally:  # now, not when a garbage collection finds it: its finally aborts upstream
            with anyio.CancelScope(shield=True):
                await close(self.body_iterator)


async def close(stream: Any) -> None:
    """Close an async generator left suspended (a stream its reader stopped reading)."""
    aclose = getattr(stream, "aclose", None)
    if aclose is not None:
        await aclose()
