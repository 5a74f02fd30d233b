"""CLI flags for every ``EngineConfig`` field, derived from the dataclass so names never drift.

``--block-size`` is ``EngineConfig.block_size`` is the CRD's ``spec.engine.blockSize``.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing

from .config import EngineConfig

_SKIP = {"model"}

# What each flag does; ``--help`` adds the field's default. A field without an entry here
# fails ``tests/engine/test_engine_api.py`` (every flag says what it is for).
HELP = {
    "dtype": "the weights' and KV cache's dtype (auto: the checkpoint's; float32 on CPU)",
    "device": "cpu, cuda or cuda:N (auto: cuda when there is one)",
    "block_size": "tokens per KV-cache block (a power of two)",
    "kv_cache_tokens": "the KV cache's size in tokens (none: a share of free memory)",
    "gpu_memory_utilization": "the share of device memory this engine may hold (CPU: of "
    "available RAM)",
    "max_kv_cache_bytes": "on CPU, the KV cache's cap in bytes",
    "max_num_seqs": "sequences running at once",
    "max_num_batched_tokens": "tokens per step (long prompts are prefilled in chunks)",
    "max_model_len": "the longest prompt + output (none: the model's, within the cache)",
    "enable_prefix_caching": "reuse cached KV blocks of a shared prompt prefix",
    "prefix_cache_scope": "whose cached blocks a request may hit: its own key's, or global",
    "attention_backend": "the attention kernels (auto: flashinfer on a GPU when installed)",
    "quantized_weights": "a GGUF's Q8_0/Q4_0/Q4_1 weights multiplied as blocks with x in "
    "float32 (auto, exact) or in int8 (int8: VNNI, faster, not greedy-exact), or dequantized "
    "(off)",
    "enforce_eager": "no CUDA graphs for decode",
    "tensor_parallel_size": "GPUs (ranks) the model is split over, on all nodes together",
    "nnodes": "processes (nodes) one replica's ranks are split over (a LeaderWorkerSet group)",
    "node_rank": "this process's node in the replica: 0 serves the API, the others run ranks",
    "leader_addr": "HOST:PORT where the replica's nodes join the process group (node 0 "
    "listens there)",
    "seed": "the seed of requests without one",
    "kv_lease_seconds": "P/D: how long a prefill engine keeps blocks no decode engine pulled",
    "kv_pull_fallback": "P/D: when a KV pull fails, end the request (error) or prefill on "
    "the decode engine (recompute)",
    "session_kv_fraction": "the share of KV blocks idle sessions may keep",
    "max_sessions_per_key": "sessions one client key keeps at once",
    "pooling": "embeddings: the last token's hidden state, the mean, or the first (cls)",
    "enable_lora": "serve LoRA adapters (loaded by --lora-modules or POST /v1/load_lora_adapter)",
    "lora_modules": "LoRA adapters to serve, as name=path (PEFT's format; docs/lora.md)",
    "lora_config": "a JSON file of LoRA adapters ([{name, path}]) kept served as it changes "
    "(implies --enable-lora; docs/lora.md)",
    "max_loras": "LoRA adapters resident at once (least recently used evicted)",
    "max_lora_rank": "the highest LoRA rank accepted",
    "speculative_method": "speculative decoding: ngram (prompt lookup) or draft (--speculative-model) proposes tokens "
    "verified in one step (docs/speculative.md); none decodes one token a step",
    "num_speculative_tokens": "the most tokens proposed a step (adapted to acceptance)",
    "speculative_model": "the draft model of --speculative-method draft: a smaller model sharing the target's "
    "vocabulary (a GGUF file or HF folder; tandem make-draft makes one)",
}


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine")
    hints = typing.get_type_hints(EngineConfig)
    for f in dataclasses.fields(EngineConfig):
        if f.name in _SKIP:
            continue
        flag = "--" + f.name.replace("_", "-")
        hint = hints[f.name]
        default = "none" if f.default is None else f.default
        text = f"{HELP.get(f.name, '')} (default: {default})".lstrip()
        if hint is bool:
            group.add_argument(
                flag, dest=f.name, action=argparse.BooleanOptionalAction, default=None, help=text
            )
        elif _is_tuple(hint):  # a list of strings: --lora-modules a=x b=y
            group.add_argument(flag, dest=f.name, nargs="+", default=None, help=text)
        else:
            group.add_argument(
                flag,
                dest=f.name,
                type=_scalar_type(hint),
                default=None,
                help=text,
                choices=typing.get_args(hint)
                if typing.get_origin(hint) is typing.Literal
                else None,
            )


def _is_tuple(hint: object) -> bool:
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return typing.get_origin(hint) is tuple or any(typing.get_origin(a) is tuple for a in args)


def _scalar_type(hint: object) -> type:
    if typing.get_origin(hint) is typing.Literal:
        return str
    args = [a for a in typing.get_args(hint) if a is not type(None)] or [hint]
    return args[0] if args[0] in (int, float, str) else str


def engine_config_from_args(args: argparse.Namespace, model: str) -> EngineConfig:
    """Only flags the user gave override the dataclass defaults."""
    given = {
        f.name: _field_value(getattr(args, f.name))
        for f in dataclasses.fields(EngineConfig)
        if f.name not in _SKIP and getattr(args, f.name, None) is not None
    }
    return EngineConfig(model=model, **given)


def _field_value(value: object) -> object:
    return tuple(value) if isinstance(value, list) else value
