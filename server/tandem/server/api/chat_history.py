"""Server-side conversation history for chat sessions, so a client may send only its new turn.

ZedInfer's sessions take just the new message and remember the rest; OpenAI clients resend
the whole conversation. Both work: messages that begin with the stored conversation are
the whole conversation; anything else is the next turn(s), appended to it. Either way the
rendered prompt extends the previous one, which is what lets the engine's session reuse
its KV blocks and prefill only the new tokens.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Any

from tandem.server.engine.sessions import MAX_SESSIONS

Message = dict[str, Any]


class ChatHistories:
    """Per session, its conversation so far; at most ``capacity`` of them (the least
    recently used is forgotten first, as the engine forgets its session), each for ``ttl``."""

    def __init__(self, ttl_seconds: float | None, capacity: int = MAX_SESSIONS) -> None:
        self.ttl = ttl_seconds
        self.capacity = capacity
        self._history: OrderedDict[str, tuple[list[Message], float]] = OrderedDict()

    def resolve(self, session_id: str, messages: list[Message]) -> list[Message]:
        self._expire()
        stored = self._history.get(session_id, ([], 0.0))[0]
        if not stored or messages[: len(stored)] == stored:
            return messages
        return stored + messages

    def record(self, session_id: str, conversation: list[Message], reply: str) -> None:
        self._history[session_id] = (
            conversation + [{"role": "assistant", "content": reply}],
            time.monotonic(),
        )
        self._history.move_to_end(session_id)
        while len(self._history) > self.capacity:
            self._history.popitem(last=False)

    def drop(self, session_id: str) -> bool:
        return self._history.pop(session_id, None) is not None

    def _expire(self) -> None:
        if not self.ttl:
            return
        cutoff = time.monotonic() - self.ttl
        for sid in [sid for sid, (_, used) in self._history.items() if used < cutoff]:
            del self._history[sid]
