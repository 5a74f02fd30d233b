"""Decode speed at one user on the default GGUF: weights multiplied as GGUF blocks vs dequantized.

    python bench/quant_decode.py [--model FILE.gguf] [--rounds 5] [--tokens 128] [--rows 1,2,4,8]

Both engines are loaded in one process and run alternately (quantized, dequantized, ...), so a
change in the machine's load falls on both. A decode step's time is ``(t(1 + n) - t(1)) / n``
for one prompt generated to 1 and to ``1 + n`` tokens (``ignore_eos``), the prefix cache
reset between runs; the median over rounds is printed with the ratio and the load average.
The linears' share of a step is the time spent inside ``Linear.matmul`` (timed around each
call) over the step's. ``--rows`` also times decode steps of that many sequences at once, to
place the crossover ``models.layers.QUANT_ROWS`` where the blocks stop winning.
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

from tandem.server.engine import LLM, SamplingParams  # noqa: E402
from tandem.server.engine.default_model import default_model_path  # noqa: E402
from tandem.server.engine.models import layers  # noqa: E402

PROMPT = "Once upon a time, there was a little robot who"


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


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", help="a .gguf file (default: tandem up's default model)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rows", default="1", help="decode batch sizes to time")
    args = parser.parse_args()
    model = args.model or str(default_model_path())
    engines = {
        mode: LLM(model, kv_cache_tokens=8192, quantized_weights=mode) for mode in ("auto", "off")
    }
    for llm in engines.values():
        generate_seconds(llm, 1, 4)  # warm-up
    print(f"{model}, {args.tokens} new tokens, load average before: {os.getloadavg()}")
    for seqs in [int(r) for r in args.rows.split(",")]:
        times: dict[str, list[float]] = {mode: [] for mode in engines}
        shares: dict[str, list[float]] = {mode: [] for mode in engines}
        for _ in range(args.rounds):
            for mode, llm in engines.items():
                step, share = step_seconds(llm, seqs, args.tokens - 1)
                times[mode].append(step)
                shares[mode].append(share)
        q, d = (statistics.median(times[m]) for m in ("auto", "off"))
        print(
            f"rows {seqs}: quantized {seqs / q:7.1f} tok/s, dequantized {seqs / d:7.1f} tok/s, "
            f"ratio {d / q:.2f}x; linears' share of the run {statistics.median(shares['auto']):.0%}"
            f" vs {statistics.median(shares['off']):.0%}; load average {os.getloadavg()[0]:.2f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
