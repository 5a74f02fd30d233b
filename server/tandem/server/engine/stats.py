"""The engine's counters at one moment: read by the server's /health and /metrics."""

from __future__ import annotations

from dataclasses import dataclass


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

    @property
    def kv_utilization(self) -> float:
        return 1.0 - self.free_blocks / self.total_blocks if self.total_blocks else 0.0
