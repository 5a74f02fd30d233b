"""Decode-driven prefill -> decode behind a real Envoy: the picker routes to the decode engine
and names the prefill engine (``x-prefiller-host-port``, signed with the internal credential);
the decode engine drives the prefill, pulls the KV and decodes. Greedy output equals one
``both`` engine's token for token; a client's own header is refused."""

from __future__ import annotations

import httpx
import openai
import pytest

from ..proxy.utils import metric_value, stop_all
from ..utils import API_KEY, ENGINE_FLAGS, ServerProcess
from .utils import INTERNAL_KEY, start_gateway

pytestmark = pytest.mark.timeout(400)

MODEL = "tiny"
PROMPT = "Paged attention keeps the KV cache in fixed-size blocks so memory never fragments; " * 2
CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Why split prefill from decode?"},
]


@pytest.fixture(scope="module")
def pd_gateway(llama_dir, tmp_path_factory: pytest.TempPathFactory):
    logs = tmp_path_factory.mktemp("gateway-pd")
    env = {"TANDEM_INTERNAL_API_KEY": INTERNAL_KEY}
    p, d, ref = (
        ServerProcess(
            str(llama_dir),
            *ENGINE_FLAGS,
            "--role",
            role,
            api_key=API_KEY,
            env=env,
            log_path=logs / f"{role}.log",
        )
        for role in ("prefill", "decode", "both")
    )
    started: list = [p, d, ref]
    try:
        for e in (p, d, ref):
            e.wait_ready()
        nodes = ["--node", f"{p.url}=prefill", "--node", f"{d.url}=decode"]
        flags = ["--disagg-threshold", "0", "--health-interval", "0.3"]
        envoy = start_gateway(started, logs, *nodes, *flags, internal_key=INTERNAL_KEY)
        yield envoy, p, d, ref
    finally:
        stop_all(started[::-1])


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


def _prefills(engine: ServerProcess) -> float:
    text = httpx.get(engine.url + "/metrics").text
    return metric_value(text, "tandem:request_success_total")


@pytest.mark.parametrize("stream", [False, True])
def test_pd_through_envoy_gives_one_engines_greedy_text(pd_gateway, stream: bool) -> None:
    envoy, prefill, _, ref = pd_gateway
    gateway, one = _client(envoy.url), _client(ref.url)
    before = _prefills(prefill)
    kw = dict(model=MODEL, max_tokens=16, temperature=0)
    want = one.completions.create(prompt=PROMPT, **kw).choices[0].text
    if stream:
        chunks = gateway.completions.create(prompt=PROMPT, stream=True, **kw)
        got = "".join(c.choices[0].text for c in chunks if c.choices)
    else:
        got = gateway.completions.create(prompt=PROMPT, **kw).choices[0].text
    assert got == want
    want_chat = one.chat.completions.create(messages=CHAT, **kw).choices[0].message.content
    got_chat = gateway.chat.completions.create(messages=CHAT, **kw).choices[0].message.content
    assert got_chat == want_chat
    assert _prefills(prefill) - before == 2  # the prefill engine ran both prefill steps


def test_a_client_cannot_name_a_prefill_engine(pd_gateway) -> None:
    _, prefill, decode, _ = pd_gateway
    host_port = prefill.url.removeprefix("http://")
    r = httpx.post(
        decode.url + "/v1/completions",
        json={"model": MODEL, "prompt": PROMPT, "max_tokens": 2},
        headers={
            "Authorization": f"Bearer {API_KEY}",
            "x-prefiller-host-port": host_port,
            "x-tandem-prefiller-signature": "1795586672.000.deadbeef",
        },
    )
    assert r.status_code == 403
    assert r.json()["error"]["code"] == "prefiller_forbidden"
