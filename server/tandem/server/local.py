"""``tandem up``: an InferenceService's proxy and engines as local processes, no cluster.

It reads the same YAML the operator reads and asks the same pure ``plan()`` for the
topology, so an InferenceService means the same engines (roles, replicas, flags) on a
laptop as in a cluster. Only what is Kubernetes' job changes: ports are loopback ports
that ``tandem up`` binds itself and hands to each child (``--listen-fd``, so no other
process can take one between the pick and the child's start) instead of pod IPs, the proxy finds the engines because they register with it
(``--proxy-url``) instead of by watching pods, and the model is a local directory or .gguf
file (the default model, fetched once into the user's cache, when none is given) instead of
a download into a volume.

Every child runs in its own process group; Ctrl-C or SIGTERM stops them all (SIGTERM to
each group, SIGKILL after a grace period), and so does any failure while starting. An
engine that dies later, or stops answering its ``/health`` for ``--hang-timeout`` seconds (then
it is SIGKILLed: a stopped or wedged process never exits by itself), is restarted with backoff
on the same address; the proxy keeps it listed meanwhile and holds requests for it a while.

Keys never appear on a command line (``ps`` shows those to every user): the client key,
the admin key and the internal credential that ``tandem up`` generates for the proxy and
its engines are passed in the environment (``docs/security.md``).
"""

from __future__ import annotations

import argparse
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from tandem.server.net import reserve_port
from tandem.server.parent_watch import child_env

DEFAULT_NAME = "smollm2-135m-instruct"
HOST = "127.0.0.1"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "-f",
        "--file",
        default=None,
        help="InferenceService YAML (default: Disaggregated, 1 prefill + 1 decode, the default model)",
    )
    parser.add_argument(
        "--prefill",
        type=int,
        default=None,
        metavar="N",
        help="prefill replicas (overrides the spec)",
    )
    parser.add_argument(
        "--decode",
        type=int,
        default=None,
        metavar="M",
        help="decode replicas (the engine pool's replicas in Aggregated mode)",
    )
    parser.add_argument(
        "--model",
        default=None,
        help="a local HF-format model directory or .gguf file (overrides spec.model.uri; "
        "default: smollm2-135m-instruct, downloaded once into the cache)",
    )
    parser.add_argument(
        "--port", type=int, default=8000, help="the proxy's port (0: any free port)"
    )
    parser.add_argument(
        "--api-key",
        default=None,
        help="require this key from clients at the proxy (default: $TANDEM_PROXY_API_KEY; "
        "prefer the environment: arguments show in ps)",
    )
    parser.add_argument(
        "--admin-api-key",
        default=None,
        help="the key for the proxy's /nodes/* and the engines' admin routes (default: "
        "$TANDEM_ADMIN_API_KEY; none: those routes take only the internal credential)",
    )
    parser.add_argument(
        "--log-dir",
        default=None,
        help="where each process's log goes (default: a new directory under the temp dir)",
    )
    parser.add_argument(
        "--startup-timeout",
        type=float,
        default=600.0,
        help="seconds the engines may take to load before tandem up gives up",
    )
    parser.add_argument(
        "--hang-timeout",
        type=float,
        default=20.0,
        help="seconds a running engine may leave its /health unanswered before it is killed "
        "and restarted (0: never)",
    )
    parser.add_argument(
        "--grace", type=float, default=15.0, help="seconds between SIGTERM and SIGKILL on stop"
    )


# ----- the plan ---------------------------------------------------------------------------------
def default_spec(model_dir: str, name: str = DEFAULT_NAME) -> dict[str, Any]:
    """What ``tandem up`` runs without ``-f``: the P/D topology on one model, on CPU.

    The proxy disaggregates every request here (threshold 0), however short: a chat's
    prompts are mostly short, and the point of the default is to show the P/D path.
    """
    return {
        "apiVersion": "tandem.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": DEFAULT_NAME},
        "spec": {
            "mode": "Disaggregated",
            "model": {"name": name, "uri": model_dir},
            "prefill": {"replicas": 1, "gpus": 0},
            "decode": {"replicas": 1, "gpus": 0},
            "proxy": {"extraArgs": ["--disagg-threshold", "0"]},
            # A failed KV pull (a prefill engine died after answering) recomputes on decode.
            "engine": {"kvPullFallback": "recompute"},
        },
    }


class UpError(Exception):
    """A problem with what ``tandem up`` was asked to run; the message says what to do."""


def load_plan(args: argparse.Namespace) -> Any:
    """The Topology to run: the spec (file or default), replica overrides, the local model
    (``--model`` replaces the spec's model, its name included: the weights are served under
    their own name, not the file's old one)."""
    from tandem.operator.spec.inference_service import load_inference_service
    from tandem.operator.topology import plan

    model = _resolve_model(args.model) if args.model or not args.file else None
    if args.file:
        try:
            text = Path(args.file).read_text()
        except OSError as exc:
            raise UpError(f"cannot read {args.file}: {exc.strerror}") from None
        data = _yaml(text, args.file)
    else:
        data = default_spec(*model)
    spec = data.setdefault("spec", {}) if isinstance(data, dict) else None
    if isinstance(spec, dict) and model is not None:  # a local file: no hf:// fields apply
        spec["model"] = {"name": model[1], "uri": model[0]}
    if isinstance(spec, dict):
        if args.prefill is not None:
            if spec.get("mode", "Disaggregated") == "Aggregated":
                raise UpError(
                    "--prefill applies to Disaggregated mode; this InferenceService is Aggregated"
                )
            spec["prefill"] = {**(spec.get("prefill") or {}), "replicas": args.prefill}
            spec["prefill"].pop("autoscaling", None)
        if args.decode is not None:
            spec["decode"] = {**(spec.get("decode") or {}), "replicas": args.decode}
            spec["decode"].pop("autoscaling", None)
    try:
        isvc = load_inference_service(data)
    except ValueError as exc:
        raise UpError(str(exc)) from None
    model_dir = model[0] if model is not None else local_model_dir(isvc.spec.model.uri)
    _check_model(model_dir)
    topology = plan(isvc, model_dir=str(model_dir), discovery="static")
    if not any(r.replicas > 0 and r.role in ("decode", "both") for r in topology.engines):
        raise UpError("the plan has no decode or aggregated engine: nothing could answer requests")
    return topology


def local_model_dir(uri: str) -> str:
    """The spec's model as a local directory; hf:// and pvc:// need what only a cluster has."""
    if uri.startswith("hf://"):
        raise UpError(
            f"spec.model.uri is {uri}: tandem up does not download models (it must work offline). "
            "Download it first (e.g. `huggingface-cli download ORG/REPO --local-dir DIR`) and run "
            "`tandem up -f FILE --model DIR`, or set spec.model.uri to the directory's absolute path"
        )
    if uri.startswith("pvc://"):
        raise UpError(
            f"spec.model.uri is {uri}: a PersistentVolumeClaim exists only in a cluster; "
            "pass --model DIR with a local copy"
        )
    return uri


def _resolve_model(model: str | None) -> tuple[str, str]:
    """The model and its served name; the default one is fetched here, once, so the engines
    do not race to fetch it."""
    from tandem.server.engine.default_model import resolve_model
    from tandem.server.engine.models.config import ModelLoadError

    try:
        return resolve_model(model)
    except ModelLoadError as exc:
        raise UpError(str(exc)) from None


def _check_model(model_dir: str) -> None:
    from tandem.server.engine.default_model import check_model_path
    from tandem.server.engine.models.config import ModelLoadError

    try:
        check_model_path(Path(model_dir))
    except ModelLoadError as exc:
        raise UpError(str(exc)) from None


def _yaml(text: str, name: str) -> Any:
    import yaml

    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise UpError(f"{name} is not valid YAML: {exc}") from None


# ----- the processes ------------------------------------------------------------------------------
@dataclass
class Child:
    """One process of the topology, serving on a port ``tandem up`` holds for it."""

    name: str
    role: str
    argv: list[str]
    env: dict[str, str]
    log_path: Path
    listener: socket.socket = field(repr=False)
    port: int = 0
    proc: subprocess.Popen | None = None
    _log: Any = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self.port = self.listener.getsockname()[1]

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def start(self) -> None:
        """Spawn the process on the held socket (``--listen-fd``); the socket passes to it, so
        a restart binds the same port again (another free one if something took it)."""
        listener = self.listener if self.listener.fileno() != -1 else _rebind(self.port)
        self.port = listener.getsockname()[1]
        fd = listener.fileno()
        self._log = open(self.log_path, "ab")
        # A session of its own: the terminal's Ctrl-C reaches tandem up only, which then stops
        # each child's whole group in order (tensor-parallel workers included).
        with listener:
            self.proc = subprocess.Popen(
                [*self.argv, "--port", str(self.port), "--listen-fd", str(fd)],
                env=child_env(self.env),  # it dies with tandem up, even a kill -9 of it
                stdout=self._log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                pass_fds=(fd,),
            )

    def signal(self, sig: int) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass

    def exited(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def log_tail(self, n: int = 3000) -> str:
        try:
            return self.log_path.read_bytes()[-n:].decode(errors="replace")
        except OSError:
            return ""

    def close_log(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None


def _rebind(port: int) -> socket.socket:
    try:
        return reserve_port(HOST, port)
    except OSError:
        return reserve_port(HOST)


# Keys a child might inherit from the caller's environment; each child gets only its own.
KEY_ENV = (
    "TANDEM_API_KEY",
    "TANDEM_API_KEY_FILE",
    "TANDEM_PROXY_API_KEY",
    "TANDEM_PROXY_API_KEY_FILE",
    "TANDEM_ENGINE_API_KEY",
    "TANDEM_INTERNAL_API_KEY",
    "TANDEM_INTERNAL_API_KEY_FILE",
    "TANDEM_ADMIN_API_KEY",
    "TANDEM_ADMIN_API_KEY_FILE",
)


def build_children(
    topology: Any,
    proxy_listener: socket.socket,
    log_dir: Path,
    api_key: str | None,
    base_env: dict[str, str] | None = None,
    *,
    internal_key: str,
    admin_key: str | None = None,
) -> list[Child]:
    """The proxy first (on ``proxy_listener``), then every engine replica, each on a loopback
    port reserved for it here.

    Engines take only the internal credential (and the admin key): nothing but the proxy,
    or an administrator, can call them. Every key travels in the environment."""
    env0 = {
        k: v for k, v in (os.environ if base_env is None else base_env).items() if k not in KEY_ENV
    }
    env0.setdefault("TOKENIZERS_PARALLELISM", "false")
    env0["TANDEM_INTERNAL_API_KEY"] = internal_key
    if admin_key:
        env0["TANDEM_ADMIN_API_KEY"] = admin_key
    engines = [r for r in topology.engines if r.replicas > 0]
    n_engines = sum(r.replicas for r in engines)
    # Engines on CPU share the cores: one BLAS pool per engine each the size of the machine
    # would oversubscribe it many times over.
    if "OMP_NUM_THREADS" not in env0:
        env0["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // max(1, n_engines)))
    proxy_url = f"http://{HOST}:{proxy_listener.getsockname()[1]}"
    exe = [sys.executable, "-m", "tandem.server.cli"]
    proxy_plan = topology.role("proxy")
    proxy_args = list(proxy_plan.args) if proxy_plan is not None else ["proxy"]
    proxy_env = dict(env0)
    if api_key:
        proxy_env["TANDEM_PROXY_API_KEY"] = api_key
    children = [
        Child(
            "proxy",
            "proxy",
            [*exe, *proxy_args, "--host", HOST],
            proxy_env,
            log_dir / "proxy.log",
            proxy_listener,
        )
    ]
    gpus = _gpu_plan(engines)
    shares = memory_shares(gpus)
    lora_file = _lora_config(topology, log_dir)
    for r in engines:
        for i in range(r.replicas):
            env = {**env0, **r.env}
            if (devices := gpus.get((r.name, i))) is not None:
                env["CUDA_VISIBLE_DEVICES"] = devices
            args = [lora_file if a == topology.lora_config else a for a in r.args]
            args = _with_share(args, shares.get((r.name, i)))
            argv = [*exe, *args, "--host", HOST, "--proxy-url", proxy_url]
            log = log_dir / f"{r.name}-{i}.log"
            children.append(Child(f"{r.name}-{i}", r.role, argv, env, log, reserve_port(HOST)))
    return children


def _lora_config(topology: Any, log_dir: Path) -> str | None:
    """``spec.loras`` as the file the engines watch (``--lora-config``), in the run's log
    folder where a cluster mounts the operator's ConfigMap: the same JSON, and editing it
    hot-loads or unloads adapters on the running engines as a ConfigMap change does."""
    from tandem.operator.render.loras import lora_config_data

    if topology.lora_config is None:
        return None
    path = log_dir / "loras.json"
    path.write_text(lora_config_data(topology))
    return str(path)


def _gpu_plan(engines: list[Any]) -> dict[tuple[str, int], str]:
    """Give each replica its own GPUs (``CUDA_VISIBLE_DEVICES``) when the machine has them."""
    want = sum(r.gpus * r.replicas for r in engines)
    if want == 0 or "CUDA_VISIBLE_DEVICES" in os.environ:
        return {}
    try:
        import torch

        have = torch.cuda.device_count()
    except Exception:  # noqa: BLE001 - no torch CUDA: CPU engines
        have = 0
    if have == 0:
        return {}
    if want > have:
        print(
            f"tandem up: the spec asks for {want} GPUs and this machine has {have}; replicas will share them",
            file=sys.stderr,
        )
    out: dict[tuple[str, int], str] = {}
    next_gpu = 0
    for r in engines:
        for i in range(r.replicas):
            ids = [(next_gpu + k) % have for k in range(max(1, r.gpus))]
            next_gpu += max(1, r.gpus)
            out[(r.name, i)] = ",".join(map(str, ids))
    return out


# EngineConfig.gpu_memory_utilization's default (the supervisor does not import the engine).
GPU_MEMORY_UTILIZATION = 0.9


def memory_shares(gpus: dict[tuple[str, int], str]) -> dict[tuple[str, int], str]:
    """``--gpu-memory-utilization`` for the replicas that share a GPU: the default share
    split evenly among the engines on each one's busiest device, as two vLLM servers on one
    GPU are told to. Each engine sizes its KV cache from its share of the whole device; left
    at the default, the first to start takes nearly all of it and the other runs out of
    memory capturing its graphs (``tandem up`` on one H200)."""
    users = Counter(d for devices in gpus.values() for d in devices.split(","))
    shares = {}
    for key, devices in gpus.items():
        sharing = max(users[d] for d in devices.split(","))
        if sharing > 1:
            shares[key] = f"{GPU_MEMORY_UTILIZATION / sharing:.3f}"
    return shares


def _with_share(args: list[str], share: str | None) -> list[str]:
    """``args`` with ``--gpu-memory-utilization share`` for a replica that shares a GPU,
    unless its spec set one (``--gpu-memory-utilization X`` or ``...=X``)."""
    if share is None or any(a.split("=")[0] == "--gpu-memory-utilization" for a in args):
        return args
    return [*args, "--gpu-memory-utilization", share]


def stop_children(children: list[Child], grace: float) -> None:
    """SIGTERM every group (engines first, so they drain and deregister while the proxy is
    still there), then SIGKILL whatever is left after ``grace`` seconds."""
    engines = [c for c in children if c.role != "proxy"]
    proxies = [c for c in children if c.role == "proxy"]
    for c in engines:
        c.signal(signal.SIGTERM)
    _wait_exit(engines, grace)
    for c in proxies:
        c.signal(signal.SIGTERM)
    _wait_exit(proxies, min(grace, 5.0))
    for c in children:
        if c.exited() is None:
            c.signal(signal.SIGKILL)
    for c in children:
        if c.proc is not None:
            try:
                c.proc.wait(5)
            except subprocess.TimeoutExpired:
                pass
        c.close_log()


def _wait_exit(children: list[Child], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(c.exited() is None for c in children):
        time.sleep(0.1)


def wait_ready(children: list[Child], timeout: float, stop: threading.Event, out: TextIO) -> None:
    """Until every engine answers /health 200 and the proxy lists each as healthy.

    Raises UpError if a child exits or time runs out; returns early if ``stop`` is set.
    """
    import httpx

    proxy = next(c for c in children if c.role == "proxy")
    engines = [c for c in children if c.role != "proxy"]
    headers = internal_headers(proxy)
    deadline = time.monotonic() + timeout
    ready: set[str] = set()
    with httpx.Client(timeout=3.0) as client:
        while not stop.is_set():
            for c in children:
                if (code := c.exited()) is not None:
                    raise UpError(
                        f"{c.name} exited with status {code} while starting; the end of its log "
                        f"({c.log_path}):\n{c.log_tail()}"
                    )
            for c in engines:
                if c.name in ready:
                    continue
                try:
                    if client.get(c.url + "/health").status_code == 200:
                        ready.add(c.name)
                        print(f"  {c.name} ready on {c.url}", file=out, flush=True)
                except httpx.HTTPError:
                    pass
            if len(ready) == len(engines):
                try:
                    nodes = client.get(proxy.url + "/nodes/status", headers=headers).json()
                    if all(nodes.get(c.url, {}).get("healthy") for c in engines):
                        return
                except (httpx.HTTPError, ValueError):
                    pass
            if time.monotonic() > deadline:
                missing = [c.name for c in engines if c.name not in ready] or [
                    "the proxy's registry"
                ]
                raise UpError(
                    f"not ready after {timeout:.0f}s: {', '.join(missing)} (logs in "
                    f"{proxy.log_path.parent})"
                )
            stop.wait(0.3)


def internal_headers(proxy: Child) -> dict[str, str]:
    """What tandem up itself sends the proxy's /nodes/* routes: the internal credential."""
    return {"Authorization": f"Bearer {proxy.env['TANDEM_INTERNAL_API_KEY']}"}


@dataclass
class Restarts:
    """Engines that died after start-up: each is restarted after a delay
    that doubles with each death (1 s, 2 s, ... up to ``max_delay``)."""

    out: TextIO
    max_delay: float = 30.0
    count: dict[str, int] = field(default_factory=dict)
    due: dict[str, float] = field(default_factory=dict)

    def died(self, c: Child, rc: int) -> None:
        """Schedule the restart. The engine stays registered: it comes back on the same
        address, and the proxy holds requests for an engine it expects back (``proxy.md``)."""
        n = self.count.get(c.name, 0)
        delay = min(self.max_delay, 2.0**n)
        self.count[c.name] = n + 1
        self.due[c.name] = time.monotonic() + delay
        print(
            f"tandem up: {c.name} exited with status {rc}; restarting it in {delay:.0f}s on "
            f"{c.url} (restart {n + 1}; log: {c.log_path})",
            file=self.out,
            flush=True,
        )

    def restart_due(self, engines: list[Child]) -> None:
        now = time.monotonic()
        for c in engines:
            if self.due.get(c.name, float("inf")) <= now:
                del self.due[c.name]
                c.close_log()
                c.start()
                print(
                    f"tandem up: restarted {c.name} on {c.url}; it rejoins the proxy once loaded",
                    file=self.out,
                    flush=True,
                )

    def waiting(self, c: Child) -> bool:
        return c.name in self.due


@dataclass
class Watchdog:
    """Engines that stop answering ``/health`` (a 503 while loading or draining is an
    answer) for ``hang_timeout`` seconds are hung: stopped (SIGSTOP), deadlocked, swapping.
    Such a process never exits by itself, so it is SIGKILLed and ``Restarts`` brings it back.
    An engine is watched once it has answered since it was (re)started (a restarted engine
    loading its model is not hung)."""

    hang_timeout: float
    every: float = 1.0
    last_ok: dict[str, float] = field(default_factory=dict)
    next_check: float = 0.0

    def hung(self, engines: list[Child], restarts: Restarts) -> list[Child]:
        """The engines to kill now (each checked at most every ``every`` seconds)."""
        import httpx

        now = time.monotonic()
        if self.hang_timeout <= 0 or now < self.next_check:
            return []
        self.next_check = now + self.every
        out = []
        for c in engines:
            if restarts.waiting(c) or c.exited() is not None:
                self.last_ok.pop(c.name, None)
                continue
            try:
                httpx.get(c.url + "/health", timeout=min(2.0, self.hang_timeout))
                self.last_ok[c.name] = time.monotonic()
            except httpx.HTTPError:
                seen = self.last_ok.get(c.name)
                if seen is not None and time.monotonic() - seen >= self.hang_timeout:
                    self.last_ok.pop(c.name)
                    out.append(c)
        return out

    def kill(self, c: Child, out: TextIO) -> None:
        print(
            f"tandem up: {c.name} has not answered its health check for "
            f"{self.hang_timeout:.0f}s; killing it",
            file=out,
            flush=True,
        )
        c.signal(signal.SIGKILL)
        if c.proc is not None:
            try:
                c.proc.wait(5)
            except subprocess.TimeoutExpired:
                pass


# ----- the command ------------------------------------------------------------------------------------
def run(args: argparse.Namespace) -> int:
    out = sys.stdout
    try:
        topology = load_plan(args)
    except UpError as exc:
        print(f"tandem up: {exc}", file=sys.stderr)
        return 2
    api_key = args.api_key or os.environ.get("TANDEM_PROXY_API_KEY") or None
    admin_key = args.admin_api_key or os.environ.get("TANDEM_ADMIN_API_KEY") or None
    try:
        proxy_listener = _reserve_proxy_port(args.port)
    except UpError as exc:
        print(f"tandem up: {exc}", file=sys.stderr)
        return 2
    log_dir = (
        Path(args.log_dir)
        if args.log_dir
        else Path(tempfile.mkdtemp(prefix=f"tandem-up-{topology.name}-"))
    )
    log_dir.mkdir(parents=True, exist_ok=True)
    children = build_children(
        topology,
        proxy_listener,
        log_dir,
        api_key,
        internal_key=secrets.token_urlsafe(32),
        admin_key=admin_key,
    )

    stop = threading.Event()
    previous = {
        sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)
    }
    engines = [c for c in children if c.role != "proxy"]
    counts = ", ".join(
        f"{sum(1 for c in engines if c.role == role)} {role}"
        for role in ("prefill", "decode", "both")
        if any(c.role == role for c in engines)
    )
    print(
        f"tandem up: {topology.name} ({topology.mode}: {counts}) serving '{topology.served_model_name}'; "
        f"logs in {log_dir}",
        file=out,
        flush=True,
    )
    code = 0
    try:
        for c in children:
            c.start()
        try:
            wait_ready(children, args.startup_timeout, stop, out)
        except UpError as exc:
            print(f"tandem up: {exc}", file=sys.stderr)
            return 1
        if stop.is_set():
            return 0
        base = f"{children[0].url}/v1"
        # the key itself stays out of the terminal (and its scrollback and logs)
        auth = ' -H "Authorization: Bearer $TANDEM_PROXY_API_KEY"' if api_key else ""
        print(
            f"\nOpenAI base URL: {base}\n"
            f"  curl {base}/chat/completions -H 'Content-Type: application/json'"
            f"{auth} \\\n"
            f'    -d \'{{"model": "{topology.served_model_name}", "messages": '
            f'[{{"role": "user", "content": "Hello"}}]}}\'\n'
            f"Press Ctrl-C to stop.",
            file=out,
            flush=True,
        )
        proxy = children[0]
        restarts = Restarts(out)
        # every engine just answered (wait_ready): watched from now on
        watchdog = Watchdog(args.hang_timeout, last_ok={c.name: time.monotonic() for c in engines})
        while not stop.wait(0.5):
            if (rc := proxy.exited()) is not None:
                print(
                    f"tandem up: the proxy exited with status {rc}:\n{proxy.log_tail()}",
                    file=sys.stderr,
                )
                code = 1
                break
            for c in watchdog.hung(engines, restarts):
                watchdog.kill(c, out)
            for c in engines:
                if not restarts.waiting(c) and (rc := c.exited()) is not None:
                    restarts.died(c, rc)
            restarts.restart_due(engines)
        return code
    finally:
        print("tandem up: stopping", file=out, flush=True)
        stop_children(children, args.grace)
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _reserve_proxy_port(port: int) -> socket.socket:
    try:
        return reserve_port(HOST, port)
    except OSError:
        raise UpError(
            f"port {port} on {HOST} is in use; pick another with --port (0: any free port)"
        ) from None
