"""Multi-LoRA throughput on CPU: 16 concurrent requests spread over 4 adapters vs the same
16 on the base model alone, and how long an adapter takes to load.

Two engines on one tiny model (made here, a little larger than the tests' so the matmuls
are not all overhead): the base engine (LoRA off) and the LoRA engine serving four PEFT
adapters (``tandem make-tiny-lora``: rank 16 on q/k/v/o, rank 8 on every module, ...). Each
round runs the same 16 greedy requests (the same prompts, ``max_tokens`` each, EOS ignored)
on the base engine, then on the LoRA engine with request i through adapter i % 4, in
alternating order, so a change in machine load hits both alike. It prints the median
tokens per second of each over the rounds and their ratio (the goal: >= 0.8 on CPU), in
wall time and in process CPU time. Then the adapter load time: reading and checking one
adapter (``read_lora``) and copying it into a device slot (``Worker.load_lora``), medians.

    python bench/lora.py [--rounds 3] [--max-tokens 64] [--hidden 512] [--layers 4] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

# Ranks as fine-tunes use them (8-16, a small fraction of the hidden size).
ADAPTERS = {
    "attn-r16": dict(rank=16, targets=("q_proj", "k_proj", "v_proj", "o_proj")),
    "all-r8": dict(
        rank=8,
        targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
    ),
    "qv-r16": dict(rank=16, targets=("q_proj", "v_proj")),
    "mlp-r8": dict(rank=8, targets=("gate_proj", "up_proj", "down_proj")),
}


def make(root: Path, hidden: int, layers: int) -> tuple[Path, dict[str, Path]]:
    from tandem.server.engine.tiny_lora import TinyLoraSpec, make_tiny_lora
    from tandem.server.engine.tiny_model import TinyModelSpec, make_tiny_model

    spec = TinyModelSpec(
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 32,
        num_key_value_heads=hidden // 64,
    )
    model = make_tiny_model(root / "base", spec)
    loras = {
        name: make_tiny_lora(model, root / name, TinyLoraSpec(alpha=8, seed=i, init_std=0.05, **kw))
        for i, (name, kw) in enumerate(ADAPTERS.items())
    }
    return model, loras


def one_round(
    llm, prompts: list[list[int]], params, loras: list[str | None]
) -> tuple[float, float]:
    """(wall, cpu) tokens per second of one batch of the prompts."""
    wall, cpu = time.perf_counter(), time.process_time()
    outs = llm.generate(prompts, params, lora=loras)
    tokens = sum(len(o.token_ids) for o in outs)
    return tokens / (time.perf_counter() - wall), tokens / (time.process_time() - cpu)


def throughput(args: argparse.Namespace, model: Path, loras: dict[str, Path]) -> None:
    from tandem.server.engine import LLM, SamplingParams

    common = dict(kv_cache_tokens=16384, block_size=16, enable_prefix_caching=False)
    base = LLM(str(model), **common)
    multi = LLM(str(model), **common, lora_modules=tuple(f"{n}={p}" for n, p in loras.items()))
    words = "the scheduler decides at every step which requests run and how many tokens".split()
    prompts = [base.tokenizer.encode(" ".join(words[i % 5 :] * 4)) for i in range(16)]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    names = list(loras)
    spread = [names[i % len(names)] for i in range(16)]
    runs = {"base": [], "lora": []}
    one_round(base, prompts, params, [None] * 16)  # warm both (kernels, allocator)
    one_round(multi, prompts, params, spread)
    for r in range(args.rounds):
        order = [("base", base, [None] * 16), ("lora", multi, spread)]
        for key, llm, which in order if r % 2 == 0 else order[::-1]:
            runs[key].append(one_round(llm, prompts, params, which))
    for i, clock in enumerate(("wall", "cpu")):
        b = statistics.median(x[i] for x in runs["base"])
        m = statistics.median(x[i] for x in runs["lora"])
        print(f"{clock:>4}: base {b:8.1f} tok/s   4 adapters {m:8.1f} tok/s   ratio {m / b:.2f}x")


def load_time(model: Path, loras: dict[str, Path]) -> None:
    from tandem.server.engine import LLM

    llm = LLM(str(model), kv_cache_tokens=1024, enable_lora=True, max_loras=1)
    for name, path in loras.items():
        reads, copies = [], []
        for _ in range(5):
            start = time.perf_counter()
            adapter = llm.engine.read_lora(name, str(path))
            reads.append(time.perf_counter() - start)
            start = time.perf_counter()
            llm.engine.worker.load_lora(0, adapter)
            copies.append(time.perf_counter() - start)
        print(
            f"load {name:>9} ({adapter.num_bytes / 1e6:.2f} MB): read+check "
            f"{statistics.median(reads) * 1e3:.1f} ms, into a slot "
            f"{statistics.median(copies) * 1e3:.2f} ms"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument(
        "--threads", type=int, default=1, help="torch threads (1: steadier on a shared machine)"
    )
    ap.add_argument("--layers", type=int, default=4)
    args = ap.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    print(f"hidden {args.hidden}, {args.layers} layers, {args.threads} thread(s), 16 requests")
    with tempfile.TemporaryDirectory() as tmp:
        model, loras = make(Path(tmp), args.hidden, args.layers)
        throughput(args, model, loras)
        load_time(model, loras)


if __name__ == "__main__":
    main()
