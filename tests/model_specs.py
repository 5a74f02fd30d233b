"""The tiny models' shapes: the CPU tests' defaults, and the GPU tests' head size of 128.

FlashInfer builds kernels for head sizes 64, 128 and 256, not the tiny models' 16, so the GPU
tests use models as small at head size 128: llama's 4 query heads share one KV head (the
tensor-core decode path, as Llama-3.1-8B's groups of 4), qwen2's and qwen3's two each.
Their checkpoints are bfloat16, so an engine on ``--dtype auto`` takes FlashInfer and CUDA
graphs. ``TANDEM_TEST_GPU=1`` makes the API tests' engines (and ``tandem up``'s) use these.
"""

from __future__ import annotations

import os

from tandem.server.engine.tiny_model import TinyModelSpec

_GPU = dict(seed=1, intermediate_size=1024, dtype="bfloat16")
GPU_SPECS = {
    "llama": TinyModelSpec("llama", hidden_size=512, num_key_value_heads=1, **_GPU),
    "qwen2": TinyModelSpec("qwen2", hidden_size=512, **_GPU),
    "qwen3": TinyModelSpec("qwen3", hidden_size=256, **_GPU),
}


def on_gpu() -> bool:
    """Whether the API tests run their engines on a GPU in bfloat16 (``TANDEM_TEST_GPU=1``)."""
    return os.environ.get("TANDEM_TEST_GPU") == "1"


def api_spec(arch: str) -> TinyModelSpec:
    return GPU_SPECS[arch] if on_gpu() else TinyModelSpec(arch=arch)
