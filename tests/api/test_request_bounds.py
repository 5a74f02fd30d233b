"""Issue 26 ("No client can hurt another", items 5 and 6): grammar compiles bounded in size
and time, log lines a client cannot forge, sessions capped per key, expired P/D leases
reclaimed without traffic. Unit tests first, then one real engine on loopback."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import threading
import time
from concurrent.futures import Future
from pathlib import Path

import httpx
import pytest

from tandem.server.api.generation import _await_compile
from tandem.server.engine import LLMEngine, SamplingParams
from tandem.server.engine.config import EngineConfig
from tandem.server.engine.grammar_limits import GrammarError, check_size
from tandem.server.engine.structured import GrammarCache, GrammarSpec
from tandem.server.logsafe import EscapeControls, escape_controls
from tandem.server.wire.errors import APIError

from ..engine.utils import drain
from ..proxy.utils import ProxyProcess, stop_all
from ..utils import ENGINE_FLAGS, ServerProcess, wait_until

pytestmark = pytest.mark.timeout(300)

KEY_A, KEY_B = "sk-bounds-a", "sk-bounds-b"
INTERNAL = "sk-bounds-internal"


def _properties(n: int) -> dict:
    """An object schema of ``n`` optional string properties: what makes xgrammar slow."""
    return {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(n)}}


# ----- A: grammar size and time ------------------------------------------------------------------
@pytest.mark.parametrize(
    "kind, source",
    [
        ("json_schema", json.dumps(_properties(10_000))),
        ("json_schema", "[" * 100 + "]" * 100),
        ("json_schema", json.dumps({"type": "string", "description": "x" * 300_000})),
        ("regex", "a" * 20_000),
        ("choice", json.dumps([f"c{i}" for i in range(2_000)])),
        ("grammar", 'root ::= "' + "a" * 300_000 + '"'),
    ],
)
def test_a_grammar_over_the_limits_is_refused_before_compiling(kind: str, source: str) -> None:
    with pytest.raises(GrammarError) as err:
        check_size(kind, source)
    assert err.value.code == "grammar_too_large" and "limit" in str(err.value)


def test_real_schemas_are_within_the_limits() -> None:
    check_size("json_schema", json.dumps(_properties(500)))
    nested: dict = {"type": "integer"}
    for _ in range(20):
        nested = {"type": "object", "properties": {"a": nested}, "required": ["a"]}
    check_size("json_schema", json.dumps(nested))
    check_size("regex", r"[a-z]{3}-[0-9]{2}")


def test_a_compile_nobody_waits_for_is_cancelled_before_it_starts(llama_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(llama_dir)
    cache = GrammarCache(tok, len(tok), [])
    busy = threading.Event()
    try:
        cache._executor.submit(busy.wait)  # the compile thread, busy until released
        spec = GrammarSpec("regex", "[a-z]+")
        fut = cache.acquire(spec)
        assert cache.acquire(spec) is fut  # a second waiter shares it
        cache.release(spec)
        assert not fut.cancelled()  # one waiter is still there
        cache.release(spec)
        assert fut.cancelled() and cache.submit(spec) is not fut
    finally:
        busy.set()
        cache.close()


def test_a_compile_over_its_budget_is_a_400() -> None:
    never: Future = Future()
    with pytest.raises(APIError) as err:
        asyncio.run(_await_compile(never, 0.2, None))
    assert err.value.status == 400 and err.value.code == "grammar_timeout"
    assert not never.cancelled()  # the cache's future is left to the cache


# ----- a real engine ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def plane(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """One engine with two client keys (logging at info, so every request is a line) and a
    proxy in front of it."""
    logs = tmp_path_factory.mktemp("bounds")
    keys = logs / "keys"
    keys.write_text(f"{KEY_A}\n{KEY_B}\n")
    internal = {"TANDEM_INTERNAL_API_KEY": INTERNAL}
    server = ServerProcess(
        str(llama_dir),
        *ENGINE_FLAGS,
        "--api-key-file",
        str(keys),
        "--log-level",
        "info",
        "--kv-lease-seconds",
        "2",
        api_key=KEY_A,
        env=internal,
        log_path=logs / "engine.log",
    )
    proxy = ProxyProcess(
        "--node", server.url, "--log-level", "info", env=internal, log_path=logs / "proxy.log"
    )
    try:
        server.wait_ready()
        proxy.wait_healthy([server.url])
        yield server, proxy
    finally:
        stop_all([proxy, server])


@pytest.fixture(scope="module")
def engine(plane) -> ServerProcess:
    return plane[0]


def _completion(server: ServerProcess, key: str = KEY_A, timeout: float = 60, **extra):
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 2, **extra}
    return httpx.post(
        server.url + "/v1/completions",
        json=body,
        headers={"Authorization": f"Bearer {key}"},
        timeout=timeout,
    )


def test_an_oversize_schema_is_a_400_in_the_api_shape(engine: ServerProcess) -> None:
    r = _completion(engine, guided_json=_properties(10_000))
    assert r.status_code == 400, r.text[:300]
    err = r.json()["error"]
    assert set(err) == {"message", "type", "code", "param"}
    assert err["code"] == "grammar_too_large"


def test_a_client_leaving_a_long_compile_leaves_the_server_serving(engine: ServerProcess) -> None:
    """1,000 optional properties: within the limits, seconds to compile on the tiny model. Its
    client leaves at once; the server answers another client (plain and constrained) meanwhile."""
    with pytest.raises(httpx.TimeoutException):
        _completion(engine, timeout=0.5, guided_json=_properties(1_000))
    started = time.monotonic()
    assert _completion(engine, key=KEY_B).status_code == 200
    assert time.monotonic() - started < 30
    small = {"type": "object", "properties": {"a": {"type": "integer"}}}
    assert _completion(engine, key=KEY_B, guided_json=small).status_code == 200
    assert engine.health()["active_requests"] == 0


# ----- C: log lines a client cannot forge --------------------------------------------------------
def test_control_characters_are_escaped_in_every_record() -> None:
    assert escape_controls("a\nb\rc\x1b[31m\u2028d") == "a\\x0ab\\x0dc\\x1b[31m\\u2028d"
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.addFilter(EscapeControls())
    logger = logging.getLogger("tandem.test.logsafe")
    logger.addHandler(handler)
    try:
        logger.warning("GET %s %d", "/v1/models\nFAKE LINE", 404)
    finally:
        logger.removeHandler(handler)
    assert stream.getvalue() == "GET /v1/models\\x0aFAKE LINE 404\n"


@pytest.mark.parametrize("which", [0, 1], ids=["engine", "proxy"])
def test_an_encoded_newline_in_the_path_forges_no_log_line(plane, which: int) -> None:
    server = plane[which]
    for path in ("/v1/models%0aFAKE%20LINE", "/v1/models%0d%0aFAKE%20LINE2", "/x%E2%80%A8FAKE3"):
        httpx.get(server.url + path, timeout=10)  # no key: a 401 or 404, logged all the same
    wait_until(lambda: "FAKE3" in server.log_tail(200_000), timeout=10, what="the lines logged")
    lines = server.log_tail(200_000).splitlines()
    assert not [line for line in lines if line.startswith("FAKE")]
    assert any("/v1/models\\x0aFAKE LINE" in line for line in lines)


# ----- B: sessions capped per key ----------------------------------------------------------------
def _session_engine(llama_dir: Path, per_key: int) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model=str(llama_dir),
            kv_cache_tokens=64 * 16,
            max_model_len=256,
            max_num_seqs=8,
            session_kv_fraction=1.0,
            max_sessions_per_key=per_key,
        )
    )


def _turn(engine: LLMEngine, session: str, i: int) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    engine.add_request(f"r{i}", [7 + i] + list(range(100, 130)), params, session_id=session)
    drain(engine)


def test_one_key_evicts_only_its_own_sessions(llama_dir: Path) -> None:
    """Key B keeps its session while key A opens session after session, past its own cap and
    past the store's: A's oldest go, B's stays with its blocks."""
    engine = _session_engine(llama_dir, per_key=3)
    engine.sessions.max_sessions = 5
    _turn(engine, "keyB:chat", 0)
    b_blocks = list(engine.sessions._sessions["keyB:chat"].block_ids)
    for i in range(1, 9):
        _turn(engine, f"keyA:s{i}", i)
    names = list(engine.sessions._sessions)
    assert "keyB:chat" in names and engine.sessions._sessions["keyB:chat"].block_ids == b_blocks
    assert [n for n in names if n.startswith("keyA:")] == ["keyA:s6", "keyA:s7", "keyA:s8"]
    for i, key in enumerate(("keyC", "keyD", "keyE"), start=20):  # the store fills up
        _turn(engine, f"{key}:x", i)
    assert len(engine.sessions) <= 5 and "keyB:chat" in engine.sessions  # A (largest) gave
    engine.sessions.expire(0.0)
    engine.kv.pool.check_all_free()


# ----- D: an expired lease is reclaimed without traffic ------------------------------------------
def test_an_expired_lease_is_reclaimed_on_an_idle_engine(engine: ServerProcess) -> None:
    """A prefill whose decode engine never pulls: with no request after it, /health shows
    every block free once the lease (2 s here) has expired; a generous bound, no race."""
    engine.wait_idle(timeout=30)
    r = httpx.post(
        engine.url + "/v1/completions",
        json={
            "model": "tiny",
            "prompt": "a prompt long enough to fill some blocks " * 4,
            "max_tokens": 1,
            "kv_transfer_params": {"do_remote_decode": True},
        },
        headers={"Authorization": f"Bearer {INTERNAL}"},
        timeout=60,
    )
    assert r.status_code == 200, r.text[:300]
    pool = engine.health()["block_pool"]
    assert pool["free_blocks"] < pool["total_blocks"]  # held by the lease
    engine.wait_idle(timeout=15)


def test_the_idle_loop_wakes_at_the_next_lease_expiry() -> None:
    from tandem.server.engine.block_pool import BlockPool
    from tandem.server.engine.leases import LeaseStore

    leases = LeaseStore(BlockPool(8, None), ttl_seconds=0.3)
    assert leases.next_expiry() is None
    before = time.monotonic()
    leases.grant([])
    expiry = leases.next_expiry()
    assert expiry is not None and before + 0.3 <= expiry <= time.monotonic() + 0.3
    assert leases.sweep(now=expiry) == 1 and leases.next_expiry() is None


# ----- E: the OpenAPI document says what validation does ----------------------------------------
def _schema(doc: dict, name: str) -> dict:
    return doc["components"]["schemas"][name]


def test_the_openapi_ranges_are_the_ones_validation_applies(plane) -> None:
    engine, proxy = plane
    auth = {"Authorization": f"Bearer {KEY_A}"}
    doc = httpx.get(engine.url + "/openapi.json", headers=auth, timeout=10).json()
    top_p = _schema(doc, "CompletionRequest")["properties"]["top_p"]["anyOf"][0]
    assert top_p["exclusiveMinimum"] == 0 and top_p["maximum"] == 1
    assert _schema(doc, "GenerateRequest")["properties"]["input_ids"]["anyOf"][0]["minItems"] == 1
    assert _schema(doc, "CompletionRequest")["additionalProperties"] is True  # ignored, logged
    r = _completion(engine, top_p=0)
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_p"
    pdoc = httpx.get(proxy.url + "/openapi.json", headers=proxy.headers, timeout=10).json()
    for path in ("/tokenize", "/generate", "/v1/embeddings", "/nodes/add", "/abort_request"):
        assert "requestBody" in pdoc["paths"][path]["post"], path


@pytest.mark.parametrize("which", [0, 1], ids=["engine", "proxy"])
def test_an_unsupported_method_on_an_admin_route_is_a_405_before_auth(plane, which) -> None:
    server = plane[which]
    path = "/pause" if which == 0 else "/nodes/add"
    for headers in ({}, {"Authorization": f"Bearer {KEY_A}"}):
        r = httpx.request("TRACE", server.url + path, headers=headers, timeout=10)
        assert r.status_code == 405 and "POST" in r.headers["allow"], r.text
    assert httpx.post(server.url + path, timeout=10).status_code == 401  # the method it has
