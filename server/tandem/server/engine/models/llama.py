"""The Llama decoder (Mistral too); Qwen2 and Qwen3 are the same network with a few flags.

Tokens of all sequences in a step are flattened into one ``[num_tokens, hidden]`` batch;
attention is the only place sequences are told apart, through the step's attention object.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..attention.base import AttentionStep, KeptRows
from ..parallel import SINGLE, TensorParallel
from .config import ModelConfig
from .layers import GatedMLP, Linear, PackedLinear, RMSNorm, RowParallelLinear
from .rope import RopeTables, RotaryEmbedding


class Attention(nn.Module):
    """Under tensor parallelism each rank holds ``heads / tp`` query and ``kv_heads / tp`` KV heads."""

    def __init__(
        self, cfg: ModelConfig, layer_idx: int, rotary: RotaryEmbedding, tp: TensorParallel = SINGLE
    ) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = tp.divide(cfg.num_attention_heads, "num_attention_heads")
        self.num_kv_heads = tp.divide(cfg.num_key_value_heads, "num_key_value_heads")
        self.head_dim = cfg.head_dim
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = PackedLinear(
            cfg.hidden_size, {"q_proj": q, "k_proj": kv, "v_proj": kv}, cfg.qkv_bias, tp
        )
        self.o_proj = RowParallelLinear(
            cfg.num_attention_heads * self.head_dim, cfg.hidden_size, cfg.o_bias, tp
        )
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.rotary = rotary
        self.split = [q, kv, kv]

    def forward(
        self, rope: RopeTables, x: torch.Tensor, attn: AttentionStep, keep: KeptRows | None = None
    ) -> torch.Tensor:
        """Every row's K and V go to the cache; the output is ``keep``'s rows' (all without)."""
        n = x.shape[0]
        q, k, v = self.qkv_proj(x).split(self.split, dim=-1)
        q = q.view(n, self.num_heads, self.head_dim)
        k = k.view(n, self.num_kv_heads, self.head_dim)
        v = v.view(n, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(rope, q, k)
        out = attn.forward(self.layer_idx, q, k, v, keep)
        return self.o_proj(out.reshape(out.shape[0], self.num_heads * self.head_dim))


class DecoderLayer(nn.Module):
    def __init__(
        self, cfg: ModelConfig, layer_idx: int, rotary: RotaryEmbedding, tp: TensorParallel = SINGLE
    ) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, layer_idx, rotary, tp)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias, tp)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self,
        rope: RopeTables,
        h: torch.Tensor,
        residual: torch.Tensor | None,
        attn: AttentionStep,
        keep: KeptRows | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``h``: the previous layer's MLP output, still to be added to ``residual`` (the stream
        so far; None before the first layer, where ``h`` is the stream). Each add is done by
        the norm after it (``RMSNorm.add``); returns this layer's MLP output and the stream,
        of ``keep``'s rows only where given."""
        if residual is None:
            x, residual = self.input_layernorm(h), h
        else:
            x, residual = self.input_layernorm.add(h, residual)
        out = self.self_attn(rope, x, attn, keep)
        if keep is not None:
            residual = residual[keep.index]
        x, residual = self.post_attention_layernorm.add(out, residual)
        return self.mlp(x), residual


class DecoderModel(nn.Module):
    """The embedding, the final norm (and the lm_head above) are replicated on every TP rank."""

    def __init__(self, cfg: ModelConfig, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        rotary = RotaryEmbedding(cfg.rope, cfg.head_dim, cfg.max_position_embeddings)
        self.rotary = rotary  # shared by every layer's attention
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, i, rotary, tp) for i in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionStep,
        keep: KeptRows | None = None,
    ) -> torch.Tensor:
        """The final hidden states of every row, or of ``keep``'s rows: the last layer
        finishes only those (a prompt's other rows skip one layer's work but its K and V)."""
        h = self.embed_tokens(input_ids)
        rope = self.rotary.tables(positions, h.dtype)
        residual = None
        *layers, last = self.layers
        for layer in layers:
            h, residual = layer(rope, h, residual, attn)
        h, residual = last(rope, h, residual, attn, keep)
        return self.norm.add(h, residual)[0]


class LlamaForCausalLM(nn.Module):
    """Module names mirror HuggingFace's so checkpoints load by name (q/k/v and gate/up packed)."""

    @staticmethod
    def flags(raw: dict[str, Any]) -> dict[str, bool]:
        bias = bool(raw.get("attention_bias", False))
        return {
            "qkv_bias": bias,
            "o_bias": bias,
            "mlp_bias": bool(raw.get("mlp_bias", False)),
            "qk_norm": False,
        }

    def __init__(self, cfg: ModelConfig, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.config = cfg
        self.tp = tp
        self.model = DecoderModel(cfg, tp)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share the output projection with the input embedding (again after ``to_empty``)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionStep,
        keep: KeptRows | None = None,
    ) -> torch.Tensor:
        return self.model(input_ids, positions, attn, keep)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)
