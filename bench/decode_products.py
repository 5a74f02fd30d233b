"""Every bfloat16 decode product this machine's library holds, on the default model's layers.

A decode step's bfloat16 products take one of three kernels (``kernels.ops.DECODE_KERNELS``):
AMX tiles, dot-pair panels or widened panels; ``decode_kernel`` picks one per machine by a
rule (``cpu.dot_pairs_outrun_fmas`` among them). This prints, for each row count, GFLOP/s of
each kernel the library holds, whether chosen here or not, and of torch's own bfloat16
linear, over SmolLM2-135M's 30 layers' shapes and its LM head, so that the rule can be
checked on a new CPU. Random weights; the best of ``--rounds`` passes. No assertion.

    python bench/decode_products.py [--rows 1,4,16,32,64] [--rounds 5] [--threads 2]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "server"), str(ROOT)]

from tandem.server.engine import kernels  # noqa: E402

LAYER = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # q|k|v, o, gate|up, down
SHAPES = LAYER * 30 + [(49152, 576)]  # 30 layers, then the LM head


def _weights() -> dict[tuple[int, int], torch.Tensor]:
    return {s: torch.randn(*s).to(torch.bfloat16) for s in set(SHAPES)}


def best_seconds(call, rounds: int) -> float:
    """The fastest of ``rounds`` passes over every shape (one warm-up pass first)."""
    call()
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - start)
    return best


def kernel_pass(product: str, pack: str, rows: int, threads: int):
    """A pass of the library's ``product`` over SHAPES, each weight packed once by ``pack``."""
    lib = kernels.library.load()
    packed = {}
    for (n, k), w in _weights().items():
        packed[n, k] = torch.empty(kernels.ops.packed_elements(pack, n, k), dtype=torch.bfloat16)
        getattr(lib, pack)(w.data_ptr(), n, k, packed[n, k].data_ptr())
    xs = {k: torch.randn(rows, k).to(torch.bfloat16) for _, k in SHAPES}
    outs = {n: torch.empty(rows, n, dtype=torch.bfloat16) for n, _ in SHAPES}
    fn = getattr(lib, product)

    def call() -> None:
        for n, k in SHAPES:
            fn(xs[k].data_ptr(), k, rows, k, packed[n, k].data_ptr(), n, None,
               outs[n].data_ptr(), n, threads)  # fmt: skip

    return call


def torch_pass(rows: int):
    """The same pass by torch's bfloat16 ``F.linear`` on the plain weights."""
    weights = _weights()
    xs = {k: torch.randn(rows, k).to(torch.bfloat16) for _, k in SHAPES}

    def call() -> None:
        for n, k in SHAPES:
            F.linear(xs[k], weights[n, k])

    return call


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,4,16,32,64")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    lib = kernels.library.load()
    held = [names for names in kernels.ops.DECODE_KERNELS[torch.bfloat16] if hasattr(lib, names[0])]
    print(f"chosen here: {(kernels.decode_kernel(torch.bfloat16) or ('none',))[0]}")
    for rows in map(int, args.rows.split(",")):
        flops = sum(2 * rows * n * k for n, k in SHAPES)
        passes = {names[0]: kernel_pass(names[0], names[1], rows, args.threads) for names in held}
        passes["torch F.linear"] = torch_pass(rows)
        cells = [
            f"{name} {flops / best_seconds(call, args.rounds) / 1e9:5.0f}"
            for name, call in passes.items()
        ]
        print(f"rows {rows:3d} GFLOP/s: " + " | ".join(cells), flush=True)


if __name__ == "__main__":
    main()
