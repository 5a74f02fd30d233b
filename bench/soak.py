"""Soak: ``tandem up`` (the README's path) at steady load for N minutes.

Runs ``tandem up`` (default: its own default spec, one prefill and one decode engine behind
the proxy), keeps ``--concurrency`` clients busy with a steady mix (chat, streamed chat,
completions, and one turn in four on a new session that is then deleted), every prompt
different, and samples each process's anonymous resident memory (``RssAnon``) once a
minute. Prints a row per minute (requests, p50/p99 latency, memory of every process) and
each process's change over the last two-thirds of the run, in MB, per cent and bytes per
request: the issue-16 check is that each stays within 5% and p99 stays flat.

    python bench/soak.py --minutes 30 --concurrency 4
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from openai import OpenAI

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.utils import start_up  # noqa: E402


@dataclass
class Minute:
    latencies: list[float] = field(default_factory=list)
    errors: int = 0
    rss: dict[str, int] = field(default_factory=dict)  # process -> bytes at the minute's end


def rss_bytes(pid: int) -> int:
    """Anonymous resident memory (``RssAnon``): the process's own heap, not the shared
    libraries' file pages, which the kernel drops and reloads as other processes need RAM
    (so total RSS moves with the machine's load, not with the process)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    return 0


def children_of(pid: int) -> dict[str, int]:
    """``tandem up``'s processes by name: proxy, prefill-0, decode-0 ..."""
    found: dict[str, int] = {}
    counts: dict[str, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmd = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) != pid:
            continue
        args = [a.decode() for a in cmd]
        if "proxy" in args:
            name = "proxy"
        else:
            role = args[args.index("--role") + 1] if "--role" in args else "engine"
            name = f"{role}-{counts.get(role, 0)}"
            counts[role] = counts.get(role, 0) + 1
        found[name] = int(entry.name)
    return dict(sorted(found.items()))


def launch(args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    """``tandem up`` with no client key (the README's way), its output drained after the
    base URL so a full pipe never stalls it."""
    extra = ["--port", "0", *(["--model", args.model] if args.model else [])]
    extra += ["--log-dir", str(args.log_dir)] if args.log_dir else []
    proc, base, _ = start_up(extra, dict(os.environ), timeout=900)
    threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()
    return proc, base


def one_request(client: OpenAI, base: str, model: str, n: int, max_tokens: int) -> None:
    """The ``n``-th request of the mix; raises on any failure."""
    text = f"Request {n}: say something about the number {n * 7919 % 100003}."
    kind = n % 4
    if kind == 0:
        client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": text}], max_tokens=max_tokens
        )
    elif kind == 1:
        stream = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": text}],
            max_tokens=max_tokens,
            stream=True,
        )
        for _ in stream:
            pass
    elif kind == 2:
        client.completions.create(model=model, prompt=text, max_tokens=max_tokens)
    else:  # a session: one turn, then deleted (what a finished conversation does)
        sid = f"soak-{n}"
        client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": text}],
            max_tokens=max_tokens,
            extra_body={"session_id": sid},
        )
        httpx.delete(f"{base}/sessions/{sid}", timeout=30).raise_for_status()


def soak(args: argparse.Namespace) -> list[Minute]:
    proc, base = launch(args)
    try:
        client = OpenAI(base_url=base, api_key="none", max_retries=0, timeout=120)
        model = client.models.list().data[0].id
        procs = children_of(proc.pid)
        print(f"tandem up at {base}, model {model}, processes {procs}", flush=True)
        minutes = [Minute() for _ in range(int(args.minutes))]
        start = time.monotonic()
        end = start + 60 * len(minutes)
        counter = itertools.count()
        lock = threading.Lock()

        def worker() -> None:
            while (t0 := time.monotonic()) < end:
                n = next(counter)
                try:
                    one_request(client, base, model, n, args.max_tokens)
                    ok = True
                except Exception as exc:  # noqa: BLE001 - counted, printed, the soak goes on
                    ok = False
                    print(f"request {n}: {type(exc).__name__}: {exc}", flush=True)
                done = time.monotonic()  # a request counts in the minute it ends in, so
                i = min(int((done - start) // 60), len(minutes) - 1)  # each row is final
                with lock:
                    if ok:
                        minutes[i].latencies.append(done - t0)
                    else:
                        minutes[i].errors += 1

        threads = [threading.Thread(target=worker) for _ in range(args.concurrency)]
        for t in threads:
            t.start()
        for i, m in enumerate(minutes):
            time.sleep(max(0.0, start + 60 * (i + 1) - time.monotonic()))
            m.rss = {name: rss_bytes(pid) for name, pid in procs.items()}
            print(row(i, m), flush=True)
        for t in threads:
            t.join()
        return minutes
    finally:
        proc.terminate()
        proc.wait(timeout=120)


def row(i: int, m: Minute) -> str:
    lat = sorted(m.latencies)
    p50 = statistics.median(lat) if lat else float("nan")
    p99 = lat[min(len(lat) - 1, int(0.99 * len(lat)))] if lat else float("nan")
    rss = "  ".join(f"{k} {v / 2**20:7.1f}" for k, v in m.rss.items())
    return (
        f"min {i + 1:3d}  req {len(lat):5d}  err {m.errors:3d}  p50 {p50:6.3f}s  p99 {p99:6.3f}s"
        f"  RssAnon MB: {rss}"
    )


def growth(minutes: list[Minute]) -> list[str]:
    """Each process's RSS change from the end of the first third to the end of the run."""
    first = minutes[max(0, len(minutes) // 3 - 1)]
    last = minutes[-1]
    served = sum(len(m.latencies) for m in minutes[len(minutes) // 3 :])
    lines = []
    for name, before in first.rss.items():
        after = last.rss.get(name, 0)
        delta = after - before
        lines.append(
            f"{name}: {before / 2**20:.1f} -> {after / 2**20:.1f} MB over the last two-thirds "
            f"({100 * delta / before:+.2f}%, {delta / max(served, 1):+.0f} B per request, "
            f"{served} requests)"
        )
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--minutes", type=int, default=30)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--model", default=None, help="default: tandem up's default model")
    ap.add_argument("--log-dir", type=Path, default=None)
    args = ap.parse_args()
    minutes = soak(args)
    print("\n".join(growth(minutes)))
    lat = [sorted(m.latencies) for m in minutes if m.latencies]
    p99 = [x[min(len(x) - 1, int(0.99 * len(x)))] for x in lat]
    third = len(p99) // 3
    if third and p99[third:]:
        print(
            f"p99 over the last two-thirds: min {min(p99[third:]):.3f}s "
            f"max {max(p99[third:]):.3f}s (first minute after warm-up {p99[third]:.3f}s)"
        )


if __name__ == "__main__":
    main()
