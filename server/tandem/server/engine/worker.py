"""The device side of the engine: weights, KV cache tensors, attention backend, model runner.

The engine above it is pure bookkeeping (scheduler, blocks, requests); everything that
holds device memory or launches kernels lives here, so tensor parallelism, CUDA graphs and
other backends change this module and below, never the scheduler.

``Shard`` is what one rank holds (its slice of the weights, its KV heads, its backend and
runner). ``Worker`` is rank 0's shard plus, with ``tensor_parallel_size > 1``, the other
ranks: it starts them (``parallel.launch``), sends each step's flattened inputs to them,
and runs its own shard; the engine sees one device either way.
"""

from __future__ import annotations

import logging
import os

import torch

from .attention import select_backend
from .config import ConfigError, EngineConfig
from .kv_cache import KVCache
from .loader import load_model, reload_weights, resolve_dtype
from .model_runner import ModelRunner, StepInputs, prepare_inputs
from .models.config import ModelConfig
from .parallel import SINGLE, TensorParallel
from .request import Request
from .scheduler import ScheduledBatch

log = logging.getLogger(__name__)

# Kept free on a GPU beside the KV cache for activations, the sampler and the graphs' pool.
ACTIVATION_RESERVE_BYTES = 1 << 30


class Shard:
    """One tensor-parallel rank's weights, KV cache, attention backend and runner."""

    def __init__(
        self,
        config: EngineConfig,
        model_config: ModelConfig,
        device: torch.device,
        tp: TensorParallel = SINGLE,
    ) -> None:
        self.config = config
        self.model_config = model_config
        self.device = device
        self.tp = tp
        self.dtype = resolve_dtype(config.dtype, model_config, device)
        self.num_qo_heads = tp.divide(model_config.num_attention_heads, "num_attention_heads")
        self.num_kv_heads = tp.divide(model_config.num_key_value_heads, "num_key_value_heads")
        self.weights_path = config.model  # what wake_up(2) reloads; /update_weights changes it
        self.model = load_model(config.model, self.dtype, device, tp)
        self.num_blocks = self._agree(self._num_kv_blocks())
        self.kv_cache = KVCache(
            model_config, self.num_blocks, config.block_size, self.dtype, device, self.num_kv_heads
        )
        backend = select_backend(
            config.attention_backend, self.kv_cache, model_config.head_dim**-0.5, self.num_qo_heads
        )
        self.runner = ModelRunner(self.model, backend, config.block_size, device)
        self._capture_graphs()

    @property
    def max_model_len(self) -> int:
        """As the engine computes it: the config's cap, the model's, and what the cache holds."""
        mc = self.model_config
        return min(
            self.config.max_model_len or mc.max_position_embeddings,
            mc.max_position_embeddings,
            (self.num_blocks - 1) * self.config.block_size,
        )

    def _num_kv_blocks(self) -> int:
        """An explicit token count wins; else a fraction of device memory after the weights.

        On a GPU, ``gpu_memory_utilization`` is the share of the device's total memory this
        engine may hold; what the weights (and anything else on the device) already use, and
        a reserve for activations, come off it. On CPU: a fraction of available RAM, capped.
        """
        cfg = self.config
        if cfg.kv_cache_tokens is not None:
            return -(-cfg.kv_cache_tokens // cfg.block_size) + 1
        per_block = KVCache.bytes_per_block(
            self.model_config, cfg.block_size, self.dtype, self.tp.size
        )
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            budget = (
                int(total * cfg.gpu_memory_utilization) - (total - free) - ACTIVATION_RESERVE_BYTES
            )
        else:
            available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
            budget = min(int(available * cfg.gpu_memory_utilization), cfg.max_kv_cache_bytes)
        blocks = budget // per_block
        if blocks < 2:
            raise ConfigError(
                f"no memory left for the KV cache ({budget} bytes, {per_block} per block)"
            )
        return blocks

    def _agree(self, blocks: int) -> int:
        """Every rank must index the same blocks: take the smallest count any rank can hold."""
        if self.tp.size == 1:
            return blocks
        import torch.distributed as dist

        t = torch.tensor([blocks], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.tp.cpu_group)
        return int(t.item())

    def _capture_graphs(self) -> None:
        runner = self.runner
        if self.config.enforce_eager or self.device.type != "cuda":
            return
        if not runner.backend.supports_cuda_graphs:
            log.info(
                "the %s attention backend runs decode eagerly (no CUDA graphs)", runner.backend.name
            )
            return
        max_blocks = -(-self.max_model_len // self.config.block_size)
        runner.capture_graphs(self.config.max_num_seqs, max_blocks)

    def run(self, inputs: StepInputs, compute_logits: bool = True) -> torch.Tensor:
        return self.runner.run(inputs, compute_logits)

    def sleep(self, level: int) -> None:
        """Level 1 frees the KV cache (and parks weights in host memory on a GPU); level 2 drops weights."""
        self.runner.drop_graphs()  # they point at the memory about to go
        self.kv_cache.release()
        if level == 2:
            self.model.to_empty(device=torch.device("meta"))
        elif self.device.type == "cuda":
            self.model.to("cpu")
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def load_weights(self, path: str) -> None:
        """Swap in ``path``'s weights (same shapes; see ``loader.reload_weights``)."""
        reload_weights(self.model, path, self.dtype, self.tp)
        self.weights_path = path

    def wake_up(self, level: int) -> None:
        if level == 2:
            self.model = load_model(self.weights_path, self.dtype, self.device, self.tp)
            self.runner.model = self.model
        elif self.device.type == "cuda":
            self.model.to(self.device)
        self.kv_cache.restore()
        self._capture_graphs()


class Worker:
    """The engine's one handle on the device(s): rank 0's shard, and the other ranks behind it."""

    def __init__(self, config: EngineConfig, model_config: ModelConfig) -> None:
        self.config = config
        self.model_config = model_config
        self._ranks = None
        tp = SINGLE
        base_device = resolve_device(config.device)
        if config.tensor_parallel_size > 1:
            from .parallel.launch import RankGroup

            self._ranks = RankGroup.start(config, model_config, base_device)
            tp = self._ranks.tp
        try:
            self.shard = Shard(config, model_config, rank_device(base_device, tp.rank), tp)
            if self._ranks is not None:
                self._ranks.wait_ready()
        except BaseException:
            if self._ranks is not None:
                self._ranks.abort()
                self._ranks = None
            raise
        self.device = self.shard.device
        self.dtype = self.shard.dtype
        self.num_blocks = self.shard.num_blocks

    # The engine reads these; they follow the shard (wake_up at level 2 replaces the model).
    @property
    def model(self) -> torch.nn.Module:
        return self.shard.model

    @property
    def kv_cache(self) -> KVCache:
        return self.shard.kv_cache

    @property
    def runner(self) -> ModelRunner:
        return self.shard.runner

    @property
    def tensor_parallel_size(self) -> int:
        return self.shard.tp.size

    def execute(self, batch: ScheduledBatch) -> tuple[torch.Tensor, torch.Tensor, list[Request]]:
        """The sampling rows' logits, the pooled requests' hidden rows, the sampling requests."""
        inputs, sampling = prepare_inputs(batch, self.config.block_size)
        if self._ranks is not None:
            self._ranks.send(("step", inputs))
        logits, hidden = self.shard.runner.run_pooled(inputs)
        return logits, hidden, sampling

    def new_generator(self, seed: int) -> torch.Generator:
        return torch.Generator(device=self.device).manual_seed(seed)

    def skip_draw(self, generator: torch.Generator) -> None:
        """Advance ``generator`` past one token's draw, as sampling that token would have."""
        vocab = self.model_config.vocab_size
        torch.empty(vocab, device=self.device).exponential_(generator=generator)

    def sleep(self, level: int) -> None:
        if self._ranks is not None:
            self._ranks.send(("sleep", level))
        self.shard.sleep(level)

    def load_weights(self, path: str) -> None:
        """Rank 0 first, so a checkpoint that fails leaves every rank on the old weights."""
        self.shard.load_weights(path)
        if self._ranks is not None:
            self._ranks.send(("load_weights", path))

    def wake_up(self, level: int) -> None:
        if self._ranks is not None:
            self._ranks.send(("wake_up", level))
        self.shard.wake_up(level)

    def close(self) -> None:
        """Stop the other tensor-parallel ranks (idempotent; also runs at exit and on collection)."""
        ranks, self._ranks = self._ranks, None
        if ranks is not None:
            ranks.close()


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def rank_device(base: torch.device, rank: int) -> torch.device:
    """Rank r of a pod uses GPU ``base.index + r``; CPU ranks share the CPU."""
    if base.type != "cuda":
        return base
    return torch.device("cuda", (base.index or 0) + rank)
