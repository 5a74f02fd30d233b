"""The tiny models' shapes: the CPU tests' defaults, and the GPU tests' head size of 128.

FlashInfer builds kernels for head sizes 64, 128 and 256, not the tiny models' 16, so the GPU
tests use models as small at head size 128: llama's 4 query heads share one KV head (the
tensor-core decode path, as Llama-3.1-8B's groups of 4), qwen2's and qwen3's two each.
``TANDEM_TEST_GPU=1`` makes the API tests' engines use these, in bfloat16.
"""

from __future__ import annotations

import os

from tandem.server.engine.tiny_model import TinyModelSpec

GPU_SPECS = {
    "llama": TinyModelSpec(
        "llama", 1, hidden_size=512, intermediate_size=1024, num_key_value_heads=1
    ),
    "qwen2": TinyModelSpec("qwen2", 1, hidden_size=512, intermediate_size=1024),
    "qwen3": TinyModelSpec("qwen3", 1, hidden_size=256, intermediate_size=512),
}


def on_gpu() -> bool:
    """Whether the API tests run their engines on a GPU in bfloat16 (``TANDEM_TEST_GPU=1``)."""
    return os.environ.get("TANDEM_TEST_GPU") == "1"


def api_spec(arch: str) -> TinyModelSpec:
    return GPU_SPECS[arch] if on_gpu() else TinyModelSpec(arch=arch)
