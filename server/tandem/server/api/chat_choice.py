"""One chat choice's text as OpenAI's message or deltas: thinking split off first
(``reasoning.py``), then tool calls parsed out of the answer (``tool_parsers.py``)."""

from __future__ import annotations

from typing import Any

from .reasoning import ReasoningStream
from .tool_parsers import Parser, ToolCallStream, message_tool_calls


class ChoiceStream:
    def __init__(self, tools: Parser | None, reasoning: bool) -> None:
        self._tools = ToolCallStream(tools) if tools is not None else None
        self._reasoning = ReasoningStream() if reasoning else None
        self._content_sent = 0

    @property
    def incomplete_call(self) -> bool:
        return self._tools is not None and self._tools.incomplete

    def delta(self, text: str, final: bool) -> dict[str, Any]:
        """The delta that brings the client from the last call's text to ``text``."""
        out: dict[str, Any] = {}
        content = text
        if self._reasoning is not None:
            thought, content = self._reasoning.delta(text, final)
            if thought:
                out["reasoning_content"] = thought
        if self._tools is None:
            new = content[self._content_sent :]
            self._content_sent = max(self._content_sent, len(content))
            if new:
                out["content"] = new
            return out
        new, calls = self._tools.delta(content, final)
        if new:
            out["content"] = new
        if calls:
            out["tool_calls"] = calls
        return out

    def finish_reason(self, reason: str | None) -> str | None:
        if reason == "stop" and self._tools is not None and self._tools.called:
            return "tool_calls"
        return reason


def chat_message(
    text: str, reason: str | None, tools: Parser | None, reasoning: bool
) -> tuple[dict[str, Any], str | None]:
    """``(message, finish_reason)`` of a finished choice. A call cut off (``max_tokens``) is
    not a call: the text comes back as content, as the model wrote it."""
    stream = ChoiceStream(tools, reasoning)
    d = stream.delta(text, final=True)
    message: dict[str, Any] = {"role": "assistant", "content": d.get("content")}
    if reasoning:
        message["reasoning_content"] = d.get("reasoning_content")
    calls = d.get("tool_calls")
    if calls and not stream.incomplete_call:
        message["tool_calls"] = message_tool_calls(calls)
        message["content"] = message["content"] or None
        return message, stream.finish_reason(reason)
    if calls:  # incomplete: everything after the thinking is content
        plain = ChoiceStream(None, reasoning).delta(text, final=True)
        message["content"] = plain.get("content", "")
    elif message["content"] is None:
        message["content"] = ""
    return message, reason
