"""The proxy over two aggregated (``both``) engines, all real processes on loopback, driven by the
official ``openai`` client: passthrough equality, auth, sessions, client disconnects, registration
and dead-node handling."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

from tandem.server.api.announce import deregister_engine, register_engine
from tandem.server.net import free_port

from ..utils import (
    ENGINE_FLAGS,
    ServerProcess,
    give_up_while_held,
    leave_mid_stream,
    sse_events,
)
from .utils import (
    PROXY_ADMIN_KEY,
    PROXY_KEY,
    ProxyProcess,
    kill,
    metric_value,
    stop_all,
    wait_free,
)

pytestmark = pytest.mark.timeout(300)

MODEL = "tiny"
GREEDY = dict(temperature=0.0)


@pytest.fixture(scope="module")
def stack(llama_dir, tmp_path_factory: pytest.TempPathFactory):
    logs = tmp_path_factory.mktemp("proxy-live")
    engines = [
        ServerProcess(str(llama_dir), *ENGINE_FLAGS, log_path=logs / f"engine{i}.log")
        for i in range(2)
    ]
    proxy = ProxyProcess(
        *[a for e in engines for a in ("--node", e.url)],
        "--health-interval",
        "0.3",
        "--dead-threshold",
        "2",
        "--startup-grace",
        "2",
        log_path=logs / "proxy.log",
    )
    try:
        for e in engines:
            e.wait_ready()
        proxy.wait_healthy([e.url for e in engines])
        yield proxy, engines
    finally:
        stop_all([proxy, *engines])


@pytest.fixture(scope="module")
def client(stack) -> openai.OpenAI:
    proxy, _ = stack
    return openai.OpenAI(base_url=proxy.url + "/v1", api_key=PROXY_KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def direct(stack) -> openai.OpenAI:
    _, engines = stack
    return openai.OpenAI(
        base_url=engines[0].url + "/v1", api_key="unused", max_retries=0, timeout=60
    )


def _strip(event: str) -> object:
    if event == "[DONE]":
        return event
    d = json.loads(event)
    d.pop("id", None)
    d.pop("created", None)
    return d


def test_openai_client_through_proxy_equals_engine(
    client: openai.OpenAI, direct: openai.OpenAI
) -> None:
    for prompt in ("The quick brown fox", "Once upon a time"):
        a = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, **GREEDY)
        b = direct.completions.create(model=MODEL, prompt=prompt, max_tokens=16, **GREEDY)
        assert a.choices[0].text == b.choices[0].text and a.usage == b.usage
    messages = [{"role": "user", "content": "Say hello"}]
    a = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, **GREEDY)
    b = direct.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, **GREEDY)
    assert (
        a.choices[0].message.content == b.choices[0].message.content
        and a.choices[0].finish_reason == "length"
    )
    pieces = [
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=12, stream=True, **GREEDY
        )
        if c.choices
    ]
    assert "".join(pieces) == b.choices[0].message.content


def test_stream_is_passed_through_event_for_event(stack) -> None:
    proxy, engines = stack
    body = {
        "model": MODEL,
        "prompt": "In the beginning",
        "max_tokens": 64,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        **GREEDY,
    }
    with httpx.stream(
        "POST", proxy.url + "/v1/completions", json=body, headers=proxy.headers, timeout=60
    ) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        via_proxy = sse_events(list(r.iter_lines()))
    with httpx.stream("POST", engines[0].url + "/v1/completions", json=body, timeout=60) as r:
        direct = sse_events(list(r.iter_lines()))

    # Chunk boundaries depend on timing (the engine coalesces when its reader lags): compare the
    # text, the finish and the usage event, and that the stream came in pieces.
    def summary(events: list[str]) -> tuple:
        parsed = [_strip(e) for e in events[:-1]]
        text = "".join(c["text"] for p in parsed for c in p["choices"])
        finish = [c["finish_reason"] for p in parsed for c in p["choices"] if c["finish_reason"]]
        return text, finish, parsed[-1]["usage"], events[-1]

    assert summary(via_proxy) == summary(direct)
    assert via_proxy[-1] == "[DONE]" and len(via_proxy) > 3


def test_models_health_auth_and_errors(stack, client: openai.OpenAI) -> None:
    proxy, _ = stack
    assert [m.id for m in client.models.list().data] == [MODEL]
    h = httpx.get(proxy.url + "/health", timeout=10)  # open without a key
    assert h.status_code == 200 and h.json()["healthy_nodes"]["both"] == 2
    bad = openai.OpenAI(base_url=proxy.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model=MODEL, prompt="x", max_tokens=2)
    with pytest.raises(openai.NotFoundError) as exc:
        client.completions.create(model="no-such-model", prompt="x", max_tokens=2)
    assert exc.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError):  # the engine's own 400 comes through
        client.completions.create(model=MODEL, prompt="x", max_tokens=2, temperature=-3)
    text = proxy.metrics()
    assert (
        metric_value(
            text, "tandem_proxy_requests_total", route="completions", mode="direct", status="200"
        )
        >= 2
    )


def test_sessions_stick_to_one_engine(stack, client: openai.OpenAI) -> None:
    proxy, engines = stack
    sessions = [f"sess-{i}" for i in range(4)]
    history = {
        s: [{"role": "user", "content": f"Hello number {i}"}] for i, s in enumerate(sessions)
    }
    for _turn in range(3):
        for s in sessions:
            r = client.chat.completions.create(
                model=MODEL,
                messages=history[s],
                max_tokens=6,
                extra_body={"session_id": s},
                **GREEDY,
            )
            history[s] += [
                {"role": "assistant", "content": r.choices[0].message.content},
                {"role": "user", "content": "and then?"},
            ]
    held = [e.health()["active_sessions"] for e in engines]
    assert sum(held) == len(sessions), held  # each session lives on exactly one engine
    for s in sessions:
        r = proxy.get("/v1/sessions/x")  # GET is not a route
        assert r.status_code == 405
        r = httpx.delete(f"{proxy.url}/v1/sessions/{s}", headers=proxy.headers, timeout=10)
        assert r.status_code == 200, r.text
    for e in engines:
        wait_free(e)


def test_client_disconnects_abort_on_the_engine(stack) -> None:
    proxy, engines = stack
    body = {
        "model": MODEL,
        "prompt": "Tell me a very long story",
        "max_tokens": 450,
        "ignore_eos": True,
        "stream": True,
        **GREEDY,
    }
    url = proxy.url + "/v1/completions"
    for _ in range(2):  # left mid-stream: the engine must abort and free everything
        leave_mid_stream(url, body, proxy.headers)
    for e in engines:
        wait_free(e)
    give_up_while_held(url, body, proxy.headers, held_on=engines, engines=engines)
    for e in engines:
        wait_free(e)
    assert metric_value(proxy.metrics(), "tandem_proxy_client_disconnects_total") >= 1


def test_registration_and_dead_registered_node_is_dropped(stack) -> None:
    proxy, _ = stack
    ghost = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    asyncio.run(
        register_engine(proxy.url, ghost, "decode", ["tiny"], api_key=PROXY_ADMIN_KEY, attempts=1)
    )
    assert proxy.nodes()[ghost]["role_name"] == "decode"
    asyncio.run(deregister_engine(proxy.url, ghost, api_key=PROXY_ADMIN_KEY))
    assert ghost not in proxy.nodes()
    asyncio.run(register_engine(proxy.url, ghost, 3, ["tiny"], api_key=PROXY_ADMIN_KEY, attempts=1))
    # never healthy: kept through the startup grace (2 s), then dropped after 2 failed polls
    proxy.wait_nodes(lambda n: ghost not in n, timeout=20)
    with pytest.raises(RuntimeError, match="refused"):  # a wrong key is refused, not retried
        asyncio.run(
            register_engine(proxy.url, ghost, "decode", ["tiny"], api_key="wrong", attempts=3)
        )


def test_killed_engine_is_routed_around(stack, client: openai.OpenAI) -> None:
    """Runs last: kills one engine without warning; every request still gets its answer."""
    proxy, engines = stack
    kill(engines[1])
    for i in range(6):  # some would have gone to the dead engine: they are retried on the live one
        r = client.completions.create(model=MODEL, prompt=f"request {i}", max_tokens=4, **GREEDY)
        assert r.choices[0].finish_reason == "length"
    nodes = proxy.wait_nodes(lambda n: not n[engines[1].url]["healthy"])
    assert nodes[engines[0].url]["healthy"]
    assert httpx.get(proxy.url + "/health", timeout=10).json()["healthy_nodes"]["both"] == 1
