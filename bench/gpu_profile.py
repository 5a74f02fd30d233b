"""Where a decode step's time goes on the GPU: torch profiler tables for the next lease.

The H100 run (docs/gpu.md) left two questions only a profile answers: why Qwen3-0.6B's
batch-1 step (5.3-7.4 ms) is slower than its batch-8 step (2.8 ms), and what keeps
Llama-3.1-8B's batch-1 step at 0.67 of the HBM floor. For each model shape and batch this
prints the step's wall time, then the profiler's table of the 12 heaviest GPU kernels and of
the 12 heaviest host-side calls over ``--steps`` decode steps (CUDA graphs on, as served).

    python bench/gpu_profile.py [--models qwen3-0.6b llama-3.1-8b] [--batches 1 8]
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.gpu import (  # noqa: E402
    SHAPES,
    decode_step_time,
    free,
    model_dir,
    random_hf_model,
)


def profile_steps(llm, batch: int, context: int, steps: int) -> None:
    dev = torch.device("cuda")
    step = decode_step_time(llm, batch, context, dev, iters=20)
    print(f"\n-- batch {batch}, context {context}: {step * 1e3:.3f} ms a step", flush=True)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        decode_step_time(llm, batch, context, dev, iters=steps)
    table = prof.key_averages()
    print(table.table(sort_by="self_cuda_time_total", row_limit=12, max_name_column_width=60))
    print(table.table(sort_by="cpu_time_total", row_limit=12, max_name_column_width=60))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["qwen3-0.6b", "llama-3.1-8b"])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    from tandem.server.engine import LLM
    from tandem.server.engine.tiny_model import TinyModelSpec, make_tiny_model

    root = Path(tempfile.mkdtemp(prefix="tandem-gpu-profile-"))
    try:
        tok = make_tiny_model(root / "_tokenizer", TinyModelSpec(num_hidden_layers=1))
        for name in args.models:
            path = model_dir(name, root, tok)
            random_hf_model(path, torch.bfloat16, torch.device("cuda"), 0).save_pretrained(path)
            free(torch.device("cuda"))
            print(f"\n== {name} ({SHAPES[name]['num_hidden_layers']} layers)", flush=True)
            llm = LLM(str(path), device="cuda", dtype="bfloat16", max_num_seqs=64)
            for batch in args.batches:
                profile_steps(llm, batch, args.context, args.steps)
            llm.engine.close()
            del llm
            free(torch.device("cuda"))
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
