"""CPU per streamed token along a long stream: does token 4,000 cost more than token 100?

The real engine (a tiny model on CPU, so the model's own work is small and the output path
is visible) generates the same greedy L tokens twice per repeat, streamed and not streamed,
alternating, and records the process CPU time at every window of W tokens. The streamed
run pays for per-token outputs; the non-streamed run is the baseline that pays for the same
steps without them (both detokenize as they go: a stop string that never matches). Their
difference per window, divided by W, is the CPU a streamed token
costs at that point of the stream. If each output copied the whole stream so far (snapshots),
that figure would grow with the position; with deltas it stays flat. Prints it per window
and the ratio of the last window to the first (1.0 = flat).

    python bench/stream_cpu.py [--length 4096] [--window 512] [--repeats 5]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path


def run(engine, rid: str, length: int, window: int, stream: bool) -> list[float]:
    """CPU seconds of each window of ``window`` tokens, streamed or not."""
    from tandem.server.engine import SamplingParams

    params = SamplingParams(  # a stop string that never matches: both runs detokenize as they go
        temperature=0.0, max_tokens=length, ignore_eos=True, logprobs=1, stop=["\u2603never"]
    )
    engine.add_request(rid, [1, 2, 3, 4], params, stream=stream)
    marks, tokens = [time.process_time()], 0
    while engine.has_unfinished_requests():
        engine.step()
        tokens += 1
        if tokens % window == 0:
            marks.append(time.process_time())
    return [b - a for a, b in zip(marks, marks[1:])]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--length", type=int, default=4096)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    from tandem.server.engine import EngineConfig, LLMEngine
    from tandem.server.engine.tiny_model import TinyModelSpec, make_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        spec = TinyModelSpec(max_position_embeddings=args.length + 64)
        model = str(make_tiny_model(str(Path(tmp) / "m"), spec))
        engine = LLMEngine(
            EngineConfig(model=model, kv_cache_tokens=args.length + 128, block_size=16)
        )
        run(engine, "warm", 64, 64, True)
        streamed, final = [], []  # per repeat, per window
        for i in range(args.repeats):
            streamed.append(run(engine, f"s{i}", args.length, args.window, True))
            final.append(run(engine, f"f{i}", args.length, args.window, False))
    # Each window's least CPU over the repeats: what another process on a shared machine adds
    # (cache misses, frequency) only ever adds, so the minimum is the steadiest estimate.
    per_token = [(min(s) - min(f)) / args.window for s, f in zip(zip(*streamed), zip(*final))]
    for k, v in enumerate(per_token):
        lo, hi = k * args.window, (k + 1) * args.window
        print(f"tokens {lo:5d}-{hi:5d}: streamed beyond baseline {v * 1e6:7.1f} us/token")
    print(
        f"ratio last window / first window: {per_token[-1] / per_token[0]:.2f} "
        f"(1.0 = flat; least of {args.repeats} repeats)"
    )


if __name__ == "__main__":
    main()
