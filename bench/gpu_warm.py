"""Build one of FlashInfer's kernel modules on this GPU before the tests need it.

FlashInfer compiles each module (dtype, head size, kernel family) on first use, half a
minute or more each; ``bench/gpu_run.sh warm`` runs one process per module so they build
side by side. Usage: ``python bench/gpu_warm.py bfloat16|float16 decode|prefill`` for the
attention kernels at head size 128, ``python bench/gpu_warm.py norm|rope|act`` for the fused
layer kernels (one module each, every 16-bit dtype).
"""

from __future__ import annotations

import sys
import time
from types import SimpleNamespace

import torch

from tandem.server.engine.attention import BatchLayout
from tandem.server.engine.attention.flashinfer_backend import FlashInferAttentionBackend
from tandem.server.engine.kernels import cuda_ops
from tandem.server.engine.kv_cache import KVCache

HEADS, HEAD_DIM, BLOCK = 8, 128, 16


def attention(dtype: torch.dtype, kind: str) -> None:
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
    backend.plan(layout).forward(0, q, kv, kv)


def layer_kernel(kind: str) -> None:
    x = torch.randn(4, HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
    if kind == "norm":
        cuda_ops.rms_norm(x, torch.ones(HEAD_DIM, dtype=x.dtype, device="cuda"), 1e-6)
    elif kind == "act":
        cuda_ops.silu_and_mul(x.view(4, -1))
    else:
        cos_sin = torch.randn(64, HEAD_DIM, device="cuda")
        cuda_ops.rope_(x, x.clone(), torch.arange(4, device="cuda"), cos_sin)


def main(*args: str) -> None:
    start = time.perf_counter()
    if len(args) == 2:
        attention(getattr(torch, args[0]), args[1])
    else:
        layer_kernel(args[0])
    torch.cuda.synchronize()
    print(f"{' '.join(args)}: built and ran in {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main(*sys.argv[1:])
