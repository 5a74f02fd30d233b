"""Qwen3: the Llama network with per-head RMSNorm on q and k before RoPE, and an explicit head_dim."""

from __future__ import annotations

from typing import Any

from .llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def flags(raw: dict[str, Any]) -> dict[str, bool]:
        bias = bool(raw.get("attention_bias", False))
        return {"qkv_bias": bias, "o_bias": bias, "mlp_bias": False, "qk_norm": True}
