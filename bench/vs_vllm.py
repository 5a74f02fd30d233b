"""Tandem against vLLM's CPU build on the same machine, model and prompts, in one invocation.

Offline: each side runs ``LLM.generate`` in its own process (Tandem in this venv, vLLM in the
peer venv that ``bench/vllm_peer.py`` builds) over a grid of workloads of random token ids
(``GRID``: prompts of 16 to 4,096 tokens, outputs of 4 to 512, 8 to 64 prompts, with and
without a shared prefix of 512 or 1,024 tokens; ``--quick`` runs three of them),
``ignore_eos``, greedy, in fp32 and bf16. Prefix caching is on for both sides (the cache is
reset between runs, so only a run's own shared prefix hits). The two sides alternate run by
run and each keeps its best time: on a shared, noisy machine only the ratio means anything,
so the load average is printed beside it, and so is the ratio of CPU seconds (each side's
process tree, user + system), which a core shared with other work does not distort the way it
does wall time (vLLM's workers pin themselves to the run's CPUs; Tandem's thread does not),
and the machine's steal time during each run (a virtual machine's CPUs taken by its host).
``--cotenant -1`` runs everything beside one busy process per CPU at normal priority (a
serving pod's normal state: event loop, tokenizer, sidecars), both sides under the same load.

Serving: ``tandem serve`` and ``vllm serve`` on the same model, measured by vLLM's own client
``vllm bench serve`` (a client neither side wrote) with ``--backend openai-chat`` and
``--backend openai`` (each server's default sampling, temperature 1), and ``--backend
openai`` with ``--temperature 0.7 --top-p 0.9`` (what chat users commonly send), random
dataset, input 256, output 128, ``--ignore-eos``, at each concurrency (4 x c prompts, at
least 8); output tok/s, TTFT and ITL p50/p99, and Tandem's server overhead: the share of the
client's wall time that the engine did not spend inside ``engine.step()``.

    python bench/vs_vllm.py [--quick] [--cotenant -1] [--repeats 2]
           [--dtypes float32,bfloat16] [--no-serving] [--no-offline] [--concurrency 1,4,16,32]

Only the standard library is imported at the top: the same file is the offline child of both
venvs (``--child tandem|vllm``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SERVED_NAME = "smollm2"
# 0: every CPU this run may use, on both sides. vLLM's own default keeps one core for its
# scheduler process (on 2 cores: one compute thread, ~1.5x slower); it is given them all.
THREADS = int(os.environ.get("TANDEM_BENCH_THREADS", "0")) or len(os.sched_getaffinity(0))


# ----- the workloads (both children build them from the same seed) --------------------------
@dataclass(frozen=True)
class Workload:
    """Prompts of random token ids: ``num`` of them, lengths uniform in ``prompt``, each asking
    for a length uniform in ``output``, all behind one ``prefix``-token shared prefix."""

    name: str
    num: int
    prompt: tuple[int, int]
    output: tuple[int, int]
    prefix: int = 0

    def build(self, vocab: int = 49152, seed: int = 0) -> tuple[list[list[int]], list[int]]:
        rng = random.Random(seed)
        shared = [rng.randrange(3, vocab) for _ in range(self.prefix)]
        prompts = [
            shared + [rng.randrange(3, vocab) for _ in range(rng.randint(*self.prompt))]
            for _ in range(self.num)
        ]
        return prompts, [rng.randint(*self.output) for _ in range(self.num)]

    @property
    def max_tokens(self) -> int:
        """KV tokens the whole workload may hold at once."""
        return self.num * (self.prefix + self.prompt[1] + self.output[1])


# The space a user brings: prompts of tens to thousands of tokens, outputs of tens to hundreds,
# a few to many prompts, with and without a shared prefix. The first row is the workload the
# bench began with; --quick runs the rows marked quick.
GRID = [
    (True, Workload("short", 32, (16, 256), (16, 128))),
    (True, Workload("short+prefix512", 32, (16, 256), (16, 128), prefix=512)),
    (False, Workload("chat-like", 64, (64, 128), (64, 128))),
    (False, Workload("long-out", 16, (32, 64), (256, 512))),
    (True, Workload("long-in", 16, (512, 1024), (64, 256))),
    (False, Workload("long-in+prefix1k", 16, (256, 512), (64, 128), prefix=1024)),
    (False, Workload("very-long-in", 8, (2048, 4096), (16, 64))),
]
WORKLOADS = {w.name: w for _, w in GRID} | {"warm": Workload("warm", 2, (16, 32), (4, 4))}
MAX_MODEL_LEN = 8192


# ----- children: one engine each, driven over stdin/stdout ----------------------------------
def child(side: str, model: str, dtype: str, kv_tokens: int) -> None:
    make = _tandem_child if side == "tandem" else _vllm_child
    run = make(model, dtype, kv_tokens)
    print("READY", flush=True)
    for line in sys.stdin:
        prompts, outputs = WORKLOADS[line.strip()].build()
        cpu = tree_cpu_seconds(os.getpid())
        elapsed = run(prompts, outputs)
        cpu = tree_cpu_seconds(os.getpid()) - cpu
        print(json.dumps({"seconds": elapsed, "cpu": cpu, "tokens": sum(outputs)}), flush=True)


def tree_cpu_seconds(pid: int) -> float:
    """CPU time (user + system) of a process and its live descendants (vLLM's engine core
    runs in a child process): on a machine shared with other work, the time each side
    actually computed, which the wall clock of an oversubscribed core does not show."""
    total, todo = 0.0, [pid]
    tick = os.sysconf("SC_CLK_TCK")
    while todo:
        p = todo.pop()
        try:
            stat = Path(f"/proc/{p}/stat").read_text()
            fields = stat[stat.rindex(")") + 2 :].split()
            total += (int(fields[11]) + int(fields[12])) / tick
            for task in Path(f"/proc/{p}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except (FileNotFoundError, ProcessLookupError):
            continue
    return total


def _tandem_child(model: str, dtype: str, kv_tokens: int):
    from tandem.server.engine import LLM, SamplingParams

    llm = LLM(
        model,
        dtype=dtype,
        kv_cache_tokens=kv_tokens,
        max_model_len=MAX_MODEL_LEN,
        max_num_seqs=256,
        max_num_batched_tokens=4096,
        enable_prefix_caching=True,
    )

    def run(prompts: list[list[int]], outputs: list[int]) -> float:
        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in outputs]
        llm.engine.kv.pool.reset_prefix_cache()
        start = time.perf_counter()
        results = llm.generate(prompts, params)
        elapsed = time.perf_counter() - start
        assert [len(r.token_ids) for r in results] == outputs
        return elapsed

    run(*WORKLOADS["warm"].build())
    return run


def _vllm_child(model: str, dtype: str, kv_tokens: int):
    from vllm import LLM, SamplingParams

    llm = LLM(
        model,
        dtype=dtype,
        max_num_seqs=256,
        max_num_batched_tokens=4096,
        max_model_len=MAX_MODEL_LEN,
        enable_prefix_caching=True,
        seed=0,
    )

    def run(prompts: list[list[int]], outputs: list[int]) -> float:
        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in outputs]
        llm.reset_prefix_cache()
        start = time.perf_counter()
        results = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        assert [len(r.outputs[0].token_ids) for r in results] == outputs
        return elapsed

    run(*WORKLOADS["warm"].build())
    return run


class Child:
    """One engine in its own process, told which workload to run, line by line."""

    def __init__(self, python: str, side: str, model: str, dtype: str, kv_tokens: int) -> None:
        cmd = [python, "-P", __file__, "--child", side, "--model", model, "--dtypes", dtype]
        cmd += ["--kv-tokens", str(kv_tokens)]
        self.side = side
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=side_env(side)
        )
        for line in self.proc.stdout:
            if line.strip() == "READY":
                return
        raise RuntimeError(f"the {side} child exited before it was ready")

    def run(self, workload: Workload) -> tuple[float, float, int, float]:
        """Wall seconds, CPU seconds, output tokens and the machine's steal seconds of one run
        of the workload."""
        steal = steal_seconds()
        self.proc.stdin.write(f"{workload.name}\n")
        self.proc.stdin.flush()
        for line in self.proc.stdout:
            if line.startswith("{"):
                out = json.loads(line)
                return out["seconds"], out["cpu"], out["tokens"], steal_seconds() - steal
        raise RuntimeError(f"the {self.side} child died")

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def side_env(side: str, threads: int | None = None) -> dict[str, str]:
    """Each side's environment; ``threads`` caps both sides' compute threads alike."""
    env = dict(os.environ)
    threads = threads or THREADS
    env["OMP_NUM_THREADS"] = str(threads)
    # vLLM pins its OpenMP threads itself: to the CPUs this run may use (taskset), not 0..n-1
    cpus = sorted(os.sched_getaffinity(0))[:threads]
    env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, cpus))
    if side == "tandem":
        roots = [str(ROOT / "server"), str(ROOT / "operator"), str(ROOT)]
        env["PYTHONPATH"] = os.pathsep.join(roots + [env.get("PYTHONPATH", "")])
    else:
        env.pop("PYTHONPATH", None)
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
        env.setdefault("VLLM_TARGET_DEVICE", "cpu")
        env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    return env


def load() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def steal_seconds() -> float:
    """CPU time the hypervisor gave to others while this machine's CPUs wanted it, all CPUs
    together (``/proc/stat``'s steal; 0 on bare metal): a run's wall time grows by it while
    its CPU time does not."""
    fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()
    return int(fields[8]) / os.sysconf("SC_CLK_TCK")


def offline(
    peer: str | None, model: str, dtypes: list[str], repeats: int, workloads: list[Workload]
) -> list[tuple[str, float]]:
    ratios = []
    kv_tokens = max(w.max_tokens for w in workloads) + 1024
    for dtype in dtypes:
        sides = {"tandem": Child(sys.executable, "tandem", model, dtype, kv_tokens)}
        if peer:
            sides["vllm"] = Child(peer, "vllm", model, dtype, kv_tokens)
        for w in workloads:
            ratios += _offline_row(sides, w, dtype, repeats)
        for c in sides.values():
            c.close()
    return ratios


def _offline_row(
    sides: dict[str, Child], w: Workload, dtype: str, repeats: int
) -> list[tuple[str, float]]:
    """One workload on both sides, alternating run by run, each keeping its best time."""
    times: dict[str, list[float]] = {s: [] for s in sides}
    cpus: dict[str, list[float]] = {s: [] for s in sides}
    steals: dict[str, list[float]] = {s: [] for s in sides}
    tokens, loads = 0, []
    for r in range(repeats):
        for s in list(sides) if r % 2 == 0 else list(reversed(sides)):
            t, cpu, tokens, steal = sides[s].run(w)
            times[s].append(t)
            cpus[s].append(cpu)
            steals[s].append(steal)
        loads.append(load())
    label = f"offline {dtype:8s} {w.name}"
    best = {s: min(v) for s, v in times.items()}
    runs = ", ".join(f"{s} {[round(t, 2) for t in v]}" for s, v in times.items())
    cpu_runs = ", ".join(f"{s} {[round(t, 2) for t in v]}" for s, v in cpus.items())
    steal_runs = ", ".join(f"{s} {[round(t, 2) for t in v]}" for s, v in steals.items())
    print(f"{label}: runs (s) {runs}; CPU (s) {cpu_runs}; steal (s) {steal_runs}; load {loads}")
    line = f"{label}: tandem {tokens / best['tandem']:7.1f} tok/s"
    if "vllm" not in best:
        print(line, flush=True)
        return []
    ratio = best["vllm"] / best["tandem"]
    cpu_ratio = min(cpus["vllm"]) / min(cpus["tandem"])
    line += f"  vllm {tokens / best['vllm']:7.1f} tok/s  ratio {ratio:.2f}x"
    print(line + f"  CPU-time ratio {cpu_ratio:.2f}x", flush=True)
    return [(label, ratio), (f"{label} (CPU time)", cpu_ratio)]


@contextlib.contextmanager
def cotenants(n: int) -> Iterator[None]:
    """``n`` busy processes at normal priority beside both sides (0: none): the state of a
    serving pod's cores, where the event loop, tokenizer and sidecars run by the engine."""
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        yield
    finally:
        for proc in busy:
            proc.kill()
            proc.wait()


# ----- serving ------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, side: str, cmd: list[str], port: int, log: Path) -> None:
        self.side, self.port = side, port
        self.url = f"http://127.0.0.1:{port}"
        self.log = log.open("w")
        self.proc = subprocess.Popen(
            cmd,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env=side_env(side),
            start_new_session=True,
        )

    def wait_ready(self, timeout: float = 900) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.side} server exited; see {self.log.name}")
            try:
                with urllib.request.urlopen(self.url + "/v1/models", timeout=5) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(2)
        raise RuntimeError(f"{self.side} server not ready after {timeout} s")

    def step_seconds(self) -> float | None:
        """Tandem's engine time so far (its /metrics); None for a server without it."""
        try:
            with urllib.request.urlopen(self.url + "/metrics", timeout=10) as r:
                text = r.read().decode()
        except OSError:
            return None
        m = re.search(r"^tandem:engine_step_seconds\{[^}]*\} (\S+)$", text, re.M)
        return float(m.group(1)) if m else None

    def stop(self) -> None:
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def prompts_for(conc: int) -> int:
    """Four rounds of requests per concurrency (at least eight): with two (four prompts at c=1,
    eight at c=4) one slow request moved a row's ratio by a fifth between runs."""
    return max(8, 4 * conc)


# Each serving row: the client's backend, and the sampling its requests ask for (none: each
# server's default, temperature 1; "top-p": what chat users commonly send).
SERVING_ROWS = {
    "openai-chat": ("openai-chat", []),
    "openai": ("openai", []),
    "openai top-p": ("openai", ["--temperature", "0.7", "--top-p", "0.9"]),
}


def bench_serve(peer_bin: Path, server: Server, model: str, row: str, conc: int, out: Path) -> dict:
    backend, sampling = SERVING_ROWS[row]
    endpoint = "/v1/chat/completions" if backend == "openai-chat" else "/v1/completions"
    name = f"{server.side}-{row.replace(' ', '-')}-{conc}.json"
    cmd = [
        str(peer_bin / "vllm"),
        "bench",
        "serve",
        "--backend",
        backend,
        "--base-url",
        server.url,
        "--endpoint",
        endpoint,
        "--model",
        model,
        "--served-model-name",
        SERVED_NAME,
        "--tokenizer",
        model,
        "--dataset-name",
        "random",
        "--random-input-len",
        "256",
        "--random-output-len",
        "128",
        "--ignore-eos",
        "--max-concurrency",
        str(conc),
        "--num-prompts",
        str(prompts_for(conc)),
        "--percentile-metrics",
        "ttft,tpot,itl",
        "--metric-percentiles",
        "50,99",
        "--seed",
        "0",
        *sampling,
        "--save-result",
        "--result-dir",
        str(out),
        "--result-filename",
        name,
    ]
    before = server.step_seconds()
    done = subprocess.run(cmd, env=side_env("vllm"), capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"vllm bench serve failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    result = json.loads((out / name).read_text())
    after = server.step_seconds()
    if before is not None and after is not None:
        result["server_overhead"] = 1.0 - (after - before) / result["duration"]
    return result


def serving(peer: Path, model: str, dtype: str, concurrency: list[int]) -> list[tuple[str, float]]:
    peer_bin = peer.parent
    work = Path(tempfile.mkdtemp(prefix="tandem-vs-vllm-"))
    tp, vp = free_port(), free_port()
    servers = {
        "tandem": Server(
            "tandem",
            [sys.executable, "-m", "tandem.server.cli", "serve", "--model", model, "--dtype", dtype]
            + ["--served-model-name", SERVED_NAME, "--host", "127.0.0.1", "--port", str(tp)]
            + ["--log-level", "warning"],
            tp,
            work / "tandem.log",
        ),
        "vllm": Server(
            "vllm",
            [str(peer_bin / "vllm"), "serve", model, "--dtype", dtype]
            + ["--served-model-name", SERVED_NAME, "--host", "127.0.0.1", "--port", str(vp)]
            + ["--max-model-len", "2048", "--enable-prefix-caching"],
            vp,
            work / "vllm.log",
        ),
    }
    ratios = []
    try:
        for s in servers.values():
            s.wait_ready()
        for i, conc in enumerate(concurrency):
            for row in SERVING_ROWS:
                order = ["tandem", "vllm"] if i % 2 == 0 else ["vllm", "tandem"]
                res = {s: bench_serve(peer_bin, servers[s], model, row, conc, work) for s in order}
                label = f"serve {dtype} {row:12s} c={conc:2d}"
                for s in ("tandem", "vllm"):
                    r = res[s]
                    extra = ""
                    if "server_overhead" in r:
                        extra = f"  server overhead {100 * r['server_overhead']:.1f}%"
                    print(
                        f"{label} {s:6s}: {r['output_throughput']:7.1f} tok/s  "
                        f"TTFT p50 {r['median_ttft_ms']:7.1f} p99 {r['p99_ttft_ms']:7.1f} ms  "
                        f"ITL p50 {r['median_itl_ms']:6.1f} p99 {r['p99_itl_ms']:6.1f} ms{extra}"
                    )
                ratio = res["tandem"]["output_throughput"] / res["vllm"]["output_throughput"]
                ratios.append((label, ratio))
                print(f"{label} ratio tandem/vllm {ratio:.2f}x  load {load()}", flush=True)
    finally:
        for s in servers.values():
            s.stop()
    return ratios


def machine() -> str:
    info = Path("/proc/cpuinfo").read_text()
    name = re.search(r"^model name\s*:\s*(.*)$", info, re.M)
    flags = re.search(r"^flags\s*:\s*(.*)$", info, re.M)
    isa = sorted(
        f for f in (flags.group(1).split() if flags else []) if re.match(r"(avx|amx|fma|f16c)", f)
    )
    return (
        f"machine: {os.cpu_count()} cores, {name.group(1) if name else '?'}\n"
        f"ISA: {' '.join(isa)}\nload average at start: {load()}"
    )


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--child", choices=("tandem", "vllm"), help=argparse.SUPPRESS)
    ap.add_argument("--kv-tokens", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--model", default=None, help="HF folder (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="the grid's quick rows only")
    ap.add_argument("--workloads", help="comma-separated workload names (default: the grid)")
    ap.add_argument(
        "--cotenant",
        type=int,
        default=0,
        help="busy processes running beside both sides for the whole bench (-1: one per CPU "
        "of this run; 0, the default: a quiet run)",
    )
    ap.add_argument("--concurrency", default="1,4,16,32")
    ap.add_argument("--serving-dtype", default="bfloat16")
    ap.add_argument(
        "--threads",
        type=int,
        default=0,
        help="compute threads for both sides (0: every CPU of this run's affinity)",
    )
    ap.add_argument("--no-offline", action="store_true")
    ap.add_argument("--no-serving", action="store_true")
    return ap.parse_args()


def chosen_workloads(args: argparse.Namespace) -> list[Workload]:
    if args.workloads:
        return [WORKLOADS[name] for name in args.workloads.split(",")]
    return [w for quick, w in GRID if quick or not args.quick]


def main() -> None:
    args = parse_args()
    if args.child:
        child(args.child, args.model, args.dtypes, args.kv_tokens)
        return
    if args.threads:
        os.environ["TANDEM_BENCH_THREADS"] = str(args.threads)
        global THREADS
        THREADS = args.threads
    sys.path.insert(0, str(HERE))
    import vllm_peer

    model = args.model or str(vllm_peer.smollm2_dir())
    busy = len(os.sched_getaffinity(0)) if args.cotenant < 0 else args.cotenant
    print(machine())
    print(f"model: {model}; threads per side: {THREADS} (vLLM bound to the same CPUs)")
    print(f"co-tenants: {busy} busy processes beside both sides" if busy else "quiet run")
    try:
        peer: Path | None = vllm_peer.build_peer()
    except vllm_peer.PeerUnavailable as exc:
        peer = None
        print(f"vLLM peer skipped: {exc}; Tandem runs alone")
    ratios = []
    with cotenants(busy):
        if not args.no_offline:
            dtypes = args.dtypes.split(",")
            ratios += offline(
                str(peer) if peer else None, model, dtypes, args.repeats, chosen_workloads(args)
            )
        if not args.no_serving and peer is not None:
            conc = [int(c) for c in args.concurrency.split(",")]
            ratios += serving(peer, model, args.serving_dtype, conc)
    print("summary (tandem/vllm throughput, >= 1.00x means Tandem is faster):")
    for label, ratio in ratios:
        print(f"  {label:48s} {ratio:5.2f}x")
    print(f"load average at end: {load()}")


if __name__ == "__main__":
    main()
