"""P/D over HTTP between real `tandem serve` processes on loopback: the DistServe flow by hand.

The proxy does this flow for clients (tests/proxy/); here each step is checked at the
engines: the handoff, the pull, the lease release, failures and the layout handshake.
"""

from __future__ import annotations

import json

import httpx
import pytest

from ..utils import ENGINE_FLAGS, ServerProcess, make_model, sse_events

FLAGS = [*ENGINE_FLAGS, "--kv-lease-seconds", "3"]
BODY = {
    "model": "tiny",
    "prompt": "The scheduler decides, at every step, which requests run and how many tokens",
    "max_tokens": 20,
    "temperature": 0,
    "ignore_eos": True,
}
CHAT = {
    "model": "tiny",
    "messages": [{"role": "user", "content": "Tell me about paged KV caches."}],
    "max_tokens": 20,
    "temperature": 0,
    "ignore_eos": True,
}


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("pd")
    model = make_model(root)
    procs = {
        role: ServerProcess(model, *FLAGS, "--role", role, log_path=root / f"{role}.log")
        for role in ("prefill", "decode", "both")
    }
    procs["decode16"] = ServerProcess(
        model,
        *[f if f != "16" else "8" for f in FLAGS],
        "--role",
        "decode",
        log_path=root / "decode8.log",
    )
    try:
        for p in procs.values():
            p.wait_ready()
        yield procs
    finally:
        for p in procs.values():
            p.stop()


def _prefill(p: ServerProcess, route: str, body: dict) -> dict:
    r = httpx.post(
        p.url + route, json={**body, "kv_transfer_params": {"do_remote_decode": True}}, timeout=60
    )
    assert r.status_code == 200, r.text
    data = r.json()
    assert data["usage"]["completion_tokens"] == 1
    handle = data["kv_transfer_params"]
    assert handle["do_remote_prefill"] and handle["remote_addr"].startswith("tcp://127.0.0.1:")
    return {**handle, "remote_engine_url": p.url}


def _text(route: str, data: dict) -> str:
    choice = data["choices"][0]
    return choice["message"]["content"] if route.endswith("chat/completions") else choice["text"]


@pytest.mark.parametrize("route,body", [("/v1/completions", BODY), ("/v1/chat/completions", CHAT)])
def test_disaggregated_output_equals_aggregated(engines, route: str, body: dict) -> None:
    both, prefill, decode = engines["both"], engines["prefill"], engines["decode"]
    expected = httpx.post(both.url + route, json=body, timeout=60).json()
    handle = _prefill(prefill, route, body)
    r = httpx.post(decode.url + route, json={**body, "kv_transfer_params": handle}, timeout=60)
    assert r.status_code == 200, r.text
    got = r.json()
    assert _text(route, got) == _text(route, expected) and len(_text(route, got)) > 0
    assert got["usage"]["completion_tokens"] == body["max_tokens"]
    # streamed, through a fresh handoff
    handle = _prefill(prefill, route, body)
    with httpx.stream(
        "POST",
        decode.url + route,
        json={**body, "stream": True, "kv_transfer_params": handle},
        timeout=60,
    ) as s:
        events = sse_events(list(s.iter_lines()))
    chunks = [json.loads(e) for e in events if e != "[DONE]"]
    key = "delta" if route.endswith("chat/completions") else "text"
    streamed = "".join(
        (c["choices"][0][key].get("content") or "") if key == "delta" else c["choices"][0]["text"]
        for c in chunks
        if c["choices"]
    )
    assert streamed == _text(route, expected)
    for engine in (prefill, decode):
        engine.wait_idle()  # the decode side released the lease: every block free on both sides


def test_engine_info_and_layout_handshake(engines) -> None:
    prefill, decode, decode8 = engines["prefill"], engines["decode"], engines["decode16"]
    info = httpx.get(prefill.url + "/distserve/engine_info", timeout=10).json()
    assert info["role"] == "prefill" and info["kv_layout"]["block_size"] == 16
    connect = {
        "remote_engine_id": info["engine_id"],
        "remote_engine_endpoint_info": {"zmq_address": info["transport"]["address"]},
    }
    ok = httpx.post(decode.url + "/distserve/p2p_connect", json=connect, timeout=10)
    assert ok.status_code == 200, ok.text
    bad = httpx.post(decode8.url + "/distserve/p2p_connect", json=connect, timeout=10)
    assert bad.status_code == 400
    assert "block_size: remote 16 vs local 8" in bad.json()["error"]["message"]
    # a pull across mismatched layouts fails with the same clear message and frees everything
    handle = _prefill(prefill, "/v1/completions", BODY)
    r = httpx.post(
        decode8.url + "/v1/completions", json={**BODY, "kv_transfer_params": handle}, timeout=60
    )
    assert r.status_code == 502 and "block_size" in r.json()["error"]["message"]
    # the engine's side failed, not the client's request: a typed server error
    assert r.json()["error"]["type"] == "server_error"
    assert r.json()["error"]["code"] == "kv_transfer_error"
    decode8.wait_idle()
    httpx.post(
        prefill.url + "/distserve/free_cache",
        json={"remote_engine_id": info["engine_id"], "remote_lease_id": handle["remote_lease_id"]},
        timeout=10,
    )
    prefill.wait_idle()


def test_lease_that_is_never_pulled_expires(engines) -> None:
    prefill = engines["prefill"]
    _prefill(prefill, "/v1/completions", BODY)
    h = prefill.health()
    assert h["block_pool"]["free_blocks"] < h["block_pool"]["total_blocks"]
    prefill.wait_idle(timeout=10)  # --kv-lease-seconds 3, swept at least every second


def test_pull_of_a_released_lease_fails_cleanly(engines) -> None:
    prefill, decode = engines["prefill"], engines["decode"]
    handle = _prefill(prefill, "/v1/completions", BODY)
    r = httpx.post(
        prefill.url + "/distserve/free_cache",
        json={"remote_lease_id": handle["remote_lease_id"]},
        timeout=10,
    )
    assert r.json()["success"] is True
    assert httpx.post(prefill.url + "/distserve/gc", timeout=10).json()["success"] is True
    r = httpx.post(
        decode.url + "/v1/completions", json={**BODY, "kv_transfer_params": handle}, timeout=60
    )
    assert r.status_code == 502 and "unknown, released or expired" in r.json()["error"]["message"]
    decode.wait_idle()
    prefill.wait_idle()


def test_bad_handles_are_400(engines) -> None:
    decode = engines["decode"]
    r = httpx.post(
        decode.url + "/v1/completions",
        json={**BODY, "kv_transfer_params": {"do_remote_prefill": True, "remote_engine_id": "x"}},
        timeout=10,
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "kv_transfer_params"
