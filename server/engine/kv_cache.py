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
    """

    def __init__(self, cfg: "ModelConfig", num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.dtype = dtype
        self.device = device
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.data = torch.zeros(cfg.num_hidden_layers, 2, num_blocks, block_size, cfg.num_key_value_heads,
                                cfg.head_dim, dtype=dtype, device=device)

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.data[layer, 0], self.data[layer, 1]

    def flat_kv(self, layer: int) -> torch.Tensor:
        """``[2, slots, kv_heads, head_dim]``: K and V of one layer indexed by flat slot."""
        return self.data[layer].view(2, self.num_blocks * self.block_size, self.num_kv_heads, self.head_dim)

    def release(self) -> None:
        """Drop the cache memory (sleep mode); ``restore`` allocates it again, zeroed."""
        self.data = torch.empty(0, dtype=self.dtype, device=self.device)

    def restore(self, cfg: "ModelConfig") -> None:
        self.data = torch.zeros(cfg.num_hidden_layers, 2, self.num_blocks, self.block_size, self.num_kv_heads,
                                self.head_dim, dtype=self.dtype, device=self.device)

    @staticmethod
    def bytes_per_block(cfg: "ModelConfig", block_size: int, dtype: torch.dtype) -> int:
        itemsize = torch.tensor([], dtype=dtype).element_size()
        return cfg.num_hidden_layers * 2 * block_size * cfg.num_key_value_heads * cfg.head_dim * itemsize
