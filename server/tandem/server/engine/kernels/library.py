"""Builds the C kernels into one shared library per machine and loads it with ctypes.

It is compiled with the machine's own compiler for the machine's own ISA (``-march=native``),
cached in Tandem's cache directory (``paths.cache_dir``) by a hash of the sources,
flags and CPU, and linked against the OpenMP runtime PyTorch already loaded (one thread pool,
not two). Where no C compiler is installed, or the build fails, ``load`` says so once and
returns None: callers keep their PyTorch path.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from .. import cpu
from ..paths import cache_dir

log = logging.getLogger(__name__)

HERE = Path(__file__).parent
SOURCES = [
    HERE / f
    for f in (
        "paged_decode.c",
        "prefill_attention.c",
        "layers.c",
        "quant_gemv.c",
        "quant_vnni.c",
        "decode_chain.c",
        "tile_linear.c",
        "plane_linear.c",
        "panel_linear.c",
        "sampling.c",
    )
]
HEADERS = [
    HERE / f
    for f in ("amx.h", "convert.h", "kernels.h", "vector16.h", "quant_blocks.h", "quant_columns.h")
]
# Reassociation (not -ffast-math: infinities stay) lets the dot products and sums vectorise.
FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fno-trapping-math", "-fassociative-math"]
FLAGS += ["-fno-signed-zeros", "-fopenmp", "-shared", "-fPIC"]

_P, _I, _I64, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
SIGNATURES = {
    # q, q_stride, k, v, out, out_stride, tables, width, lens, batch, heads, kv_heads, dim,
    # block_size, max_len, scale, bf16, threads, lse (or NULL)
    "paged_decode": [_P, _I64, _P, _P, _P, _I64, _P, _I, _P] + [_I] * 6 + [_F, _I, _I, _P],
    # q, q_stride, k, v, pages, num_pages, block_size, batch, heads, kv_heads, dim, scale, bf16,
    # threads, out, lse
    "shared_attention": [_P, _I64, _P, _P, _P] + [_I] * 6 + [_F, _I, _I, _P, _P],
    "shared_attention_tiles": [],  # returns an int: RESULTS
    # out, out_stride, lse, shared, shared_lse, batch, heads, dim, bf16
    "merge_attention": [_P, _I64, _P, _P, _P, _I, _I, _I, _I],
    # q, q_stride, k, v, kv_stride, out, out_stride, q_len, kv_len, heads, kv_heads, dim, scale,
    # bf16 (only where prefill_attention_bf16 is 1), threads
    "prefill_attention": [_P, _I64, _P, _P, _I64, _P, _I64] + [_I] * 5 + [_F, _I, _I],
    # x, out, weight, rows, dim, x_stride, eps, bf16, threads
    "rms_norm": [_P, _P, _P, _I, _I, _I64, _F, _I, _I],
    # x, residual, sum, out, weight, rows, dim, eps, bf16, threads
    "add_rms_norm": [_P, _P, _P, _P, _P, _I, _I, _F, _I, _I],
    # gate_up, out, rows, inter, bf16, threads
    "silu_mul": [_P, _P, _I, _I, _I, _I],
    # x, cos, sin, tokens, heads, head_dim, rotary_dim, token_stride, bf16, threads
    "rope": [_P, _P, _P, _I, _I, _I, _I, _I64, _I, _I],
    # x, x_stride, blocks, block_row_bytes, y, y_stride, rows, N, K, ggml type, bf16, threads
    "quant_gemv": [_P, _I64, _P, _I64, _P, _I64] + [_I] * 6,
    "quant_gemv_q8": [_P, _I64, _P, _I64, _P, _I64] + [_I] * 6,  # quant_gemv's, AVX512-VNNI
    # h, layers (chain_layer[]), num_layers, step (chain_step *)
    "decode_chain": [_P, _P, _I, _P],
    # w, n, k, out
    "tile_pack": [_P, _I, _I, _P],
    # x, x_stride, m, k, packed, n, bias (or NULL), out, out_stride, threads
    "tile_linear": [_P, _I64, _I, _I, _P, _I, _P, _P, _I64, _I],
    # x, x_stride, m, k, packed gate|up, inter, out, out_stride, threads
    "tile_linear_silu": [_P, _I64, _I, _I, _P, _I, _P, _I64, _I],
    "tile_linear_tiles": [],  # returns an int: RESULTS
    # w, n, k, out
    "plane_pack": [_P, _I, _I, _P],
    # x, x_stride, m, k, packed, n, bias (or NULL), out, out_stride, threads
    "plane_linear": [_P, _I64, _I, _I, _P, _I, _P, _P, _I64, _I],
    # x, x_stride, m, k, packed gate|up, inter, out, out_stride, threads
    "plane_linear_silu": [_P, _I64, _I, _I, _P, _I, _P, _I64, _I],
    "plane_linear_tiles": [],  # returns an int: RESULTS
    # w, n, k, out
    "panel_pack": [_P, _I, _I, _P],
    # x, x_stride, m, k, packed, n, bias (or NULL), out, out_stride, threads
    "panel_linear": [_P, _I64, _I, _I, _P, _I, _P, _P, _I64, _I],
    "panel_pack_bf16": [_P, _I, _I, _P],
    "panel_linear_bf16": [_P, _I64, _I, _I, _P, _I, _P, _P, _I64, _I],
    "panel_pack_pairs": [_P, _I, _I, _P],
    "panel_linear_pairs": [_P, _I64, _I, _I, _P, _I, _P, _P, _I64, _I],
    # logits, stride, rows, vocab, bf16, threads, best, ids
    "argmax_rows": [_P, _I64, _I, _I, _I, _I, _P, _P],
    # logits, stride, rows, vocab, bf16, temps (or NULL), uniforms (float64), threads, best, ids
    "draw_rows": [_P, _I64, _I, _I, _I, _P, _P, _I, _P, _P],
}

RESULTS = {
    "shared_attention_tiles": _I,
    "tile_linear_tiles": _I,
    "plane_linear_tiles": _I,
}  # the functions that return something


@functools.cache
def load() -> ctypes.CDLL | None:
    """The built library, or None (with one warning) where it cannot be built."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        log.warning("no C compiler: the CPU path runs without its C kernels")
        return None
    path = cache_dir() / "kernels" / f"tandem-kernels-{_build_key(compiler)}.so"
    if not path.exists():
        try:
            _build(compiler, path)
        except (OSError, subprocess.SubprocessError) as exc:
            log.warning("could not build the CPU kernels (%s): running without them", exc)
            return None
    lib = ctypes.CDLL(str(path))
    for name, argtypes in SIGNATURES.items():
        if hasattr(lib, name):  # paged_decode, prefill_attention, quant_gemv*, decode_chain:
            # AVX-512 only (panel_*, argmax_rows, draw_rows too); tile_*, plane_*: AMX only
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = argtypes, RESULTS.get(name)
    return lib


def _build_key(compiler: str) -> str:
    """Sources, flags, compiler and CPU: a new machine or a changed source builds anew."""
    h = hashlib.sha256()
    for f in SOURCES + HEADERS:
        h.update(f.read_bytes())
    h.update(" ".join([compiler, *FLAGS]).encode())
    h.update(" ".join(sorted(cpu.flags())).encode())
    return h.hexdigest()[:16]


def _build(compiler: str, path: Path) -> None:
    """Compile into a temporary file beside ``path`` and rename it in: concurrent engines
    starting on one machine never load a half-written library."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        built = Path(tmp) / path.name
        cmd = [compiler, *FLAGS, *map(str, SOURCES), "-o", str(built), "-lm"]
        subprocess.run(cmd, check=True, capture_output=True, timeout=300)
        os.replace(built, path)
