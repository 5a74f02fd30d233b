"""Does a huge request body stall the event loop? ``/health`` latency while a 20 MB prompt
is read, parsed and refused, against the same polls with nothing else running.

A real ``tandem serve`` (a tiny model: the prompt is refused before any model work) is polled
every 10 ms from a thread of this process; ``curl`` sends the body from its own process so
the sending never holds this process's GIL. Prints each phase's p50/p99/max poll latency and
the ratio of the busy phase's worst poll to the idle phase's (the issue's bar: no poll more
than 50 ms over the idle worst).

    python bench/big_body.py [--megabytes 20] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import httpx

from tandem.server.engine.tiny_model import TinyModelSpec, make_tiny_model
from tandem.server.net import free_port

T = TypeVar("T")


def polls(url: str, during: Callable[[], T]) -> tuple[list[float], T]:
    """Seconds of each ``/health`` poll (every 10 ms) while ``during()`` runs, and its result."""
    times: list[float] = []
    stop = threading.Event()

    def poll() -> None:
        with httpx.Client() as c:
            while not stop.is_set():
                t = time.perf_counter()
                c.get(url + "/health")
                times.append(time.perf_counter() - t)
                time.sleep(0.01)

    poller = threading.Thread(target=poll)
    poller.start()
    try:
        result = during()
    finally:
        stop.set()
        poller.join()
    return times, result


def summary(name: str, times: list[float]) -> str:
    q = statistics.quantiles(times, n=100, method="inclusive") if len(times) > 1 else times * 99
    return (
        f"{name:5s} polls={len(times):4d} p50={1e3 * q[49]:6.1f} ms "
        f"p99={1e3 * q[98]:6.1f} ms max={1e3 * max(times):6.1f} ms"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--megabytes", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = str(make_tiny_model(str(Path(tmp) / "m"), TinyModelSpec()))
        body = Path(tmp) / "big.json"
        words = args.megabytes * 1024 * 1024 // 5
        body.write_bytes(json.dumps({"model": "m", "prompt": "word " * words}).encode())
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        cmd = [sys.executable, "-m", "tandem.server.cli", "serve", "--model", model]
        cmd += ["--served-model-name", "m", "--host", "127.0.0.1", "--port", str(port)]
        cmd += ["--log-level", "warning"]
        server = subprocess.Popen(cmd, env=dict(os.environ, OMP_NUM_THREADS="1"))
        try:
            deadline = time.monotonic() + 120
            while True:
                try:
                    if httpx.get(url + "/health", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise SystemExit("the server did not start")
                time.sleep(0.2)
            send = ["curl", "-s", "-o", "/dev/null", "-w", "%{http_code}"]
            send += ["-H", "content-type: application/json", "--data-binary", f"@{body}"]

            def big() -> str:
                out = subprocess.run(
                    send + [url + "/v1/completions"], capture_output=True, check=True
                )
                return out.stdout.decode()

            worst_ratio = []
            for i in range(args.repeats):
                idle, _ = polls(url, lambda: time.sleep(1.0))
                busy, status = polls(url, big)
                print(f"repeat {i}: {args.megabytes} MB body answered {status}")
                print("  " + summary("idle", idle))
                print("  " + summary("busy", busy))
                over = 1e3 * (max(busy) - max(idle))
                worst_ratio.append(max(busy) / max(idle))
                print(f"  busy worst - idle worst = {over:+.1f} ms; ratio {worst_ratio[-1]:.2f}x")
            print(
                f"worst-poll ratio busy/idle over repeats: {min(worst_ratio):.2f}x .. "
                f"{max(worst_ratio):.2f}x"
            )
        finally:
            server.terminate()
            server.wait(30)


if __name__ == "__main__":
    main()
