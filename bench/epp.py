"""The endpoint picker's added latency: the same requests through a real Envoy configured as a
GIE gateway (``ext_proc`` full duplex to ``tandem epp``, ``ORIGINAL_DST`` by the picked
endpoint) and through the same Envoy with a static route to the same engine, in one run.

One tiny-model engine serves every gateway; requests rotate between them, sequentially,
each over a kept-alive connection, so drift on this shared machine hits every side alike.
The picker is measured under each response mode a gateway may configure
(``tests/gateway/utils.RESPONSE_MODES``): ``gie-none`` (the exchange ends with the request's
body: one round trip to the picker per request), ``gie-headers`` (the response's headers
too: a second round trip, before the client sees them) and ``gie-streamed`` (headers, body
chunks and trailers through the picker, as GIE's and llm-d's reference Envoy configurations
send them). Besides the static route (``static``), one reference: ``floor``, the same Envoy
(mode none) asking a do-nothing Python ``ext_proc`` server (fixed endpoint, no parsing, no
scoring): what one exchange with any Python gRPC server costs here, so ``gie-none`` minus
``floor`` is the picker's own share. Two request kinds: ``POST /tokenize`` (the engine's own
time is a fraction of a millisecond, so the gateway's share shows) and ``POST
/v1/completions`` with one output token. Prints each side's p50/p99 and the added latency
over the static route (goal <= 1 ms at p50).

    python bench/epp.py [--requests 400]
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import grpc
import httpx
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tandem.server.net import free_port  # noqa: E402
from tandem.server.picker import protocol  # noqa: E402
from tests.gateway.utils import (  # noqa: E402
    RESPONSE_MODES,
    EnvoyProcess,
    PickerProcess,
    gie_gateway,
    static_gateway,
)
from tests.utils import ENGINE_FLAGS, ServerProcess, make_model  # noqa: E402

KINDS = {
    "tokenize": ("/tokenize", {"model": "tiny", "prompt": "The picker chooses an engine " * 8}),
    "completion": (
        "/v1/completions",
        {"model": "tiny", "prompt": "The picker chooses an engine " * 8, "max_tokens": 1},
    ),
}


class _FixedEndpoint(ext_proc_grpc.ExternalProcessorServicer):
    """The floor: answers the protocol's messages with one endpoint, reading nothing."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint

    async def Process(self, requests, context):  # noqa: N802 - the gRPC method's name
        body = b""
        async for m in requests:
            which = m.WhichOneof("request")
            if which == "request_body":
                body += m.request_body.body
                if m.request_body.end_of_stream:
                    yield protocol.routed(self.endpoint, len(body))
                    yield protocol.body_passed(body)


def serve_floor(endpoint: str, port: int) -> None:
    """The do-nothing ext_proc server, in its own process as the picker is."""

    async def main() -> None:
        server = grpc.aio.server()
        ext_proc_grpc.add_ExternalProcessorServicer_to_server(_FixedEndpoint(endpoint), server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        await server.wait_for_termination()

    asyncio.run(main())


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def measure(gateways: dict[str, str], path: str, body: dict, n: int) -> dict[str, list[float]]:
    """Milliseconds per request on each gateway, rotating which goes first."""
    clients = {name: httpx.Client(base_url=url, timeout=30) for name, url in gateways.items()}
    times: dict[str, list[float]] = {name: [] for name in gateways}
    names = list(gateways)
    for name in names:  # warm each connection, the engine and each picker's code paths
        for _ in range(30):
            clients[name].post(path, json=body).raise_for_status()
    for i in range(n):
        for name in names[i % len(names) :] + names[: i % len(names)]:  # each goes first in turn
            start = time.perf_counter()
            clients[name].post(path, json=body).raise_for_status()
            times[name].append((time.perf_counter() - start) * 1000)
    for c in clients.values():
        c.close()
    return times


def report(kind: str, times: dict[str, list[float]]) -> None:
    for name, values in times.items():
        print(
            f"{kind:10s} {name:12s} p50 {percentile(values, 0.5):7.3f} ms   "
            f"p99 {percentile(values, 0.99):7.3f} ms   (n={len(values)})"
        )
    for name, base in [(n, "static") for n in times if n != "static"] + [("gie-none", "floor")]:
        gie, ref = times[name], times[base]
        pairs = [g - r for g, r in zip(gie, ref)]
        print(
            f"{kind:10s} {name:12s} over {base:6s} p50 "
            f"{percentile(gie, 0.5) - percentile(ref, 0.5):+.3f} ms, p99 "
            f"{percentile(gie, 0.99) - percentile(ref, 0.99):+.3f} ms; median of paired "
            f"differences {statistics.median(pairs):+.3f} ms; ratio of p50s "
            f"{percentile(gie, 0.5) / percentile(ref, 0.5):.2f}"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=400)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-epp-"))
    engine = ServerProcess(make_model(work / "models"), *ENGINE_FLAGS, log_path=work / "e.log")
    started: list = [engine]
    floor = None
    try:
        engine.wait_ready()
        picker = PickerProcess("--node", engine.url, log_path=work / "epp.log")
        started.append(picker)
        picker.wait_ready()
        floor_port = free_port()
        floor = multiprocessing.Process(
            target=serve_floor, args=(f"127.0.0.1:{engine.port}", floor_port), daemon=True
        )
        floor.start()
        gateways = {
            f"gie-{mode}": EnvoyProcess(
                functools.partial(gie_gateway, response=mode), work, picker.port
            )
            for mode in RESPONSE_MODES
        }
        gateways["floor"] = EnvoyProcess(
            functools.partial(gie_gateway, response="none"), work, floor_port
        )
        gateways["static"] = EnvoyProcess(static_gateway, work, engine.port)
        started += gateways.values()
        for g in gateways.values():
            g.wait_ready()
        urls = {name: g.url for name, g in gateways.items()}
        for kind, (path, body) in KINDS.items():
            print(f"load average before {kind}: {os.getloadavg()}")
            report(kind, measure(urls, path, body, args.requests))
        print(f"load average after: {os.getloadavg()} ({os.cpu_count()} cores)")
    finally:
        for p in reversed(started):
            p.stop()
        if floor is not None:
            floor.terminate()


if __name__ == "__main__":
    main()
