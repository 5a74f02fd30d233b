"""The subset of a HuggingFace config.json our decoder models need, read once and frozen.

A model is an HF-format directory (its ``config.json``) or a GGUF file (its metadata, mapped
onto the same fields by ``gguf_loader``); ``loader.read_model_config`` reads either. A leaf:
it imports nothing of the engine, so anything may hold a ``ModelConfig``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ModelLoadError(ValueError):
    """Not a loadable model: a missing file or tensor, a shape that disagrees, an unsupported
    architecture or format. The message names what; the CLIs print it instead of a traceback."""


class WeightsMismatchError(ModelLoadError):
    """Weights that cannot replace the running ones: another architecture, config or tensor
    shape (``/update_weights`` answers 409)."""


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    rope: dict[str, Any] = field(default_factory=dict)
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    torch_dtype: str = "float32"
    eos_token_ids: tuple[int, ...] = ()
    # Trained for Matryoshka truncation (embeddings' ``dimensions``), as vLLM reads config.json.
    is_matryoshka: bool = False
    matryoshka_dimensions: tuple[int, ...] = ()

    @staticmethod
    def from_dict(raw: dict[str, Any], flags: dict[str, bool]) -> ModelConfig:
        """An HF ``config.json`` dict; ``flags`` (biases, q/k norm) are its family's
        (``loader.read_model_config`` looks the family up, so this module imports no model)."""
        heads = raw["num_attention_heads"]
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        return ModelConfig(
            architecture=architecture_of(raw),
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=raw.get("num_key_value_heads") or heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            rope=rope_parameters(raw),
            torch_dtype=str(raw.get("dtype") or raw.get("torch_dtype") or "float32"),
            eos_token_ids=eos_ids,
            is_matryoshka=bool(raw.get("is_matryoshka") or raw.get("matryoshka_dimensions")),
            matryoshka_dimensions=tuple(raw.get("matryoshka_dimensions") or ()),
            **flags,
        )


def architecture_of(raw: dict[str, Any]) -> str:
    """The HF architecture a ``config.json`` dict names (Llama when it names none)."""
    return (raw.get("architectures") or ["LlamaForCausalLM"])[0]


def rope_parameters(raw: dict[str, Any]) -> dict[str, Any]:
    """One dict for RoPE whichever way the config spells it (transformers 4 or 5)."""
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    params["rope_type"] = params.get("rope_type") or params.get("type") or "default"
    params.setdefault("rope_theta", raw.get("rope_theta", 10000.0))
    if params["rope_type"] in ("llama3", "yarn"):
        params.setdefault(
            "original_max_position_embeddings",
            raw.get("original_max_position_embeddings") or raw.get("max_position_embeddings", 2048),
        )
    return params


def eos_token_ids(model_dir: str, cfg: ModelConfig, tokenizer: object) -> set[int]:
    """The ids that end generation: generation_config.json's, else config.json's, else the tokenizer's."""
    gen = Path(model_dir) / "generation_config.json"
    if gen.exists():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        if eos is not None:
            return set(eos) if isinstance(eos, list) else {eos}
    if cfg.eos_token_ids:
        return set(cfg.eos_token_ids)
    eos_id = getattr(tokenizer, "eos_token_id", None)
    return {eos_id} if eos_id is not None else set()
