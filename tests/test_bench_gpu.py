"""bench/gpu.py: the tiny --smoke run works on CPU; the full run refuses clearly without CUDA."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parent.parent / "bench" / "gpu.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("tandem_bench_gpu", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_workload_is_nano_vllm_shaped(bench) -> None:
    prompts, outputs = bench.workload(256, 151936, 100, 1024, seed=0)
    assert len(prompts) == len(outputs) == 256
    assert all(100 <= len(p) <= 1024 for p in prompts) and all(100 <= n <= 1024 for n in outputs)
    assert (
        bench.SHAPES["llama-3.1-8b"]["hidden_size"] == 4096
        and bench.SHAPES["qwen3-0.6b"]["head_dim"] == 128
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown without CUDA")
def test_full_run_needs_cuda(bench, capsys) -> None:
    assert bench.main([]) == 2
    assert "needs a CUDA device" in capsys.readouterr().err


def test_smoke_run_on_cpu(bench, capsys) -> None:
    argv = ["--smoke", "--num-seqs", "3", "--max-len", "24", "--decode-iters", "2"]
    assert bench.main([*argv, "--profile-batches", "1"]) == 0
    out = capsys.readouterr().out
    for line in ("tandem ", "transformers generate", "x transformers generate", "of the floor's"):
        assert line in out
    assert "decode step, batch   1" in out and "prefill 64 tokens" in out
    assert "generate, one sequence" in out and "-- profile: batch 1" in out and "Self CPU" in out
