"""Rotary position embeddings with the scaling schemes HuggingFace configs name.

The formulas follow transformers' ``modeling_rope_utils`` exactly (float32 inverse
frequencies, cos/sin scaled by the attention factor), since generation is checked token for
token against it.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
from torch import nn

from .. import kernels


def inverse_frequencies(
    params: dict[str, Any], head_dim: int, max_position: int
) -> tuple[torch.Tensor, float]:
    rope_type = params.get("rope_type", "default")
    base = float(params["rope_theta"])
    dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float) / dim)
    inv_freq = 1.0 / pos_freqs
    if rope_type in ("default", "dynamic"):
        return inv_freq, 1.0
    if rope_type == "linear":
        return inv_freq / params["factor"], 1.0
    if rope_type == "llama3":
        return _llama3(inv_freq, params), 1.0
    if rope_type == "yarn":
        return _yarn(pos_freqs, params, dim, base, max_position)
    raise ValueError(
        f"unsupported rope_type {rope_type!r} (supported: default, linear, llama3, yarn, dynamic)"
    )


def _llama3(inv_freq: torch.Tensor, p: dict[str, Any]) -> torch.Tensor:
    factor, low, high = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
    old_len = p["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn(
    pos_freqs: torch.Tensor, p: dict[str, Any], dim: int, base: float, max_position: int
) -> tuple[torch.Tensor, float]:
    original = p["original_max_position_embeddings"]
    factor = p.get("factor") or max_position / original

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = p.get("attention_factor")
    if attention_factor is None:
        if p.get("mscale") and p.get("mscale_all_dim"):
            attention_factor = float(
                mscale(factor, p["mscale"]) / mscale(factor, p["mscale_all_dim"])
            )
        else:
            attention_factor = mscale(factor)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(p.get("beta_fast") or 32), correction_dim(p.get("beta_slow") or 1)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (
        1.0 / pos_freqs
    ) * extrapolation
    return inv_freq, attention_factor


class RopeTables(NamedTuple):
    """A step's rotary inputs, looked up once per step rather than per layer."""

    cos: torch.Tensor  # [tokens, 1, rotary_dim]
    sin: torch.Tensor
    positions: torch.Tensor  # [tokens]


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin for every position up to ``max_position``; applied in place of HF's.

    One float32 table per device, ``cos_sin`` ``[max_position, rotary_dim]``: the cos of each
    frequency, then its sin (the layout FlashInfer's fused rotary reads). HF's full-width
    cos and sin repeat each half twice, so ``tables`` rebuilds a step's rows from it.
    """

    def __init__(self, params: dict[str, Any], head_dim: int, max_position: int) -> None:
        super().__init__()
        inv_freq, scale = inverse_frequencies(params, head_dim, max_position)
        self.rotary_dim = inv_freq.numel() * 2
        positions = torch.arange(max_position, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq)
        cos_sin = torch.cat((freqs.cos() * scale, freqs.sin() * scale), dim=-1)
        self.register_buffer("cos_sin", cos_sin, persistent=False)

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> RopeTables:
        """cos/sin rows of a step's positions (``[tokens, 1, rotary_dim]``, contiguous, in
        ``dtype``), looked up once per step rather than per layer."""
        rows = self.cos_sin[positions].unsqueeze(1)
        half = self.rotary_dim // 2
        cos = rows[..., :half].repeat(1, 1, 2).to(dtype)
        sin = rows[..., half:].repeat(1, 1, 2).to(dtype)
        return RopeTables(cos, sin, positions)

    def forward(
        self, rope: RopeTables, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = rope.cos, rope.sin
        if kernels.cuda_ops.cuda_kernels_for(q.device, q.dtype):  # in place, as below
            return kernels.cuda_ops.rope_(q, k, rope.positions, self.cos_sin)
        if kernels.cpu_kernels_for(q.device, q.dtype):  # in place: q and k are this step's own
            return kernels.rope_(q, cos, sin), kernels.rope_(k, cos, sin)
        return _apply(q, cos, sin, self.rotary_dim), _apply(k, cos, sin, self.rotary_dim)


def _apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int) -> torch.Tensor:
    if rotary_dim < x.shape[-1]:
        rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
        return torch.cat((_apply(rot, cos, sin, rotary_dim), rest), dim=-1)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
