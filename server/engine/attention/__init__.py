"""Attention backends behind one interface; ``select_backend`` picks one for the device."""
from __future__ import annotations

from ..kv_cache import KVCache
from .base import AttentionBackend, AttentionStep, BatchLayout
from .torch_backend import TorchAttentionBackend

__all__ = ["AttentionBackend", "AttentionStep", "BatchLayout", "TorchAttentionBackend", "select_backend"]


def select_backend(name: str, kv_cache: KVCache, scale: float) -> AttentionBackend:
    """``auto`` means FlashInfer on CUDA when it imports, else the torch reference."""
    if name == "flashinfer" or (name == "auto" and kv_cache.device.type == "cuda" and _flashinfer_available()):
        if kv_cache.device.type != "cuda":
            raise ValueError("the flashinfer attention backend needs a CUDA device")
        if not _flashinfer_available():
            raise ValueError("attention_backend=flashinfer but the flashinfer package does not import")
        raise ValueError("the flashinfer attention backend is not built yet; use attention_backend=torch")
    if name not in ("auto", "torch", "flashinfer"):
        raise ValueError(f"unknown attention backend {name!r} (auto, torch, flashinfer)")
    return TorchAttentionBackend(kv_cache, scale)


def _flashinfer_available() -> bool:
    try:
        import flashinfer  # noqa: F401
    except Exception:
        return False
    return True
