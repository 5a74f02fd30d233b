"""What the P/D trust boundary costs and what it protects, each against a baseline in the
same run (docs/security.md):

1. the authenticated transport: ``KVTransportClient.pull`` with the transport key (a nonce
   and an HMAC per request, an HMAC on the answer's header) against the same pull unkeyed;
2. a stalled peer: the latency of real pulls through a ``KVPuller`` (4 workers) while four
   pulls are held by a peer that never answers (issue 11's four-request stall), against the
   same pulls with no stalled peer.

    python bench/pd_trust.py [--blocks 64] [--repeats 5] [--pulls 30]
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from types import SimpleNamespace

import torch
import zmq

from tandem.server.engine.kv_cache import KVCache

SECRET = "bench-internal-credential"


def make_cache(num_blocks: int, args: argparse.Namespace) -> KVCache:
    cfg = SimpleNamespace(
        num_hidden_layers=args.layers, num_key_value_heads=args.kv_heads, head_dim=args.head_dim
    )
    return KVCache(cfg, num_blocks, args.block_size, torch.float16, torch.device("cpu"))


def bench_keyed(args: argparse.Namespace) -> dict[str, float]:
    from tandem.server.disagg.transport import KVTransportClient, KVTransportServer
    from tandem.server.wire.trust import derive_key

    key = derive_key(SECRET, "kv-transport")
    n = args.blocks
    src, dst = make_cache(n + 1, args), make_cache(n + 1, args)
    src.data.normal_()
    blocks = list(range(1, n + 1))
    leases = {"lease": blocks}
    best = {}
    for name, k in (("plain", None), ("keyed", key)):
        server = KVTransportServer(src, leases.get, lambda _: True, key=k).start()
        client = KVTransportClient(server.address, timeout_s=120, key=k)
        client.pull("lease", blocks, dst, blocks)  # warm-up
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            client.pull("lease", blocks, dst, blocks)
            times.append(time.perf_counter() - t0)
        best[name] = min(times)
        client.close()
        server.close()
    assert torch.equal(dst.data[:, :, 1:], src.data[:, :, 1:]), (
        "pulled blocks differ from the source"
    )
    return best


def bench_stall(args: argparse.Namespace) -> dict[str, float]:
    from tandem.server.disagg.puller import KVPuller
    from tandem.server.disagg.transport import KVTransportServer, layout_of
    from tandem.server.engine.kv_transfer import PullTask
    from tandem.server.wire.trust import derive_key

    key = derive_key(SECRET, "kv-transport")
    src, dst = make_cache(9, args), make_cache(9, args)
    src.data.normal_()
    layout = layout_of(dst)
    server = KVTransportServer(src, {"lease": [1, 2, 3, 4]}.get, lambda _: True, key=key).start()
    ctx = zmq.Context()
    silent = ctx.socket(zmq.ROUTER)
    silent.setsockopt(zmq.LINGER, 0)
    silent_addr = f"tcp://127.0.0.1:{silent.bind_to_random_port('tcp://127.0.0.1')}"
    # Two pullers side by side, their pulls alternating, so load from other processes on a
    # shared machine falls on both alike; one has four pulls held by the silent peer.
    pullers = {
        name: KVPuller(lambda: layout, max_workers=4, timeout_s=600, key=key)
        for name in ("baseline", "4 stalled")
    }
    ended: list[str] = []
    for i in range(4):
        pullers["4 stalled"].submit(
            PullTask(f"s{i}", silent_addr, "x", "e", [1], [8]),
            dst,
            lambda rid, _: ended.append(rid),
        )
    latencies: dict[str, list[float]] = {name: [] for name in pullers}
    for i in range(args.pulls + 1):
        for name, puller in pullers.items():
            done = threading.Event()
            t0 = time.perf_counter()
            puller.submit(
                PullTask(f"r{i}", server.address, "lease", "e", [1, 2, 3, 4], [4, 5, 6, 7]),
                dst,
                lambda _rid, err, done=done: done.set() if err is None else None,
            )
            if not done.wait(60):
                raise RuntimeError(f"{name}: a real pull did not finish in 60 s")
            if i:  # the first one connects
                latencies[name].append(time.perf_counter() - t0)
    assert not ended, "a stalled pull ended early"
    while len(ended) < 4:  # now let the stalled pulls fail, so no thread is left
        if silent.poll(100):
            ident, *_ = silent.recv_multipart()
            silent.send_multipart([ident, b"ERR", b"the benchmark is over"])
    for puller in pullers.values():
        puller.close()
    results = {name: statistics.median(v) for name, v in latencies.items()}
    silent.close()
    server.close()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--pulls", type=int, default=30)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    args = parser.parse_args()
    keyed = bench_keyed(args)
    print(
        f"authenticated transport, {args.blocks} blocks: keyed {keyed['keyed'] * 1e3:.1f} ms vs "
        f"unkeyed {keyed['plain'] * 1e3:.1f} ms (ratio {keyed['keyed'] / keyed['plain']:.3f})"
    )
    stall = bench_stall(args)
    print(
        f"real pull latency (median of {args.pulls}) with 4 pulls held by a silent peer: "
        f"{stall['4 stalled'] * 1e3:.2f} ms vs {stall['baseline'] * 1e3:.2f} ms without "
        f"(ratio {stall['4 stalled'] / stall['baseline']:.3f})"
    )


if __name__ == "__main__":
    main()
