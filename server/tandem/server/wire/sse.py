"""Wire framing for streams: Server-Sent Events (OpenAI, LMDeploy) and NDJSON (Ollama)."""

from __future__ import annotations

import json
from typing import Any

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
