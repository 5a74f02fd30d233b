"""Serving on one GPU: one engine against prefill + decode engines behind the proxy, same run.

The model has Qwen3-0.6B's shape (random bfloat16 weights, as ``bench/gpu.py`` makes them).
First ``tandem serve`` alone (``--gpu-memory-utilization 0.9``), then a prefill and a decode
engine sharing the GPU (0.45 each) behind ``tandem proxy``. Each setup serves streamed
``/v1/completions`` at 8, 32 and 128 concurrent streams (random prompts of
``--prompt-tokens`` token ids, ``--output-tokens`` out, ``ignore_eos``, greedy): output tok/s,
TTFT and ITL p50/p99, the disaggregated figures as ratios of the aggregated ones. Before the
load, the disaggregated outputs of a few prompts are checked equal to the single engine's.
Last, the KV transfer between two GPU caches through the transport (device → pinned host →
TCP on loopback → device) in GB/s, against a device-to-device copy of the same bytes.

    python bench/gpu_serve.py [--concurrency 8 32 128] [--prompt-tokens 512] [--output-tokens 128]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.gpu import measure_bandwidth, model_dir, random_hf_model, sync  # noqa: E402
from tests.proxy.utils import PROXY_KEY, ProxyProcess, stop_all  # noqa: E402
from tests.utils import ServerProcess  # noqa: E402

MODEL = "qwen3-0.6b"


async def one_stream(client: httpx.AsyncClient, url: str, body: dict) -> tuple[float, list[float]]:
    """(TTFT, per-token gaps after the first) of one streamed completion, in seconds.

    Token ids, not text, mark the tokens (random ids outside the small tokenizer decode to
    nothing); a chunk carrying k tokens after a gap g counts k gaps of g / k.
    """
    start = time.perf_counter()
    first, last, gaps = None, None, []
    async with client.stream("POST", url, json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            choices = json.loads(line[5:])["choices"]
            k = len(choices[0].get("token_ids") or []) if choices else 0
            if not k:
                continue
            now = time.perf_counter()
            if first is None:
                first, k = now, k - 1
            elif k:
                gaps.extend([(now - last) / k] * k)
            last = now
    return first - start, gaps


async def load(base: str, key: str, prompts: list[list[int]], args, concurrency: int) -> dict:
    gate = asyncio.Semaphore(concurrency)
    headers = {"Authorization": f"Bearer {key}"}
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(headers=headers, timeout=600, limits=limits) as client:

        async def run(p: list[int]) -> tuple[float, list[float]]:
            async with gate:
                body = dict(
                    model="m", prompt=p, max_tokens=args.output_tokens, ignore_eos=True,
                    temperature=0.0, stream=True, return_token_ids=True,
                )  # fmt: skip
                return await one_stream(client, base + "/v1/completions", body)

        start = time.perf_counter()
        results = await asyncio.gather(*(run(p) for p in prompts))
        elapsed = time.perf_counter() - start
    ttft = sorted(r[0] for r in results)
    itl = sorted(g for r in results for g in r[1])
    pct = lambda xs, q: xs[min(len(xs) - 1, int(q * len(xs)))]  # noqa: E731
    return {
        "tok/s": len(prompts) * args.output_tokens / elapsed,
        "ttft_p50": statistics.median(ttft), "ttft_p99": pct(ttft, 0.99),
        "itl_p50": statistics.median(itl), "itl_p99": pct(itl, 0.99),
    }  # fmt: skip


def greedy_tokens(base: str, key: str, prompts: list[list[int]]) -> list[list[int]]:
    out = []
    for p in prompts:
        body = dict(
            model="m", prompt=p, max_tokens=32, ignore_eos=True, temperature=0.0,
            return_token_ids=True,
        )  # fmt: skip
        r = httpx.post(
            base + "/v1/completions", json=body, timeout=120,
            headers={"Authorization": f"Bearer {key}"},
        )  # fmt: skip
        r.raise_for_status()
        out.append(r.json()["choices"][0]["token_ids"])
    return out


def engine(path: Path, util: float, logs: Path, *extra: str) -> ServerProcess:
    flags = ["--gpu-memory-utilization", str(util), "--max-num-seqs", "256", "--dtype", "bfloat16"]
    name = extra[-1] if extra else "both"
    return ServerProcess(
        str(path), *flags, *extra, served_model_name="m", log_path=logs / f"{name}.log"
    )


def serve_all(base: str, key: str, prompts_for, args) -> dict[int, dict]:
    figures = {}
    for c in args.concurrency:
        figures[c] = asyncio.run(load(base, key, prompts_for(c), args, c))
        f = figures[c]
        print(
            f"  c={c:3d}: {f['tok/s']:8.0f} tok/s  TTFT p50 {f['ttft_p50'] * 1e3:7.1f} ms "
            f"p99 {f['ttft_p99'] * 1e3:7.1f} ms  ITL p50 {f['itl_p50'] * 1e3:6.2f} ms "
            f"p99 {f['itl_p99'] * 1e3:6.2f} ms",
            flush=True,
        )
    return figures


def kv_transfer(blocks: int) -> None:
    """GB/s of a transport pull between two GPU caches, against a device copy of the bytes."""
    from types import SimpleNamespace

    from tandem.server.disagg.transport import KVTransportClient, KVTransportServer
    from tandem.server.engine.kv_cache import KVCache

    cfg = SimpleNamespace(num_hidden_layers=28, num_key_value_heads=8, head_dim=128)
    dev = torch.device("cuda")
    src, dst = (KVCache(cfg, blocks + 1, 16, torch.bfloat16, dev) for _ in range(2))
    src.data.normal_()
    ids = list(range(1, blocks + 1))
    server = KVTransportServer(src, {"l": ids}.get, lambda lease: True).start()
    client = KVTransportClient(server.address, timeout_s=120)
    nbytes = src.data[:, :, 1:].numel() * src.data.element_size()
    client.pull("l", ids, dst, ids)
    best = float("inf")
    for _ in range(5):
        sync(dev)
        t0 = time.perf_counter()
        client.pull("l", ids, dst, ids)
        sync(dev)
        best = min(best, time.perf_counter() - t0)
    assert torch.equal(dst.data[:, :, 1:], src.data[:, :, 1:])
    client.close()
    server.close()
    copy = measure_bandwidth(dev, nbytes) / 2  # bytes moved per second, one way
    print(
        f"KV transfer of {nbytes / 1e9:.2f} GB ({blocks} blocks): {nbytes / best / 1e9:.1f} GB/s; "
        f"device copy {copy / 1e9:.0f} GB/s; {nbytes / best / copy:.3f} of it",
        flush=True,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[8, 32, 128])
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--output-tokens", type=int, default=128)
    ap.add_argument("--kv-blocks", type=int, default=256)
    args = ap.parse_args()
    from tandem.server.engine.tiny_model import TinyModelSpec, make_tiny_model

    root = Path(tempfile.mkdtemp(prefix="tandem-gpu-serve-"))
    rng = random.Random(0)
    prompts_for = lambda c: [  # noqa: E731
        [rng.randrange(10, 150000) for _ in range(args.prompt_tokens)] for _ in range(2 * c)
    ]
    procs: list = []
    try:
        tok = make_tiny_model(root / "_tokenizer", TinyModelSpec(num_hidden_layers=1))
        path = model_dir(MODEL, root, tok)
        random_hf_model(path, torch.bfloat16, torch.device("cuda"), 0).save_pretrained(path)
        torch.cuda.empty_cache()
        check = prompts_for(2)[:4]
        print(f"== aggregated: one engine, {MODEL} shape, bf16", flush=True)
        agg = engine(path, 0.9, root)
        procs = [agg]
        agg.wait_ready(300)
        want = greedy_tokens(agg.url, "unused", check)
        single = serve_all(agg.url, "unused", prompts_for, args)
        stop_all(procs)
        print("== disaggregated: prefill + decode engines (0.45 each) behind the proxy", flush=True)
        p, d = (engine(path, 0.45, root, "--role", r) for r in ("prefill", "decode"))
        proxy = ProxyProcess(
            "--node", f"{p.url}=prefill", "--node", f"{d.url}=decode",
            "--disagg-threshold", "0", log_path=root / "proxy.log",
        )  # fmt: skip
        procs = [proxy, p, d]
        for e in (p, d):
            e.wait_ready(300)
        proxy.wait_healthy([p.url, d.url], 120)
        got = greedy_tokens(proxy.url, PROXY_KEY, check)
        print(f"disaggregated outputs equal the single engine's: {got == want}", flush=True)
        split = serve_all(proxy.url, PROXY_KEY, prompts_for, args)
        for c in args.concurrency:
            a, b = single[c], split[c]
            print(
                f"  c={c:3d} disagg/agg: tok/s {b['tok/s'] / a['tok/s']:.2f}x, "
                f"TTFT p50 {b['ttft_p50'] / a['ttft_p50']:.2f}x, ITL p50 {b['itl_p50'] / a['itl_p50']:.2f}x, "
                f"ITL p99 {b['itl_p99'] / a['itl_p99']:.2f}x"
            )
        stop_all(procs)
        procs = []
        kv_transfer(args.kv_blocks)
    finally:
        stop_all(procs)
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
