"""Offline throughput: Tandem's engine against transformers, both ways it batches, in one run.

Random prompts with lengths uniform in 16..256 and outputs uniform in 16..128 (ignore_eos),
greedy, on each model asked for: the random tiny Llama (64 prompts) and the default model,
SmolLM2-135M-Instruct from its Q4_1 GGUF (12 prompts; both sides run the same dequantized
float32 weights). Two transformers baselines:

- static ``generate``: one left-padded batch with ``max_new_tokens`` set to the longest
  requested output, as a user would write it; its throughput counts the tokens that were
  asked for (what the user keeps) and, beside it, every token it generated;
- continuous batching (``init_continuous_batching``: paged KV cache, each request with its
  own ``max_new_tokens``), the closest thing transformers has to this engine.

The runs alternate ``--repeats`` times and each side keeps its best time, so a burst of load
from another process hurts no side alone. Prints tokens/s and the ratios; the machine is
shared and noisy, so only the ratios are meaningful.

    python bench/offline.py [--model tiny|smollm2|PATH ...] [--num-prompts N] [--repeats 3]
                            [--threads 1] [--seed 0]
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time

import torch


def workload(num: int, vocab: int, seed: int) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(16, 256))] for _ in range(num)]
    outputs = [rng.randint(16, 128) for _ in range(num)]
    return prompts, outputs


def tandem_runner(model_dir: str, prompts: list[list[int]], outputs: list[int]):
    from tandem.server.engine import LLM, SamplingParams

    llm = LLM(
        model_dir,
        kv_cache_tokens=len(prompts) * 400,
        max_num_seqs=len(prompts),
        max_num_batched_tokens=4096,
    )
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in outputs]
    llm.generate(prompts[:2], [p.clone(max_tokens=4) for p in params[:2]])  # warm-up
    return lambda: run_tandem(llm, prompts, params, outputs)


def run_tandem(
    llm, prompts: list[list[int]], params: list, outputs: list[int]
) -> tuple[float, int]:
    llm.engine.kv.pool.reset_prefix_cache()  # repeats must not reuse the previous run's prompts
    start = time.perf_counter()
    results = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    produced = sum(len(r.token_ids) for r in results)
    assert produced == sum(outputs)
    return elapsed, produced


def hf_model(model: str) -> torch.nn.Module:
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    if model.endswith(".gguf"):
        path = Path(model)
        return AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32
        ).eval()
    return AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()


def transformers_runner(model, prompts: list[list[int]], outputs: list[int]):
    pad = model.generation_config.pad_token_id or 0
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    kwargs = dict(do_sample=False, eos_token_id=None, pad_token_id=pad)
    with torch.no_grad():
        model.generate(ids[:2], attention_mask=mask[:2], max_new_tokens=4, **kwargs)  # warm-up
    return lambda: run_transformers(model, ids, mask, width, outputs, kwargs)


def run_transformers(
    model, ids: torch.Tensor, mask: torch.Tensor, width: int, outputs: list[int], kwargs: dict
) -> tuple[float, int]:
    with torch.no_grad():
        start = time.perf_counter()
        out = model.generate(ids, attention_mask=mask, max_new_tokens=max(outputs), **kwargs)
        elapsed = time.perf_counter() - start
    return elapsed, (out.shape[1] - width) * ids.shape[0]


def transformers_cb_runner(model, prompts: list[list[int]], outputs: list[int]):
    """One manager (paged cache sized for the workload, no prefix sharing so a repeat cannot
    reuse the previous run's prompts) started once; its set-up is not timed, as ours is not."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    config = GenerationConfig(
        do_sample=False, max_new_tokens=max(outputs), eos_token_id=-1, pad_token_id=0
    )
    cb_config = ContinuousBatchingConfig(
        num_blocks=2 * len(prompts) + 4, max_batch_tokens=4096, allow_block_sharing=False
    )
    manager = model.init_continuous_batching(
        generation_config=config, continuous_batching_config=cb_config
    )
    manager.start()
    run_transformers_cb(manager, prompts[:2], [4, 4])  # warm-up
    return lambda: run_transformers_cb(manager, prompts, outputs), manager


def run_transformers_cb(manager, prompts: list[list[int]], outputs: list[int]) -> tuple[float, int]:
    start = time.perf_counter()
    ids = [manager.add_request(p, max_new_tokens=n) for p, n in zip(prompts, outputs)]
    done = {}
    while len(done) < len(ids):
        result = manager.get_result(timeout=1)
        if result is not None and result.is_finished():
            done[result.request_id] = result
    elapsed = time.perf_counter() - start
    produced = sum(len(r.generated_tokens) for r in done.values())
    assert produced == sum(outputs), (produced, sum(outputs))
    return elapsed, produced


def resolve(model: str) -> tuple[str, int]:
    """The model's path and its default number of prompts."""
    if model == "tiny":
        from tandem.server.engine.tiny_model import TinyModelSpec, make_tiny_model

        path = make_tiny_model(tempfile.mkdtemp(prefix="tandem-bench-"), TinyModelSpec())
        return str(path), 64
    if model == "smollm2":
        from tandem.server.engine.default_model import default_model_path

        return str(default_model_path()), 12
    return model, 64


def bench(model: str, num_prompts: int | None, repeats: int, seed: int) -> None:
    from tandem.server.engine.loader import read_model_config

    path, default_prompts = resolve(model)
    vocab = read_model_config(path).vocab_size
    prompts, outputs = workload(num_prompts or default_prompts, vocab, seed)
    wanted = sum(outputs)
    hf = hf_model(path)
    cb_run, cb_manager = transformers_cb_runner(hf, prompts, outputs)
    runners = {
        "tandem": tandem_runner(path, prompts, outputs),
        "static": transformers_runner(hf, prompts, outputs),
        "cb": cb_run,
    }
    runs: dict[str, list[tuple[float, int]]] = {k: [] for k in runners}
    try:
        for _ in range(repeats):
            for name, run in runners.items():
                runs[name].append(run())
    finally:
        cb_manager.stop(block=True)  # its thread is not a daemon: the process would not exit
    best = {k: min(v) for k, v in runs.items()}
    print(f"== {model}: {path}")
    print("runs (s): " + ", ".join(f"{k} {[round(t, 2) for t, _ in v]}" for k, v in runs.items()))
    print(
        f"workload: {len(prompts)} prompts, {sum(map(len, prompts))} prompt tokens, "
        f"{wanted} output tokens"
    )
    ours = wanted / best["tandem"][0]
    static_useful, static_all = wanted / best["static"][0], best["static"][1] / best["static"][0]
    cb = wanted / best["cb"][0]
    print(f"tandem                        {best['tandem'][0]:8.2f} s  {ours:10.1f} output tok/s")
    print(
        f"transformers generate         {best['static'][0]:8.2f} s  {static_useful:10.1f} output "
        f"tok/s asked for ({static_all:.1f} tok/s counting all {best['static'][1]} generated)"
    )
    print(f"transformers continuous batch {best['cb'][0]:8.2f} s  {cb:10.1f} output tok/s")
    print(
        f"ratio tandem/transformers generate: {ours / static_useful:.2f}x "
        f"(against all generated: {ours / static_all:.2f}x); "
        f"tandem/transformers continuous batching: {ours / cb:.2f}x"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model",
        action="append",
        default=None,
        help="tiny, smollm2 (the default model's GGUF), or a model directory / .gguf; repeat "
        "for several (default: tiny and smollm2)",
    )
    parser.add_argument("--num-prompts", type=int, default=None, help="default: 64, smollm2 12")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads for every side (1 keeps a shared 2-core machine from thrashing)",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    for model in args.model or ["tiny", "smollm2"]:
        bench(model, args.num_prompts, args.repeats, args.seed)


if __name__ == "__main__":
    main()
