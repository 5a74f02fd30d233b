"""The CPU decode-attention kernel (``paged_decode.c``): compiled once per machine, called via ctypes.

PyTorch has no batched product that reads a paged cache in place, so its decode attention
gathers every sequence's pages into a contiguous buffer and multiplies that: the KV is read
twice and written once per layer, and the gather alone ran at ~12 GB/s on one core. The C
kernel walks the block table itself and reads each K and V row once. It is built with the
machine's own compiler for the machine's own ISA (``-march=native``), cached under the user's
cache directory by a hash of the source, flags and CPU, and linked against the OpenMP runtime
PyTorch already loaded (one thread pool, not two). Where no C compiler is installed the torch
backend keeps its gather + ``bmm`` path, which is also this kernel's reference in the tests.
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

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("paged_decode.c")
# Reassociation (not -ffast-math: infinities stay) lets the dot products and sums vectorise.
FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fno-trapping-math", "-fassociative-math"]
FLAGS += ["-fno-signed-zeros", "-fopenmp", "-shared", "-fPIC"]
DTYPES = {torch.float32: 0, torch.bfloat16: 1}


def kernel_supports(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the kernel can serve a cache on ``device`` in ``dtype`` (and is built, or can be)."""
    return device.type == "cpu" and dtype in DTYPES and load_paged_decode() is not None


@functools.cache
def load_paged_decode() -> ctypes.CDLL | None:
    """The built kernel, or None (with one warning) where it cannot be built."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        log.warning("no C compiler: CPU decode attention uses the gather + bmm path")
        return None
    path = _cache_dir() / f"paged_decode-{_build_key(compiler)}.so"
    if not path.exists():
        try:
            _build(compiler, path)
        except (OSError, subprocess.CalledProcessError) as exc:
            log.warning("could not build the CPU attention kernel (%s): using gather + bmm", exc)
            return None
    lib = ctypes.CDLL(str(path))
    lib.paged_decode.restype = None
    lib.paged_decode.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int, ctypes.c_void_p]
    lib.paged_decode.argtypes += [ctypes.c_int] * 6 + [ctypes.c_float, ctypes.c_int, ctypes.c_int]
    return lib


def paged_decode(
    q: torch.Tensor,
    pages: torch.Tensor,
    tables: torch.Tensor,
    lens: torch.Tensor,
    max_len: int,
    scale: float,
) -> torch.Tensor:
    """One query token per sequence over its pages, read in place.

    q: ``[B, H, D]``; pages: one layer's ``[2, blocks, block_size, H_kv, D]`` (contiguous, q's
    dtype); tables: ``[B, width]`` int32 page ids; lens: ``[B]`` int32 tokens each attends to
    (at most ``max_len``). Returns ``[B, H, D]``.
    """
    q = q.contiguous()
    out = torch.empty_like(q)
    batch, heads, dim = q.shape
    _, _, block_size, kv_heads, _ = pages.shape
    load_paged_decode().paged_decode(
        q.data_ptr(),
        pages[0].data_ptr(),
        pages[1].data_ptr(),
        out.data_ptr(),
        tables.data_ptr(),
        tables.shape[1],
        lens.data_ptr(),
        batch,
        heads,
        kv_heads,
        dim,
        block_size,
        max_len,
        scale,
        DTYPES[q.dtype],
        torch.get_num_threads(),
    )
    return out


def _cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "tandem" / "kernels"


def _build_key(compiler: str) -> str:
    """Source, flags, compiler and CPU: a new machine or a changed source builds anew."""
    h = hashlib.sha256(SOURCE.read_bytes())
    h.update(" ".join([compiler, *FLAGS]).encode())
    cpu = Path("/proc/cpuinfo")
    if cpu.exists():
        h.update(
            next((ln for ln in cpu.read_text().splitlines() if ln.startswith("flags")), "").encode()
        )
    return h.hexdigest()[:16]


def _build(compiler: str, path: Path) -> None:
    """Compile into a temporary file beside ``path`` and rename it in: concurrent engines
    starting on one machine never load a half-written library."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        built = Path(tmp) / path.name
        cmd = [compiler, *FLAGS, str(SOURCE), "-o", str(built), "-lm"]
        subprocess.run(cmd, check=True, capture_output=True, timeout=120)
        os.replace(built, path)
