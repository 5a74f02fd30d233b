"""The pool of KV-cache blocks: reference counts and an LRU queue of free blocks.

Free blocks that still hold a cached prefix stay findable by the prefix cache until the pool
hands them out again; the queue gives out the least recently freed block first, and a
sequence frees its blocks tail first, so the deepest (least shareable) blocks go first.
Block 0 is reserved as the padding page that attention backends may point unused slots at.
"""

from __future__ import annotations

from collections import OrderedDict

from .prefix_cache import PrefixCache


class BlockPoolError(RuntimeError):
    """An invariant of the pool broke (a double free, say): a bug, never a user error."""


NULL_BLOCK = 0  # reserved: the padding page that padded rows attend to and write into


class BlockPool:
    def __init__(self, num_blocks: int, prefix_cache: PrefixCache | None) -> None:
        if num_blocks < 2:
            raise ValueError("the KV cache needs at least 2 blocks (one is the padding page)")
        self.num_blocks = num_blocks
        self.prefix_cache = prefix_cache
        self._ref = [0] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(1, num_blocks))

    @property
    def num_usable(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_cached(self) -> int:
        return len(self.prefix_cache) if self.prefix_cache is not None else 0

    def ref_count(self, block_id: int) -> int:
        return self._ref[block_id]

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise BlockPoolError(f"asked for {n} blocks with {len(self._free)} free")
        out = []
        for _ in range(n):
            block_id, _ = self._free.popitem(last=False)
            if self.prefix_cache is not None:
                self.prefix_cache.evict(block_id)
            self._ref[block_id] = 1
            out.append(block_id)
        return out

    def share(self, block_ids: list[int]) -> None:
        """Take one more reference on blocks another owner (or the prefix cache) holds."""
        for block_id in block_ids:
            if self._ref[block_id] == 0:
                del self._free[block_id]
            self._ref[block_id] += 1

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference per block, tail first; blocks reaching zero join the LRU queue."""
        for block_id in reversed(block_ids):
            if self._ref[block_id] <= 0 or block_id == NULL_BLOCK:
                raise BlockPoolError(f"block {block_id} freed with no reference held")
            self._ref[block_id] -= 1
            if self._ref[block_id] == 0:
                self._free[block_id] = None

    def check_all_free(self) -> None:
        """Raise unless every usable block is free: the leak check of tests and shutdown."""
        held = [b for b in range(1, self.num_blocks) if self._ref[b] != 0]
        if held or len(self._free) != self.num_usable:
            raise BlockPoolError(f"blocks still referenced: {held[:16]} ({len(held)} in all)")

    def reset_prefix_cache(self) -> None:
        if self.prefix_cache is not None:
            self.prefix_cache.clear()
