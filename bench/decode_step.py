"""One decode step on the default GGUF: the decoder layers as modules vs as one chained C call.

    python bench/decode_step.py [--model FILE.gguf] [--rows 1,4,8] [--rounds 5] [--tokens 64]

Both paths run in one engine, alternately (modules, chain, ...), the prefix cache reset
between runs, each at a fixed thread count (``--threads``, default all: the tuner is off so
both sides run alike). A step's time is ``(t(1 + n) - t(1)) / n`` for prompts generated to 1
and to ``1 + n`` tokens; the median over rounds is printed. The chain's own C call is timed
too: it does the very arithmetic the modules do (its output is theirs bit for bit), so
``1 - C time / step time`` is the share of a step spent outside that arithmetic (Python,
dispatch, scheduling, sampling), printed for both paths: the profile's before and after.
No assertion: figures to read.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "server"), str(ROOT)]

from tandem.server.engine import LLM, SamplingParams  # noqa: E402
from tandem.server.engine.default_model import default_model_path  # noqa: E402

PROMPT = "Once upon a time, there was a little robot who"


class ChainClock:
    """Seconds inside the chain's C call while installed (wraps the library function)."""

    def __init__(self, chain) -> None:  # noqa: ANN001 - a DecodeChain
        self.seconds = 0.0
        self.chain = chain

    def __enter__(self) -> ChainClock:
        from tandem.server.engine import kernels

        lib = kernels.library.load()
        self._fn = lib.decode_chain

        def timed(*args: object) -> None:
            start = time.perf_counter()
            self._fn(*args)
            self.seconds += time.perf_counter() - start

        self._lib = lib
        lib.decode_chain = timed
        return self

    def __exit__(self, *exc: object) -> None:
        self._lib.decode_chain = self._fn


def seconds(llm: LLM, rows: int, tokens: int) -> float:
    llm.engine.kv.pool.reset_prefix_cache()
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    start = time.perf_counter()
    llm.generate([f"{PROMPT} {i}" for i in range(rows)], params)
    return time.perf_counter() - start


def step(llm: LLM, rows: int, steps: int, chain, use_chain: bool) -> tuple[float, float]:  # noqa: ANN001
    """(seconds per decode step, C-chain seconds per step) with the chain on or off."""
    runner = llm.engine.worker.runner
    runner._chain = chain if use_chain else None
    first = seconds(llm, rows, 1)
    with ChainClock(chain) as clock:
        whole = seconds(llm, rows, 1 + steps)
    return (whole - first) / steps, clock.seconds / steps


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", help="a .gguf file (default: tandem up's default model)")
    parser.add_argument("--rows", default="1,4,8")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    llm = LLM(args.model or str(default_model_path()), kv_cache_tokens=8192)
    llm.engine.worker._threads = None  # a fixed thread count on both sides
    torch.set_num_threads(args.threads)
    chain = llm.engine.worker.runner._chain
    if chain is None:
        print("this model or machine does not qualify for the decode chain")
        return 0
    seconds(llm, 1, 4)  # warm-up
    print(f"{args.tokens} new tokens, {args.threads} threads, load {os.getloadavg()[0]:.2f}")
    for rows in [int(r) for r in args.rows.split(",")]:
        runs: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
        for _ in range(args.rounds):
            for use in (False, True):
                runs[use].append(step(llm, rows, args.tokens - 1, chain, use))
        mod = statistics.median(s for s, _ in runs[False])
        ch, c_time = (statistics.median(x) for x in zip(*runs[True]))
        print(
            f"rows {rows}: modules {1e3 * mod:6.2f} ms/step ({rows / mod:6.1f} tok/s), chain "
            f"{1e3 * ch:6.2f} ms/step ({rows / ch:6.1f} tok/s), {mod / ch:.2f}x; C arithmetic "
            f"{1e3 * c_time:.2f} ms: outside it {1 - c_time / mod:.0%} of a step before, "
            f"{1 - c_time / ch:.0%} after; load {os.getloadavg()[0]:.2f}",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
