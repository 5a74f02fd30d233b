"""Sessions: a conversation's KV blocks stay with it between turns.

When a turn finishes, its blocks move into the session instead of back to the pool. The
next turn takes them over as far as its prompt agrees with the tokens they hold, so only
the new tokens are prefilled. A block is rewritten only when nobody else holds it.

Sessions are a cache, not a reservation: idle sessions together hold at most ``max_blocks``,
and ``reclaim`` takes blocks back from the least recently used idle sessions whenever a
request finds the pool short. A session that lost its blocks stays a session; its next
turn recomputes (or finds its blocks still in the prefix cache).

The sessions themselves are bounded too, per key and in all: a key (the ``owner:`` prefix the
API scopes every id with, ``tenancy.session_key``) past ``max_per_key`` forgets its own least
recently used idle session, and a store past ``max_sessions`` forgets one of the key that
opened the new session if it has any idle, else one of the key holding the most. So a client
opening a session per request cannot grow the store for a whole TTL, nor push another key's
sessions out; when idle sessions hold more than ``max_blocks``, the key that just finished a
turn gives its own sessions' blocks back first.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from .kv_cache_manager import KVCacheManager
from .prefix_cache import ROOT_HASH, chain_hashes
from .request import Request
from .sampling_params import InvalidParamError

# Conversations an engine (and the API's chat histories) remember at once; one key's share.
MAX_SESSIONS = 4096
MAX_SESSIONS_PER_KEY = 1024


def session_owner(session_id: str) -> str:
    """The key a session belongs to: the ``owner:`` prefix of a scoped id, "" for unscoped
    ids (no credential configured: one tenant)."""
    owner, sep, _ = session_id.partition(":")
    return owner if sep else ""


@dataclass
class Session:
    session_id: str
    owner: str = ""
    token_ids: list[int] = field(default_factory=list)  # tokens whose K/V the blocks hold
    block_ids: list[int] = field(default_factory=list)
    cache_root: int = ROOT_HASH  # the partition (tenant, salt, adapter) the blocks were made in
    busy: bool = False
    last_used: float = 0.0  # on the store's clock


class SessionStore:
    def __init__(
        self,
        kv: KVCacheManager,
        max_blocks: int,
        max_sessions: int = MAX_SESSIONS,
        max_per_key: int = MAX_SESSIONS_PER_KEY,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.kv = kv
        self._clock = clock  # idle time and LRU order; a test passes its own
        self.max_blocks = max_blocks
        self.max_sessions = max_sessions
        self.max_per_key = max_per_key
        self.held_blocks = 0  # blocks idle sessions hold
        self._sessions: OrderedDict[str, Session] = OrderedDict()  # least recently used first
        self._per_owner: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._sessions)

    def __contains__(self, session_id: str) -> bool:
        return session_id in self._sessions

    def attach(self, session_id: str, req: Request) -> None:
        """Give ``req`` the session's blocks for the prefix it shares; free the rest."""
        s = self._sessions.get(session_id) or self._open(session_id)
        self._sessions.move_to_end(session_id)
        s.busy = True
        s.last_used = self._clock()
        self.held_blocks -= len(s.block_ids)
        bs = self.kv.block_size
        # KV made in another partition (another adapter's) is not this turn's prefix
        same = s.cache_root == req.cache_root
        limit = req.num_prompt_tokens - 1 if same else 0
        common = _common_prefix(s.token_ids, req.prompt_token_ids, limit=limit)
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
            s.cache_root = req.cache_root
            req.block_ids, req.block_hashes = [], []
        else:
            self.kv.free(req)  # an aborted turn: the session's history went with it
            self._remove(session_id)
            return
        s.busy = False
        s.last_used = self._clock()
        self._sessions.move_to_end(session_id)
        self.held_blocks += len(s.block_ids)
        if self.held_blocks > self.max_blocks:
            self._evict(lambda: self.held_blocks <= self.max_blocks, first=s.owner)

    def _open(self, session_id: str) -> Session:
        """A new session, room made for it first: its key's own oldest idle one goes at the
        key's cap; at the store's cap, that key's again if it has one idle, else the oldest
        idle one of the key holding the most. Never another key's while this one has any."""
        owner = session_owner(session_id)
        if self._per_owner.get(owner, 0) >= self.max_per_key:
            self._forget_idle(owner)
        if len(self._sessions) >= self.max_sessions and not self._forget_idle(owner):
            self._forget_idle(self._largest_owner())
        s = self._sessions[session_id] = Session(session_id, owner, last_used=self._clock())
        self._per_owner[owner] = self._per_owner.get(owner, 0) + 1
        return s

    def _largest_owner(self) -> str:
        idle = {s.owner for s in self._sessions.values() if not s.busy}
        return max(idle, key=lambda o: self._per_owner[o], default="")

    def _forget_idle(self, owner: str) -> bool:
        """Forget ``owner``'s least recently used idle session (blocks and all), if any."""
        sid = next((k for k, s in self._sessions.items() if s.owner == owner and not s.busy), None)
        return sid is not None and self.delete(sid)

    def _remove(self, session_id: str) -> None:
        owner = self._sessions.pop(session_id).owner
        self._per_owner[owner] -= 1
        if not self._per_owner[owner]:
            del self._per_owner[owner]

    def reclaim(self, num_blocks: int) -> None:
        """Give blocks back until the pool has ``num_blocks`` free (or no idle session has any)."""
        self._evict(lambda: self.kv.pool.num_free >= num_blocks)

    def _evict(self, enough: Callable[[], bool], first: str | None = None) -> None:
        """Drop idle sessions' blocks, least recently used first (``first``'s sessions before
        any other key's), until ``enough``."""
        order = sorted(self._sessions.values(), key=lambda s: s.owner != first)  # stable
        for s in order:
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
        self._remove(session_id)
        return True

    def expire(self, idle_seconds: float) -> int:
        cutoff = self._clock() - idle_seconds
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
