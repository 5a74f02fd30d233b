"""GPU throughput: Tandem against transformers ``generate`` on real model shapes, in the same run.

The offline workload of nano-vllm's benchmark: 256 sequences, input and output lengths each
uniform in 100..1024 (random token ids), ``ignore_eos``, greedy. Models: the shapes of
Qwen3-0.6B and Llama-3.1-8B (their published config.json) with random bfloat16 weights made
on the GPU, saved into the model's directory; Tandem loads them from there, so both sides run
the same model on the same prompts.

Per model it prints:
  * Tandem's output tokens/s over the whole workload (one ``generate`` call);
  * transformers' output tokens/s on the same prompts, as left-padded batches of
    ``--hf-batch-size`` (its KV cache for all 256 at once does not fit beside the 8B weights),
    each batch generating up to its longest requested output; tokens/s counts the tokens
    that were asked for; and the ratio;
  * a decode step at batch 1 (``--decode-context`` tokens of context; CUDA graphs when on),
    against the physical floor: the bytes a step must read (weights, plus the KV of the
    context) over the device bandwidth measured by a large device-to-device copy.

    python bench/gpu.py                         # both models; needs CUDA
    python bench/gpu.py --models qwen3-0.6b --num-seqs 64
    python bench/gpu.py --smoke                 # tiny shapes, a few sequences; runs on CPU
"""

from __future__ import annotations

import argparse
import gc
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


def run_tandem(path: Path, prompts, outputs, args, device: torch.device, dtype_name: str):
    from tandem.server.engine import LLM, SamplingParams

    llm = LLM(
        str(path),
        device=str(device),
        dtype=dtype_name,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enforce_eager=args.enforce_eager,
        gpu_memory_utilization=args.gpu_memory_utilization,
        **({"kv_cache_tokens": args.kv_cache_tokens} if args.kv_cache_tokens else {}),
    )
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in outputs]
    llm.generate(prompts[:2], [p.clone(max_tokens=4) for p in params[:2]])  # warm-up
    sync(device)
    start = time.perf_counter()
    results = llm.generate(prompts, params)
    sync(device)
    elapsed = time.perf_counter() - start
    produced = sum(len(r.token_ids) for r in results)
    assert produced == sum(outputs), (produced, sum(outputs))
    return llm, elapsed, produced


def decode_step_time(llm, context: int, device: torch.device, iters: int) -> float:
    """Seconds per forward of one decode row with ``context`` tokens of context (logits included)."""
    from tandem.server.engine.model_runner import StepInputs

    runner = llm.engine.worker.runner
    bs = llm.engine.config.block_size
    blocks = list(range(1, -(-context // bs) + 1))
    if blocks[-1] >= runner.num_blocks:
        raise SystemExit(
            f"--decode-context {context} does not fit the KV cache ({runner.num_blocks} blocks)"
        )
    pos = context - 1
    inputs = StepInputs(
        [11], [pos], [blocks[pos // bs] * bs + pos % bs], [1], [context], [blocks], [0]
    )
    for _ in range(5):
        runner.run(inputs)
    sync(device)
    start = time.perf_counter()
    for _ in range(iters):
        runner.run(inputs)
    sync(device)
    return (time.perf_counter() - start) / iters


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


def bench_model(name: str, args, device: torch.device, root: Path, tokenizer_src: Path) -> None:
    cfg = SHAPES[name]
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    dtype_name = str(dtype).removeprefix("torch.")
    path = model_dir(name, root, tokenizer_src)
    lo, hi = (args.min_len, args.max_len)
    prompts, outputs = workload(args.num_seqs, cfg["vocab_size"], lo, hi, args.seed)
    wanted = sum(outputs)
    print(
        f"\n== {name}: {args.num_seqs} sequences, {sum(map(len, prompts))} prompt tokens, "
        f"{wanted} output tokens, {dtype_name} on {device}",
        flush=True,
    )

    hf = random_hf_model(path, dtype, device, args.seed)
    hf.save_pretrained(path)  # the checkpoint Tandem loads: the very tensors transformers holds
    llm, t_ours, n_ours = run_tandem(path, prompts, outputs, args, device, dtype_name)
    runner = llm.engine.worker.runner
    print(
        f"tandem        {t_ours:8.2f} s  {n_ours / t_ours:10.1f} output tok/s  "
        f"(backend {runner.backend.name}, CUDA graphs {runner.graph_sizes[-1:] and 'up to ' + str(runner.graph_sizes[-1]) or 'off'})",
        flush=True,
    )

    step = decode_step_time(llm, args.decode_context, device, args.decode_iters)
    weights, kv = step_bytes(llm.engine.worker.runner.model, cfg, args.decode_context, dtype)
    bandwidth = measure_bandwidth(device, args.bandwidth_bytes)
    floor = (weights + kv) / bandwidth
    del llm
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()

    t_hf, n_hf = run_transformers(hf, prompts, outputs, args.hf_batch_size, device)
    print(
        f"transformers  {t_hf:8.2f} s  {wanted / t_hf:10.1f} output tok/s asked for "
        f"({n_hf / t_hf:.1f} tok/s counting all {n_hf} generated; batches of {args.hf_batch_size})"
    )
    print(f"ratio tandem/transformers: {(n_ours / t_ours) / (wanted / t_hf):.2f}x")
    print(
        f"decode step, batch 1, context {args.decode_context}: {step * 1e3:.3f} ms; floor {floor * 1e3:.3f} ms "
        f"= ({weights / 1e9:.3f} GB weights + {kv / 1e9:.3f} GB KV) / {bandwidth / 1e9:.0f} GB/s measured; "
        f"{floor / step * 100:.0f}% of the floor"
    )
    del hf
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


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
    parser.add_argument("--decode-context", type=int, default=None)
    parser.add_argument("--decode-iters", type=int, default=50)
    parser.add_argument("--bandwidth-bytes", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    if args.smoke:
        device = torch.device("cpu")
        models = args.models or ["tiny-qwen3"]
        defaults = dict(
            num_seqs=8, min_len=16, max_len=48, decode_context=64, bandwidth_bytes=64 << 20
        )
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
            num_seqs=256, min_len=100, max_len=1024, decode_context=512, bandwidth_bytes=1 << 30
        )
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
