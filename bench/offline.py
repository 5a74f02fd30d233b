"""Offline throughput: Tandem's engine against transformers ``generate``, in the same run.

64 prompts with lengths uniform in 16..256 and outputs uniform in 16..128 (ignore_eos), on
one tiny model. transformers runs them as one left-padded batch, greedy, with
``max_new_tokens`` set to the longest requested output, as a user would write it; its
throughput counts the tokens that were asked for (what the user keeps) and, beside it, every
token it generated. The two runs alternate ``--repeats`` times and each side keeps its best
time, so a burst of load from another process hurts neither side alone. Prints tokens/s of both
and the ratio; the machine is shared and noisy, so only the ratio is meaningful.

    python bench/offline.py [--model DIR] [--num-prompts 64] [--repeats 3] [--threads 1] [--seed 0]
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


def transformers_runner(model_dir: str, prompts: list[list[int]], outputs: list[int]):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="HF model dir (default: a fresh tiny llama)")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads for both sides (1 keeps a shared 2-core machine from thrashing)",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model_dir = args.model
    if model_dir is None:
        from tandem.server.engine.tiny_model import TinyModelSpec, make_tiny_model

        model_dir = str(
            make_tiny_model(tempfile.mkdtemp(prefix="tandem-bench-"), TinyModelSpec(arch="llama"))
        )
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(model_dir).vocab_size
    prompts, outputs = workload(args.num_prompts, vocab, args.seed)
    wanted = sum(outputs)
    ours_run, hf_run = (
        tandem_runner(model_dir, prompts, outputs),
        transformers_runner(model_dir, prompts, outputs),
    )
    ours_runs, hf_runs = [], []
    for _ in range(args.repeats):
        ours_runs.append(ours_run())
        hf_runs.append(hf_run())
    (t_ours, n_ours), (t_hf, n_hf) = min(ours_runs), min(hf_runs)
    print(
        f"runs (s): tandem {[round(t, 2) for t, _ in ours_runs]}, transformers {[round(t, 2) for t, _ in hf_runs]}"
    )
    ours, hf_useful, hf_all = n_ours / t_ours, wanted / t_hf, n_hf / t_hf
    print(
        f"workload: {len(prompts)} prompts, {sum(map(len, prompts))} prompt tokens, {wanted} output tokens"
    )
    print(f"tandem        {t_ours:8.2f} s  {ours:10.1f} output tok/s")
    print(
        f"transformers  {t_hf:8.2f} s  {hf_useful:10.1f} output tok/s asked for "
        f"({hf_all:.1f} tok/s counting all {n_hf} generated)"
    )
    print(
        f"ratio tandem/transformers: {ours / hf_useful:.2f}x (against all generated: {ours / hf_all:.2f}x)"
    )


if __name__ == "__main__":
    main()
