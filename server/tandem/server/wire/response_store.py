"""Stored responses (``store: true``) for ``GET /v1/responses/{id}`` and
``previous_response_id``: per API key (another key naming the id finds nothing), at most
``capacity`` of them (the least recently used forgotten first), each for ``ttl_seconds``."""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

DEFAULT_CAPACITY = 1024
DEFAULT_TTL_S = 3600.0


@dataclass(frozen=True)
class StoredResponse:
    """The response object as answered, and the conversation it ended (its chat messages,
    its own output included, the instructions not: a later request gives its own)."""

    response: dict[str, Any]
    conversation: list[dict[str, Any]]


class ResponseStore:
    def __init__(
        self, capacity: int = DEFAULT_CAPACITY, ttl_seconds: float = DEFAULT_TTL_S
    ) -> None:
        self.capacity = capacity
        self.ttl = ttl_seconds
        self._items: OrderedDict[tuple[str, str], tuple[StoredResponse, float]] = OrderedDict()

    def put(self, owner: str | None, stored: StoredResponse) -> None:
        key = (owner or "", stored.response["id"])
        self._items[key] = (stored, time.monotonic())
        self._items.move_to_end(key)
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def get(self, owner: str | None, response_id: str) -> StoredResponse | None:
        self._expire()
        found = self._items.get((owner or "", response_id))
        return found[0] if found else None

    def delete(self, owner: str | None, response_id: str) -> bool:
        return self._items.pop((owner or "", response_id), None) is not None

    def _expire(self) -> None:
        cutoff = time.monotonic() - self.ttl
        while self._items and next(iter(self._items.values()))[1] < cutoff:
            self._items.popitem(last=False)
