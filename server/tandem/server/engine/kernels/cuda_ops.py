"""FlashInfer's fused layer kernels for 16-bit CUDA tensors: one launch where the PyTorch
reference takes several.

A decode step of a small model is bound by launches, not bytes: Qwen3-0.6B at batch 1 took
4.2 ms on an H100 against a 0.42 ms HBM floor, with some 45 kernels a layer, most of them
the norms' and the rotary embedding's elementwise ops. These run one kernel each (RMSNorm,
the residual add with the next RMSNorm, rotary on q and k in place, SiLU * up), in float32
inside and rounded once. Callers check ``cuda_kernels_for`` first and keep their PyTorch
code, the CPU path and the tests' oracle, for everything else.
"""

from __future__ import annotations

import functools
import importlib
from types import ModuleType

import torch

DTYPES = (torch.float16, torch.bfloat16)


@functools.cache
def _flashinfer() -> ModuleType | None:
    try:
        return importlib.import_module("flashinfer")
    except Exception:  # not installed, or no CUDA toolkit it can build with
        return None


def cuda_kernels_for(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the fused kernels can take tensors on ``device`` in ``dtype``."""
    return device.type == "cuda" and dtype in DTYPES and _flashinfer() is not None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension (rows of any leading shape)."""
    rows = x.reshape(-1, x.shape[-1])
    return _flashinfer().norm.rmsnorm(rows, weight, eps).view(x.shape)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The RMSNorm of ``x + residual`` and that sum, in one launch where the add was a kernel of
    its own; in place: ``residual`` becomes the sum and ``x`` its norm (both are returned)."""
    dim = x.shape[-1]
    _flashinfer().norm.fused_add_rmsnorm(x.view(-1, dim), residual.view(-1, dim), weight, eps)
    return x, residual


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SiLU of the first half of the last dimension times its second half."""
    return _flashinfer().activation.silu_and_mul(gate_up)


def rope_(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary embedding (NeoX halves) on q ``[n, heads, dim]`` and k in place.

    ``cos_sin`` is float32 ``[max_position, rotary_dim]``: cos of each frequency, then sin.
    """
    n, _, dim = q.shape
    _flashinfer().rope.apply_rope_with_cos_sin_cache_inplace(
        positions, q.reshape(n, -1), k.reshape(n, -1), dim, cos_sin, is_neox=True
    )
    return q, k
