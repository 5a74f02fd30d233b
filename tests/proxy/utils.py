"""Helpers for the proxy, P/D and ``tandem up`` tests (no tests here): a ``tandem proxy`` process
on loopback, starting several processes at once, and waiting on engine and proxy state."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai

from ..utils import ChildProcess, ServerProcess, wait_until

PROXY_KEY = "sk-proxy-key"  # a client key
PROXY_ADMIN_KEY = "sk-proxy-admin"  # /nodes/*, /distserve/* (docs/security.md)


class ProxyProcess(ChildProcess):
    """``tandem proxy`` in a subprocess."""

    def __init__(
        self,
        *extra: str,
        api_key: str | None = PROXY_KEY,
        admin_key: str | None = PROXY_ADMIN_KEY,
        log_path: Path | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        self.api_key = api_key
        self.admin_key = admin_key if api_key else None
        cmd = [
            sys.executable,
            "-m",
            "tandem.server.cli",
            "proxy",
            "--host",
            "127.0.0.1",
            "--log-level",
            "warning",
            *extra,
        ]
        if api_key:
            cmd += ["--api-key", api_key]
        child_env = dict(os.environ)
        child_env.pop("TANDEM_PROXY_API_KEY", None)
        child_env.pop("TANDEM_ADMIN_API_KEY", None)
        if self.admin_key:
            child_env["TANDEM_ADMIN_API_KEY"] = self.admin_key
        super().__init__(cmd, {**child_env, **(env or {})}, log_path)

    def headers_for(self, path: str) -> dict[str, str]:
        """The admin key for the admin routes, the client key for the rest."""
        if self.admin_key and path.startswith(("/nodes/", "/distserve/")):
            return {"Authorization": f"Bearer {self.admin_key}"}
        return self.headers

    def get(self, path: str, **kw: Any) -> httpx.Response:
        return httpx.get(self.url + path, headers=self.headers_for(path), timeout=30, **kw)

    def post(self, path: str, json: Any = None, **kw: Any) -> httpx.Response:
        return httpx.post(
            self.url + path, json=json, headers=self.headers_for(path), timeout=60, **kw
        )

    def nodes(self) -> dict[str, dict]:
        return self.get("/nodes/status").json()

    def wait_nodes(
        self, predicate: Callable[[dict[str, dict]], bool], timeout: float = 60.0
    ) -> dict[str, dict]:
        seen: list[dict[str, dict]] = [{}]

        def matched() -> bool:
            if self.proc.poll() is not None:
                raise RuntimeError(f"proxy exited with {self.proc.returncode}: {self.log_tail()}")
            try:
                seen[0] = self.nodes()
            except httpx.HTTPError:
                return False
            return predicate(seen[0])

        try:
            wait_until(matched, timeout, "the proxy's nodes to match")
        except AssertionError:
            raise AssertionError(
                f"proxy nodes never matched: {seen[0]}\n{self.log_tail()}"
            ) from None
        return seen[0]

    def wait_healthy(self, urls: list[str], timeout: float = 60.0) -> dict[str, dict]:
        return self.wait_nodes(lambda n: all(n.get(u, {}).get("healthy") for u in urls), timeout)

    def metrics(self) -> str:
        return self.get("/metrics").text


def kill(server: ServerProcess) -> None:
    """SIGKILL an engine (no drain, no goodbye): what a crashed pod looks like to the proxy."""
    if server.proc.poll() is None:
        server.proc.kill()
        server.proc.wait()


def stop_all(procs: list[Any]) -> None:
    """Stop everything started, whatever state it is in (fixture finalizers)."""
    for p in procs:
        try:
            if p.proc.poll() is None:
                p.proc.send_signal(signal.SIGTERM)
        except Exception:  # noqa: BLE001
            pass
    for p in procs:
        try:
            p.stop(timeout=20)
        except Exception:  # noqa: BLE001
            p.proc.kill()


@contextlib.contextmanager
def engine_and_proxies(
    model_dir: str, logs: Path, *flags: str, both_flags: tuple[str, ...] = ()
) -> Iterator[tuple[ServerProcess, ProxyProcess, ProxyProcess]]:
    """A ``both`` engine (``flags`` + ``both_flags``) and a prefill engine (``flags``); yields
    the engine, a proxy over it alone (aggregated) and one over both engines (P/D always)."""
    both = ServerProcess(model_dir, *flags, *both_flags, log_path=logs / "both.log")
    prefill = ServerProcess(model_dir, *flags, "--role", "prefill", log_path=logs / "prefill.log")
    aggregated = ProxyProcess("--node", both.url, log_path=logs / "proxy-agg.log")
    pd = ProxyProcess(
        "--node",
        f"{prefill.url}=prefill",
        "--node",
        f"{both.url}=both",
        "--disagg-threshold",
        "0",
        log_path=logs / "proxy-pd.log",
    )
    try:
        both.wait_ready()
        prefill.wait_ready()
        aggregated.wait_healthy([both.url])
        pd.wait_healthy([prefill.url, both.url])
        yield both, aggregated, pd
    finally:
        stop_all([aggregated, pd, prefill, both])


FRONTS = ("engine", "proxy", "proxy-pd")


def front_of(
    stack: tuple[ServerProcess, ProxyProcess, ProxyProcess], which: str
) -> tuple[str, dict[str, str]]:
    """The URL and auth headers of ``engine_and_proxies``' engine, or of one of its proxies."""
    both, aggregated, pd = stack
    target = {"engine": both, "proxy": aggregated, "proxy-pd": pd}[which]
    return target.url, target.headers


def openai_client(url: str, headers: dict[str, str]) -> openai.OpenAI:
    key = headers.get("Authorization", "Bearer none").split()[-1]
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0)


def wait_free(server: ServerProcess, timeout: float = 30.0) -> dict:
    """Until the engine runs nothing and every block is free (no session holds any)."""
    return server.wait_idle(timeout=timeout)


def metric_value(text: str, name: str, **labels: str) -> float:
    """The sum of the samples of ``name`` whose labels include ``labels`` (0 if none)."""
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name):
            continue
        head, _, value = line.rpartition(" ")
        if head.split("{")[0] != name:
            continue
        if all(f'{k}="{v}"' in head for k, v in labels.items()):
            total += float(value)
    return total
