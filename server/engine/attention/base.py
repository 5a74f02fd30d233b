"""The attention backend interface: plan once per step, then attend per layer.

The model never sees block tables: the runner describes the step's batch layout, the
backend turns it into whatever its kernels need (``plan``), and each layer calls
``forward`` on the resulting step object, which writes the new K/V into their slots and
attends over each sequence's pages. A FlashInfer backend plugs in behind the same two calls.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class BatchLayout:
    """Where each sequence's new tokens sit in the flat batch and in the KV cache.

    Sequence i has ``query_lens[i]`` new tokens at the end of ``kv_lens[i]`` tokens of context;
    its causal mask is aligned to the end of the KV, so chunked prefill and prefix hits need
    no special case.
    """

    query_lens: list[int]
    kv_lens: list[int]
    block_tables: list[list[int]]
    slot_mapping: torch.Tensor  # [num_tokens] int64: flat cache slot of each new token

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)


class AttentionStep(ABC):
    @abstractmethod
    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, H_kv, D]; returns [T, H, D]."""


class AttentionBackend(ABC):
    name: str

    @abstractmethod
    def plan(self, layout: BatchLayout) -> AttentionStep:
        """Build the per-step metadata once; the step object is reused by every layer."""
