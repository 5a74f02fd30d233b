"""Build one of FlashInfer's kernel modules on this GPU before the tests need it.

FlashInfer compiles each module (dtype, head size, kernel family) on first use, a minute or
more each; ``bench/gpu_run.sh warm`` runs one process per module so they build side by side.
Usage: ``python bench/gpu_warm.py bfloat16|float16 decode|prefill``.
"""

from __future__ import annotations

import sys
import time
from types import SimpleNamespace

import torch

from tandem.server.engine.attention import BatchLayout
from tandem.server.engine.attention.flashinfer_backend import FlashInferAttentionBackend
from tandem.server.engine.kv_cache import KVCache

HEADS, HEAD_DIM, BLOCK = 8, 128, 16


def main(dtype_name: str, kind: str) -> None:
    dtype = getattr(torch, dtype_name)
    # decode: groups of 2 run FlashInfer's decode kernel; prefill: FA2, which groups of 4
    # (tensor-core decode) share
    kv_heads = 4 if kind == "decode" else 2
    cfg = SimpleNamespace(num_hidden_layers=1, num_key_value_heads=kv_heads, head_dim=HEAD_DIM)
    cache = KVCache(cfg, 8, BLOCK, dtype, torch.device("cuda"))
    backend = FlashInferAttentionBackend(cache, HEAD_DIM**-0.5, HEADS)
    q_len = 1 if kind == "decode" else 20
    slots = torch.arange(BLOCK, BLOCK + q_len, device="cuda")
    layout = BatchLayout([q_len], [q_len], [[1, 2]], slots)
    q = torch.randn(q_len, HEADS, HEAD_DIM, dtype=dtype, device="cuda")
    kv = torch.randn(q_len, kv_heads, HEAD_DIM, dtype=dtype, device="cuda")
    start = time.perf_counter()
    backend.plan(layout).forward(0, q, kv, kv)
    torch.cuda.synchronize()
    print(f"{dtype_name} {kind}: built and ran in {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main(*sys.argv[1:])
