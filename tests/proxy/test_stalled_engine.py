"""Issue 26, item 4: a stalled engine (``SIGSTOP``) behind the proxy. Its clients never hang
(a stream in flight ends with an error event, a new request is served elsewhere), the proxy
tells stalled from dead in ``/nodes/status``, and re-admits the engine after ``SIGCONT``.

Every bound here is generous: the tests assert outcomes (the stream ended, the request was
answered, the engine came back), never how fast; ``bench/faults.py`` measures the times."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator

import openai
import pytest

from ..utils import ENGINE_FLAGS, ServerProcess
from .utils import (
    PROXY_ADMIN_KEY,
    ProxyProcess,
    metric_value,
    openai_client,
    stop_all,
    wait_free,
)

MODEL = "tiny"
STALL_S = 3  # the proxy's --stall-timeout here


@pytest.fixture(scope="module")
def stack(
    llama_dir, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[ProxyProcess, ServerProcess, ServerProcess]]:
    """A proxy (P/D for every request, stall timeout 3 s, health every 0.5 s) and a prefill and
    a decode engine that register themselves."""
    logs = tmp_path_factory.mktemp("stall")
    proxy = ProxyProcess(
        "--disagg-threshold",
        "0",
        "--stall-timeout",
        str(STALL_S),
        "--health-interval",
        "0.5",
        "--dead-threshold",
        "2",
        log_path=logs / "proxy.log",
    )
    register = ("--proxy-url", proxy.url, "--proxy-api-key", PROXY_ADMIN_KEY)
    prefill = ServerProcess(
        str(llama_dir), *ENGINE_FLAGS, "--role", "prefill", *register, log_path=logs / "p.log"
    )
    decode = ServerProcess(
        str(llama_dir), *ENGINE_FLAGS, "--role", "decode", *register, log_path=logs / "d.log"
    )
    try:
        prefill.wait_ready()
        decode.wait_ready()
        proxy.wait_healthy([prefill.url, decode.url])
        yield proxy, prefill, decode
    finally:
        for e in (prefill, decode):
            if e.proc.poll() is None:
                os.kill(e.proc.pid, signal.SIGCONT)
        stop_all([proxy, prefill, decode])


def _client(proxy: ProxyProcess) -> openai.OpenAI:
    client = openai_client(proxy.url, proxy.headers)
    return client.with_options(timeout=120)  # a bound on a hang, not a timing


def test_stalled_prefill_is_routed_around_and_readmitted(stack) -> None:
    proxy, prefill, decode = stack
    client = _client(proxy)
    os.kill(prefill.proc.pid, signal.SIGSTOP)
    try:
        for stream in (False, True):
            r = client.completions.create(
                model=MODEL, prompt="Once upon a time", max_tokens=8, temperature=0, stream=stream
            )
            chunks = list(r) if stream else [r]
            assert any(c.choices and c.choices[0].finish_reason for c in chunks)
        nodes = proxy.wait_nodes(lambda n: n[prefill.url]["health"] == "stalled", timeout=60)
        assert not nodes[prefill.url]["healthy"] and nodes[decode.url]["healthy"]
        assert metric_value(proxy.metrics(), "tandem_proxy_aggregated_fallbacks_total") >= 1
    finally:
        os.kill(prefill.proc.pid, signal.SIGCONT)
    proxy.wait_healthy([prefill.url], timeout=90)  # re-probed and re-admitted
    r = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=4)
    assert r.choices[0].text is not None
    wait_free(prefill, timeout=60)
    wait_free(decode, timeout=60)


def test_stream_on_a_stalled_decode_engine_ends_with_an_error(stack) -> None:
    proxy, prefill, decode = stack
    client = _client(proxy)
    stream = client.completions.create(
        model=MODEL,
        prompt="Once upon a time",
        max_tokens=400,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    got = 0
    try:
        with pytest.raises(openai.APIError, match="stalled"):
            for _ in stream:
                got += 1
                if got == 3:
                    os.kill(decode.proc.pid, signal.SIGSTOP)
        assert got >= 3
        nodes = proxy.wait_nodes(lambda n: not n[decode.url]["healthy"], timeout=60)
        assert nodes[decode.url]["health"] in ("stalled", "dead")
        assert metric_value(proxy.metrics(), "tandem_proxy_stalls_total") >= 1
    finally:
        os.kill(decode.proc.pid, signal.SIGCONT)
    proxy.wait_healthy([decode.url], timeout=90)
    r = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=4)
    assert r.choices[0].text is not None
    wait_free(decode, timeout=60)  # the abandoned stream was aborted: every block free
    wait_free(prefill, timeout=60)
