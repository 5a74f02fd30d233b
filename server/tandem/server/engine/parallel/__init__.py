"""Tensor parallelism inside one pod: the process group a model shard reduces over.

``TensorParallel`` is what the model layers see (rank, size, the group to all-reduce
over); ``launch.py`` starts the ranks and carries each step from rank 0 to the others.
With ``size == 1`` nothing here talks to ``torch.distributed``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


class TensorParallelError(ValueError):
    """A model that cannot be split this way (heads or sizes not divisible by the TP size)."""


class RankGroupLost(RuntimeError):
    """A rank of the group exited or cannot be reached: torch.distributed takes no rank back,
    so the engine is over (its server exits; in a cluster LWS or the Deployment starts it
    again), rather than failing every later request one by one."""


@dataclass(frozen=True)
class TensorParallel:
    rank: int = 0
    size: int = 1
    group: Any = None  # the device group (NCCL on CUDA, gloo on CPU); None with size 1
    cpu_group: Any = None  # a gloo group for Python objects (the step's inputs)

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            import torch.distributed as dist

            dist.all_reduce(t, group=self.group)
        return t

    def divide(self, n: int, what: str) -> int:
        if n % self.size:
            raise TensorParallelError(
                f"{what} ({n}) is not divisible by tensor_parallel_size {self.size}"
            )
        return n // self.size


SINGLE = TensorParallel()


def rank_device(base: torch.device, rank: int) -> torch.device:
    """Rank r of a pod uses GPU ``base.index + r``; CPU ranks share the CPU."""
    if base.type != "cuda":
        return base
    return torch.device("cuda", (base.index or 0) + rank)
