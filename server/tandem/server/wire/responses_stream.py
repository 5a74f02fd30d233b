"""A streamed chat completion as the Responses API's typed events, in the order the ``openai``
SDK's ``responses.stream`` expects: ``response.created``, ``response.in_progress``, per output
item ``output_item.added`` .. its deltas .. ``output_item.done``, then ``response.completed``
(``response.incomplete`` when cut at ``max_output_tokens``, ``response.failed`` on an error),
each with its ``sequence_number``."""

from __future__ import annotations

import copy
from typing import Any

from .responses_api import Item, call_item, finish, message_item, reasoning_item, usage
from .sse import typed_event


class ResponsesStream:
    """One response's events, from the chat chunks that make it."""

    def __init__(self, response: dict[str, Any]) -> None:
        self.response = response  # the in-progress envelope; its output fills as items close
        self._seq = 0
        self._open: Item | None = None
        self._text = ""  # the open item's text (message, reasoning) or arguments

    def event(self, kind: str, **fields: Any) -> bytes:
        payload = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return typed_event(kind, payload)

    def start(self) -> list[bytes]:
        snapshot = copy.deepcopy(self.response)
        return [
            self.event("response.created", response=snapshot),
            self.event("response.in_progress", response=snapshot),
        ]

    def _index(self) -> int:
        return len(self.response["output"])

    def _ids(self) -> dict[str, Any]:
        assert self._open is not None
        return {"item_id": self._open["id"], "output_index": self._index()}

    def _begin(self, item: Item) -> list[bytes]:
        events = self.close()
        self._open, self._text = item, ""
        events.append(
            self.event("response.output_item.added", output_index=self._index(), item=item)
        )
        if item["type"] == "message":
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            events.append(
                self.event("response.content_part.added", **self._ids(), content_index=0, part=part)
            )
        return events

    def close(self) -> list[bytes]:
        """Finish the open item (if any): its ``done`` events, and it joins the output."""
        item, text = self._open, self._text
        if item is None:
            return []
        ids, events = self._ids(), []
        if item["type"] == "message":
            done = message_item(text)
            done["id"] = item["id"]
            part = done["content"][0]
            events.append(
                self.event(
                    "response.output_text.done", **ids, content_index=0, text=text, logprobs=[]
                )
            )
            events.append(
                self.event("response.content_part.done", **ids, content_index=0, part=part)
            )
        elif item["type"] == "reasoning":
            done = {**reasoning_item(text), "id": item["id"]}
            events.append(
                self.event("response.reasoning_text.done", **ids, content_index=0, text=text)
            )
        else:
            done = {**item, "arguments": text, "status": "completed"}
            events.append(
                self.event(
                    "response.function_call_arguments.done",
                    **ids,
                    name=item["name"],
                    arguments=text,
                )
            )
        events.append(
            self.event("response.output_item.done", output_index=ids["output_index"], item=done)
        )
        self.response["output"].append(done)
        self._open = None
        return events

    def _append(self, kind: str, delta: str, **extra: Any) -> list[bytes]:
        self._text += delta
        return [self.event(kind, **self._ids(), delta=delta, **extra)]

    def delta(self, delta: dict[str, Any]) -> list[bytes]:
        """The events of one chat delta (thinking, content, tool calls)."""
        events: list[bytes] = []
        if thought := delta.get("reasoning_content"):
            if self._open is None or self._open["type"] != "reasoning":
                events += self._begin({**reasoning_item(""), "content": []})
            events += self._append("response.reasoning_text.delta", thought, content_index=0)
        if text := delta.get("content"):
            if self._open is None or self._open["type"] != "message":
                events += self._begin(message_item("", status="in_progress"))
            events += self._append("response.output_text.delta", text, content_index=0, logprobs=[])
        for call in delta.get("tool_calls") or []:
            fn = call.get("function") or {}
            if call.get("id"):
                events += self._begin(
                    call_item(call["id"], fn.get("name") or "", "", "in_progress")
                )
            if fn.get("arguments") and self._open is not None:
                events += self._append("response.function_call_arguments.delta", fn["arguments"])
        return events

    def end(
        self, finish_reason: str | None, matched: Any, chat_usage: dict[str, Any] | None
    ) -> list[bytes]:
        """The closing events (a stop string matched is a plain ``completed`` here)."""
        events = self.close()
        if not self.response["output"]:
            events += self._begin(message_item("", status="in_progress")) + self.close()
        finish(self.response, finish_reason)
        self.response["usage"] = usage(chat_usage)
        kind = (
            "response.incomplete"
            if self.response["status"] == "incomplete"
            else "response.completed"
        )
        return events + [self.event(kind, response=self.response)]

    def fail(self, error: dict[str, Any]) -> list[bytes]:
        self._open = None
        self.response.update(
            status="failed",
            error={
                "code": error.get("code") or "server_error",
                "message": error.get("message", ""),
            },
        )
        return [self.event("response.failed", response=self.response)]
