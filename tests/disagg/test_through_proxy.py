"""Prefill/decode disaggregation through the proxy, all real processes on loopback: greedy output
through 1 prefill + 1 decode engine equals a single ``both`` engine's token for token, and the
proxy-level failures (client gone mid-stream, decode killed, prefill killed) leave every block free."""

from __future__ import annotations

import asyncio
import json
import signal
import threading

import httpx
import openai
import pytest

from tandem.server.api.announce import register_engine

from ..proxy.utils import (
    PROXY_ADMIN_KEY,
    PROXY_KEY,
    ProxyProcess,
    kill,
    metric_value,
    stop_all,
    wait_free,
)
from ..utils import (
    ENGINE_FLAGS,
    ServerProcess,
    give_up_while_held,
    leave_mid_stream,
    sse_events,
)

pytestmark = pytest.mark.timeout(300)

MODEL = "tiny"
LEASE_S = 3
FLAGS = [*ENGINE_FLAGS, "--kv-lease-seconds", str(LEASE_S)]
PROMPTS = [
    "The scheduler decides, at every step, which requests run and how many tokens each computes",
    "Once upon a time",
    "Paged attention keeps the KV cache in fixed-size blocks so that memory is never fragmented; "
    * 3,
]
CHATS = [
    [{"role": "user", "content": "Tell me about paged KV caches."}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Why disaggregate?"},
        {"role": "assistant", "content": "Prefill and decode differ."},
        {"role": "user", "content": "How?"},
    ],
]


def _engine(model: str, role: str, logs, name: str, *extra: str) -> ServerProcess:
    return ServerProcess(model, *FLAGS, "--role", role, *extra, log_path=logs / f"{name}.log")


@pytest.fixture(scope="module")
def stack(llama_dir, tmp_path_factory: pytest.TempPathFactory):
    """A prefill and a decode engine behind the proxy (disaggregating everything), and a both engine
    beside them as the reference."""
    logs = tmp_path_factory.mktemp("pd-proxy")
    p, d, ref = (_engine(str(llama_dir), r, logs, r) for r in ("prefill", "decode", "both"))
    proxy = ProxyProcess(
        "--node",
        f"{p.url}=prefill",
        "--node",
        f"{d.url}=decode",
        "--disagg-threshold",
        "0",
        "--health-interval",
        "0.5",
        log_path=logs / "proxy.log",
    )
    try:
        for e in (p, d, ref):
            e.wait_ready()
        proxy.wait_healthy([p.url, d.url])
        yield proxy, p, d, ref
    finally:
        stop_all([proxy, p, d, ref])


def _client(url: str, key: str = PROXY_KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=60)


def _complete(
    client: openai.OpenAI, prompt: str, stream: bool, max_tokens: int = 24, **more: object
) -> tuple[str, str | None]:
    kw = dict(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0.0, **more)
    if not stream:
        r = client.completions.create(**kw)
        return r.choices[0].text, r.choices[0].finish_reason
    text, finish = "", None
    for c in client.completions.create(stream=True, **kw):
        for ch in c.choices:
            text += ch.text
            finish = ch.finish_reason or finish
    return text, finish


def _chat(
    client: openai.OpenAI, messages: list, stream: bool, max_tokens: int = 24
) -> tuple[str, str | None]:
    kw = dict(model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0.0)
    if not stream:
        r = client.chat.completions.create(**kw)
        return r.choices[0].message.content or "", r.choices[0].finish_reason
    text, finish = "", None
    for c in client.chat.completions.create(stream=True, **kw):
        for ch in c.choices:
            text += ch.delta.content or ""
            finish = ch.finish_reason or finish
    return text, finish


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_pd_output_equals_single_engine(stack, stream: bool) -> None:
    proxy, p, d, ref = stack
    via, alone = _client(proxy.url), _client(ref.url, "unused")
    before = metric_value(
        proxy.metrics(), "tandem_proxy_requests_total", mode="disaggregated", status="200"
    )
    outputs = set()
    for prompt in PROMPTS:
        got, want = _complete(via, prompt, stream), _complete(alone, prompt, stream=False)
        assert got == want
        outputs.add(got[0])
    for messages in CHATS:
        got, want = _chat(via, messages, stream), _chat(alone, messages, stream=False)
        assert got == want
        outputs.add(got[0])
    assert len(outputs) == len(PROMPTS) + len(CHATS) and all(outputs)  # varied, non-empty output
    after = metric_value(
        proxy.metrics(), "tandem_proxy_requests_total", mode="disaggregated", status="200"
    )
    assert after - before == len(PROMPTS) + len(CHATS)  # every one went prefill -> decode
    for e in (p, d):
        wait_free(e)  # the decode side released each lease: every block free on both sides


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_pd_first_token_that_stops(stack, stream: bool) -> None:
    """The prefill's one token already ends the request: the decode engine answers it (without
    a pull) as one engine would, and the proxy passes that through untouched."""
    proxy, p, d, ref = stack
    via, alone = _client(proxy.url), _client(ref.url, "unused")
    first, _ = _complete(alone, PROMPTS[1], stream=False, max_tokens=1)
    assert first
    before = metric_value(
        proxy.metrics(), "tandem_proxy_requests_total", mode="disaggregated", status="200"
    )
    want = _complete(alone, PROMPTS[1], stream=False, stop=[first])
    assert want == ("", "stop")
    assert _complete(via, PROMPTS[1], stream, stop=[first]) == want
    after = metric_value(
        proxy.metrics(), "tandem_proxy_requests_total", mode="disaggregated", status="200"
    )
    assert after - before == 1
    for e in (p, d):
        wait_free(e)  # the decode side released the lease it never pulled from


def test_pd_usage_and_token_ids_are_the_whole_requests(stack) -> None:
    proxy, p, d, ref = stack
    body = {
        "model": MODEL,
        "prompt": PROMPTS[0],
        "max_tokens": 12,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with httpx.stream(
        "POST", proxy.url + "/v1/completions", json=body, headers=proxy.headers, timeout=60
    ) as r:
        assert r.status_code == 200
        events = [json.loads(e) for e in sse_events(list(r.iter_lines())) if e != "[DONE]"]
    want = httpx.post(
        ref.url + "/v1/completions", json={**body, "stream": False}, timeout=60
    ).json()
    assert events[-1]["usage"]["completion_tokens"] == 12
    assert events[-1]["usage"]["prompt_tokens"] == want["usage"]["prompt_tokens"]
    assert "".join(c["text"] for e in events for c in e["choices"]) == want["choices"][0]["text"]
    assert all("kv_transfer_params" not in e or e["kv_transfer_params"] is None for e in events)


def test_connection_warmup(stack) -> None:
    proxy, p, d, _ = stack
    r = proxy.post("/distserve/connection_warmup")
    assert r.status_code == 200, r.text
    assert r.json()["connections"] == [
        {"prefill": p.url, "decode": d.url, "ok": True, "status": 200}
    ]


def test_client_dropped_mid_stream_frees_both_sides(stack) -> None:
    proxy, p, d, _ = stack
    body = {
        "model": MODEL,
        "messages": CHATS[0],
        "max_tokens": 450,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
    }
    url = proxy.url + "/v1/chat/completions"
    leave_mid_stream(url, body, proxy.headers)
    for e in (p, d):
        wait_free(e, timeout=15)
    # and a client that gives up on a non-streamed request, held in flight on the decode engine
    give_up_while_held(url, body, proxy.headers, held_on=[d], engines=[p, d])
    for e in (p, d):
        wait_free(e, timeout=15)


# ----- engines that die ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def fragile(llama_dir, tmp_path_factory: pytest.TempPathFactory, stack):
    """A proxy that polls health rarely (so only requests find out an engine died), and engines
    all started at once (loading in parallel): prefill1/decode1 register themselves
    (``--proxy-url``), the others are registered by the tests when they need them."""
    logs = tmp_path_factory.mktemp("pd-fragile")
    proxy = ProxyProcess(
        "--disagg-threshold", "0", "--health-interval", "30", log_path=logs / "proxy.log"
    )
    started: list = [proxy]
    try:
        self_registering = ("--proxy-url", proxy.url, "--proxy-api-key", PROXY_ADMIN_KEY)
        engines = {
            name: _engine(
                str(llama_dir), role, logs, name, *(self_registering if name.endswith("1") else ())
            )
            for name, role in (
                ("prefill1", "prefill"),
                ("decode1", "decode"),
                ("prefill2", "prefill"),
                ("decode2", "decode"),
                ("decode3", "decode"),
            )
        }
        started += engines.values()
        yield proxy, engines, stack[3]
    finally:
        stop_all(started)


def _register(proxy: ProxyProcess, *engines_and_roles: tuple[ServerProcess, str]) -> None:
    for e, role in engines_and_roles:
        e.wait_ready()
        asyncio.run(
            register_engine(proxy.url, e.url, role, [MODEL], api_key=PROXY_ADMIN_KEY, attempts=1)
        )
    proxy.wait_healthy([e.url for e, _ in engines_and_roles])


def test_killed_prefill_engine_is_retried_aggregated(fragile) -> None:
    proxy, engines, ref = fragile
    p, d = engines["prefill1"], engines["decode1"]
    for e in (p, d):
        e.wait_ready()
    proxy.wait_healthy([p.url, d.url])  # they registered themselves
    assert proxy.nodes()[p.url]["role_name"] == "prefill" and proxy.nodes()[p.url]["models"] == [
        MODEL
    ]
    via, alone = _client(proxy.url), _client(ref.url, "unused")
    assert _complete(via, PROMPTS[0], False) == _complete(alone, PROMPTS[0], False)
    kill(p)
    for stream in (False, True):  # the proxy still thinks P is fine: the request finds out
        assert _chat(via, CHATS[1], stream) == _chat(alone, CHATS[1], False)
    text = proxy.metrics()
    assert metric_value(text, "tandem_proxy_prefill_failures_total") >= 1
    assert (
        metric_value(
            text,
            "tandem_proxy_requests_total",
            route="chat",
            mode="aggregated_fallback",
            status="200",
        )
        >= 1
    )
    assert not proxy.nodes()[p.url]["healthy"]
    wait_free(d)
    kill(d)


def test_killed_decode_engine(fragile) -> None:
    proxy, engines, _ = fragile
    p, d, d2 = engines["prefill2"], engines["decode2"], engines["decode3"]
    _register(proxy, (p, "prefill"), (d, "decode"))
    via = _client(proxy.url)
    # 1. killed mid-stream: the client gets an error event, not a silently short answer
    stream = via.completions.create(
        model=MODEL,
        prompt=PROMPTS[1],
        max_tokens=400,
        temperature=0.0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    got = []
    with pytest.raises(openai.APIError, match="failed mid-stream"):
        for chunk in stream:
            got.append(chunk)
            if len(got) == 3:
                kill(d)
    wait_free(p, timeout=LEASE_S + 10)
    # 2. frozen while the handoff is under way, then killed: P holds a lease D never pulls; the
    #    proxy finds D gone, releases the lease and says no decode engine is left
    _register(proxy, (d2, "decode"))
    d2.proc.send_signal(signal.SIGSTOP)
    killer = threading.Timer(2.0, d2.proc.kill)
    killer.start()
    try:
        with pytest.raises(openai.APIStatusError) as exc:
            via.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=20, temperature=0.0)
        assert exc.value.status_code == 503 and "decode" in exc.value.message
    finally:
        killer.join()
        d2.proc.kill()
        d2.proc.wait()
    wait_free(p, timeout=LEASE_S + 10)  # released by the proxy (or, at worst, on lease expiry)
    # 3. with no decode engine left the proxy refuses clearly rather than hanging
    proxy.wait_nodes(
        lambda n: not any(v["healthy"] and v["role_name"] != "prefill" for v in n.values())
    )
    with pytest.raises(openai.APIStatusError) as exc:
        via.completions.create(model=MODEL, prompt="x", max_tokens=2)
    assert exc.value.status_code == 503 and exc.value.body["code"] == "no_engine_available"
    wait_free(p)
