"""The device side of the engine: weights, KV cache tensors, attention backend, model runner.

The engine above it is pure bookkeeping (scheduler, blocks, requests); everything that
holds device memory or launches kernels lives here, so tensor parallelism, CUDA graphs and
other backends change this module and below, never the scheduler.
"""
from __future__ import annotations

import os

import torch

from .attention import select_backend
from .config import ConfigError, EngineConfig
from .kv_cache import KVCache
from .loader import load_model, resolve_dtype
from .model_runner import ModelRunner
from .models.config import ModelConfig
from .request import Request
from .scheduler import ScheduledBatch


class Worker:
    def __init__(self, config: EngineConfig, model_config: ModelConfig) -> None:
        self.config = config
        self.model_config = model_config
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, model_config, self.device)
        self.model = load_model(config.model, self.dtype, self.device)
        self.num_blocks = self._num_kv_blocks()
        self.kv_cache = KVCache(model_config, self.num_blocks, config.block_size, self.dtype, self.device)
        backend = select_backend(config.attention_backend, self.kv_cache, model_config.head_dim ** -0.5)
        self.runner = ModelRunner(self.model, backend, config.block_size, self.device)

    def _num_kv_blocks(self) -> int:
        """An explicit token count wins; else a fraction of free device memory (CPU: of RAM, capped)."""
        cfg = self.config
        if cfg.kv_cache_tokens is not None:
            return -(-cfg.kv_cache_tokens // cfg.block_size) + 1
        per_block = KVCache.bytes_per_block(self.model_config, cfg.block_size, self.dtype)
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = int(free * cfg.gpu_memory_utilization)
        else:
            available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
            budget = min(int(available * cfg.gpu_memory_utilization), cfg.max_kv_cache_bytes)
        blocks = budget // per_block
        if blocks < 2:
            raise ConfigError(f"no memory left for the KV cache ({budget} bytes, {per_block} per block)")
        return blocks

    def execute(self, batch: ScheduledBatch) -> tuple[torch.Tensor, list[Request]]:
        return self.runner.execute(batch)

    def new_generator(self, seed: int) -> torch.Generator:
        return torch.Generator(device=self.device).manual_seed(seed)

    def sleep(self, level: int) -> None:
        """Level 1 frees the KV cache (and parks weights in host memory on a GPU); level 2 drops weights."""
        self.kv_cache.release()
        if level == 2:
            self.model.to_empty(device=torch.device("meta"))
        elif self.device.type == "cuda":
            self.model.to("cpu")
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def wake_up(self, level: int) -> None:
        if level == 2:
            self.model = load_model(self.config.model, self.dtype, self.device)
            self.runner.model = self.model
        elif self.device.type == "cuda":
            self.model.to(self.device)
        self.kv_cache.restore(self.model_config)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)
