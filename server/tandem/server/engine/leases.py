"""Blocks a prefill engine keeps for a decode engine to pull, until released or expired.

The engine thread grants and sweeps; the transport thread looks blocks up and asks for
releases, which take effect on the engine thread's next sweep (the pool is not thread-safe).
"""

from __future__ import annotations

import threading
import time
import uuid
from dataclasses import dataclass

from .block_pool import BlockPool


@dataclass
class _Lease:
    block_ids: list[int]
    expires_at: float


class LeaseStore:
    def __init__(self, pool: BlockPool, ttl_seconds: float) -> None:
        self.pool = pool
        self.ttl = ttl_seconds
        self._lock = threading.Lock()
        self._leases: dict[str, _Lease] = {}
        self._release_asked: set[str] = set()
        self.num_expired = 0

    def __len__(self) -> int:
        with self._lock:
            return len(self._leases)

    def grant(self, block_ids: list[int]) -> str:
        lease_id = uuid.uuid4().hex
        with self._lock:
            self._leases[lease_id] = _Lease(list(block_ids), time.monotonic() + self.ttl)
        return lease_id

    def blocks(self, lease_id: str) -> list[int] | None:
        with self._lock:
            lease = self._leases.get(lease_id)
            return (
                None if lease is None or lease_id in self._release_asked else list(lease.block_ids)
            )

    def ask_release(self, lease_id: str) -> bool:
        """Any thread: the blocks go back to the pool at the engine's next sweep."""
        with self._lock:
            if lease_id not in self._leases:
                return False
            self._release_asked.add(lease_id)
            return True

    def next_expiry(self) -> float | None:
        """When the soonest lease expires (``time.monotonic``), None without leases: the
        server loop's idle wait ends then, so an idle engine frees the blocks on time."""
        with self._lock:
            return min((lease.expires_at for lease in self._leases.values()), default=None)

    def sweep(self, now: float | None = None) -> int:
        """Engine thread: free released and expired leases; returns how many ended."""
        now = time.monotonic() if now is None else now
        with self._lock:
            ended = [
                lid
                for lid, lease in self._leases.items()
                if lid in self._release_asked or lease.expires_at <= now
            ]
            self.num_expired += sum(1 for lid in ended if lid not in self._release_asked)
            freed = [self._leases.pop(lid).block_ids for lid in ended]
            self._release_asked.difference_update(ended)
        for block_ids in freed:
            self.pool.free(block_ids)
        return len(ended)

    def clear(self) -> None:
        self.sweep(now=float("inf"))
