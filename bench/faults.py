"""Fault run (issue 26): ``tandem up`` on a tiny model, 16 concurrent streams, and each engine
in turn SIGKILLed, then SIGSTOPped for ``--stop-seconds`` and SIGCONTed. Prints, per fault, the
client errors, the worst stall a client saw (longest gap between bytes), the time until the
proxy listed the engine healthy again, and whether it was re-admitted.

Goals: no client waits more than 10 s on a stalled engine, no engine lost for good, a decode
restart costs at most 2 s of errors. A benchmark, bounded in time: never a test assertion.

    python bench/faults.py [--streams 16] [--stop-seconds 15] [--budget 600]
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ADMIN = "sk-faults-admin"


@dataclass
class Load:
    """Streams kept in flight by worker threads; each outcome is (end time, ok, worst gap)."""

    base: str
    model: str
    stop: threading.Event = field(default_factory=threading.Event)
    results: list[tuple[float, bool, float]] = field(default_factory=list)

    def one(self, client: httpx.Client) -> None:
        body = {"model": self.model, "prompt": "Once upon a time", "max_tokens": 32,
                "stream": True, "ignore_eos": True}  # fmt: skip
        last, worst, ok = time.monotonic(), 0.0, False
        try:
            with client.stream("POST", self.base + "/completions", json=body) as r:
                for chunk in r.iter_raw():
                    now = time.monotonic()
                    worst, last = max(worst, now - last), now
                    ok = r.status_code == 200 and b'"error"' not in chunk
                    if b'"error"' in chunk:
                        break
        except httpx.HTTPError:
            ok = False
        worst = max(worst, time.monotonic() - last) if not ok else worst
        self.results.append((time.monotonic(), ok, worst))

    def worker(self) -> None:
        with httpx.Client(timeout=120) as client:
            while not self.stop.is_set():
                self.one(client)

    def window(self, start: float, end: float) -> tuple[int, int, float, float]:
        """(requests, errors, seconds from first to last error, worst gap) ending in it."""
        rs = [r for r in self.results if start <= r[0] <= end]
        errs = [t for t, ok, _ in rs if not ok]
        span = (max(errs) - min(errs)) if errs else 0.0
        return len(rs), len(errs), span, max((g for _, _, g in rs), default=0.0)


def start_up(model: str, logs: Path) -> tuple[subprocess.Popen, str, dict[str, str]]:
    """``tandem up`` on loopback; its process, OpenAI base URL and engine URLs by name."""
    env = dict(os.environ, TANDEM_ADMIN_API_KEY=ADMIN, TOKENIZERS_PARALLELISM="false")
    env.pop("TANDEM_PROXY_API_KEY", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "tandem.server.cli", "up", "--model", model, "--port", "0",
         "--log-dir", str(logs), "--grace", "10"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
    )  # fmt: skip
    text = ""
    for line in iter(proc.stdout.readline, ""):
        text += line
        if m := re.search(r"OpenAI base URL: (\S+)", line):
            threading.Thread(target=lambda: [print("  |", ln.rstrip()) for ln in proc.stdout],
                             daemon=True).start()  # fmt: skip
            return proc, m.group(1), dict(re.findall(r"(\S+) ready on (\S+)", text))
    raise SystemExit("tandem up did not start:\n" + text)


def pid_on(url: str) -> int:
    port = url.rsplit(":", 1)[1].encode()
    for entry in Path("/proc").iterdir():
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"serve" in argv and b"--port" in argv and argv[argv.index(b"--port") + 1] == port:
            return int(entry.name)
    raise SystemExit(f"no engine on {url}")


def healthy(proxy: str, url: str) -> bool:
    try:
        nodes = httpx.get(proxy + "/nodes/status", headers={"Authorization": f"Bearer {ADMIN}"},
                          timeout=5).json()  # fmt: skip
    except (httpx.HTTPError, ValueError):
        return False
    return bool(nodes.get(url, {}).get("healthy"))


def fault(load: Load, proxy: str, name: str, url: str, kind: str, args: argparse.Namespace) -> None:
    """One fault, then until the engine is healthy again (bounded), then a settling pause."""
    t0 = time.monotonic()
    if kind == "SIGKILL":
        os.kill(pid_on(url), signal.SIGKILL)
    else:
        pid = pid_on(url)
        os.kill(pid, signal.SIGSTOP)
        time.sleep(args.stop_seconds)
        os.kill(pid, signal.SIGCONT)
    deadline = time.monotonic() + args.recover_bound
    time.sleep(1.0)
    while not healthy(proxy, url) and time.monotonic() < deadline:
        time.sleep(0.2)
    back = healthy(proxy, url)
    recovered = time.monotonic() - t0
    time.sleep(args.settle)
    n, errs, span, worst = load.window(t0, time.monotonic())
    print(f"{kind:7} {name:9}  requests {n:4}  errors {errs:3} (over {span:5.1f}s)  worst stall "
          f"{worst:5.1f}s  healthy again after {recovered:5.1f}s  re-admitted {back}",
          flush=True)  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="model dir (default: a tiny random llama)")
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--stop-seconds", type=float, default=15.0)
    ap.add_argument("--settle", type=float, default=5.0)
    ap.add_argument("--recover-bound", type=float, default=90.0)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="tandem-faults-"))
    model = args.model
    if model is None:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        from tests.utils import make_model

        model = make_model(tmp / "model")
    proc, base, engines = start_up(model, tmp / "logs")
    proxy = base.removesuffix("/v1")
    load = Load(base, Path(model).name)
    threads = [threading.Thread(target=load.worker, daemon=True) for _ in range(args.streams)]
    try:
        for t in threads:
            t.start()
        time.sleep(args.settle)
        for name in ("prefill-0", "decode-0"):
            for kind in ("SIGKILL", "SIGSTOP"):
                fault(load, proxy, name, engines[name], kind, args)
    finally:
        load.stop.set()
        for t in threads:
            t.join(30)
        proc.send_signal(signal.SIGINT)
        proc.wait(60)
    return 0


if __name__ == "__main__":
    sys.exit(main())
