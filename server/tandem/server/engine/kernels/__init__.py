"""C kernels for the CPU path, built once per machine and called through ctypes.

``paged_decode.c`` is decode attention reading the paged KV cache in place, a long
sequence's KV heads together a span of tokens at a time (AVX-512 only; bfloat16 q.k in AMX
tiles where the CPU has them), with ``merge_attention`` weighing a row's own pages against
pages shared with other rows;
``prefill_attention.c`` a prompt's causal attention (AVX-512; bfloat16 with AVX512-BF16, in
AMX tiles where the CPU has them) and ``shared_attention``, the pages every decode of a step
begins with attended once for all of them; ``layers.c`` holds the elementwise parts of a
decoder layer (RMSNorm, SiLU * up, rotary embedding), one pass each instead of several torch
ops; ``quant_gemv.c`` multiplies a few rows by weights kept in GGUF's Q8_0 / Q4_0 / Q4_1
blocks (AVX-512 only), and ``quant_vnni.c`` the same product with x quantized to int8 per
block, as llama.cpp does (AVX512-VNNI); ``tile_linear.c`` and ``panel_linear.c`` multiply a
decode step's rows by a weight kept in AMX's tile layout (bfloat16) or in AVX-512 panels
(float32, and bfloat16 without AMX); ``plane_linear.c`` multiplies more rows in float32 on
AMX tiles, each operand three bfloat16 planes; ``decode_chain.c`` runs every decoder layer of a
small decode step in one call, chaining the others; ``sampling.c`` is greedy sampling's argmax
over the logits in the model's dtype and the draw of a row only a temperature shapes.
``kernels.h`` declares what they export, ``amx.h`` what the tile kernels share.
``library.py`` builds and loads them; ``ops.py`` is the typed Python side. ``cuda_ops.py`` is
their GPU counterpart: FlashInfer's fused kernels for 16-bit CUDA tensors. Every kernel has a
plain PyTorch reference that runs where they cannot (no C compiler, a GPU, float16) and that
the tests compare them against.
"""

from . import cuda_ops
from .ops import (
    QUANT_BLOCK,
    QUANT_BLOCK_BYTES,
    QUANT_MAX_ROWS,
    add_rms_norm,
    argmax_rows,
    argmax_rows_for,
    cpu_kernels_for,
    decode_kernel,
    decode_linear,
    decode_linear_for,
    decode_pack,
    draw_rows,
    draw_rows_for,
    merge_attention,
    paged_decode,
    paged_decode_for,
    plane_linear,
    plane_linear_for,
    plane_linear_silu,
    plane_pack,
    prefill_attention,
    prefill_attention_for,
    quant_gemv,
    quant_gemv_for,
    quant_gemv_q8,
    quant_gemv_q8_for,
    quant_kernel,
    rms_norm,
    rope_,
    shared_attention,
    shared_attention_for,
    silu_and_mul,
)

__all__ = [
    "add_rms_norm",
    "argmax_rows",
    "argmax_rows_for",
    "QUANT_BLOCK",
    "QUANT_BLOCK_BYTES",
    "QUANT_MAX_ROWS",
    "cpu_kernels_for",
    "cuda_ops",
    "decode_linear",
    "decode_kernel",
    "decode_linear_for",
    "decode_pack",
    "draw_rows",
    "draw_rows_for",
    "merge_attention",
    "paged_decode",
    "paged_decode_for",
    "plane_linear",
    "plane_linear_for",
    "plane_linear_silu",
    "plane_pack",
    "prefill_attention",
    "prefill_attention_for",
    "quant_gemv",
    "quant_gemv_for",
    "quant_gemv_q8",
    "quant_gemv_q8_for",
    "quant_kernel",
    "rms_norm",
    "rope_",
    "shared_attention",
    "shared_attention_for",
    "silu_and_mul",
]
