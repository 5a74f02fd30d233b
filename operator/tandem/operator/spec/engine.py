"""``spec.engine``: the engine settings every engine role shares."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field

from .rules import Rule, SpecModel


class EngineSpec(SpecModel):
    """Engine settings shared by every engine role. Names are ``EngineConfig``'s fields.

    Unset fields keep the engine's own default, so the CRD does not freeze defaults that
    belong to the engine. ``tensorParallelSize`` is not here: it is each role's ``gpus``.
    """

    image: str | None = Field(
        None, description="Engine image (default: the operator's configured image)"
    )
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] | None = Field(
        None, description="Image pull policy"
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] | None = Field(
        None, description="Weights and activations dtype"
    )
    block_size: int | None = Field(
        None, ge=1, le=1024, description="KV cache block size in tokens (a power of two)"
    )
    max_model_len: int | None = Field(
        None, ge=1, description="Longest sequence (prompt + output) in tokens"
    )
    gpu_memory_utilization: float | None = Field(
        None,
        gt=0,
        le=1,
        description="Fraction of GPU memory the engine may use for weights and KV cache",
    )
    kv_cache_tokens: int | None = Field(
        None, ge=1, description="KV cache size in tokens (overrides gpuMemoryUtilization)"
    )
    max_num_seqs: int | None = Field(None, ge=1, description="Most sequences in one batch")
    max_num_batched_tokens: int | None = Field(
        None, ge=1, description="Token budget of one engine step"
    )
    enable_prefix_caching: bool | None = Field(
        None, description="Reuse KV blocks of shared prefixes"
    )
    prefix_cache_scope: Literal["key", "global"] | None = Field(
        None,
        description="Whose cached prefixes a request may reuse: its own API key's (key, the "
        "default) or every key's (global)",
    )
    attention_backend: Literal["auto", "torch", "flashinfer"] | None = Field(
        None, description="Attention kernels"
    )
    quantized_weights: Literal["auto", "exact", "int8", "off"] | None = Field(
        None,
        description="A GGUF model's Q8_0/Q4_0/Q4_1 weights multiplied as blocks at decode batch "
        "sizes on AVX-512 CPUs, with activations in float32 (auto, exact) or quantized to int8 "
        "(int8: VNNI dot products as llama.cpp's, faster, greedy tokens may differ), or always "
        "dequantized (off)",
    )
    enforce_eager: bool | None = Field(None, description="Disable CUDA graphs")
    seed: int | None = Field(None, description="Sampling seed for requests without their own")
    kv_lease_seconds: float | None = Field(
        None,
        gt=0,
        description="Seconds a prefill engine holds exported KV blocks for the decode engine to pull",
    )
    kv_pull_fallback: Literal["error", "recompute"] | None = Field(
        None,
        description="When a decode engine cannot pull the KV cache: fail the request, or recompute the prefill",
    )
    session_kv_fraction: float | None = Field(
        None,
        ge=0,
        le=1,
        description="Fraction of the KV cache idle sessions may hold; beyond it the least recently used give theirs back",
    )
    max_sessions_per_key: int | None = Field(
        None,
        ge=1,
        description="Sessions one client key keeps at once; past it that key's own least recently used idle session goes, never another key's",
    )
    pooling: Literal["last", "mean", "cls"] | None = Field(
        None,
        description="Embeddings and /pooling: the last token's hidden state, the mean, or the first (CLS)",
    )
    enable_lora: bool | None = Field(
        None, description="LoRA adapters may be loaded at run time (implied by loraModules)"
    )
    lora_modules: tuple[str, ...] | None = Field(
        None,
        description="LoRA adapters served from the start, each 'name=path' (a PEFT directory in the pod)",
    )
    max_loras: int | None = Field(
        None, ge=1, description="LoRA adapters resident (and used by running requests) at once"
    )
    max_lora_rank: int | None = Field(None, ge=1, description="The highest LoRA rank accepted")
    speculative_method: Literal["ngram", "draft"] | None = Field(
        None,
        description="Speculative decoding: ngram (prompt lookup) or draft (speculativeModel) "
        "proposes tokens verified in one forward pass; unset decodes one token a step",
    )
    num_speculative_tokens: int | None = Field(
        None, ge=1, le=16, description="Most tokens proposed per step (adapted to acceptance)"
    )
    speculative_model: str | None = Field(
        None,
        description="The draft model of speculativeMethod draft: a smaller model sharing the "
        "target's vocabulary (a path in the engine's pod)",
    )
    extra_args: list[str] = Field(
        default_factory=list, description="More 'tandem serve' flags, appended as given"
    )
    env: dict[str, str] = Field(
        default_factory=dict, description="Environment variables for the engine containers"
    )
    shutdown_timeout_seconds: int = Field(
        30, ge=0, le=3600, description="Seconds running requests may take to finish after SIGTERM"
    )
    startup_timeout_seconds: int = Field(
        1800,
        ge=60,
        le=86400,
        description="Seconds a pod may take to load the model before it is restarted",
    )

    rules: ClassVar[tuple[Rule, ...]] = (
        Rule(
            "!has(self.blockSize) || [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024].exists(p, p == self.blockSize)",
            "engine.blockSize must be a power of two",
            lambda e: e.block_size is None or e.block_size & (e.block_size - 1) == 0,
            field=".blockSize",
        ),
        Rule(
            "!has(self.kvCacheTokens) || !has(self.blockSize) || self.kvCacheTokens >= self.blockSize",
            "engine.kvCacheTokens must hold at least one block",
            lambda e: (
                e.kv_cache_tokens is None
                or e.block_size is None
                or e.kv_cache_tokens >= e.block_size
            ),
        ),
    )
