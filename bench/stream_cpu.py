"""CPU per streamed token along a long stream: does token 4,000 cost more than token 100?

Two engines on one tiny model (on CPU, so the model's own work is small and the output path
is visible) generate the same greedy L tokens, one streamed and one not. They step in
lockstep, alternating which goes first, and each step's process CPU time is recorded: the
non-streamed engine is the baseline that pays for the same step without per-token outputs
(both detokenize as they go: a stop string that never matches). The difference of a pair of
steps is what one streamed token costs at that position; pairing step by step means a
change in machine load hits both sides alike. Per window of W tokens it prints the median
of those differences over the window and the repeats; if each output copied the whole
stream so far (snapshots), the figure would grow with the position, with deltas it stays
flat. Last, the ratio of the last window to the first (1.0 = flat).

    python bench/stream_cpu.py [--length 4096] [--window 512] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path


def timed_step(engine) -> float:
    start = time.process_time()
    engine.step()
    return time.process_time() - start


def run(streamed, whole, rid: str, length: int) -> list[float]:
    """Per position, the CPU seconds the streamed step took beyond the non-streamed one."""
    from tandem.server.engine import SamplingParams

    params = SamplingParams(  # a stop string that never matches: both runs detokenize as they go
        temperature=0.0, max_tokens=length, ignore_eos=True, logprobs=1, stop=["\u2603never"]
    )
    streamed.add_request(rid, [1, 2, 3, 4], params, stream=True)
    whole.add_request(rid, [1, 2, 3, 4], params, stream=False)
    extra = []
    while streamed.has_unfinished_requests() or whole.has_unfinished_requests():
        if len(extra) % 2:
            s, w = timed_step(streamed), timed_step(whole)
        else:
            w, s = timed_step(whole), timed_step(streamed)
        extra.append(s - w)
    return extra[:length]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--length", type=int, default=4096)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    from tandem.server.engine import EngineConfig, LLMEngine
    from tandem.server.engine.tiny_model import TinyModelSpec, make_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        spec = TinyModelSpec(max_position_embeddings=args.length + 64)
        model = str(make_tiny_model(str(Path(tmp) / "m"), spec))
        config = EngineConfig(model=model, kv_cache_tokens=args.length + 128, block_size=16)
        streamed, whole = LLMEngine(config), LLMEngine(config)
        run(streamed, whole, "warm", 64)
        runs = [run(streamed, whole, f"r{i}", args.length) for i in range(args.repeats)]
    per_token = []
    for k in range(0, args.length, args.window):
        window = [d for r in runs for d in r[k : k + args.window]]
        per_token.append(statistics.median(window))
        print(
            f"tokens {k:5d}-{k + args.window:5d}: streamed beyond baseline "
            f"{per_token[-1] * 1e6:7.1f} us/token"
        )
    print(
        f"ratio last window / first window: {per_token[-1] / per_token[0]:.2f} "
        f"(1.0 = flat; median of {args.repeats} repeats, steps paired)"
    )


if __name__ == "__main__":
    main()
