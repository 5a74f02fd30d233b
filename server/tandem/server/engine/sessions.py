"""Sessions: a conversation's KV blocks stay with it between turns.

When a turn finishes, its blocks move into the session instead of back to the pool. The
next turn takes them over as far as its prompt agrees with the tokens they hold, so only
the new tokens are prefilled. A block is rewritten only when nobody else holds it.

Sessions are a cache, not a reservation: idle sessions together hold at most ``max_blocks``,
and ``reclaim`` takes blocks back from the least recently used idle sessions whenever a
request finds the pool short. A session that lost its blocks stays a session; its next
turn recomputes (or finds its blocks still in the prefix cache).

The sessions themselves are bounded too: beyond ``max_sessions`` the least recently used idle
one is forgotten as if it had expired, so a client opening a new session per request cannot
grow the store for a whole TTL.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from .kv_cache_manager import KVCacheManager
from .prefix_cache import chain_hashes
from .request import Request
from .sampling_params import InvalidParamError

# Conversations an engine (and the API's chat histories) remember at once.
MAX_SESSIONS = 4096


@dataclass
class Session:
    session_id: str
    token_ids: list[int] = field(default_factory=list)  # tokens whose K/V the blocks hold
    block_ids: list[int] = field(default_factory=list)
    busy: bool = False
    last_used: float = field(default_factory=time.monotonic)


class SessionStore:
    def __init__(
        self, kv: KVCacheManager, max_blocks: int, max_sessions: int = MAX_SESSIONS
    ) -> None:
        self.kv = kv
        self.max_blocks = max_blocks
        self.max_sessions = max_sessions
        self.held_blocks = 0  # blocks idle sessions hold
        self._sessions: OrderedDict[str, Session] = OrderedDict()  # least recently used first

    def __len__(self) -> int:
        return len(self._sessions)

    def __contains__(self, session_id: str) -> bool:
        return session_id in self._sessions

    def attach(self, session_id: str, req: Request) -> None:
        """Give ``req`` the session's blocks for the prefix it shares; free the rest."""
        if session_id not in self._sessions:
            self._forget_idle(len(self._sessions) + 1 - self.max_sessions)
        s = self._sessions.setdefault(session_id, Session(session_id))
        self._sessions.move_to_end(session_id)
        s.busy = True
        s.last_used = time.monotonic()
        self.held_blocks -= len(s.block_ids)
        bs = self.kv.block_size
        common = _common_prefix(s.token_ids, req.prompt_token_ids, limit=req.num_prompt_tokens - 1)
        keep = -(-common // bs)
        if common % bs and self.kv.pool.ref_count(s.block_ids[keep - 1]) > 1:
            keep -= 1  # the partly matching block is shared: recompute it rather than overwrite it
            common = keep * bs
        if common % bs and self.kv.prefix_cache is not None:
            self.kv.prefix_cache.evict(s.block_ids[keep - 1])  # its tail is about to change
        self.kv.pool.free(s.block_ids[keep:])
        req.block_ids = s.block_ids[:keep]
        req.block_hashes = chain_hashes(
            req.prompt_token_ids[: (common // bs) * bs], bs, root=req.cache_root
        )
        req.num_computed_tokens = common
        req.num_cached_tokens = common
        s.token_ids, s.block_ids = [], []

    def detach(self, session_id: str, req: Request, keep_blocks: bool) -> None:
        """Take the finished request's blocks into the session; an aborted turn ends the session."""
        s = self._sessions.get(session_id)
        if s is None:
            self.kv.free(req)
            return
        if keep_blocks:
            s.token_ids = req.token_slice(0, req.num_computed_tokens)
            s.block_ids = req.block_ids
            req.block_ids, req.block_hashes = [], []
        else:
            self.kv.free(req)  # an aborted turn: the session's history went with it
            del self._sessions[session_id]
            return
        s.busy = False
        s.last_used = time.monotonic()
        self._sessions.move_to_end(session_id)
        self.held_blocks += len(s.block_ids)
        if self.held_blocks > self.max_blocks:
            self._evict(lambda: self.held_blocks <= self.max_blocks)

    def _forget_idle(self, count: int) -> None:
        """Forget the ``count`` least recently used idle sessions (blocks and all)."""
        oldest = [sid for sid, s in self._sessions.items() if not s.busy][: max(count, 0)]
        for sid in oldest:
            self.delete(sid)

    def reclaim(self, num_blocks: int) -> None:
        """Give blocks back until the pool has ``num_blocks`` free (or no idle session has any)."""
        self._evict(lambda: self.kv.pool.num_free >= num_blocks)

    def _evict(self, enough: Callable[[], bool]) -> None:
        for s in list(self._sessions.values()):
            if enough():
                return
            if not s.busy and s.block_ids:
                self._drop_blocks(s)

    def _drop_blocks(self, s: Session) -> None:
        self.held_blocks -= len(s.block_ids)
        self.kv.pool.free(s.block_ids)
        s.token_ids, s.block_ids = [], []

    def check_can_attach(self, session_id: str, n: int) -> None:
        """A session runs one sequence at a time: ``n > 1`` or a second request is a 400."""
        if n != 1:
            raise InvalidParamError("n", "a request in a session takes n=1")
        if self.is_busy(session_id):
            raise InvalidParamError(
                "session_id", f"session {session_id!r} already has a request in flight"
            )

    def is_busy(self, session_id: str) -> bool:
        s = self._sessions.get(session_id)
        return s is not None and s.busy

    def delete(self, session_id: str) -> bool:
        s = self._sessions.get(session_id)
        if s is None:
            return False
        if s.block_ids:
            self._drop_blocks(s)
        del self._sessions[session_id]
        return True

    def expire(self, idle_seconds: float) -> int:
        cutoff = time.monotonic() - idle_seconds
        stale = [sid for sid, s in self._sessions.items() if not s.busy and s.last_used < cutoff]
        for sid in stale:
            self.delete(sid)
        return len(stale)

    def clear(self) -> None:
        for sid in [sid for sid, s in self._sessions.items() if not s.busy]:
            self.delete(sid)


def _common_prefix(a: list[int], b: list[int], limit: int) -> int:
    n = min(len(a), len(b), limit)
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
