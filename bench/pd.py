"""P/D costs, each against its baseline in the same run: the KV transfer, and the proxy's hop.

1. KV transfer throughput over loopback: ``KVTransportClient.pull`` of N blocks from a
   ``KVTransportServer`` (staging the blocks, one zero-copy frame, scattering them into the
   destination cache) against a plain TCP socket sending the same number of bytes from a ready
   buffer into a ready buffer (the floor: no staging, no scatter, no protocol). The KV layout
   is a Llama-3-8B-like one (32 layers, 8 KV heads, head dim 128, fp16, blocks of 16 tokens:
   2 MiB per block) unless told otherwise.
2. The proxy's added latency: the same small request (a short prompt, one output token, so the
   engine's own time is small and the hop is visible) sent straight to a ``tandem serve``
   engine and through a ``tandem proxy`` in front of it, alternating, sequentially, each over a
   kept-alive connection. Prints medians, p90 and the ratio.

Runs alternate ``--repeats`` times and keep each side's best (transfer) or their medians
(latency), so a burst from another process on this shared machine hurts neither side alone.

    python bench/pd.py [--blocks 64] [--repeats 5] [--requests 60] [--skip-transfer] [--skip-proxy]
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import torch


# ----- 1. KV transfer ---------------------------------------------------------------------------
def make_cache(num_blocks: int, args: argparse.Namespace):
    from tandem.server.engine.kv_cache import KVCache

    cfg = SimpleNamespace(
        num_hidden_layers=args.layers, num_key_value_heads=args.kv_heads, head_dim=args.head_dim
    )
    return KVCache(
        cfg, num_blocks, args.block_size, getattr(torch, args.dtype), torch.device("cpu")
    )


def bench_transport(args: argparse.Namespace) -> dict[str, float]:
    from tandem.server.disagg.transport import KVTransportClient, KVTransportServer

    n = args.blocks
    src = make_cache(n + 1, args)
    src.data.normal_()
    dst = make_cache(n + 1, args)
    blocks = list(range(1, n + 1))
    leases = {"lease": blocks}
    server = KVTransportServer(src, leases.get, lambda lease_id: True).start()
    client = KVTransportClient(server.address, timeout_s=120)
    nbytes = src.data[:, :, 1:].numel() * src.data.element_size()

    # the baseline: a plain socket moving the same bytes from one ready buffer into another
    payload = src.data[:, :, 1:].contiguous().view(-1).view(torch.uint8).numpy()
    sink = bytearray(nbytes)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    stop = threading.Event()

    def serve() -> None:
        conn, _ = listener.accept()
        with conn:
            while not stop.is_set():
                if not conn.recv(1):
                    return
                conn.sendall(memoryview(payload))

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    sock = socket.create_connection(listener.getsockname())
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def socket_copy() -> None:
        sock.sendall(b"g")
        view = memoryview(sink)
        got = 0
        while got < nbytes:
            got += sock.recv_into(view[got:], nbytes - got)

    def pull() -> None:
        moved = client.pull("lease", blocks, dst, blocks)
        assert moved == nbytes

    pull()
    socket_copy()  # warm-up both
    assert torch.equal(dst.data[:, :, 1:], src.data[:, :, 1:]), (
        "the pulled blocks differ from the source"
    )
    best = {"transport": float("inf"), "socket": float("inf")}
    for _ in range(args.repeats):
        for name, fn in (("transport", pull), ("socket", socket_copy)):
            t0 = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - t0)
    stop.set()
    sock.close()
    listener.close()
    client.close()
    server.close()
    return {"bytes": nbytes, "transport_s": best["transport"], "socket_s": best["socket"]}


# ----- 2. the proxy's hop ----------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_health(url: str, proc: subprocess.Popen, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: process exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(url)


def bench_proxy(args: argparse.Namespace) -> dict[str, float]:
    model = args.model
    tmp = None
    if model is None:
        from tandem.server.engine.tiny_model import TinyModelSpec, make_tiny_model

        tmp = tempfile.TemporaryDirectory()
        model = str(make_tiny_model(Path(tmp.name) / "llama", TinyModelSpec(arch="llama", seed=1)))
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
    env.pop("TANDEM_API_KEY", None)
    env.pop("TANDEM_PROXY_API_KEY", None)
    exe = [sys.executable, "-m", "tandem.server.cli"]
    e_port, p_port = free_port(), free_port()
    engine_url, proxy_url = f"http://127.0.0.1:{e_port}", f"http://127.0.0.1:{p_port}"
    procs = [
        subprocess.Popen(
            [
                *exe,
                "serve",
                "--model",
                model,
                "--served-model-name",
                "tiny",
                "--host",
                "127.0.0.1",
                "--port",
                str(e_port),
                "--log-level",
                "warning",
                "--kv-cache-tokens",
                "4096",
            ],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        ),
        subprocess.Popen(
            [
                *exe,
                "proxy",
                "--host",
                "127.0.0.1",
                "--port",
                str(p_port),
                "--node",
                engine_url,
                "--log-level",
                "warning",
            ],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        ),
    ]
    try:
        wait_health(engine_url, procs[0])
        wait_health(proxy_url, procs[1])
        body = {"model": "tiny", "prompt": "Hello there", "max_tokens": 1, "temperature": 0}
        times: dict[str, list[float]] = {"direct": [], "proxy": []}
        with (
            httpx.Client(base_url=engine_url, timeout=60) as direct,
            httpx.Client(base_url=proxy_url, timeout=60) as via,
        ):
            clients = {"direct": direct, "proxy": via}
            for c in clients.values():  # warm-up: connections, first-request costs
                for _ in range(5):
                    c.post("/v1/completions", json=body).raise_for_status()
            for _ in range(args.requests):
                for name, c in clients.items():
                    t0 = time.perf_counter()
                    r = c.post("/v1/completions", json=body)
                    times[name].append(time.perf_counter() - t0)
                    r.raise_for_status()
        out = {}
        for name, ts in times.items():
            ts.sort()
            out[f"{name}_median_s"] = statistics.median(ts)
            out[f"{name}_p90_s"] = ts[int(0.9 * (len(ts) - 1))]
        return out
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
        if tmp is not None:
            tmp.cleanup()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=64, help="KV blocks per pull")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument(
        "--requests", type=int, default=60, help="requests per side for the proxy latency"
    )
    ap.add_argument(
        "--model", default=None, help="model for the proxy latency run (default: a tiny one)"
    )
    ap.add_argument("--skip-transfer", action="store_true")
    ap.add_argument("--skip-proxy", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // 2))

    if not args.skip_transfer:
        r = bench_transport(args)
        mib = r["bytes"] / 2**20
        t_gbs = r["bytes"] / r["transport_s"] / 1e9
        s_gbs = r["bytes"] / r["socket_s"] / 1e9
        print(
            f"KV transfer over loopback, {args.blocks} blocks = {mib:.0f} MiB per pull "
            f"({args.layers} layers x {args.kv_heads} KV heads x {args.head_dim} x {args.dtype}, "
            f"block {args.block_size}), best of {args.repeats}:"
        )
        print(
            f"  tandem transport (pyzmq, stage + scatter): {r['transport_s'] * 1e3:8.1f} ms  {t_gbs:6.2f} GB/s"
        )
        print(
            f"  plain socket copy of the same bytes:       {r['socket_s'] * 1e3:8.1f} ms  {s_gbs:6.2f} GB/s"
        )
        print(f"  ratio transport / socket throughput:       {t_gbs / s_gbs:8.2f}")
    if not args.skip_proxy:
        r = bench_proxy(args)
        print(
            f"Proxy hop, {args.requests} sequential requests per side (1 output token, alternating):"
        )
        print(
            f"  engine direct:   median {r['direct_median_s'] * 1e3:7.2f} ms   p90 {r['direct_p90_s'] * 1e3:7.2f} ms"
        )
        print(
            f"  through proxy:   median {r['proxy_median_s'] * 1e3:7.2f} ms   p90 {r['proxy_p90_s'] * 1e3:7.2f} ms"
        )
        print(
            f"  added per request (median): {(r['proxy_median_s'] - r['direct_median_s']) * 1e3:.2f} ms; "
            f"ratio proxy / direct: {r['proxy_median_s'] / r['direct_median_s']:.2f}"
        )


if __name__ == "__main__":
    main()
