"""Measure an engine's performance profile for the SLO planner (``EngineProfile`` JSON).

    python bench/profile_engine.py [--model DIR] [--out profile.json] [--threads 1]

Prefill: one prompt of each length with ``max_tokens=1`` (the first token comes from the
prefill step), best of ``--repeats``: tokens/s by prompt length. Decode: ``b`` prompts of
context ``c`` generated to ``1`` and to ``1 + STEPS`` tokens; the difference over ``STEPS``
is one decode step of a batch of ``b`` at context ~``c``, best of ``--repeats``. The prefix
cache is reset between runs so every prompt is computed. Without ``--model`` it measures the
tiny CPU model the tests use (the figures are then a CPU's, for the pipeline, not a GPU's).
Put the output in the ConfigMap that ``spec.slo.profileConfigMap`` names, key
``profile.json``.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "operator"), str(ROOT / "server"), str(ROOT)]

from tandem.operator.autoscaler.profile import EngineProfile  # noqa: E402

STEPS = 16


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", help="model directory (default: a fresh tiny model)")
    parser.add_argument("--out", type=Path, help="write the profile JSON here (default: stdout)")
    parser.add_argument("--isl", default="64,256,1024", help="prompt lengths for prefill")
    parser.add_argument("--batch", default="1,8,32", help="decode batch sizes")
    parser.add_argument("--ctx", default="64,512", help="decode context lengths")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from tandem.server.engine import LLM, SamplingParams

    model, name = args.model, args.model
    if model is None:
        name = "the tiny test model (TinyModelSpec())"
        from tandem.server.engine.tiny_model import TinyModelSpec, make_tiny_model

        model = str(make_tiny_model(tempfile.mkdtemp(prefix="tandem-profile-"), TinyModelSpec()))
    isls = [int(x) for x in args.isl.split(",")]
    batches = [int(x) for x in args.batch.split(",")]
    ctxs = [int(x) for x in args.ctx.split(",")]
    kv_tokens = max(batches) * (max(ctxs) + STEPS + 16) + max(isls) + 64
    llm = LLM(
        model,
        kv_cache_tokens=kv_tokens,
        max_num_seqs=max(batches),
        max_num_batched_tokens=max(max(isls), max(batches) * max(ctxs)),
    )
    vocab = llm.tokenizer.get_vocab_size() if hasattr(llm.tokenizer, "get_vocab_size") else 1000
    rng = random.Random(0)

    def run(n: int, length: int, max_tokens: int) -> float:
        llm.engine.kv.pool.reset_prefix_cache()
        prompts = [[rng.randrange(3, min(vocab, 1000)) for _ in range(length)] for _ in range(n)]
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        start = time.perf_counter()
        llm.generate(prompts, params)
        return time.perf_counter() - start

    run(1, 16, 2)  # warm-up
    tps = []
    for isl in isls:
        best = min(run(1, isl, 1) for _ in range(args.repeats))
        tps.append(isl / best)
        print(f"prefill isl={isl}: {best * 1000:.1f} ms, {isl / best:,.0f} tok/s", file=sys.stderr)
    rows = []
    for b in batches:
        row = []
        for c in ctxs:
            diffs = [run(b, c, 1 + STEPS) - run(b, c, 1) for _ in range(args.repeats)]
            step = max(min(diffs), 1e-6) / STEPS
            row.append(step)
            print(f"decode b={b} ctx={c}: step {step * 1000:.2f} ms", file=sys.stderr)
        rows.append(tuple(row))
    profile = EngineProfile(
        prefill_isl=tuple(isls),
        prefill_tps=tuple(tps),
        decode_batch=tuple(batches),
        decode_ctx=tuple(ctxs),
        decode_step_s=tuple(rows),
        kv_cache_tokens=llm.engine.config.kv_cache_tokens or kv_tokens,
        max_num_seqs=llm.engine.config.max_num_seqs,
        source=f"measured by bench/profile_engine.py on {name}, {args.threads} CPU thread(s)",
    )
    text = json.dumps(profile.to_dict(), indent=1)
    if args.out:
        args.out.write_text(text + "\n")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
