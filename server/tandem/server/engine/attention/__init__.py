"""Attention backends behind one interface; ``select_backend`` picks one for the device."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..kv_cache import KVCache
from .base import AttentionBackend, AttentionStep, BatchLayout
from .torch_backend import TorchAttentionBackend

__all__ = [
    "AttentionBackend",
    "AttentionStep",
    "BatchLayout",
    "TorchAttentionBackend",
    "choose_backend",
    "flashinfer_available",
    "select_backend",
]

BACKENDS = ("auto", "torch", "flashinfer")
_FLASHINFER_DTYPES = (torch.float16, torch.bfloat16)


def flashinfer_available() -> bool:
    try:
        import flashinfer  # noqa: F401
    except Exception:
        return False
    return True


def choose_backend(
    name: str,
    device_type: str,
    dtype: torch.dtype,
    flashinfer_ok: Callable[[], bool] = flashinfer_available,
) -> str:
    """The backend to build: ``auto`` means FlashInfer on CUDA in float16/bfloat16 when it imports.

    Explicitly asking for ``flashinfer`` where it cannot run is an error, never a silent fallback.
    """
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r} ({', '.join(BACKENDS)})")
    if name == "torch":
        return "torch"
    if name == "auto":
        usable = device_type == "cuda" and dtype in _FLASHINFER_DTYPES and flashinfer_ok()
        return "flashinfer" if usable else "torch"
    if device_type != "cuda":
        raise ValueError(
            f"the flashinfer attention backend needs a CUDA device, not {device_type!r}"
        )
    if dtype not in _FLASHINFER_DTYPES:
        raise ValueError(
            f"the flashinfer attention backend takes float16 or bfloat16, not {dtype}; "
            "use --dtype bfloat16, or attention_backend torch"
        )
    if not flashinfer_ok():
        raise ValueError("attention_backend=flashinfer but the flashinfer package does not import")
    return "flashinfer"


def select_backend(
    name: str, kv_cache: KVCache, scale: float, num_qo_heads: int | None = None
) -> AttentionBackend:
    """Build the chosen backend over ``kv_cache``; ``num_qo_heads`` is this rank's query heads."""
    chosen = choose_backend(name, kv_cache.device.type, kv_cache.dtype)
    if chosen == "flashinfer":
        from .flashinfer_backend import FlashInferAttentionBackend

        if num_qo_heads is None:
            raise ValueError("the flashinfer backend needs the number of query heads")
        return FlashInferAttentionBackend(kv_cache, scale, num_qo_heads)
    return TorchAttentionBackend(kv_cache, scale)
