"""Prefix caching: a hash chain over full blocks, so equal prefixes find each other's KV blocks.

A block's hash covers its parent's hash and its own token ids, so a hit on block i implies the
whole prefix up to i matches. Hashes of int tuples are stable across processes (no hash
randomisation for ints), which the P/D path relies on. Collisions are caught by comparing the
stored token ids on every hit.

A chain starts from a root: ``ROOT_HASH`` for the shared tenant, or ``salted_root(salt)`` for
a tenant's own (``docs/security.md``): the salt enters the first block's hash, so every block of
the chain differs and one tenant's prompts never hit (or reveal) another's blocks.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

ROOT_HASH = 0x7A4D_E000


def salted_root(salt: str | None) -> int:
    """The chain's root for a cache partition (``None``: the shared one). A digest, not
    ``hash(str)``, so every process (a prefill and a decode engine) derives the same root."""
    if salt is None:
        return ROOT_HASH
    digest = hashlib.sha256(b"tandem/prefix-cache\0" + salt.encode()).digest()
    return int.from_bytes(digest[:8], "little") & 0x7FFF_FFFF_FFFF_FFFF


def hash_block(parent_hash: int, token_ids: Sequence[int]) -> int:
    return hash((parent_hash, tuple(token_ids)))


def chain_hashes(
    token_ids: Sequence[int],
    block_size: int,
    start: list[int] | None = None,
    root: int = ROOT_HASH,
) -> list[int]:
    """Hashes of every full block of ``token_ids``, extending the chain ``start`` if given,
    else starting from ``root`` (the request's cache partition)."""
    hashes = list(start or [])
    parent = hashes[-1] if hashes else root
    for b in range(len(hashes), len(token_ids) // block_size):
        parent = hash_block(parent, token_ids[b * block_size : (b + 1) * block_size])
        hashes.append(parent)
    return hashes


class PrefixCache:
    """Maps block hashes to block ids; the block pool evicts entries when it reuses a block."""

    def __init__(self) -> None:
        self._by_hash: dict[int, int] = {}
        self._entry: dict[int, tuple[int, tuple[int, ...]]] = {}
        self.queries = 0
        self.hits = 0

    def __len__(self) -> int:
        return len(self._by_hash)

    def lookup(self, block_hash: int, token_ids: Sequence[int]) -> int | None:
        block_id = self._by_hash.get(block_hash)
        if block_id is None or self._entry[block_id][1] != tuple(token_ids):
            return None
        return block_id

    def insert(self, block_id: int, block_hash: int, token_ids: Sequence[int]) -> None:
        if block_hash in self._by_hash or block_id in self._entry:
            return
        self._by_hash[block_hash] = block_id
        self._entry[block_id] = (block_hash, tuple(token_ids))

    def evict(self, block_id: int) -> None:
        entry = self._entry.pop(block_id, None)
        if entry is not None:
            del self._by_hash[entry[0]]

    def record(self, queried_tokens: int, hit_tokens: int) -> None:
        self.queries += queried_tokens
        self.hits += hit_tokens

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0

    def clear(self) -> None:
        self._by_hash.clear()
        self._entry.clear()
