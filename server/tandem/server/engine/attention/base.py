"""The attention backend interface: plan once per step, then attend per layer.

The model never sees block tables: the runner describes the step's batch layout, the
backend turns it into whatever its kernels need (``plan``), and each layer calls
``forward`` on the resulting step object, which writes the new K/V into their slots and
attends over each sequence's pages. The FlashInfer backend plugs in behind the same calls.

A backend that can run inside a CUDA graph (``supports_cuda_graphs``) also hands out, per
captured batch size, a step bound to static buffers (``graph_step``) and re-plans those
buffers before each replay (``plan_graph``), outside the graph.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch


class SeqShape:
    """What a step's per-sequence query lengths say about it (shared by layouts and inputs)."""

    query_lens: list[int]

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def is_decode(self) -> bool:
        return all(n == 1 for n in self.query_lens)


@dataclass(frozen=True)
class BatchLayout(SeqShape):
    """Where each sequence's new tokens sit in the flat batch and in the KV cache.

    Sequence i has ``query_lens[i]`` new tokens at the end of ``kv_lens[i]`` tokens of context;
    its causal mask is aligned to the end of the KV, so chunked prefill and prefix hits need
    no special case.
    """

    query_lens: list[int]
    kv_lens: list[int]
    block_tables: list[list[int]]
    slot_mapping: torch.Tensor  # [num_tokens] int64: flat cache slot of each new token


@dataclass(frozen=True)
class KeptRows:
    """The rows a step's last layer finishes: each sequence's last ``tails[i]`` new tokens,
    those sampled or pooled. That layer writes every row's K and V, which later steps read,
    but its attention output, o_proj, MLP and the final norm serve only these rows: the rest
    of a prompt (all of a chunk that does not end one) stops at its K and V."""

    tails: list[int]  # per sequence, in the step's order
    index: torch.Tensor | slice  # their flat rows, in order


class AttentionStep(ABC):
    @abstractmethod
    def forward(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        keep: KeptRows | None = None,
    ) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, H_kv, D]; writes every row's K and V and returns the
        attention output of every row ([T, H, D]) or of ``keep``'s rows only."""


class AttentionBackend(ABC):
    name: str
    supports_cuda_graphs: bool = False

    @abstractmethod
    def plan(self, layout: BatchLayout) -> AttentionStep:
        """Build the per-step metadata once; the step object is reused by every layer."""

    def graph_step(
        self, batch_size: int, slot_mapping: torch.Tensor, max_blocks_per_seq: int
    ) -> AttentionStep:
        """A decode step for ``batch_size`` rows reading only static buffers (for capture)."""
        raise NotImplementedError(f"the {self.name} attention backend cannot run in a CUDA graph")

    def plan_graph(self, batch_size: int, layout: BatchLayout) -> None:
        """Fill the static buffers of ``graph_step(batch_size)`` for this (padded) decode batch."""
        raise NotImplementedError(f"the {self.name} attention backend cannot run in a CUDA graph")
