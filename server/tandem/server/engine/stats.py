"""The engine's counters at one moment: read by the server's /health and /metrics."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .kv_cache_manager import KVCacheManager
    from .kv_handoff import KVHandoff
    from .scheduler import Scheduler


@dataclass
class Totals:
    """Counts since start, bumped by the engine as it runs."""

    preemptions: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    # Speculative decoding: proposals verified, tokens proposed and accepted, and how often
    # the proposal's token at each position was accepted (spec_decode/speculator.py).
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_accepted_per_position: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class EngineStats:
    num_running: int = 0
    num_waiting: int = 0
    total_blocks: int = 0
    free_blocks: int = 0
    cached_blocks: int = 0
    block_size: int = 0
    prefix_hit_rate: float = 0.0
    num_sessions: int = 0
    is_sleeping: bool = False
    num_preemptions: int = 0
    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    num_leases: int = 0
    num_pulling: int = 0
    # Multi-LoRA (0 and empty without it): the adapters of the running and the waiting requests
    max_loras: int = 0
    running_loras: tuple[str, ...] = ()
    waiting_loras: tuple[str, ...] = ()
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_position: tuple[int, ...] = ()

    @property
    def kv_utilization(self) -> float:
        return 1.0 - self.free_blocks / self.total_blocks if self.total_blocks else 0.0

    @classmethod
    def of(
        cls,
        kv: KVCacheManager,
        scheduler: Scheduler,
        num_sessions: int,
        handoff: KVHandoff,
        is_sleeping: bool,
        totals: Totals,
    ) -> EngineStats:
        pool, cache = kv.pool, kv.prefix_cache
        return cls(
            num_running=len(scheduler.running),
            num_waiting=len(scheduler.waiting),
            total_blocks=pool.num_usable,
            free_blocks=pool.num_free,
            cached_blocks=pool.num_cached,
            block_size=kv.block_size,
            prefix_hit_rate=cache.hit_rate if cache is not None else 0.0,
            num_sessions=num_sessions,
            is_sleeping=is_sleeping,
            num_preemptions=totals.preemptions,
            num_prompt_tokens=totals.prompt_tokens,
            num_generated_tokens=totals.generated_tokens,
            num_leases=len(handoff.leases),
            num_pulling=len(handoff.pulling),
            spec_num_drafts=totals.spec_drafts,
            spec_num_draft_tokens=totals.spec_draft_tokens,
            spec_num_accepted_tokens=totals.spec_accepted_tokens,
            spec_accepted_per_position=tuple(totals.spec_accepted_per_position),
        )
