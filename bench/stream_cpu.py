"""Server CPU per streamed token: does a long stream cost more per token than a short one?

A real ``tandem serve`` process on loopback (a tiny model, so the model's own work is small
and the output path is visible) answers the same greedy completion of L tokens twice,
streamed and not streamed, alternating. The server's CPU time (user + system, read from
``/proc``) of the non-streamed request is the baseline: the same steps without per-token
output. The difference divided by L is the stream's own CPU per token. If each streamed token
cost O(L) (snapshots of the whole output every step), that figure would grow with L; with
deltas it stays flat. Prints it for each L and the ratio of the longest to the shortest.

    python bench/stream_cpu.py [--lengths 512 4096] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.api_helpers import ServerProcess  # noqa: E402


def server_cpu_seconds(pid: int) -> float:
    """utime + stime of every thread of ``pid``."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_one(server: ServerProcess, client: httpx.Client, length: int, stream: bool) -> float:
    body = {
        "model": "tiny",
        "prompt": "The stream",
        "max_tokens": length,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
    }
    before = server_cpu_seconds(server.proc.pid)
    if stream:
        with client.stream("POST", server.url + "/v1/completions", json=body) as r:
            r.raise_for_status()
            for _ in r.iter_lines():
                pass
    else:
        r = client.post(server.url + "/v1/completions", json=body)
        r.raise_for_status()
        assert r.json()["usage"]["completion_tokens"] == length
    return server_cpu_seconds(server.proc.pid) - before


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[512, 4096])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    from tandem.server.engine.tiny_model import TinyModelSpec, make_tiny_model

    longest = max(args.lengths)
    with tempfile.TemporaryDirectory() as tmp:
        spec = TinyModelSpec(max_position_embeddings=longest + 64)
        model = str(make_tiny_model(str(Path(tmp) / "m"), spec))
        server = ServerProcess(model, "--kv-cache-tokens", str(longest + 128), "--block-size", "16")
        try:
            server.wait_ready()
            per_token: dict[int, float] = {}
            with httpx.Client(timeout=600) as client:
                run_one(server, client, 32, True)  # warm-up
                for length in args.lengths:
                    diffs = []
                    for _ in range(args.repeats):
                        streamed = run_one(server, client, length, True)
                        final = run_one(server, client, length, False)
                        diffs.append((streamed - final) / length)
                    per_token[length] = statistics.median(diffs)
                    print(
                        f"L={length:5d}: stream CPU beyond the non-streamed baseline "
                        f"{per_token[length] * 1e6:8.1f} us/token (median of {args.repeats})"
                    )
        finally:
            server.stop()
    short, long_ = min(args.lengths), longest
    print(
        f"ratio per-token stream CPU L={long_} / L={short}: "
        f"{per_token[long_] / max(per_token[short], 1e-9):.2f} (1.0 = flat)"
    )


if __name__ == "__main__":
    main()
