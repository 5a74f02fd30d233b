"""Issue 16: no 5xx for any input, sessions scoped to their key and bounded as a cache.

The bad inputs the issue lists, sent raw (so ``NaN`` and lone surrogates reach the server
as a client could send them) to an engine and to a proxy in front of it, all real processes
on loopback; and the session store on a small pool, on the engine itself.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tandem.server.api.chat_history import ChatHistories
from tandem.server.engine import LLMEngine, SamplingParams
from tandem.server.engine.config import EngineConfig
from tandem.server.proxy.app import build_app
from tandem.server.proxy.state import ProxySettings

from ..engine.utils import drain
from ..proxy.utils import ProxyProcess, stop_all
from ..utils import ENGINE_FLAGS, ServerProcess, held, wait_until

pytestmark = pytest.mark.timeout(300)

INTERNAL, ADMIN = "sk-internal-robust", "sk-admin-robust"
KEY_A, KEY_B = "sk-client-a", "sk-client-b"


# ----- sessions are a cache on a small pool ----------------------------------------------------
def _small_engine(llama_dir: Path, fraction: float) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model=str(llama_dir),
            kv_cache_tokens=32 * 16,  # 32 blocks of 16
            max_model_len=256,
            max_num_seqs=8,
            session_kv_fraction=fraction,
        )
    )


def _fill_sessions(engine: LLMEngine, count: int) -> SamplingParams:
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    for i in range(count):  # 60 + 4 tokens: 4 blocks each
        engine.add_request(f"s{i}", [7 + i] + list(range(100, 159)), params, session_id=f"c{i}")
        drain(engine)
    return params


def test_idle_sessions_hold_at_most_their_share_of_the_pool(llama_dir: Path) -> None:
    engine = _small_engine(llama_dir, 0.5)
    params = _fill_sessions(engine, 8)  # 32 blocks wanted, 16 allowed
    store = engine.sessions
    assert store.max_blocks == 16
    assert store.held_blocks <= 16
    assert len(engine.sessions) == 8  # the sessions stay; only their blocks went
    held = sum(len(s.block_ids) for s in store._sessions.values())
    assert held == store.held_blocks
    # the oldest session lost its blocks: its next turn recomputes and answers as stateless
    prompt = [7] + list(range(100, 159)) + list(range(200, 210))
    engine.add_request("again", prompt, params, session_id="c0")
    out = drain(engine)["again"]
    engine.kv.pool.reset_prefix_cache()
    engine.add_request("ref", prompt, params)
    assert drain(engine)["ref"].token_ids == out.token_ids
    assert engine.sessions.expire(0.0) == 8
    engine.kv.pool.check_all_free()


def test_a_request_never_waits_on_session_blocks(llama_dir: Path) -> None:
    engine = _small_engine(llama_dir, 1.0)  # sessions may take the whole pool
    params = _fill_sessions(engine, 7)  # 28 of 32 blocks held by idle sessions
    assert engine.kv.pool.num_free <= 4
    big = list(range(300, 500))  # 200 + 8 tokens: 13 blocks
    engine.add_request("big", big, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    engine.step()
    assert [r.request_id for r in engine.scheduler.running] == ["big"]  # admitted at once
    assert drain(engine)["big"].token_ids
    assert engine.sessions.held_blocks <= 32 - 13
    del params
    engine.sessions.expire(0.0)
    engine.kv.pool.check_all_free()


def test_sessions_are_bounded_in_number_too(llama_dir: Path) -> None:
    """A client opening a new session per request (the soak's growth, issue 16) leaves at
    most ``max_sessions`` behind, not a TTL's worth: the least recently used idle one goes,
    blocks and all, and every block is free once they expire."""
    engine = _small_engine(llama_dir, 1.0)
    engine.sessions.max_sessions = 3
    _fill_sessions(engine, 6)  # c0 .. c5, one after another
    assert list(engine.sessions._sessions) == ["c3", "c4", "c5"]
    held = sum(len(s.block_ids) for s in engine.sessions._sessions.values())
    assert held == engine.sessions.held_blocks > 0
    assert engine.kv.pool.num_free == engine.kv.pool.num_blocks - 1 - held
    assert engine.sessions.expire(0.0) == 3
    engine.kv.pool.check_all_free()


def test_the_prefix_cache_index_is_bounded_by_the_pool(llama_dir: Path) -> None:
    """What a soak's heap grows by, request after request (tracemalloc, issue 16): one
    prefix-cache entry per full block computed. It stops at one entry per block of the pool:
    a block's entry goes when the block is reused."""
    engine = _small_engine(llama_dir, 0.5)
    cache = engine.kv.prefix_cache
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    sizes = []
    for i in range(40):  # 40 distinct 64-token prompts: 4 full blocks each, 160 in all
        engine.add_request(f"p{i}", [3 + i] + list(range(500 + i, 563 + i)), params)
        drain(engine)
        sizes.append(len(cache))
    assert max(sizes) <= engine.kv.pool.num_blocks - 1
    assert sizes[-1] == sizes[-10] > sizes[0]  # saturated: flat, not growing
    engine.kv.pool.check_all_free()


def test_chat_histories_are_bounded_in_number() -> None:
    histories = ChatHistories(ttl_seconds=600.0, capacity=2)
    turn = [{"role": "user", "content": "hi"}]
    for sid in ("a", "b", "c"):
        histories.record(sid, turn, "hello")
    assert histories.resolve("a", turn) == turn  # forgotten: the turn is the conversation
    reply = {"role": "assistant", "content": "hello"}
    assert histories.resolve("c", turn) == [*turn, reply, *turn]  # remembered: appended to
    histories.record("b", turn, "again")  # b is now the most recent; c the oldest
    histories.record("d", turn, "hello")
    assert histories.resolve("c", turn) == turn
    assert histories.drop("b") and histories.drop("d") and not histories.drop("c")


# ----- bad inputs at the engine and the proxy --------------------------------------------------
@pytest.fixture(scope="module")
def plane(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """One aggregated engine with two client keys, and a proxy in front of it."""
    logs = tmp_path_factory.mktemp("robust")
    keys = logs / "keys"
    keys.write_text(f"{KEY_A}\n{KEY_B}\n")
    internal = {"TANDEM_INTERNAL_API_KEY": INTERNAL}
    engine = ServerProcess(
        str(llama_dir),
        *ENGINE_FLAGS,
        "--api-key-file",
        str(keys),
        api_key=KEY_A,
        admin_key=ADMIN,
        env=internal,
        log_path=logs / "engine.log",
    )
    proxy = ProxyProcess(
        "--node",
        engine.url,
        "--api-key-file",
        str(keys),
        api_key=KEY_A,
        admin_key=ADMIN,
        env=internal,
        log_path=logs / "proxy.log",
    )
    try:
        engine.wait_ready()
        proxy.wait_healthy([engine.url])
        yield engine, proxy
    finally:
        stop_all([proxy, engine])


def _raw(url: str, path: str, body: str, key: str = KEY_A, ctype: str = "application/json"):
    return httpx.post(
        url + path,
        content=body.encode("utf-8", "surrogatepass"),
        headers={"Authorization": f"Bearer {key}", "Content-Type": ctype},
        timeout=60,
    )


def _is_error(r: httpx.Response, status: int = 400, what: str = "") -> dict:
    assert r.status_code == status, (what, r.text[:500])
    err = r.json()["error"]
    assert set(err) == {"message", "type", "code", "param"} and err["message"]
    return err


CHAT = '{"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]'
COMPLETION = '{"model": "tiny", "max_tokens": 2, "prompt": "hi"'

BAD_BODIES = {
    "nan temperature": COMPLETION + ', "temperature": NaN}',
    "infinite temperature": COMPLETION + ', "temperature": Infinity}',
    "1e308 temperature": COMPLETION + ', "temperature": 1e308}',
    "-infinite top_p": COMPLETION + ', "top_p": -Infinity}',
    "lone surrogate": '{"model": "tiny", "max_tokens": 2, "prompt": "a\\ud800b"}',
    "lone low surrogate in a key": COMPLETION + ', "\\udc00": 1}',
    "10,000 deep": COMPLETION + ', "x": ' + "[" * 10_000 + "]" * 10_000 + "}",
    "10,000 stop strings": COMPLETION + ', "stop": ' + json.dumps(["s"] * 10_000) + "}",
    "1 MB stop string": COMPLETION + ', "stop": ' + json.dumps("s" * 1_000_000) + "}",
    "n of a million": COMPLETION + ', "n": 1000000}',
    "2,000 logit_bias entries": COMPLETION
    + ', "logit_bias": '
    + json.dumps({str(i): 1.0 for i in range(2000)})
    + "}",
    "newline session id": COMPLETION + ', "session_id": "a\\nb"}',
    "token id over int64, echoed": COMPLETION[: COMPLETION.index(', "prompt"')]
    + ', "echo": true, "prompt": [[1, 69841568264764841984]]}',
    "negative token id": COMPLETION[: COMPLETION.index(', "prompt"')] + ', "prompt": [-3]}',
}

BAD_CHATS = {
    "wizard role": '{"model": "tiny", "messages": [{"role": "wizard", "content": "hi"}]}',
    "5,000 messages": '{"model": "tiny", "messages": '
    + json.dumps([{"role": "user", "content": "x"}] * 5000)
    + "}",
    "200 tools": CHAT
    + ', "tools": '
    + json.dumps([{"type": "function", "function": {"name": f"f{i}"}} for i in range(200)])
    + "}",
}


@pytest.mark.parametrize("server", ["engine", "proxy"])
def test_every_bad_input_is_a_400(plane, server: str) -> None:
    url = plane[0 if server == "engine" else 1].url
    for what, body in BAD_BODIES.items():
        err = _is_error(_raw(url, "/v1/completions", body), what=what)
        assert err["type"] == "invalid_request_error", what
    for what, body in BAD_CHATS.items():
        _is_error(_raw(url, "/v1/chat/completions", body), what=what)
    # the same model at both: the field is named the same way
    err = _is_error(_raw(url, "/v1/completions", COMPLETION + ', "temperature": 1e308}'))
    assert err["param"] == "temperature"
    # LMDeploy's form of messages stays accepted
    r = _raw(url, "/v1/chat/completions", '{"model": "tiny", "max_tokens": 2, "messages": "hi"}')
    assert r.status_code == 200, r.text
    # a body that is not JSON by its media type
    _is_error(_raw(url, "/v1/completions", COMPLETION + "}", ctype="text/plain"), 415)
    r = httpx.delete(url + "/v1/sessions/%0A", headers={"Authorization": f"Bearer {KEY_A}"})
    assert 400 <= r.status_code < 500, r.text


# Every route that takes a body, not only the OpenAI ones (found by an outside-in run: the
# proxy re-encoded 1e999 into a 500, and Ollama's and /tokenize's messages took any role).
OTHER_ROUTES_BAD = {
    "/v1/chat/completions": CHAT + ', "metadata": {"x": 1e999}}',
    "/v1/completions": COMPLETION + ', "unknown": -1e999}',
    "/generate": '{"prompt": "hi", "temperature": 1e999}',
    "/api/generate": '{"model": "tiny", "prompt": "hi", "options": {"temperature": 1e999}}',
    "/api/chat": '{"model": "tiny", "messages": [{"role": "wizard", "content": "hi"}]}',
    "/tokenize": '{"model": "tiny", "messages": [{"role": "wizard", "content": "hi"}]}',
    "/pooling": '{"model": "tiny", "input": "hi", "x": 1e999}',
    "/api/show": '{"model": "tiny", "x": 1e999}',
}


@pytest.mark.parametrize("server", ["engine", "proxy"])
def test_every_route_refuses_bad_input_with_a_4xx(plane, server: str) -> None:
    url = plane[0 if server == "engine" else 1].url
    for path, body in OTHER_ROUTES_BAD.items():
        _is_error(_raw(url, path, body), what=path)
    stops = json.dumps({"model": "tiny", "prompt": "hi", "options": {"stop": ["s"] * 10_000}})
    _is_error(_raw(url, "/api/generate", stops), what="10,000 Ollama stop strings")
    # no Content-Type at all: a 415 that says what to send (FastAPI would not parse it)
    r = httpx.post(
        url + "/v1/completions",
        content=(COMPLETION + "}").encode(),
        headers={"Authorization": f"Bearer {KEY_A}"},
    )
    assert "Content-Type" in _is_error(r, 415)["message"]
    assert httpx.get(url + "/health").status_code == 200


def test_a_weights_path_the_os_refuses_is_not_found(plane) -> None:
    """A file name over the OS's limit made ``Path.exists`` raise (a 500 at the fuzz)."""
    engine, _ = plane
    body = json.dumps({"model_path": "0" * 3000})
    err = _is_error(_raw(engine.url, "/update_weights", body, key=ADMIN), 404)
    assert err["code"] == "weights_not_found"


def test_p2p_connect_with_an_empty_address_is_a_400(plane) -> None:
    engine, _ = plane
    body = json.dumps({"remote_engine_id": "x", "remote_engine_endpoint_info": {"zmq_address": ""}})
    err = _is_error(_raw(engine.url, "/distserve/p2p_connect", body, key=INTERNAL))
    assert err["param"].startswith("remote_engine_endpoint_info")


@pytest.mark.parametrize("server", ["engine", "proxy"])
def test_a_session_belongs_to_the_key_that_made_it(plane, server: str) -> None:
    engine, proxy = plane
    url = (engine if server == "engine" else proxy).url
    sid = f"mine-{server}"
    turn = json.dumps(
        {
            "model": "tiny",
            "max_tokens": 2,
            "temperature": 0,
            "session_id": sid,
            "messages": [{"role": "user", "content": "remember the word avocado"}],
        }
    )
    first = _raw(url, "/v1/chat/completions", turn, key=KEY_A).json()
    again_a = _raw(url, "/v1/chat/completions", turn, key=KEY_A).json()
    as_b = _raw(url, "/v1/chat/completions", turn, key=KEY_B).json()
    # A's second turn carries A's history; B's "same" session starts empty
    assert again_a["usage"]["prompt_tokens"] > first["usage"]["prompt_tokens"]
    assert as_b["usage"]["prompt_tokens"] == first["usage"]["prompt_tokens"]
    gone = httpx.delete(f"{url}/v1/sessions/{sid}", headers={"Authorization": f"Bearer {KEY_B}"})
    assert gone.status_code == 200  # B deletes its own session of that name ...
    again_b = httpx.delete(f"{url}/v1/sessions/{sid}", headers={"Authorization": f"Bearer {KEY_B}"})
    _is_error(again_b, 404)  # ... and cannot reach A's
    ok = httpx.delete(f"{url}/v1/sessions/{sid}", headers={"Authorization": f"Bearer {KEY_A}"})
    assert ok.status_code == 200, ok.text
    engine.wait_idle()


# ----- what the proxy fuzz found ---------------------------------------------------------------
@pytest.mark.parametrize("server", ["engine", "proxy"])
def test_a_content_part_with_null_text_is_a_400(plane, server: str) -> None:
    """The proxy estimated the prompt's length from ``"".join(part["text"])`` and a part with
    ``"text": null`` (or on Ollama's chat route, unvalidated) was a 500 there."""
    url = plane[0 if server == "engine" else 1].url
    for part in ({"type": "text", "text": None}, {"type": "image_url", "text": None}):
        messages = [{"role": "user", "content": [part]}]
        body = json.dumps({"model": "tiny", "max_tokens": 1, "messages": messages})
        _is_error(_raw(url, "/v1/chat/completions", body), what=str(part))
        r = _raw(url, "/api/chat", json.dumps({"model": "tiny", "messages": messages}))
        assert 400 <= r.status_code < 500, (part, r.status_code, r.text[:300])


@pytest.mark.parametrize("server", ["engine", "proxy"])
def test_the_openapi_document_names_each_operation_once(plane, server: str) -> None:
    """Operation ids are unique (``/nodes/terminate_all`` took one id for GET and POST) and
    ``/metrics`` documents the content type it answers with."""
    target = plane[0 if server == "engine" else 1]
    spec = httpx.get(target.url + "/openapi.json", headers=target.admin_headers).json()
    ops = [(m, p, op["operationId"]) for p, item in spec["paths"].items() for m, op in item.items()]
    ids = [i for _, _, i in ops]
    assert len(ids) == len(set(ids)), sorted(i for i in ids if ids.count(i) > 1)
    metrics = spec["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    assert list(metrics) == ["text/plain"]
    r = httpx.get(target.url + "/metrics", headers=target.admin_headers)
    assert r.headers["content-type"].split(";")[0] == "text/plain"
    if server == "proxy":  # one route, two methods, two operations; its 405 allows both
        assert {"get", "post"} <= set(spec["paths"]["/nodes/terminate_all"])
        r = httpx.put(target.url + "/nodes/terminate_all", headers=target.admin_headers)
        assert r.status_code == 405
        assert {m.strip() for m in r.headers["allow"].split(",")} == {"GET", "POST"}


def test_p2p_connect_to_an_address_zmq_cannot_use_is_a_400(plane) -> None:
    """Found by the fuzz: a port above 65535 (or a host ZMQ cannot parse) was a 502."""
    engine, _ = plane
    for address in ("tcp://127.0.0.1:99999", "tcp://127.0.0.1:0", "tcp://*:5555"):
        info = {"zmq_address": address}
        body = json.dumps({"remote_engine_id": "x", "remote_engine_endpoint_info": info})
        err = _is_error(
            _raw(engine.url, "/distserve/p2p_connect", body, key=INTERNAL), what=address
        )
        assert err["param"].startswith("remote_engine_endpoint_info"), address


def test_deleting_a_session_on_an_engine_that_does_not_answer_is_a_503_not_a_404() -> None:
    """Found by the soak: a DELETE the holding engine answered after the proxy's timeout
    came back 404 ("does not exist") for a session that existed."""
    with socket.socket() as silent:  # accepts, then closes without a word
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        threading.Thread(target=lambda: silent.accept()[0].close(), daemon=True).start()
        app = build_app(ProxySettings(static_nodes=[(url, "decode")]))
        app.state.proxy.flow.sessions.set("s1", url)

        async def delete() -> httpx.Response:
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://proxy") as c:
                return await c.delete("/v1/sessions/s1")

        err = _is_error(asyncio.run(delete()), 503)
        assert err["code"] == "no_engine_available" and url in err["message"]


def test_update_weights_for_a_model_nobody_serves_is_a_404(plane) -> None:
    """Found by the fuzz: the proxy answered 503 ("no healthy engine") for a model name no
    engine has, as if the service were down."""
    _, proxy = plane
    body = json.dumps({"model": "no-such-model", "model_path": "/nowhere"})
    err = _is_error(_raw(proxy.url, "/update_weights", body, key=ADMIN), 404)
    assert (err["code"], err["param"]) == ("model_not_found", "model")


# ----- one client's request cannot fail another's (issue 26, item 1) --------------------------
# Each used to crash the engine step (an out-of-range token, or none allowed) and with it every
# key's requests in flight. Now: the first two are served, the schema is a 400 before it
# reaches the engine, and the grammar that runs out of tokens ends its own request alone.
HOSTILE: dict[str, dict[str, Any]] = {
    "temperature 1e-300": {"temperature": 1e-300},
    "repetition_penalty 1e-300": {"extra_body": {"repetition_penalty": 1e-300}},
    "a schema that is only a reference to itself": {
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "loop", "schema": {"$ref": "#"}},
        }
    },
    "a grammar that ends before min_tokens": {
        "max_tokens": 40,
        "extra_body": {"guided_choice": ["yes"], "min_tokens": 30},
    },
}
EXPECTED = {
    "temperature 1e-300": "length",
    "repetition_penalty 1e-300": "length",
    "a schema that is only a reference to itself": "invalid_schema",
    "a grammar that ends before min_tokens": "no_token_allowed",
}
STREAMED = {
    "model": "tiny",
    "messages": [{"role": "user", "content": "tell me about caches"}],
    "max_tokens": 48,
    "temperature": 0.0,
    "extra_body": {"ignore_eos": True},
}


def _client(url: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=120)


def _stream(client: openai.OpenAI) -> tuple[str, list[str]]:
    """The streamed text and every finish reason the stream reported."""
    chunks = list(client.chat.completions.create(stream=True, **STREAMED))
    choices = [c.choices[0] for c in chunks if c.choices]
    return "".join(c.delta.content or "" for c in choices), [
        c.finish_reason for c in choices if c.finish_reason
    ]


def _hostile(client: openai.OpenAI, kwargs: dict[str, Any], stream: bool) -> str:
    """How the request ended: its finish reason, or its error's code (raised in-band for a
    stream, as an HTTP status otherwise)."""
    body = {**STREAMED, "max_tokens": 8, "temperature": 1.0, **kwargs}
    body["extra_body"] = {"ignore_eos": True, **kwargs.get("extra_body", {})}
    try:
        if not stream:
            return client.chat.completions.create(**body).choices[0].finish_reason
        chunks = list(client.chat.completions.create(stream=True, **body))
        return [c.choices[0].finish_reason for c in chunks if c.choices][-1]
    except openai.APIError as err:
        assert isinstance(err, openai.BadRequestError) or stream, err
        return err.code or ""


@pytest.mark.parametrize("via", ["engine", "proxy"])
def test_a_failing_request_never_fails_another_keys_stream(plane, via: str) -> None:
    engine, proxy = plane
    url = engine.url if via == "engine" else proxy.url
    a, b = _client(url, KEY_A), _client(url, KEY_B)
    reference = _stream(a)
    assert reference[1] == ["length"] and reference[0]
    with ThreadPoolExecutor(1 + 2 * len(HOSTILE)) as pool:
        with held(engine):  # all of them admitted before any step: they share every step
            first = pool.submit(_stream, a)
            ends = {
                (name, stream): pool.submit(_hostile, b, kwargs, stream)
                for name, kwargs in HOSTILE.items()
                for stream in (False, True)
            }
            schema = "a schema that is only a reference to itself"
            assert ends[(schema, False)].result() == ends[(schema, True)].result()
            wait_until(
                lambda: engine.health()["pending_requests"] == 1 + 2 * (len(HOSTILE) - 1),
                what="every request admitted",
            )
        assert first.result() == reference
        for (name, stream), end in ends.items():
            assert end.result() == EXPECTED[name], (name, stream)
    engine.wait_idle()
    assert _stream(a) == reference  # and the server keeps serving
