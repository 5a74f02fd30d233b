"""Qwen2: the Llama network with biases on q, k and v (none on o)."""

from __future__ import annotations

from typing import Any

from .llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def flags(raw: dict[str, Any]) -> dict[str, bool]:
        return {"qkv_bias": True, "o_bias": False, "mlp_bias": False, "qk_norm": False}
