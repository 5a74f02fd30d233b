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


def ndjson_line(payload: dict[str, Any]) -> bytes:
    return json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode() + b"\n"
