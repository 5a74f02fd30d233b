"""Gives requests their KV blocks: prefix hits, growth as tokens are computed, forks and frees."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .block_pool import BlockPool
from .prefix_cache import PrefixCache, chain_hashes, hash_block
from .request import Request


@dataclass(frozen=True)
class CachedPrefix:
    block_ids: list[int]
    block_hashes: list[int]


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, PrefixCache() if enable_prefix_caching else None)
        # Called with the number of free blocks wanted when the pool is short: the engine's
        # sessions give back what they hold, so no request waits on a cache.
        self.reclaim: Callable[[int], None] | None = None

    @property
    def prefix_cache(self) -> PrefixCache | None:
        return self.pool.prefix_cache

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def find_cached_prefix(self, req: Request) -> CachedPrefix:
        """The longest run of cached full blocks at the start of the request's tokens.

        At least one token is always left to compute, because sampling needs its logits.
        """
        cache = self.prefix_cache
        if cache is None:
            return CachedPrefix([], [])
        tokens = req.all_token_ids
        bs = self.block_size
        hashes = chain_hashes(tokens[: ((len(tokens) - 1) // bs) * bs], bs, root=req.cache_root)
        hits: list[int] = []
        for i, block_hash in enumerate(hashes):
            block_id = cache.lookup(block_hash, tokens[i * bs : (i + 1) * bs])
            if block_id is None:
                break
            hits.append(block_id)
        return CachedPrefix(hits, hashes[: len(hits)])

    def allocate(
        self, req: Request, num_new_tokens: int, prefix: CachedPrefix | None = None
    ) -> bool:
        """Grow the request's block table to hold ``num_new_tokens`` more; False if the pool is short.

        With ``prefix`` (first admission), the request takes the cached blocks and starts after them.
        """
        cached = prefix.block_ids if prefix else []
        start = len(cached) * self.block_size if prefix else req.num_computed_tokens
        have = len(cached) if prefix else len(req.block_ids)
        new_blocks = self.blocks_for(start + num_new_tokens) - have
        leaving_free_queue = sum(1 for b in cached if self.pool.ref_count(b) == 0)
        wanted = max(new_blocks, 0) + leaving_free_queue
        if wanted > self.pool.num_free and self.reclaim is not None:
            self.reclaim(wanted)
        if wanted > self.pool.num_free:
            return False
        if prefix is not None:
            self.pool.share(cached)
            req.block_ids = list(cached)
            req.block_hashes = list(prefix.block_hashes)
            req.num_computed_tokens = start
            req.num_cached_tokens = start
            if self.prefix_cache is not None:
                self.prefix_cache.record(req.num_tokens, start)
        if new_blocks > 0:
            req.block_ids.extend(self.pool.allocate(new_blocks))
        return True

    def cache_full_blocks(self, req: Request, num_tokens: int) -> None:
        """Publish the full blocks among the request's first ``num_tokens`` to the prefix cache.

        The scheduler calls it when it schedules the tokens, before they are computed: a step
        writes every sequence's new K/V into a layer's pages before any of them attends in that
        layer, so a request admitted later in the same step can already read those blocks.
        """
        cache = self.prefix_cache
        if cache is None:
            return
        bs = self.block_size
        parent = req.block_hashes[-1] if req.block_hashes else req.cache_root
        for b in range(len(req.block_hashes), num_tokens // bs):
            tokens = req.token_slice(b * bs, (b + 1) * bs)
            parent = hash_block(parent, tokens)
            req.block_hashes.append(parent)
            cache.insert(req.block_ids[b], parent, tokens)

    def fork(self, parent: Request, child: Request, num_blocks: int) -> None:
        """Let ``child`` share the first ``num_blocks`` (full) blocks of ``parent``'s computed prompt."""
        shared = parent.block_ids[:num_blocks]
        self.pool.share(shared)
        child.block_ids = list(shared)
        child.block_hashes = list(parent.block_hashes[:num_blocks])
        child.num_computed_tokens = num_blocks * self.block_size

    def trim(self, req: Request) -> None:
        """Give back the blocks past the request's tokens (speculation wrote rejected
        positions there; they were never published)."""
        keep = self.blocks_for(req.num_tokens)
        if len(req.block_ids) > keep:
            self.pool.free(req.block_ids[keep:])
            del req.block_ids[keep:]

    def free(self, req: Request) -> None:
        if req.block_ids:
            self.pool.free(req.block_ids)
        req.block_ids = []
        req.block_hashes = []
