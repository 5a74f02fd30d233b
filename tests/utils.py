"""Helpers every test folder uses: a tiny model on disk, a real ``tandem serve`` process on
loopback, ``tandem up`` as a real process, and the one way to wait for a condition."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tandem.server.net import reserve_port

from .model_specs import api_spec, on_gpu

API_KEY = "sk-test-key"
ADMIN_KEY = "sk-test-admin"  # /pause, /abort_request, ... (docs/security.md)
# Small enough for a 2-core CPU; max_model_len 512 makes an oversized prompt cheap to build.
ENGINE_FLAGS = [
    "--kv-cache-tokens",
    "4096",
    "--max-num-seqs",
    "64",
    "--max-model-len",
    "512",
    "--block-size",
    "16",
    *(["--dtype", "bfloat16"] if on_gpu() else []),
]


def make_model(root: Path, arch: str = "llama") -> str:
    from tandem.server.engine.tiny_model import make_tiny_model

    return str(make_tiny_model(str(root / arch), api_spec(arch)))


class ChildProcess:
    """A ``tandem`` subcommand in a subprocess serving on a loopback port held for it from the
    pick (``--listen-fd``, as ``tandem up`` does), its output in ``log_path``; ``stop`` sends
    SIGTERM, then SIGKILL after ``timeout``."""

    def __init__(self, cmd: list[str], env: dict[str, str], log_path: Path | None) -> None:
        self.log_path = log_path
        self._log = open(log_path, "wb") if log_path else subprocess.DEVNULL
        with reserve_port("127.0.0.1") as listener:
            self.port = listener.getsockname()[1]
            self.url = f"http://127.0.0.1:{self.port}"
            fd = listener.fileno()
            self.proc = subprocess.Popen(
                [*cmd, "--port", str(self.port), "--listen-fd", str(fd)],
                stdout=self._log,
                stderr=subprocess.STDOUT,
                env=env,
                pass_fds=(fd,),
            )

    @property
    def headers(self) -> dict[str, str]:
        key = getattr(self, "api_key", None)
        return {"Authorization": f"Bearer {key}"} if key else {}

    @property
    def admin_headers(self) -> dict[str, str]:
        """For the admin routes: the admin key when this process has one."""
        key = getattr(self, "admin_key", None)
        return {"Authorization": f"Bearer {key}"} if key else self.headers

    def log_tail(self, n: int = 4000) -> str:
        if self.log_path and self.log_path.exists():
            return self.log_path.read_bytes()[-n:].decode(errors="replace")
        return ""

    def stop(self, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self._log is not subprocess.DEVNULL:
            self._log.close()
        return self.proc.returncode


class ServerProcess(ChildProcess):
    """``tandem serve`` in a subprocess."""

    def __init__(
        self,
        model_dir: str,
        *extra: str,
        api_key: str | None = None,
        log_path: Path | None = None,
        served_model_name: str = "tiny",
        env: dict[str, str] | None = None,
        admin_key: str | None = None,
    ) -> None:
        self.api_key = api_key
        self.admin_key = admin_key
        cmd = [
            sys.executable,
            "-m",
            "tandem.server.cli",
            "serve",
            "--model",
            model_dir,
            "--host",
            "127.0.0.1",
            "--served-model-name",
            served_model_name,
            "--log-level",
            "warning",
            *extra,
        ]
        if api_key:
            cmd += ["--api-key", api_key]
        child_env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
        child_env.pop("TANDEM_API_KEY", None)
        child_env.pop("TANDEM_ADMIN_API_KEY", None)
        if admin_key:
            child_env["TANDEM_ADMIN_API_KEY"] = admin_key
        super().__init__(cmd, {**child_env, **(env or {})}, log_path)

    def wait_ready(self, timeout: float = 120.0) -> None:
        def ready() -> bool:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}: {self.log_tail()}")
            try:
                return httpx.get(self.url + "/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        try:
            wait_until(ready, timeout, "the server to be ready")
        except AssertionError:
            raise TimeoutError(f"server not ready in {timeout}s: {self.log_tail()}") from None

    def health(self) -> dict:
        """``/health`` as the operator sees it (the admin key: the weights' path included)."""
        return httpx.get(self.url + "/health", headers=self.admin_headers, timeout=10).json()

    def wait_idle(self, timeout: float = 20.0, sessions_ok: bool = False) -> dict:
        """Poll /health until nothing runs or waits and every block is free (sessions aside)."""
        last: list[dict] = []

        def idle() -> bool:
            h = self.health()
            last[:] = [h]
            pool = h["block_pool"]
            return (
                h["active_requests"] == 0
                and h["pending_requests"] == 0
                and (
                    sessions_ok
                    or (h["active_sessions"] == 0 and pool["free_blocks"] == pool["total_blocks"])
                )
            )

        try:
            wait_until(idle, timeout, "the server to go idle")
        except AssertionError:
            raise AssertionError(f"server did not go idle: {last}") from None
        return last[0]


def sse_events(lines: list[str]) -> list[str]:
    """The ``data:`` payloads of an SSE body, in order."""
    return [line[len("data:") :].strip() for line in lines if line.startswith("data:")]


def wait_until(
    condition: Callable[[], bool], timeout: float = 30.0, what: str = "condition"
) -> None:
    """Poll ``condition`` until it holds; a generous bound, never a race the test relies on."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not hold within {timeout}s")
        time.sleep(0.05)


async def wait_until_async(
    condition: Callable[[], Awaitable[bool]], timeout: float = 30.0, what: str = "condition"
) -> None:
    """``wait_until`` for a test's event loop: ``condition`` is awaited (a request to the
    server under test, say), the loop is never blocked between polls."""
    deadline = time.monotonic() + timeout
    while not await condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not hold within {timeout}s")
        await asyncio.sleep(0.02)


def aborted_count(server: ChildProcess) -> float:
    """Requests this engine finished with ``finish_reason: abort`` (its Prometheus counter)."""
    text = httpx.get(server.url + "/metrics", timeout=10).text
    lines = [
        line
        for line in text.splitlines()
        if line.startswith("tandem:request_success_total") and 'finished_reason="abort"' in line
    ]
    return sum(float(line.split()[-1]) for line in lines)


@contextlib.contextmanager
def held(*servers: ChildProcess) -> Iterator[None]:
    """Hold every request on these engines in flight (``POST /pause``) until the block exits:
    a request that must still be running when its client leaves is held there, not raced."""
    for s in servers:
        httpx.post(s.url + "/pause", headers=s.admin_headers, timeout=10).raise_for_status()
    try:
        yield
    finally:
        for s in servers:
            httpx.post(s.url + "/resume", headers=s.admin_headers, timeout=10).raise_for_status()


def leave_mid_stream(url: str, body: dict, headers: dict[str, str] | None = None) -> None:
    """Start a streamed request, read until its first event, then hang up: a client that
    goes away mid-stream (the server must abort the request and free its blocks)."""
    with httpx.stream("POST", url, json={**body, "stream": True}, headers=headers, timeout=60) as r:
        lines = r.iter_lines()
        assert any(next(lines).startswith("data:") for _ in range(6))


def give_up_while_held(
    url: str,
    body: dict,
    headers: dict[str, str] | None,
    held_on: list[ChildProcess],
    engines: list[ChildProcess],
) -> None:
    """A non-streamed request held in flight on ``held_on`` whose client gives up: one of
    ``engines`` must abort it (counted by its metrics, so nothing races the clock)."""
    before = sum(aborted_count(e) for e in engines)
    with held(*held_on):
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(url, json={**body, "stream": False}, headers=headers, timeout=0.4)
        wait_until(
            lambda: sum(aborted_count(e) for e in engines) > before, what="an engine aborting"
        )


def project_config_map(volume: Path, data: dict[str, str]) -> None:
    """Write a ConfigMap's ``data`` into ``volume`` as the kubelet projects a configMap volume
    (its AtomicWriter): the files in a new timestamped directory, a ``..data`` link swapped
    to it atomically (a new link renamed over the old), each key a link through ``..data``,
    then the keys no longer in ``data`` and the old directory removed. A reader of
    ``volume/KEY`` sees the old file or the new one, never a partial one."""
    volume.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("..%Y_%m_%d_%H_%M_%S.", time.gmtime()) + str(time.time_ns() % 10**9)
    fresh = volume / stamp
    fresh.mkdir()
    for key, text in data.items():
        (fresh / key).write_text(text)
    data_link = volume / "..data"
    old = os.readlink(data_link) if data_link.is_symlink() else None
    (volume / "..data_tmp").symlink_to(stamp)
    os.rename(volume / "..data_tmp", data_link)
    for key in data:
        if not (volume / key).is_symlink():
            (volume / key).symlink_to(f"..data/{key}")
    for link in volume.iterdir():
        if link.is_symlink() and not link.name.startswith("..") and link.name not in data:
            link.unlink()
    if old is not None:
        for file in (volume / old).iterdir():
            file.unlink()
        (volume / old).rmdir()


@contextlib.contextmanager
def serving(server: ServerProcess) -> Iterator[ServerProcess]:
    """A module fixture's body: ready on entry; stopped on exit, which must be a clean exit."""
    try:
        server.wait_ready()
        yield server
    finally:
        code = server.stop()
        assert code == 0, server.log_tail()


def start_up(
    args: list[str], env: dict[str, str], timeout: float
) -> tuple[subprocess.Popen, str, list[str]]:
    """``tandem up ARGS`` with no client credentials inherited; returns the process, its
    OpenAI base URL and the lines it printed until then (the caller stops it)."""
    env = dict(env, TOKENIZERS_PARALLELISM="false")
    env.pop("TANDEM_PROXY_API_KEY", None)
    env.pop("TANDEM_API_KEY", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "tandem.server.cli", "up", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    lines: list[str] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if m := re.search(r"OpenAI base URL: (\S+)", line):
            return proc, m.group(1), lines
    proc.kill()
    proc.wait(30)
    raise AssertionError("tandem up printed no base URL:\n" + "".join(lines))


def stop_up(proc: subprocess.Popen, reader: threading.Thread) -> None:
    """Ctrl-C ``tandem up`` as a user would, kill it if it does not stop within a minute,
    then let the thread reading its output finish."""
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
        reader.join(10)


def call_app(app: Any, method: str, path: str, **kw: Any) -> httpx.Response:
    """One request to an ASGI app in process (no server, no port)."""

    async def go() -> httpx.Response:
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://app"
        ) as c:
            return await c.request(method, path, **kw)

    return asyncio.run(go())


def greedy_token_ids(client: Any, model: str, prompt_ids: list[int], max_tokens: int) -> list[int]:
    """Greedy token ids of ``prompt_ids`` through ``model`` (an ``openai.OpenAI`` client;
    the completion's ``token_ids`` extension), EOS ignored."""
    out = client.completions.create(
        model=model,
        prompt=prompt_ids,
        max_tokens=max_tokens,
        temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    return out.choices[0].model_extra["token_ids"]


def up_args(**kw: Any) -> argparse.Namespace:
    """``tandem up``'s parsed flags, defaults but for ``kw`` (what ``local.load_plan`` reads)."""
    from tandem.server import local

    parser = argparse.ArgumentParser()
    local.add_arguments(parser)
    ns = parser.parse_args([])
    for k, v in kw.items():
        setattr(ns, k, v)
    return ns
