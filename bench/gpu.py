"""GPU throughput: Tandem against transformers ``generate`` on real model shapes, in the same run.

The offline workload of nano-vllm's benchmark: 256 sequences, input and output lengths each
uniform in 100..1024 (random token ids), ``ignore_eos``, greedy. Models: the shapes of
Qwen3-0.6B and Llama-3.1-8B (their published config.json) with random bfloat16 weights made
on the GPU, saved into the model's directory; Tandem loads them from there, so both sides run
the same model on the same prompts.

Per model it prints, each against a baseline or a limit measured in the same run:
  * transformers first (then freed, so Tandem sizes its KV cache from a clean device):
    static ``generate`` on the first ``--hf-seqs`` prompts as left-padded batches of
    ``--hf-batch-size``, each batch generating up to its longest requested output (tokens/s
    counts the tokens asked for); and its continuous batching (``generate_batch``) on the
    same prompts with ``--cb-tokens`` new tokens each;
  * Tandem's output tokens/s over the whole workload (one ``generate`` call), and on the
    continuous-batching workload, with the ratios;
  * a decode step at batch 1, 8, 64 and 256 (``--decode-context`` tokens of context per row;
    CUDA graphs when on) against the physical floor: the bytes a step must read (weights, plus
    every row's KV) over the bandwidth of a large device-to-device copy;
  * one sequence generated end to end (scheduler, sampler, detokenizer): ms a token against
    the batch-1 floor;
  * with ``--profile-batches``, the torch profiler's heaviest GPU kernels and host calls over
    20 decode steps at each of those batches;
  * one prefill of ``--prefill-tokens`` tokens: tokens/s, and its FLOP rate against an
    8192 x 8192 x 8192 matrix product in the model's dtype.

    python bench/gpu.py                         # both models; needs CUDA
    python bench/gpu.py --models qwen3-0.6b --num-seqs 64
    python bench/gpu.py --smoke                 # tiny shapes, a few sequences; runs on CPU
"""

from __future__ import annotations

import argparse
import gc
import inspect
import json
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

# The published config.json of each model, as far as the shapes go.
SHAPES: dict[str, dict] = {
    "qwen3-0.6b": {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": 151936,
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000,
        "tie_word_embeddings": True,
        "attention_bias": False,
        "hidden_act": "silu",
        "torch_dtype": "bfloat16",
        "bos_token_id": 151643,
        "eos_token_id": 151645,
    },
    "llama-3.1-8b": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 128256,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "hidden_act": "silu",
        "torch_dtype": "bfloat16",
        "bos_token_id": 128000,
        "eos_token_id": [128001, 128008, 128009],
        "rope_scaling": {
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
            "rope_type": "llama3",
        },
    },
    # --smoke: the tiny test shapes, on CPU
    "tiny-qwen3": {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": 1024,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000,
        "tie_word_embeddings": True,
        "attention_bias": False,
        "hidden_act": "silu",
        "torch_dtype": "float32",
        "eos_token_id": 2,
    },
}


def workload(
    num: int, vocab: int, lo: int, hi: int, seed: int
) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(10, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(num)]
    outputs = [rng.randint(lo, hi) for _ in range(num)]
    return prompts, outputs


def model_dir(name: str, root: Path, tokenizer_src: Path) -> Path:
    """config.json from the shapes, and a tokenizer (the engine wants one; prompts are token ids)."""
    out = root / name
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(SHAPES[name], indent=2))
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(tokenizer_src / f, out / f)
    return out


def random_hf_model(path: Path, dtype: torch.dtype, device: torch.device, seed: int):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    config = AutoConfig.from_pretrained(path)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def hold_clocks_up(device: torch.device, seconds: float = 1.0) -> None:
    """Keep the GPU busy for ``seconds`` before a timing. An idle H200 sits at 345 MHz; the
    first figure after the model's load ran at a fraction of the chip's speed (Qwen3-0.6B's
    batch-1 step timed first at 7.6 ms, then 1.8 ms a step under the profiler; the copy
    bandwidth read 2.95-4.19 TB/s between runs)."""
    if device.type != "cuda":
        return
    a = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        for _ in range(20):
            a @ a
        sync(device)


def measure_bandwidth(device: torch.device, nbytes: int, repeats: int = 10) -> float:
    """Bytes/s of a large device-to-device copy (each copy reads and writes ``nbytes``)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    dst.copy_(src)
    sync(device)
    start = time.perf_counter()
    for _ in range(repeats):
        dst.copy_(src)
    sync(device)
    elapsed = time.perf_counter() - start
    del src, dst
    return 2 * nbytes * repeats / elapsed


def step_bytes(
    model: torch.nn.Module, cfg: dict, context: int, dtype: torch.dtype
) -> tuple[int, int]:
    """(weight bytes a decode step reads, KV bytes of the context it reads)."""
    seen, total = set(), 0
    for name, p in model.named_parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        if name.endswith("embed_tokens.weight") and not cfg.get("tie_word_embeddings"):
            total += (
                p.shape[1] * p.element_size()
            )  # a lookup reads one row; the untied lm_head reads all
        else:
            total += p.numel() * p.element_size()
    itemsize = torch.tensor([], dtype=dtype).element_size()
    kv = (
        cfg["num_hidden_layers"]
        * 2
        * cfg["num_key_value_heads"]
        * cfg["head_dim"]
        * itemsize
        * context
    )
    return total, kv


def make_tandem(path: Path, args, device: torch.device, dtype_name: str):
    from tandem.server.engine import LLM

    return LLM(
        str(path),
        device=str(device),
        dtype=dtype_name,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enforce_eager=args.enforce_eager,
        gpu_memory_utilization=args.gpu_memory_utilization,
        **({"kv_cache_tokens": args.kv_cache_tokens} if args.kv_cache_tokens else {}),
    )


def run_tandem(llm, prompts, outputs, device: torch.device) -> tuple[float, int]:
    """Seconds and output tokens of one ``generate`` over the prompts (greedy, ignore_eos)."""
    from tandem.server.engine import SamplingParams

    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in outputs]
    llm.generate(prompts[:2], [p.clone(max_tokens=4) for p in params[:2]])  # warm-up
    sync(device)
    start = time.perf_counter()
    results = llm.generate(prompts, params)
    sync(device)
    elapsed = time.perf_counter() - start
    produced = sum(len(r.token_ids) for r in results)
    assert produced == sum(outputs), (produced, sum(outputs))
    return elapsed, produced


def timed(fn, device: torch.device, iters: int, warmup: int = 3) -> float:
    """Seconds per call of ``fn`` after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    sync(device)
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    sync(device)
    return (time.perf_counter() - start) / iters


def decode_step_time(llm, batch: int, context: int, device: torch.device, iters: int) -> float:
    """Seconds per forward of ``batch`` decode rows, each with ``context`` tokens of its own
    context (logits included; a CUDA graph replays when one holds the batch)."""
    from tandem.server.engine.model_runner import StepInputs

    runner = llm.engine.worker.runner
    bs = llm.engine.config.block_size
    per_row = -(-context // bs)
    if batch * per_row >= runner.num_blocks:
        raise SystemExit(f"{batch} rows of {context} tokens do not fit the KV cache")
    tables = [list(range(1 + r * per_row, 1 + (r + 1) * per_row)) for r in range(batch)]
    pos = context - 1
    slots = [t[pos // bs] * bs + pos % bs for t in tables]
    inputs = StepInputs(
        [11] * batch, [pos] * batch, slots, [1] * batch, [context] * batch, tables,
        list(range(batch)),
    )  # fmt: skip
    return timed(lambda: runner.run(inputs), device, iters)


def generate_token_time(llm, context: int, new: int, device: torch.device) -> float:
    """Seconds per output token of one sequence generated end to end (scheduler, sampler and
    detokenizer included): ``new`` tokens after a ``context``-token prompt, less the prefill."""
    from tandem.server.engine import SamplingParams

    prompt = [[11 + i % 1000 for i in range(context)]]
    params = SamplingParams(temperature=0.0, max_tokens=new + 1, ignore_eos=True)

    def run(p: SamplingParams) -> float:
        start = time.perf_counter()
        llm.generate(prompt, p)
        sync(device)
        return time.perf_counter() - start

    run(params)  # warm-up
    return (run(params) - run(params.clone(max_tokens=1))) / new


def replay_time(llm, batch: int, iters: int) -> float | None:
    """Seconds per replay of the captured graph that holds ``batch`` rows, alone: the GPU's
    part of a decode step, without the host's inputs, plan, logits and sampling around it
    (None when graphs are off)."""
    from tandem.server.engine.model_runner import pick_graph_size

    runner = llm.engine.worker.runner
    if not runner.graph_sizes:
        return None
    graph = runner._graphs.graphs[pick_graph_size(batch, runner.graph_sizes)]
    return timed(graph.replay, torch.device("cuda"), iters)


def profile_decode(llm, batch: int, context: int, device: torch.device, steps: int) -> None:
    """The profiler's 12 heaviest GPU kernels and host calls over ``steps`` decode steps."""
    from torch.profiler import ProfilerActivity, profile

    gpu = [ProfilerActivity.CUDA] if device.type == "cuda" else []
    with profile(activities=[ProfilerActivity.CPU, *gpu]) as prof:
        decode_step_time(llm, batch, context, device, iters=steps)
    table = prof.key_averages()
    print(f"\n-- profile: batch {batch}, context {context}, {steps} steps")
    print(table.table(sort_by="self_cuda_time_total", row_limit=12, max_name_column_width=60))
    print(table.table(sort_by="cpu_time_total", row_limit=12, max_name_column_width=60))


def prefill_time(llm, tokens: int, device: torch.device, iters: int) -> float:
    """Seconds per forward of one ``tokens``-long prompt in a single step (last row's logits)."""
    from tandem.server.engine.model_runner import StepInputs

    runner = llm.engine.worker.runner
    bs = llm.engine.config.block_size
    table = list(range(1, 1 + -(-tokens // bs)))
    slots = [table[p // bs] * bs + p % bs for p in range(tokens)]
    ids = [11 + p % 1000 for p in range(tokens)]
    inputs = StepInputs(ids, list(range(tokens)), slots, [tokens], [tokens], [table], [tokens - 1])
    return timed(lambda: runner.run(inputs), device, iters, warmup=1)


def prefill_flops(cfg: dict, body_params: int, tokens: int) -> float:
    """Matrix FLOPs of a causal prefill: 2 per weight per token, and QK^T plus PV over the
    lower triangle (2 * n^2 * heads * head_dim per layer)."""
    attn = cfg["num_hidden_layers"] * 2 * tokens**2 * cfg["num_attention_heads"] * cfg["head_dim"]
    return 2 * body_params * tokens + attn


def matmul_rate(dtype: torch.dtype, device: torch.device, n: int = 8192) -> float:
    """FLOP/s of an n x n x n product in ``dtype`` on random data."""
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    return 2 * n**3 / timed(lambda: a @ b, device, 10)


def body_parameters(model: torch.nn.Module) -> int:
    """Weights a prompt token multiplies by: everything but the embedding and the lm_head."""
    seen, total = set(), 0
    for name, p in model.named_parameters():
        if id(p) in seen or "embed_tokens" in name or "lm_head" in name:
            continue
        seen.add(id(p))
        total += p.numel()
    return total


def run_transformers(
    model, prompts, outputs, batch_size: int, device: torch.device
) -> tuple[float, int]:
    total_time, produced = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(prompts), batch_size):
            chunk, outs = prompts[i : i + batch_size], outputs[i : i + batch_size]
            width = max(len(p) for p in chunk)
            ids = torch.tensor([[0] * (width - len(p)) + p for p in chunk], device=device)
            mask = torch.tensor(
                [[0] * (width - len(p)) + [1] * len(p) for p in chunk], device=device
            )
            sync(device)
            start = time.perf_counter()
            out = model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=max(outs),
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
            sync(device)
            total_time += time.perf_counter() - start
            produced += (out.shape[1] - width) * len(chunk)
            del out
    return total_time, produced


def run_transformers_cb(model, prompts, new_tokens: int, device: torch.device) -> tuple[float, int]:
    """transformers' continuous batching (``generate_batch``): seconds and tokens generated."""
    from transformers import GenerationConfig

    config = GenerationConfig(
        max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    # The warm-up run (graph capture, cache sizing) is the same workload, and its manager is
    # kept for the timed run, as Tandem's engine is built before its clock starts.
    keep = "persistent_manager" in inspect.signature(model.generate_batch).parameters
    kw = {"persistent_manager": True} if keep else {}
    model.generate_batch(inputs=prompts, generation_config=config, **kw)
    sync(device)
    start = time.perf_counter()
    out = model.generate_batch(inputs=prompts, generation_config=config, **kw)
    sync(device)
    return time.perf_counter() - start, sum(len(o.generated_tokens) for o in out.values())


def free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def transformers_baselines(hf, prompts, outputs, args, device) -> dict[str, float]:
    """Output tokens/s of static ``generate`` (tokens asked for) and of continuous batching."""
    hf_prompts, hf_outputs = prompts[: args.hf_seqs], outputs[: args.hf_seqs]
    t_hf, n_hf = run_transformers(hf, hf_prompts, hf_outputs, args.hf_batch_size, device)
    rates = {"static": sum(hf_outputs) / t_hf}
    print(
        f"transformers generate   {t_hf:8.2f} s  {rates['static']:10.1f} output tok/s asked for "
        f"({args.hf_seqs} sequences in batches of {args.hf_batch_size}; {n_hf} generated)",
        flush=True,
    )
    try:
        t_cb, n_cb = run_transformers_cb(hf, hf_prompts, args.cb_tokens, device)
        rates["cb"] = n_cb / t_cb
        print(
            f"transformers CB         {t_cb:8.2f} s  {rates['cb']:10.1f} output tok/s "
            f"({args.hf_seqs} sequences x {args.cb_tokens} tokens)",
            flush=True,
        )
    except Exception as exc:  # a baseline that cannot run is reported, not fatal
        print(f"transformers CB: did not run ({type(exc).__name__}: {exc})", flush=True)
    return rates


def report_decode(llm, cfg: dict, args, device: torch.device, dtype: torch.dtype) -> None:
    hold_clocks_up(device)
    bandwidth = measure_bandwidth(device, args.bandwidth_bytes)
    weights, kv = step_bytes(llm.engine.worker.runner.model, cfg, args.decode_context, dtype)
    print(f"copy bandwidth {bandwidth / 1e9:.0f} GB/s (read + write)")
    for batch in args.decode_batches:
        step = decode_step_time(llm, batch, args.decode_context, device, args.decode_iters)
        floor = (weights + batch * kv) / bandwidth
        replay = replay_time(llm, batch, args.decode_iters) if device.type == "cuda" else None
        print(
            f"decode step, batch {batch:3d}, context {args.decode_context}: {step * 1e3:7.3f} ms; "
            f"floor {floor * 1e3:7.3f} ms ({weights / 1e9:.2f} GB weights + "
            f"{batch * kv / 1e9:.2f} GB KV); {floor / step:.2f} of the floor's speed; "
            f"{batch / step:8.0f} tok/s"
            + (f"; the graph's replay alone {replay * 1e3:.3f} ms" if replay else ""),
            flush=True,
        )
    per_token = generate_token_time(llm, args.decode_context, 128, device)
    floor = (weights + kv) / bandwidth
    print(
        f"generate, one sequence, context {args.decode_context}: {per_token * 1e3:7.3f} ms a token "
        f"end to end; {floor / per_token:.2f} of the floor's speed; {1 / per_token:6.0f} tok/s",
        flush=True,
    )
    for batch in args.profile_batches:
        profile_decode(llm, batch, args.decode_context, device, steps=20)


def report_prefill(llm, cfg: dict, args, device: torch.device, dtype: torch.dtype) -> None:
    hold_clocks_up(device)
    seconds = prefill_time(llm, args.prefill_tokens, device, iters=3)
    flops = prefill_flops(cfg, body_parameters(llm.engine.worker.runner.model), args.prefill_tokens)
    rate = matmul_rate(dtype, device, 8192 if device.type == "cuda" else 512)
    print(
        f"prefill {args.prefill_tokens} tokens: {seconds * 1e3:.1f} ms, "
        f"{args.prefill_tokens / seconds:.0f} tok/s, {flops / seconds / 1e12:.0f} TFLOP/s = "
        f"{flops / seconds / rate:.2f} of the {rate / 1e12:.0f} TFLOP/s matrix product measured",
        flush=True,
    )


def bench_model(name: str, args, device: torch.device, root: Path, tokenizer_src: Path) -> None:
    cfg = SHAPES[name]
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    dtype_name = str(dtype).removeprefix("torch.")
    path = model_dir(name, root, tokenizer_src)
    prompts, outputs = workload(
        args.num_seqs, cfg["vocab_size"], args.min_len, args.max_len, args.seed
    )
    print(
        f"\n== {name}: {args.num_seqs} sequences, {sum(map(len, prompts))} prompt tokens, "
        f"{sum(outputs)} output tokens, {dtype_name} on {device}",
        flush=True,
    )
    hf = random_hf_model(path, dtype, device, args.seed)
    hf.save_pretrained(path)  # the checkpoint Tandem loads: the very tensors transformers holds
    base = {} if args.steps_only else transformers_baselines(hf, prompts, outputs, args, device)
    del hf
    free(device)

    llm = make_tandem(path, args, device, dtype_name)
    runner = llm.engine.worker.runner
    if not args.steps_only:
        offline(llm, prompts, outputs, base, args, device)
    report_decode(llm, cfg, args, device, dtype)
    report_prefill(llm, cfg, args, device, dtype)
    llm.engine.close()
    del llm, runner
    free(device)


def offline(llm, prompts, outputs, base: dict[str, float], args, device) -> None:
    """Tandem on the whole workload, and on the continuous-batching baseline's."""
    runner = llm.engine.worker.runner
    t_ours, n_ours = run_tandem(llm, prompts, outputs, device)
    graphs = f"up to {runner.graph_sizes[-1]}" if runner.graph_sizes else "off"
    print(
        f"tandem                  {t_ours:8.2f} s  {n_ours / t_ours:10.1f} output tok/s "
        f"(backend {runner.backend.name}, CUDA graphs {graphs}); "
        f"{n_ours / t_ours / base['static']:.2f}x transformers generate",
        flush=True,
    )
    if "cb" in base:
        cb_prompts = prompts[: args.hf_seqs]
        t_cb, n_cb = run_tandem(llm, cb_prompts, [args.cb_tokens] * len(cb_prompts), device)
        print(
            f"tandem, CB workload     {t_cb:8.2f} s  {n_cb / t_cb:10.1f} output tok/s; "
            f"{n_cb / t_cb / base['cb']:.2f}x transformers CB",
            flush=True,
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--smoke", action="store_true", help="tiny shapes and a few sequences; runs on CPU"
    )
    parser.add_argument("--models", nargs="+", default=None, choices=sorted(SHAPES))
    parser.add_argument("--num-seqs", type=int, default=None)
    parser.add_argument("--min-len", type=int, default=None)
    parser.add_argument("--max-len", type=int, default=None)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=16384)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--kv-cache-tokens", type=int, default=None)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--hf-batch-size", type=int, default=64)
    parser.add_argument(
        "--steps-only", action="store_true", help="decode steps and prefill only (no baselines)"
    )
    parser.add_argument("--hf-seqs", type=int, default=None, help="prompts the baselines run")
    parser.add_argument("--cb-tokens", type=int, default=None)
    parser.add_argument("--decode-batches", type=int, nargs="+", default=None)
    parser.add_argument("--prefill-tokens", type=int, default=None)
    parser.add_argument("--decode-context", type=int, default=None)
    parser.add_argument("--decode-iters", type=int, default=50)
    parser.add_argument("--bandwidth-bytes", type=int, default=None)
    parser.add_argument(
        "--profile-batches", type=int, nargs="*", default=[],
        help="after the decode sweep, torch profiler tables of decode steps at these batches",
    )  # fmt: skip
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    if args.smoke:
        device = torch.device("cpu")
        models = args.models or ["tiny-qwen3"]
        defaults = dict(
            num_seqs=8, min_len=16, max_len=48, decode_context=64, bandwidth_bytes=64 << 20,
            hf_seqs=4, cb_tokens=8, decode_batches=[1, 4], prefill_tokens=64,
        )  # fmt: skip
        args.kv_cache_tokens = args.kv_cache_tokens or 8192
        args.decode_iters = min(args.decode_iters, 10)
    else:
        if not torch.cuda.is_available():
            print(
                "bench/gpu.py needs a CUDA device for the full run (none is visible); "
                "`python bench/gpu.py --smoke` runs the tiny version on CPU",
                file=sys.stderr,
            )
            return 2
        device = torch.device("cuda")
        models = args.models or ["qwen3-0.6b", "llama-3.1-8b"]
        defaults = dict(
            num_seqs=256, min_len=100, max_len=1024, decode_context=512, bandwidth_bytes=1 << 30,
            hf_seqs=64, cb_tokens=256, decode_batches=[1, 8, 64, 256], prefill_tokens=4096,
        )  # fmt: skip
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)

    from tandem.server.engine.tiny_model import TinyModelSpec, make_tiny_model

    root = Path(tempfile.mkdtemp(prefix="tandem-gpu-bench-"))
    try:
        tokenizer_src = make_tiny_model(root / "_tokenizer", TinyModelSpec(num_hidden_layers=1))
        if device.type == "cuda":
            print(f"device: {torch.cuda.get_device_name(device)}")
        for name in models:
            bench_model(name, args, device, root, tokenizer_src)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
