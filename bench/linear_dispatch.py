"""Which product a CPU linear layer should take: MKL's ``F.linear`` on the plain weight, or
oneDNN's on a copy packed once into its blocked layout (``models.layers.Linear``).

For each of SmolLM2-135M's linear shapes (q|k|v, o, gate|up, down, the 49k-row lm_head), row
counts from one decode row to a 4,096-token prefill and float32 / bfloat16, prints the seconds
of each product and their ratio (packed / plain: below 1.00x the packed copy is faster), on
the threads this run may use. Weights and inputs are random; only the shapes matter.

    python bench/linear_dispatch.py [--rows 1,4,16,32,64,256,4096] [--dtypes float32,bfloat16]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

SHAPES = {  # (out, in) of SmolLM2-135M's linears
    "qkv": (960, 576),
    "o": (576, 576),
    "gate_up": (3072, 576),
    "down": (576, 1536),
    "lm_head": (49152, 576),
}


def seconds(fn, flops: int) -> float:
    """Best-effort mean over about 2 GFLOP of calls (3 to 200), after 3 warm-up calls."""
    for _ in range(3):
        fn()
    n = min(200, max(3, int(2e9 / flops)))
    start = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - start) / n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,4,16,32,64,256,4096")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    args = ap.parse_args()
    print(f"threads: {torch.get_num_threads()}")
    for dtype in (getattr(torch, d) for d in args.dtypes.split(",")):
        for rows in map(int, args.rows.split(",")):
            cells = []
            for name, (out, inp) in SHAPES.items():
                w, x = torch.randn(out, inp, dtype=dtype), torch.randn(rows, inp, dtype=dtype)
                packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
                flops = 2 * rows * out * inp
                plain = seconds(lambda x=x, w=w: F.linear(x, w), flops)
                dnn = seconds(
                    lambda x=x, p=packed: torch.ops.mkldnn._linear_pointwise(
                        x, p, None, "none", [], ""
                    ),
                    flops,
                )
                cells.append(f"{name} {plain * 1e3:.3f}/{dnn * 1e3:.3f} ms {dnn / plain:.2f}x")
            print(f"{str(dtype)[6:]:8} rows {rows:5}: " + " | ".join(cells), flush=True)


if __name__ == "__main__":
    main()
