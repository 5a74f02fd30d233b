"""Tandem against llama.cpp's server on the default GGUF: one user on a laptop, and a few.

    python bench/vs_llamacpp.py [--concurrency 1,4,16] [--workloads short,long] [--threads 2]

Both servers load the same file, the default model ``tandem up`` serves (SmolLM2-135M-Instruct
Q4_1); llama.cpp is ``llama-cpp-python[server]`` from PyPI, compiled once into its own venv
under ~/.cache/tandem-bench/llamacpp (where it cannot build, the bench says why and stops).
One server runs at a time; the same plain client (streamed ``/v1/completions``, greedy) sends
each the same prompts: ``short`` is 128 tokens in / 128 out, ``long`` 1,024 in / 256 out, with
``2 * concurrency`` requests (at least 4) per row, every prompt distinct so no prefix cache
helps. Neither side stops at EOS: Tandem gets ``ignore_eos``, llama.cpp (which has no such
field) an EOS logit bias of -100. Output tok/s counts the tokens generated over the row's wall
time; TTFT is the time to the first streamed text. llama.cpp's server runs one request at a
time, the others queued (``--interrupt_requests False``: by default a new request cuts the
running one short). No assertion: figures to read.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "server"), str(ROOT)]
# tandem.server sets GOMP_SPINCOUNT as it is imported; the peer keeps the user's own
USER_SPIN = os.environ.get("GOMP_SPINCOUNT")

from bench.vllm_peer import CACHE, smollm2_dir  # noqa: E402
from bench.vs_vllm import free_port, machine  # noqa: E402
from tandem.server.engine.default_model import default_model_path  # noqa: E402

LLAMACPP = "llama-cpp-python[server]==0.3.36"
SERVED = "smollm2"
EOS_IDS = (0, 2)  # <|endoftext|>, <|im_end|>: either ends a SmolLM2 generation
WORKLOADS = {"short": (128, 128), "long": (1024, 256)}


@dataclass(frozen=True)
class Row:
    tok_s: float
    ttft_p50_ms: float
    tokens: int


def llamacpp_python(log: Path) -> Path | None:
    """The cached venv's python with llama.cpp's server built, or None (said why)."""
    venv = CACHE / "llamacpp"
    python = venv / "bin" / "python"
    probe = [str(python), "-c", "import llama_cpp.server"]
    if python.exists() and subprocess.run(probe, capture_output=True).returncode == 0:
        return python
    print(f"building {LLAMACPP} into {venv} (once; several minutes)", flush=True)
    with log.open("w") as out:
        steps = [
            [sys.executable, "-m", "venv", str(venv)],
            [str(python), "-m", "pip", "install", LLAMACPP],
        ]
        for cmd in steps:
            if subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT).returncode:
                print(f"llama.cpp could not be built here ({' '.join(cmd[-2:])}); see {log}")
                return None
    return python


def prompts(count: int, length: int, seed: int) -> list[str]:
    """Distinct prompts of about ``length`` tokens: random vocabulary ids, decoded."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir())
    rng = random.Random(seed)
    hi = tok.vocab_size - 1
    return [tok.decode([rng.randrange(100, hi) for _ in range(length)]) for _ in range(count)]


class Server:
    """One server process on loopback, stopped with its process group."""

    def __init__(self, name: str, cmd: list[str], port: int, log: Path) -> None:
        self.name, self.url = name, f"http://127.0.0.1:{port}"
        self.log = log.open("w")
        env = {k: v for k, v in os.environ.items() if k != "GOMP_SPINCOUNT"}
        env |= {"GOMP_SPINCOUNT": USER_SPIN} if USER_SPIN is not None else {}
        self.proc = subprocess.Popen(
            cmd, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True, env=env
        )

    def wait_ready(self, timeout: float = 600) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited; see {self.log.name}")
            probe = json.dumps({"model": SERVED, "prompt": "Hi", "max_tokens": 1}).encode()
            request = urllib.request.Request(
                self.url + "/v1/completions", probe, {"Content-Type": "application/json"}
            )
            try:  # a completion, not a listing: Tandem answers /v1/models while it loads
                with urllib.request.urlopen(request, timeout=30) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(1)
        raise RuntimeError(f"{self.name} not ready after {timeout} s")

    def stop(self) -> None:
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def start(name: str, gguf: Path, threads: int, work: Path, llama: Path | None) -> Server:
    port = free_port()
    if name == "tandem":
        cmd = [sys.executable, "-m", "tandem.server.cli", "serve", "--model", str(gguf)]
        cmd += ["--served-model-name", SERVED, "--log-level", "warning"]
    else:
        cmd = [str(llama), "-m", "llama_cpp.server", "--model", str(gguf), "--model_alias", SERVED]
        cmd += ["--n_threads", str(threads), "--n_threads_batch", str(threads), "--n_ctx", "4096"]
        cmd += ["--interrupt_requests", "False"]  # queue a request that arrives mid-stream
    server = Server(
        name, cmd + ["--host", "127.0.0.1", "--port", str(port)], port, work / f"{name}.log"
    )
    server.wait_ready()
    return server


async def one(client: httpx.AsyncClient, url: str, body: dict) -> tuple[float, int]:
    """(TTFT seconds, tokens generated) of one streamed completion."""
    start, first, chunks, reason = time.perf_counter(), None, 0, None
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line[6:])["choices"][0]
            if choice.get("text") and first is None:
                first = time.perf_counter()
            chunks += bool(choice.get("text"))
            reason = choice.get("finish_reason") or reason
    tokens = body["max_tokens"] if reason == "length" else chunks
    return (first or time.perf_counter()) - start, tokens


async def run_row(server: Server, texts: list[str], out_len: int, conc: int) -> Row:
    body = {"model": SERVED, "max_tokens": out_len, "temperature": 0.0, "stream": True}
    if server.name == "tandem":
        body["ignore_eos"] = True
    else:
        body["logit_bias"] = {str(t): -100.0 for t in EOS_IDS}
        body["logit_bias_type"] = "input_ids"
    sem = asyncio.Semaphore(conc)
    async with httpx.AsyncClient(timeout=None) as client:

        async def bounded(text: str) -> tuple[float, int]:
            async with sem:
                return await one(client, server.url, {**body, "prompt": text})

        start = time.perf_counter()
        results = await asyncio.gather(*(bounded(t) for t in texts))
        wall = time.perf_counter() - start
    tokens = sum(n for _, n in results)
    return Row(tokens / wall, 1e3 * statistics.median(t for t, _ in results), tokens)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--concurrency", default="1,4,16")
    parser.add_argument("--workloads", default="short,long")
    parser.add_argument("--threads", type=int, default=2, help="llama.cpp's threads")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="tandem-vs-llamacpp-"))
    llama = llamacpp_python(work / "build.log")
    if llama is None:
        return 0
    gguf = default_model_path()
    concs = [int(c) for c in args.concurrency.split(",")]
    print(
        f"{machine()}\n{gguf.name}; llama.cpp {LLAMACPP} with {args.threads} threads; logs in {work}"
    )
    for wl in args.workloads.split(","):
        in_len, out_len = WORKLOADS[wl]
        rows: dict[str, dict[int, Row]] = {}
        for name in ("tandem", "llama.cpp"):
            server = start(name, gguf, args.threads, work, llama)
            try:
                asyncio.run(run_row(server, prompts(2, in_len, seed=99), 8, 1))  # warm-up
                rows[name] = {
                    c: asyncio.run(
                        run_row(server, prompts(max(4, 2 * c), in_len, seed=c), out_len, c)
                    )
                    for c in concs
                }
            finally:
                server.stop()
        for c in concs:
            t, ll = rows["tandem"][c], rows["llama.cpp"][c]
            print(
                f"{wl:5s} {in_len:4d} in / {out_len:3d} out  c={c:2d}: tandem {t.tok_s:6.1f} tok/s "
                f"(TTFT p50 {t.ttft_p50_ms:7.1f} ms)  llama.cpp {ll.tok_s:6.1f} tok/s "
                f"(TTFT p50 {ll.ttft_p50_ms:7.1f} ms)  ratio {t.tok_s / ll.tok_s:.2f}x  "
                f"load {os.getloadavg()[0]:.2f}",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
