"""A streamed chat completion as Anthropic's event sequence: ``message_start``, ``ping``, per
content block ``content_block_start`` / ``content_block_delta`` (``text_delta``,
``input_json_delta``, ``thinking_delta``) / ``content_block_stop``, then ``message_delta``
(stop reason, usage) and ``message_stop``; an error mid-stream is an ``error`` event."""

from __future__ import annotations

from typing import Any

from .messages_api import envelope, error_body, stop_reason, usage
from .sse import typed_event


class MessagesStream:
    """One message's events, from the chat chunks that make it."""

    def __init__(self, message_id: str, model: str) -> None:
        self.message_id, self.model = message_id, model
        self._index = -1  # the open block's index
        self._open: str | None = None  # its type

    @staticmethod
    def event(kind: str, **fields: Any) -> bytes:
        return typed_event(kind, {"type": kind, **fields})

    def start(self) -> list[bytes]:
        return [
            self.event("message_start", message=envelope(self.message_id, self.model)),
            self.event("ping"),
        ]

    def _begin(self, block: dict[str, Any]) -> list[bytes]:
        events = self.close()
        self._index += 1
        self._open = block["type"]
        return events + [self.event("content_block_start", index=self._index, content_block=block)]

    def close(self) -> list[bytes]:
        if self._open is None:
            return []
        self._open = None
        return [self.event("content_block_stop", index=self._index)]

    def _delta(self, delta: dict[str, Any]) -> bytes:
        return self.event("content_block_delta", index=self._index, delta=delta)

    def delta(self, delta: dict[str, Any]) -> list[bytes]:
        events: list[bytes] = []
        if thought := delta.get("reasoning_content"):
            if self._open != "thinking":
                events += self._begin({"type": "thinking", "thinking": "", "signature": ""})
            events.append(self._delta({"type": "thinking_delta", "thinking": thought}))
        if text := delta.get("content"):
            if self._open != "text":
                events += self._begin({"type": "text", "text": ""})
            events.append(self._delta({"type": "text_delta", "text": text}))
        for call in delta.get("tool_calls") or []:
            fn = call.get("function") or {}
            if call.get("id"):
                block = {
                    "type": "tool_use",
                    "id": call["id"],
                    "name": fn.get("name") or "",
                    "input": {},
                }
                events += self._begin(block)
            if fn.get("arguments") and self._open == "tool_use":
                events.append(
                    self._delta({"type": "input_json_delta", "partial_json": fn["arguments"]})
                )
        return events

    def end(
        self, finish_reason: str | None, matched: Any, chat_usage: dict[str, Any] | None
    ) -> list[bytes]:
        reason, sequence = stop_reason(finish_reason, matched)
        return self.close() + [
            self.event(
                "message_delta",
                delta={"stop_reason": reason, "stop_sequence": sequence},
                usage=usage(chat_usage),
            ),
            self.event("message_stop"),
        ]

    def fail(self, error: dict[str, Any]) -> list[bytes]:
        body = error_body(500, str(error.get("message", "error")))
        return [typed_event("error", body)]
