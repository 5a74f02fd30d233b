"""The P/D trust boundary (issue 11, docs/security.md), in process: credentials, signed
handles, the authenticated transport, bounded pulls, and who may call which route.

Each test names the finding of issue 11 it reproduces; the live reproducers (a fake prefill
server against a real proxy, `tandem up`) are in tests/disagg/test_trust_live.py.
"""

from __future__ import annotations

import os
import socket
import threading
from pathlib import Path

import pytest
import torch
import zmq
from fastapi.testclient import TestClient

from tandem.server.api.app import build_app, transport_key
from tandem.server.api.state import ServerSettings
from tandem.server.disagg.puller import KVPuller
from tandem.server.disagg.transport import KVTransportClient, KVTransportServer, TransportError
from tandem.server.engine import LLMEngine
from tandem.server.engine.config import EngineConfig
from tandem.server.engine.kv_cache import KVCache
from tandem.server.engine.kv_transfer import PullTask
from tandem.server.proxy.app import build_app as build_proxy
from tandem.server.proxy.state import ProxySettings
from tandem.server.wire import trust
from tandem.server.wire.auth import Credentials, load_credentials

from ..utils import call_app, wait_until

INTERNAL, ADMIN, CLIENT = "int-secret", "adm-secret", "k1"
KEY = trust.derive_key(INTERNAL, "kv-transport")


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


# ----- credentials and signatures (pure) ----------------------------------------------------
def test_three_credentials_are_told_apart(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("# clients\nc1\n\nc2\n")
    creds = load_credentials(
        client_keys=["c0"], client_key_file=str(keys), internal_key="i", admin_key="a"
    )
    assert creds.client_keys == {"c0", "c1", "c2"}
    assert [creds.principal(f"Bearer {k}".encode()) for k in ("c2", "i", "a", "x")] == [
        "client",
        "internal",
        "admin",
        None,
    ]
    assert creds.principal(b"c1") is None and creds.principal(b"") is None  # no scheme
    assert Credentials().principal(b"") == "open"
    with pytest.raises(ValueError, match="differ"):
        Credentials(frozenset({"same"}), admin_key="same")


def test_a_handle_is_bound_to_its_address_blocks_and_prompt() -> None:
    key = trust.derive_key(INTERNAL, "kv-handle")
    kv = {
        "remote_engine_id": "e",
        "remote_lease_id": "l",
        "remote_block_ids": [3, 4],
        "remote_num_tokens": 20,
        "remote_addr": "tcp://10.0.0.1:5000",
        "first_token_ids": [7],
    }
    prompt = list(range(20))
    signed = trust.sign_handle(key, kv, prompt)
    assert trust.handle_problem(key, signed, prompt) is None
    assert "not signed" in trust.handle_problem(key, kv, prompt)
    for field, value in [
        ("remote_addr", "tcp://127.0.0.1:6666"),  # finding 1: the attacker's own server
        ("remote_block_ids", [1, 2]),
        ("remote_num_tokens", 48),
        ("first_token_ids", [8]),
    ]:
        assert "does not match" in trust.handle_problem(key, {**signed, field: value}, prompt)
    # blocks computed for another prompt never enter this one's prefix cache
    assert "does not match" in trust.handle_problem(key, signed, [*prompt[:-1], 99])
    other = trust.derive_key("another-secret", "kv-handle")
    assert trust.handle_problem(other, signed, prompt) is not None


# ----- the transport --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def engines(llama_dir: Path):
    cfg = EngineConfig(model=str(llama_dir), kv_cache_tokens=1024, block_size=8)
    return LLMEngine(cfg), LLMEngine(cfg)


def _garbage_cache(engine: LLMEngine) -> KVCache:
    cache = KVCache(
        engine.model_config,
        16,
        engine.kv_cache.block_size,
        engine.kv_cache.dtype,
        torch.device("cpu"),
    )
    cache.data.normal_()
    return cache


def test_decode_reads_blocks_only_from_a_peer_holding_the_secret(engines) -> None:
    prefill, decode = engines
    lease = "lease-1"
    # A fake prefill server speaking the transport protocol, without the internal secret,
    # serving a lease of its own with garbage blocks.
    fake = KVTransportServer(
        _garbage_cache(prefill), lambda _: [1, 2], lambda _: True, layout=prefill.kv_layout
    ).start()
    real = KVTransportServer(
        prefill.kv_cache,
        {lease: [1, 2]}.get,
        lambda _: True,
        layout=prefill.kv_layout,
        key=KEY,
    ).start()
    before = decode.kv_cache.data.clone()
    try:
        client = KVTransportClient(fake.address, timeout_s=5, key=KEY)
        with pytest.raises(TransportError, match="not a trusted peer"):
            client.pull(lease, [1, 2], decode.kv_cache, [5, 6])
        client.close()
        assert torch.equal(decode.kv_cache.data, before)  # nothing written
        # and the real prefill engine answers no one without the secret
        stranger = KVTransportClient(real.address, timeout_s=5)
        with pytest.raises(TransportError, match="unauthenticated"):
            stranger.pull(lease, [1, 2], decode.kv_cache, [5, 6])
        stranger.close()
        assert torch.equal(decode.kv_cache.data, before)
        peer = KVTransportClient(real.address, timeout_s=5, key=KEY)
        peer.pull(lease, [1, 2], decode.kv_cache, [5, 6])
        peer.close()
        assert torch.equal(decode.kv_cache.data[:, :, 5:7], prefill.kv_cache.data[:, :, 1:3])
    finally:
        fake.close()
        real.close()


class HeldPeer:
    """A peer that accepts transport requests and answers none until released (then ERR)."""

    def __init__(self) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.address = f"tcp://127.0.0.1:{self.sock.bind_to_random_port('tcp://127.0.0.1')}"
        self.release = threading.Event()
        self.stop = threading.Event()
        self.received = 0
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        held: list[bytes] = []
        while not self.stop.is_set():
            if self.sock.poll(50):
                ident, *_ = self.sock.recv_multipart()
                self.received += 1
                held.append(ident)
            if self.release.is_set():
                for ident in held:
                    self.sock.send_multipart([ident, b"ERR", b"released"])
                held = []
        self.sock.close()
        self.ctx.term()


def _threads() -> int:
    for line in Path(f"/proc/{os.getpid()}/status").read_text().splitlines():
        if line.startswith("Threads:"):
            return int(line.split()[1])
    raise AssertionError("no Threads line")


def test_one_stalled_peer_cannot_hold_every_pull_worker(engines) -> None:
    prefill, decode = engines
    real = KVTransportServer(
        prefill.kv_cache,
        {"lease-2": [1, 2]}.get,
        lambda _: True,
        layout=prefill.kv_layout,
        key=KEY,
    ).start()
    held = HeldPeer()
    puller = KVPuller(lambda: decode.kv_layout, max_workers=4, timeout_s=60, key=KEY)
    results: dict[str, str | None] = {}
    finished = threading.Event()

    def done(rid: str, error: str | None) -> None:
        results[rid] = error
        if rid == "real":
            finished.set()

    try:
        for i in range(4):  # the four requests at one closed/stalled address
            puller.submit(
                PullTask(f"stall{i}", held.address, "l", "e", [1], [1]), decode.kv_cache, done
            )
        puller.submit(
            PullTask("real", real.address, "lease-2", "e", [1, 2], [5, 6]), decode.kv_cache, done
        )
        assert finished.wait(30), "a real pull waited behind a stalled peer"
        assert results == {"real": None}  # the stalled ones are all still held
        assert torch.equal(decode.kv_cache.data[:, :, 5:7], prefill.kv_cache.data[:, :, 1:3])
        held.release.set()
        wait_until(lambda: len(results) == 5, what="the stalled pulls to fail once released")
        assert all(results[f"stall{i}"] for i in range(4))  # each failed, none hung
        assert puller.num_peers == 1  # the failed peer's socket is closed, the good one kept

        # Every dead address used to keep a ZMQ context (and its I/O thread) forever.
        quick = KVPuller(lambda: decode.kv_layout, timeout_s=0.2, key=KEY)
        start = _threads()
        for _ in range(12):
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            assert quick.connect(f"tcp://127.0.0.1:{port}") is not None
        assert quick.num_peers == 0 and _threads() - start <= 2
        quick.close()
    finally:
        held.release.set()
        held.stop.set()
        puller.close()
        real.close()


# ----- who may call what: the engine ---------------------------------------------------------
ENGINE_ADMIN_ROUTES = [
    ("GET", "/terminate"),
    ("POST", "/sleep"),
    ("POST", "/wakeup"),
    ("POST", "/pause"),
    ("POST", "/resume"),
    ("POST", "/abort_request"),
    ("GET", "/distserve/engine_info"),
    ("POST", "/distserve/p2p_initialize"),
    ("POST", "/distserve/p2p_connect"),
    ("POST", "/distserve/p2p_drop_connect"),
    ("POST", "/distserve/free_cache"),
    ("POST", "/distserve/gc"),
]


@pytest.fixture(scope="module")
def engine_app(llama_dir: Path):
    from transformers import AutoTokenizer

    settings = ServerSettings(
        model_dir=str(llama_dir),
        served_model_name="unit",
        api_key=CLIENT,
        internal_api_key=INTERNAL,
        admin_api_key=ADMIN,
    )
    config = EngineConfig(model=str(llama_dir), kv_cache_tokens=1024, max_model_len=256)
    app = build_app(
        settings,
        lambda: LLMEngine(config),
        tokenizer=AutoTokenizer.from_pretrained(str(llama_dir)),
        vocab_size=1024,
    )
    with TestClient(app) as c:
        assert app.state.tandem.engine.wait_ready(60)
        yield c


def test_a_client_key_reaches_no_engine_admin_route(engine_app) -> None:
    for method, path in ENGINE_ADMIN_ROUTES:
        r = engine_app.request(method, path, json={}, headers=bearer(CLIENT))
        assert r.status_code == 403, (path, r.text)
        assert r.json()["error"]["code"] == "forbidden"
        assert engine_app.request(method, path, json={}).status_code == 401
    # the admin key does reach them (pause/resume: harmless to run)
    for path in ("/pause", "/resume"):
        assert engine_app.post(path, headers=bearer(ADMIN)).status_code == 200
    assert engine_app.get("/distserve/engine_info", headers=bearer(INTERNAL)).status_code == 200


def test_only_the_internal_credential_sends_kv_transfer_params(engine_app) -> None:
    body = {
        "model": "unit",
        "prompt": [5, 6, 7, 8, 9, 10, 11, 12, 13],
        "max_tokens": 4,
        "temperature": 0,
    }
    forged = {
        "do_remote_prefill": True,
        "remote_engine_id": "x",
        "remote_block_ids": [1, 2, 3],
        "remote_num_tokens": 9,
        "remote_lease_id": "l",
        "remote_addr": "tcp://127.0.0.1:9",
        "first_token_ids": [1],
    }
    for key in (CLIENT, ADMIN):
        for route, extra in (
            ("/v1/completions", {}),
            (
                "/v1/chat/completions",
                {"messages": [{"role": "user", "content": "hi"}], "logprobs": True},
            ),
        ):
            r = engine_app.post(
                route,
                json={**body, "logprobs": 1, **extra, "kv_transfer_params": forged},
                headers=bearer(key),
            )
            assert r.status_code == 403 and r.json()["error"]["code"] == "kv_transfer_forbidden"
    # internal, but a handle no prefill engine signed: refused before any pull
    r = engine_app.post(
        "/v1/completions", json={**body, "kv_transfer_params": forged}, headers=bearer(INTERNAL)
    )
    assert r.status_code == 403 and r.json()["error"]["code"] == "untrusted_kv_handle"
    # the genuine flow: a signed handle, used for exactly its prompt
    r = engine_app.post(
        "/v1/completions",
        json={**body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}},
        headers=bearer(INTERNAL),
    )
    handle = r.json()["kv_transfer_params"]
    assert r.status_code == 200 and trust.SIGNATURE_FIELD in handle
    other = {**body, "prompt": [5, 6, 7, 8, 9, 10, 11, 12, 14]}
    r = engine_app.post(
        "/v1/completions", json={**other, "kv_transfer_params": handle}, headers=bearer(INTERNAL)
    )
    assert r.status_code == 403 and "does not match" in r.json()["error"]["message"]
    r = engine_app.post(
        "/v1/completions", json={**body, "kv_transfer_params": handle}, headers=bearer(INTERNAL)
    )
    assert r.status_code == 200, r.text
    plain = engine_app.post("/v1/completions", json=body, headers=bearer(CLIENT))
    assert r.json()["choices"][0]["text"] == plain.json()["choices"][0]["text"]


def test_transport_key_is_derived_not_the_credential() -> None:
    assert transport_key(None) is None and transport_key(INTERNAL) == KEY != INTERNAL.encode()


# ----- who may call what: the proxy ----------------------------------------------------------
PROXY_ADMIN_ROUTES = [
    ("POST", "/nodes/add"),
    ("POST", "/nodes/remove"),
    ("GET", "/nodes/status"),
    ("POST", "/nodes/terminate"),
    ("GET", "/nodes/terminate_all"),
    ("POST", "/nodes/terminate_all"),
    ("POST", "/distserve/connection_warmup"),
    ("POST", "/distserve/gc"),
]


def test_a_client_key_administers_nothing_at_the_proxy() -> None:
    hits: list[bytes] = []
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    listener.settimeout(0.5)
    victim = f"http://127.0.0.1:{listener.getsockname()[1]}"

    def accept() -> None:
        try:
            conn, _ = listener.accept()
            hits.append(conn.recv(100))
            conn.close()
        except OSError:
            pass

    app = build_proxy(
        ProxySettings(
            api_key=CLIENT, credentials=Credentials(internal_key=INTERNAL, admin_key=ADMIN)
        )
    )
    body = {"url": victim, "status": {"role": "decode"}}
    for method, path in PROXY_ADMIN_ROUTES:
        r = call_app(app, method, path, json=body, headers=bearer(CLIENT))
        assert r.status_code == 403, (path, r.text)
        assert call_app(app, method, path, json=body).status_code == 401
    watcher = threading.Thread(target=accept)
    watcher.start()
    # no SSRF even for the admin: only a registered engine is terminated, nothing is fetched
    r = call_app(app, "POST", "/nodes/terminate", json={"url": victim}, headers=bearer(ADMIN))
    watcher.join()
    listener.close()
    assert r.status_code == 404 and r.json()["error"]["code"] == "node_not_found" and not hits
    assert call_app(app, "GET", "/nodes/status", headers=bearer(INTERNAL)).status_code == 200
    # kv_transfer_params is never a client's to send, whoever asks
    for key in (CLIENT, ADMIN):
        r = call_app(
            app,
            "POST",
            "/v1/completions",
            json={"prompt": "x", "kv_transfer_params": {"do_remote_prefill": True}},
            headers=bearer(key),
        )
        assert r.status_code == 403 and r.json()["error"]["code"] == "kv_transfer_forbidden"


def test_a_proxy_without_client_keys_serves_keyless_clients_and_nothing_more() -> None:
    """`tandem up` with no --api-key: clients need no key, the admin and internal planes
    stay closed, and kv_transfer_params is still refused."""
    app = build_proxy(ProxySettings(credentials=Credentials(internal_key=INTERNAL)))
    for headers in ({}, bearer("EMPTY")):
        assert call_app(app, "GET", "/v1/models", headers=headers).status_code == 200
        for method, path in PROXY_ADMIN_ROUTES:
            r = call_app(app, method, path, json={"url": "http://127.0.0.1:1"}, headers=headers)
            assert r.status_code == 401, (path, r.text)
        r = call_app(
            app,
            "POST",
            "/v1/completions",
            json={"prompt": "x", "kv_transfer_params": {"do_remote_prefill": True}},
            headers=headers,
        )
        assert r.status_code == 403
    assert call_app(app, "GET", "/nodes/status", headers=bearer(INTERNAL)).status_code == 200


def test_keyless_callers_reach_an_engine_only_when_it_is_no_pd_back_end() -> None:
    back_end = ServerSettings(model_dir="m", served_model_name="m", internal_api_key=INTERNAL)
    assert back_end.credentials.principal(b"") is None
    assert back_end.credentials.principal(bearer(INTERNAL)["Authorization"].encode()) == "internal"
    admin_only = ServerSettings(model_dir="m", served_model_name="m", admin_api_key=ADMIN)
    assert admin_only.credentials.principal(b"Bearer EMPTY") == "anonymous"
    assert admin_only.credentials.principal(bearer(ADMIN)["Authorization"].encode()) == "admin"
