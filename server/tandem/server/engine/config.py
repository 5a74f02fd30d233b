"""Engine configuration: validated once at the edge, frozen afterwards.

The same field names are used by the CLI flags (``--block-size``), the CRD's
``spec.engine`` (``blockSize``) and the Helm values, so one spec maps onto all three.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, get_args

Dtype = Literal["auto", "float32", "bfloat16", "float16"]
PoolingKind = Literal["last", "mean", "cls"]
PrefixCacheScope = Literal["key", "global"]
QuantizedWeights = Literal["auto", "exact", "int8", "off"]
SpeculativeMethod = Literal["ngram", "draft"]


class ConfigError(ValueError):
    """A configuration value that cannot work; raised before anything is loaded."""


@dataclass(frozen=True)
class EngineConfig:
    model: str
    dtype: Dtype = "auto"
    device: str = "auto"
    block_size: int = 16
    # KV cache size: an explicit token count wins; otherwise a fraction of the device's free
    # memory after the weights (on CPU: of available RAM, capped by max_kv_cache_bytes).
    kv_cache_tokens: int | None = None
    gpu_memory_utilization: float = 0.9
    max_kv_cache_bytes: int = 1 << 30
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    # Whose prefix-cache blocks a request may hit: only its own client key's (and cache_salt's),
    # so cached_tokens never reveals another tenant's prompt; "global" shares across keys.
    prefix_cache_scope: PrefixCacheScope = "key"
    attention_backend: Literal["auto", "torch", "flashinfer"] = "auto"
    # A GGUF file's Q8_0 / Q4_0 / Q4_1 linear weights multiplied as blocks at decode batch
    # sizes on an AVX-512 CPU: "exact" by each weight rebuilt in float32 (the dequantized
    # product up to the order of the sums), "int8" with x quantized to 8 bits per block and
    # VNNI dot products (llama.cpp's way: faster, but it changes greedy tokens; the exact
    # kernel where the CPU lacks VNNI), or "off": always by their dequantized copy. "auto"
    # is exact (docs/performance.md: int8 flipped greedy tokens on the default model).
    quantized_weights: QuantizedWeights = "auto"
    enforce_eager: bool = False
    tensor_parallel_size: int = 1
    # A replica that spans nodes (docs/operator.md, LeaderWorkerSet): its tensor_parallel_size
    # ranks are split evenly over nnodes processes on different hosts, which join the process
    # group at the leader's leader_addr (HOST:PORT). Node 0 (the leader) serves the API; the
    # others run the ranks' step loop and serve nothing (parallel/member.py).
    nnodes: int = 1
    node_rank: int = 0
    leader_addr: str | None = None
    seed: int = 0
    # P/D: how long a prefill engine holds blocks for a decode engine that never pulls them,
    # and what a decode engine does when a pull fails (end the request, or prefill itself).
    kv_lease_seconds: float = 30.0
    kv_pull_fallback: Literal["error", "recompute"] = "error"
    # Sessions are a cache: idle sessions together hold at most this fraction of the pool, and
    # give their blocks back (least recently used first) whenever a request needs them.
    session_kv_fraction: float = 0.5
    # Sessions one client key keeps at once (of the store's 4096): past it the key's own least
    # recently used idle session goes, never another key's (sessions.py).
    max_sessions_per_key: int = 1024
    # Embeddings and /pooling: the hidden state of the last token (a decoder LM's default, as
    # vLLM's), the mean over the prompt, or the first token's (CLS); see pooling.py.
    pooling: PoolingKind = "last"
    # Multi-LoRA (docs/lora.md): adapters served from the start ("name=path", PEFT
    # directories), how many may be resident (and used by the running requests) at once, and
    # the highest rank accepted. With enable_lora and no modules, adapters come by HTTP.
    # lora_config: a JSON file of adapters the server keeps served as the file changes
    # (api/lora_config.py; the operator's spec.loras, projected from a ConfigMap).
    enable_lora: bool = False
    lora_modules: tuple[str, ...] | None = None
    lora_config: str | None = None
    max_loras: int = 4
    max_lora_rank: int = 64
    # Speculative decoding (docs/speculative.md): "ngram" proposes up to
    # num_speculative_tokens tokens a step by prompt lookup, verified in one forward pass;
    # None (the default) decodes one token a step. "draft": a smaller model sharing the
    # target's vocabulary (speculative_model, a path) proposes them (spec_decode/draft_model.py).
    speculative_method: SpeculativeMethod | None = None
    num_speculative_tokens: int = 4
    speculative_model: str | None = None

    def __post_init__(self) -> None:
        _check(
            self.block_size > 0 and self.block_size & (self.block_size - 1) == 0,
            f"block_size must be a positive power of two, got {self.block_size}",
        )
        _check(
            self.kv_cache_tokens is None or self.kv_cache_tokens >= self.block_size,
            f"kv_cache_tokens must hold at least one block ({self.block_size} tokens)",
        )
        _check(
            0.0 < self.gpu_memory_utilization <= 1.0,
            f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}",
        )
        _check(self.max_num_seqs >= 1, "max_num_seqs must be >= 1")
        _check(self.max_num_batched_tokens >= 1, "max_num_batched_tokens must be >= 1")
        _check(self.max_model_len is None or self.max_model_len >= 1, "max_model_len must be >= 1")
        _check(self.tensor_parallel_size >= 1, "tensor_parallel_size must be >= 1")
        _check(self.kv_lease_seconds > 0, "kv_lease_seconds must be positive")
        _check(
            0.0 <= self.session_kv_fraction <= 1.0,
            f"session_kv_fraction must be in [0, 1], got {self.session_kv_fraction}",
        )
        _check(self.max_sessions_per_key >= 1, "max_sessions_per_key must be >= 1")
        _check(
            self.dtype in ("auto", "float32", "bfloat16", "float16"),
            f"unknown dtype {self.dtype!r}",
        )
        _check(
            self.pooling in get_args(PoolingKind),
            f"pooling must be last, mean or cls, got {self.pooling!r}",
        )

        _check(
            self.quantized_weights in get_args(QuantizedWeights),
            f"quantized_weights must be auto, exact, int8 or off, got {self.quantized_weights!r}",
        )
        _check(
            self.prefix_cache_scope in get_args(PrefixCacheScope),
            f"prefix_cache_scope must be key or global, got {self.prefix_cache_scope!r}",
        )
        self._check_lora()
        self._check_speculative()
        self._check_nodes()

    def _check_nodes(self) -> None:
        _check(self.nnodes >= 1, "nnodes must be >= 1")
        _check(
            0 <= self.node_rank < self.nnodes,
            f"node_rank must be in [0, nnodes), got {self.node_rank} with nnodes {self.nnodes}",
        )
        _check(
            self.tensor_parallel_size % self.nnodes == 0,
            f"tensor_parallel_size ({self.tensor_parallel_size}) must be a multiple of nnodes "
            f"({self.nnodes}): each node runs the same number of ranks",
        )
        host, _, port = (self.leader_addr or "").rpartition(":")
        _check(
            self.nnodes == 1 or (bool(host) and port.isdigit() and 0 < int(port) < 65536),
            f"nnodes > 1 needs leader_addr as HOST:PORT, got {self.leader_addr!r}",
        )

    @property
    def ranks_per_node(self) -> int:
        """Tensor-parallel ranks each node of the replica runs."""
        return self.tensor_parallel_size // self.nnodes

    def _check_speculative(self) -> None:
        _check(
            self.speculative_method in (None, *get_args(SpeculativeMethod)),
            f"speculative_method must be ngram or draft, got {self.speculative_method!r}",
        )
        _check(
            1 <= self.num_speculative_tokens <= 16,
            f"num_speculative_tokens must be in [1, 16], got {self.num_speculative_tokens}",
        )
        _check(
            (self.speculative_method == "draft") == (self.speculative_model is not None),
            "speculative_method=draft takes a speculative_model, and only it reads one",
        )
        _check(
            self.speculative_model is None or Path(self.speculative_model).exists(),
            f"speculative_model {self.speculative_model!r} does not exist",
        )

    def _check_lora(self) -> None:
        _check(self.max_loras >= 1, "max_loras must be >= 1")
        _check(self.max_lora_rank >= 1, "max_lora_rank must be >= 1")
        modules = self.lora_modules or ()
        names = [m.partition("=")[0] for m in modules]
        _check(
            all(n and p for n, _, p in (m.partition("=") for m in modules)),
            f"lora_modules takes name=path entries, got {list(modules)}",
        )
        _check(len(set(names)) == len(names), f"lora_modules names repeat: {names}")
        _check(
            not (self.lora_enabled and self.tensor_parallel_size > 1),
            "LoRA adapters with tensor_parallel_size > 1 are not supported yet",
        )

    @property
    def lora_enabled(self) -> bool:
        """Adapters may be served: asked for, named at the start, or in a config file."""
        return self.enable_lora or bool(self.lora_modules) or self.lora_config is not None

    @property
    def lora_paths(self) -> dict[str, str]:
        """``lora_modules`` as name -> path."""
        return dict(m.split("=", 1) for m in self.lora_modules or ())

    def replace(self, **changes: object) -> EngineConfig:
        return dataclasses.replace(self, **changes)


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)
