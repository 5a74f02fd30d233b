"""A rollout that changes the KV layout, through the proxy, loses no request.

Real processes on loopback: an old prefill/decode pair (block size 16, layout "A") serves a
bounded loop of disaggregated requests while a new pair (block size 32, layout "B") joins and
the old pair leaves, as a Kubernetes rollout would have it (the operator labels each engine
pod with its layout; here the engines register with it). Blocks of 16 and 32 tokens cannot
be handed over (``--kv-pull-fallback error``), so a request that paired an old prefill with a
new decode would fail: the proxy must pair engines of one layout only. Every answer is
checked against a single engine's greedy output.
"""

from __future__ import annotations

import asyncio
import threading

import openai
import pytest

from tandem.server.api.announce import deregister_engine, register_engine

from ..proxy.utils import PROXY_ADMIN_KEY, PROXY_KEY, ProxyProcess, stop_all
from ..utils import ENGINE_FLAGS, ServerProcess, wait_until

pytestmark = pytest.mark.timeout(300)

MODEL = "tiny"
PROMPTS = ["Once upon a time", "The scheduler decides which requests run", "Paged attention"]
REQUESTS = 30


def _flags(block_size: int) -> list[str]:
    flags = list(ENGINE_FLAGS)
    flags[flags.index("--block-size") + 1] = str(block_size)
    return [*flags, "--kv-pull-fallback", "error"]


def _complete(url: str, prompt: str, key: str | None = None) -> str:
    client = openai.OpenAI(base_url=url + "/v1", api_key=key or "x", max_retries=0, timeout=60)
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0)
    return out.choices[0].text


def test_rollout_that_changes_the_kv_layout_loses_no_request(llama_dir, tmp_path) -> None:
    def engine(role: str, block: int, name: str) -> ServerProcess:
        return ServerProcess(
            str(llama_dir), *_flags(block), "--role", role, log_path=tmp_path / f"{name}.log"
        )

    old = {"prefill": engine("prefill", 16, "p-old"), "decode": engine("decode", 16, "d-old")}
    new = {"prefill": engine("prefill", 32, "p-new"), "decode": engine("decode", 32, "d-new")}
    ref = engine("both", 16, "ref")
    proxy = ProxyProcess(
        "--disagg-threshold", "0", "--health-interval", "0.5", log_path=tmp_path / "proxy.log"
    )
    started = [proxy, ref, *old.values(), *new.values()]

    def join(pair: dict[str, ServerProcess], layout: str) -> None:
        for role, e in pair.items():
            e.wait_ready()
            asyncio.run(
                register_engine(
                    proxy.url, e.url, role, [MODEL], PROXY_ADMIN_KEY, attempts=1, kv_layout=layout
                )
            )
        proxy.wait_healthy([e.url for e in pair.values()])

    try:
        ref.wait_ready()
        expected = {p: _complete(ref.url, p) for p in PROMPTS}
        join(old, "A")
        results: list[str | Exception] = []

        def loop() -> None:
            for i in range(REQUESTS):
                prompt = PROMPTS[i % len(PROMPTS)]
                try:
                    results.append(_complete(proxy.url, prompt, PROXY_KEY))
                except Exception as exc:  # every failure is the test's finding
                    results.append(exc)

        runner = threading.Thread(target=loop)
        runner.start()
        wait_until(lambda: len(results) >= 5, timeout=120, what="5 requests on the old pair")
        join(new, "B")  # both layouts serve side by side: pairs must not mix
        wait_until(lambda: len(results) >= 15, timeout=120, what="15 requests on both pairs")
        for role in ("prefill", "decode"):  # the old pods terminate: the proxy drops them
            asyncio.run(deregister_engine(proxy.url, old[role].url, role, api_key=PROXY_ADMIN_KEY))
        runner.join(timeout=180)
        assert not runner.is_alive()
        failures = [r for r in results if isinstance(r, Exception)]
        assert not failures, failures[:3]
        assert results == [expected[PROMPTS[i % len(PROMPTS)]] for i in range(REQUESTS)]
        # the new pair served after the old one left (the loop did not end before the roll)
        assert len(results) == REQUESTS
    finally:
        stop_all(started)
