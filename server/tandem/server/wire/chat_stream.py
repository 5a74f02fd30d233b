"""A chat completion's stream read as another API's events: the one loop the Responses and
Messages streams (``responses_stream``, ``messages_stream``) run their translators under."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Protocol

from .sse import close


class EventTranslator(Protocol):
    """One API's events for one answer: its opening, each choice-0 delta, its end (the
    finish reason, the stop string matched, the usage) or an in-band failure."""

    def start(self) -> list[bytes]: ...

    def delta(self, delta: dict[str, Any]) -> list[bytes]: ...

    def end(
        self, finish_reason: str | None, matched: Any, chat_usage: dict[str, Any] | None
    ) -> list[bytes]: ...

    def fail(self, error: dict[str, Any]) -> list[bytes]: ...


async def translated(
    stream: EventTranslator, chunks: AsyncIterator[dict[str, Any]]
) -> AsyncIterator[bytes]:
    """The whole event stream of one answer over the chat chunks of its run (choice 0)."""
    for event in stream.start():
        yield event
    reason, matched, chat_usage = None, None, None
    try:
        async for chunk in chunks:
            if "error" in chunk:
                error = chunk["error"] if isinstance(chunk["error"], dict) else {}
                for event in stream.fail(error):
                    yield event
                return
            chat_usage = chunk.get("usage") or chat_usage
            for choice in chunk.get("choices") or []:
                if choice.get("index", 0) != 0:
                    continue
                for event in stream.delta(choice.get("delta") or {}):
                    yield event
                reason = choice.get("finish_reason") or reason
                matched = choice.get("stop_reason", matched)
    finally:  # the client left: the chat run under it ends now (its request aborted)
        await close(chunks)
    for event in stream.end(reason, matched, chat_usage):
        yield event
