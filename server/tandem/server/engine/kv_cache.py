"""The KV cache tensors: per layer, K and V pages of ``block_size`` tokens in NHD layout."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .models.config import ModelConfig


class KVCache:
    """One tensor ``[layers, 2, num_blocks, block_size, kv_heads, head_dim]``.

    Per layer, ``k`` and ``v`` are ``[num_blocks, block_size, kv_heads, head_dim]`` views, the
    paged NHD layout FlashInfer reads; ``flat`` views them as ``[slots, kv_heads, head_dim]``.
    Under tensor parallelism each rank holds its own ``kv_heads / tp`` heads
    (``num_kv_heads``); block ids are the same on every rank. Block 0 is the null page.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        num_kv_heads: int | None = None,
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.dtype = dtype
        self.device = device
        self.num_layers = cfg.num_hidden_layers
        self.num_kv_heads = num_kv_heads or cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.data = self._allocate()

    def _allocate(self) -> torch.Tensor:
        return torch.zeros(
            self.num_layers,
            2,
            self.num_blocks,
            self.block_size,
            self.num_kv_heads,
            self.head_dim,
            dtype=self.dtype,
            device=self.device,
        )

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.data[layer, 0], self.data[layer, 1]

    def flat_kv(self, layer: int) -> torch.Tensor:
        """``[2, slots, kv_heads, head_dim]``: K and V of one layer indexed by flat slot."""
        return self.data[layer].view(
            2, self.num_blocks * self.block_size, self.num_kv_heads, self.head_dim
        )

    def release(self) -> None:
        """Drop the cache memory (sleep mode); ``restore`` allocates it again, zeroed."""
        self.data = torch.empty(0, dtype=self.dtype, device=self.device)

    def restore(self, cfg: ModelConfig | None = None) -> None:
        self.data = self._allocate()

    @staticmethod
    def bytes_per_block(
        cfg: ModelConfig, block_size: int, dtype: torch.dtype, tp_size: int = 1
    ) -> int:
        itemsize = torch.tensor([], dtype=dtype).element_size()
        return (
            cfg.num_hidden_layers
            * 2
            * block_size
            * (cfg.num_key_value_heads // tp_size)
            * cfg.head_dim
            * itemsize
        )
