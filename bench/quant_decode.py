"""Decode speed on the default GGUF: weights multiplied as GGUF blocks (x in int8, or exact)
vs dequantized; and the two block kernels alone.

    python bench/quant_decode.py [--model FILE.gguf] [--rounds 5] [--tokens 128] [--rows 1,4,8]

The three engines (``quantized_weights`` int8 (on a VNNI CPU), exact, off = dequantized)
are loaded in one process and run alternately (int8, exact, dequantized, ...), so a change in
the machine's load falls on all. Both block engines run their decode steps through the
modules (their decode chain dropped: decode_chain.c calls the exact kernel only), so the
comparison is of the kernels. A decode step's time is ``(t(1 + n) - t(1)) / n``
for one prompt generated to 1 and to ``1 + n`` tokens (``ignore_eos``), the prefix cache
reset between runs; the median over rounds is printed with the ratio and the load average.
The linears' share of a step is the time spent inside ``Linear.matmul`` (timed around each
call) over the step's. ``--rows`` times decode steps of that many sequences at once, to
place the crossover ``models.layers.QUANT_ROWS`` where the blocks stop winning.
Then the kernels alone, which a loaded machine disturbs less: ``quant_gemv`` vs
``quant_gemv_q8`` on one thread, on the model's own blocks (layer 0's four linears and the
lm_head), 1, 4 and 8 rows, best of ``--repeats`` calls, with the weights per second.
Run it with ``MKL_NUM_THREADS=1``: on 2 cores MKL's threads for a one-row ``F.linear`` and the
C kernels' OpenMP threads contend, and the dequantized engine loses several times over to that
rather than to its weights. No assertion: figures to read, not a test.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "server"), str(ROOT)]

import torch  # noqa: E402

from tandem.server.engine import LLM, SamplingParams, kernels  # noqa: E402
from tandem.server.engine.default_model import default_model_path  # noqa: E402
from tandem.server.engine.models import layers  # noqa: E402

PROMPT = "Once upon a time, there was a little robot who"
MODES = {"int8": "int8", "exact": "exact", "dequantized": "off"}


class LinearClock:
    """Seconds spent inside ``Linear.matmul`` while it is installed (wraps the method)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._original = layers.Linear.matmul

    def __enter__(self) -> LinearClock:
        original = self._original

        def timed(linear, x, bias):  # noqa: ANN001, ANN202 - the method's own signature
            start = time.perf_counter()
            try:
                return original(linear, x, bias)
            finally:
                self.seconds += time.perf_counter() - start

        layers.Linear.matmul = timed
        return self

    def __exit__(self, *exc: object) -> None:
        layers.Linear.matmul = self._original


def generate_seconds(llm: LLM, seqs: int, tokens: int) -> float:
    llm.engine.kv.pool.reset_prefix_cache()
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    start = time.perf_counter()
    llm.generate([PROMPT + f" {i}" for i in range(seqs)], params)
    return time.perf_counter() - start


def step_seconds(llm: LLM, seqs: int, steps: int) -> tuple[float, float]:
    """One decode step's seconds for ``seqs`` sequences, and the linears' share of it."""
    first = generate_seconds(llm, seqs, 1)
    with LinearClock() as clock:
        whole = generate_seconds(llm, seqs, 1 + steps)
    return (whole - first) / steps, clock.seconds / whole


def time_engines(engines: dict[str, LLM], rows: list[int], rounds: int, tokens: int) -> None:
    """Decode tok/s of each engine, alternating, and each's ratio to the dequantized one."""
    for seqs in rows:
        times: dict[str, list[float]] = {name: [] for name in engines}
        shares: dict[str, list[float]] = {name: [] for name in engines}
        for _ in range(rounds):
            for name, llm in engines.items():
                step, share = step_seconds(llm, seqs, tokens - 1)
                times[name].append(step)
                shares[name].append(share)
        med = {name: statistics.median(t) for name, t in times.items()}
        cells = ", ".join(
            f"{name} {seqs / med[name]:6.1f} tok/s ({med['dequantized'] / med[name]:.2f}x, "
            f"linears {statistics.median(shares[name]):.0%})"
            for name in engines
        )
        print(f"rows {seqs}: {cells}; load average {os.getloadavg()[0]:.2f}")


def kernel_seconds(fn, x: torch.Tensor, layer: layers.Linear, repeats: int) -> float:  # noqa: ANN001
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn(x, layer.quantized, layer.qtype)
        best = min(best, time.perf_counter() - start)
    return best


def time_kernels(llm: LLM, repeats: int) -> None:
    """quant_gemv vs quant_gemv_q8 on one thread on the model's own blocks."""
    model = llm.engine.worker.runner.model
    block = model.model.layers[0]
    linears = {
        "qkv": block.self_attn.qkv_proj,
        "o": block.self_attn.o_proj,
        "gate_up": block.mlp.gate_up_proj,
        "down": block.mlp.down_proj,
        "lm_head": model.lm_head,
    }
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for rows in (1, 4, 8):
            for name, layer in linears.items():
                x = torch.randn(rows, layer.in_features)
                exact = kernel_seconds(kernels.quant_gemv, x, layer, repeats)
                int8 = kernel_seconds(kernels.quant_gemv_q8, x, layer, repeats)
                weights = layer.in_features * layer.out_features
                print(
                    f"kernel, 1 thread, rows {rows}, {name:7s} [{layer.out_features}x"
                    f"{layer.in_features}, ggml type {layer.qtype}]: exact {exact * 1e6:8.1f} us "
                    f"({weights / exact / 1e9:5.1f} G weights/s), int8 {int8 * 1e6:8.1f} us "
                    f"({weights / int8 / 1e9:5.1f} G/s): {exact / int8:.2f}x"
                )
    finally:
        torch.set_num_threads(threads)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", help="a .gguf file (default: tandem up's default model)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rows", default="1,4,8", help="decode batch sizes to time")
    parser.add_argument("--repeats", type=int, default=200, help="kernel calls, the best kept")
    args = parser.parse_args()
    model = args.model or str(default_model_path())
    engines = {
        name: LLM(model, kv_cache_tokens=8192, quantized_weights=mode)
        for name, mode in MODES.items()
    }
    for llm in engines.values():
        llm.engine.worker.runner._chain = None  # the modules, so the kernels (docstring)
        generate_seconds(llm, 1, 4)  # warm-up
    print(f"{model}, {args.tokens} new tokens, load average before: {os.getloadavg()}")
    if kernels.quant_gemv_q8_for(torch.device("cpu"), torch.float32):
        time_kernels(engines["exact"], args.repeats)
    time_engines(engines, [int(r) for r in args.rows.split(",")], args.rounds, args.tokens)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
