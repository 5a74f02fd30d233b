"""The endpoint picker's added latency: the same requests through a real Envoy configured as a
GIE gateway (``ext_proc`` full duplex to ``tandem epp``, ``ORIGINAL_DST`` by the picked
endpoint) and through the same Envoy with a static route to the same engine, in one run.

One tiny-model engine serves every gateway; requests rotate between them, sequentially,
each over a kept-alive connection, so drift on this shared machine hits every side alike.
The picker is measured under each response mode a gateway may configure
(``tests/gateway/utils.RESPONSE_MODES``), one picker process per mode: ``gie-none`` (the
exchange ends with the request's body: one round trip to the picker per request),
``gie-headers`` (the response's headers too: a second round trip, before the client sees
them) and ``gie-streamed`` (headers, body chunks and trailers through the picker, as GIE's
and llm-d's reference Envoy configurations send them). Besides the static route
(``static``), one reference: ``floor``, the same Envoy (mode none) asking a do-nothing Python
``ext_proc`` server (fixed endpoint, no parsing, no scoring): what one exchange with any
Python gRPC server costs here, so ``gie-none`` minus ``floor`` is the picker's own share.
Two request kinds: ``POST /tokenize`` (the engine's own time is a fraction of a
millisecond, so the gateway's share shows) and ``POST /v1/completions`` with one output
token. Prints each side's p50/p99 and the added latency over the static route (goal <= 1 ms
at p50), the median of paired differences (each request against the static request of the
same round), and where the time goes as every Envoy's access log times it (the same log on
every side): ``to engine`` (the request's first byte in to its first byte out to the engine:
the picker's exchange), ``engine`` (the request's last byte out to the response's first byte
in) and ``in envoy`` (first byte in to last byte out); and the CPU time per request of each
``ext_proc`` server's process and each Envoy.

    python bench/epp.py [--requests 400] [--warmup 100] [--pause-ms 0]
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
from collections.abc import Callable
from pathlib import Path
from typing import Any

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
from tests.utils import ENGINE_FLAGS, ServerProcess, make_model, wait_until  # noqa: E402

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


# Envoy's own timing of each request, microseconds (access log ``COMMON_DURATION``):
# to engine, engine, in envoy
TIMING = (
    "%COMMON_DURATION(DS_RX_BEG:US_TX_BEG:us)% %COMMON_DURATION(US_TX_END:US_RX_BEG:us)% "
    "%COMMON_DURATION(DS_RX_BEG:DS_TX_END:us)%\n"
)
SPANS = ("to engine", "engine", "in envoy")


def timed(config: Callable[..., dict[str, Any]], log: Path) -> Callable[..., dict[str, Any]]:
    """``config`` with an access log of Envoy's timing of each request at ``log``."""

    def with_log(*ports: int) -> dict[str, Any]:
        rendered = config(*ports)
        listener = rendered["static_resources"]["listeners"][0]
        manager = listener["filter_chains"][0]["filters"][0]["typed_config"]
        manager["access_log"] = [
            {
                "name": "envoy.access_loggers.file",
                "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.access_loggers.file.v3.FileAccessLog",
                    "path": str(log),
                    "log_format": {"text_format_source": {"inline_string": TIMING}},
                },
            }
        ]
        return rendered

    return with_log


def log_lines(log: Path) -> list[str]:
    return log.read_text().splitlines() if log.exists() else []


def timings(log: Path, skip: int, n: int) -> list[tuple[int, ...]]:
    """Lines ``skip`` to ``skip + n`` of an access log, once Envoy has flushed them."""
    wait_until(lambda: len(log_lines(log)) >= skip + n, timeout=30, what=f"{log.name} flushed")
    return [tuple(int(v) for v in line.split()) for line in log_lines(log)[skip : skip + n]]


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (``/proc/PID/stat``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def measure(
    gateways: dict[str, str], path: str, body: dict, n: int, warmup: int, pause: float = 0.0
) -> dict[str, list[float]]:
    """Milliseconds per request on each gateway, rotating which goes first; ``pause``
    seconds idle after each request (what the last one left running, the engine's work
    after its answer or the picker's end of the exchange, then does not overlap the next)."""
    clients = {name: httpx.Client(base_url=url, timeout=30) for name, url in gateways.items()}
    times: dict[str, list[float]] = {name: [] for name in gateways}
    names = list(gateways)
    for i in range(warmup):  # each connection, the engine and each picker's code paths
        for name in names[i % len(names) :] + names[: i % len(names)]:
            clients[name].post(path, json=body).raise_for_status()
    for i in range(n):
        for name in names[i % len(names) :] + names[: i % len(names)]:  # each goes first in turn
            start = time.perf_counter()
            clients[name].post(path, json=body).raise_for_status()
            times[name].append((time.perf_counter() - start) * 1000)
            time.sleep(pause)
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


def report_spans(kind: str, spans: dict[str, list[tuple[int, ...]]]) -> None:
    """Envoy's medians of each span, and each side's difference from ``static``'s."""
    medians = {
        name: [statistics.median(row[i] for row in rows) / 1000 for i in range(len(SPANS))]
        for name, rows in spans.items()
    }
    for name, values in medians.items():
        parts = [
            f"{span} {v:6.3f}" + ("" if name == "static" else f" ({v - s:+.3f})")
            for span, v, s in zip(SPANS, values, medians["static"])
        ]
        print(f"{kind:10s} {name:12s} envoy ms: " + ", ".join(parts))


def report_cpu(kind: str, used: dict[str, float], requests: int) -> None:
    print(
        f"{kind:10s} CPU ms per request: "
        + ", ".join(f"{name} {seconds / requests * 1000:.3f}" for name, seconds in used.items())
    )


def run_kind(kind: str, gateways: dict, servers: dict[str, int], args, logs: Path) -> None:
    """One request kind on every gateway: latencies, Envoy's spans, processes' CPU."""
    path, body = KINDS[kind]
    pids = {f"{name} server": pid for name, pid in servers.items()}
    pids |= {f"{name} envoy": g.proc.pid for name, g in gateways.items()}
    done = {name: len(log_lines(logs / f"{name}.log")) for name in gateways}
    before = {name: cpu_seconds(pid) for name, pid in pids.items()}
    print(f"load average before {kind}: {os.getloadavg()}")
    urls = {name: g.url for name, g in gateways.items()}
    times = measure(urls, path, body, args.requests, args.warmup, args.pause_ms / 1000)
    used = {name: cpu_seconds(pid) - before[name] for name, pid in pids.items()}
    report(kind, times)
    spans = {
        name: timings(logs / f"{name}.log", done[name] + args.warmup, args.requests)
        for name in gateways
    }
    report_spans(kind, spans)
    report_cpu(kind, used, args.warmup + args.requests)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--pause-ms", type=float, default=0.0, help="idle after each request")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-epp-"))
    engine = ServerProcess(make_model(work / "models"), *ENGINE_FLAGS, log_path=work / "e.log")
    started: list = [engine]
    floor = None
    try:
        engine.wait_ready()
        servers: dict[str, int] = {}
        gateways: dict[str, EnvoyProcess] = {}
        for mode in RESPONSE_MODES:
            picker = PickerProcess("--node", engine.url, log_path=work / f"epp-{mode}.log")
            started.append(picker)
            picker.wait_ready()
            servers[f"gie-{mode}"] = picker.proc.pid
            config = functools.partial(gie_gateway, response=mode)
            gateways[f"gie-{mode}"] = EnvoyProcess(
                timed(config, work / f"gie-{mode}.log"), work, picker.port
            )
        floor_port = free_port()
        floor = multiprocessing.Process(
            target=serve_floor, args=(f"127.0.0.1:{engine.port}", floor_port), daemon=True
        )
        floor.start()
        servers["floor"] = floor.pid
        config = functools.partial(gie_gateway, response="none")
        gateways["floor"] = EnvoyProcess(timed(config, work / "floor.log"), work, floor_port)
        gateways["static"] = EnvoyProcess(
            timed(static_gateway, work / "static.log"), work, engine.port
        )
        started += gateways.values()
        for g in gateways.values():
            g.wait_ready()
        for kind in KINDS:
            run_kind(kind, gateways, servers, args, work)
        print(f"load average after: {os.getloadavg()} ({os.cpu_count()} cores)")
    finally:
        for p in reversed(started):
            p.stop()
        if floor is not None:
            floor.terminate()


if __name__ == "__main__":
    main()
