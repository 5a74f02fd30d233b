"""The serving surface beyond chat/completions (docs/routes.md): token routes, model retrieval,
Ollama's routes (with the official ``ollama`` client), X-Request-Id, CORS, the body limit and
``/abort_request``, on an engine and through the proxy in both modes (aggregated over one
``both`` engine; P/D over a prefill and that engine)."""

from __future__ import annotations

import json
import shutil
import subprocess
import threading

import httpx
import ollama
import openai
import pytest

from bench.big_body import polls

from ..proxy.utils import FRONTS, engine_and_proxies, front_of, openai_client
from ..utils import ENGINE_FLAGS, held, wait_until

pytestmark = pytest.mark.timeout(300)

MODEL = "tiny"


@pytest.fixture(scope="module")
def stack(llama_dir, tmp_path_factory: pytest.TempPathFactory):
    logs = tmp_path_factory.mktemp("surface")
    origins = ("--allowed-origins", "http://ui.example")
    with engine_and_proxies(str(llama_dir), logs, *ENGINE_FLAGS, both_flags=origins) as stack:
        yield stack


@pytest.fixture(params=FRONTS)
def front(request, stack):
    return front_of(stack, request.param)


def test_tokenize_detokenize_and_models_retrieve(front) -> None:
    url, headers = front
    r = httpx.post(url + "/tokenize", json={"prompt": "hello world"}, headers=headers)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["count"] == len(body["tokens"]) > 0 and body["max_model_len"] == 512
    back = httpx.post(url + "/detokenize", json={"tokens": body["tokens"]}, headers=headers)
    assert back.json()["prompt"].endswith("hello world")
    chat = httpx.post(
        url + "/tokenize",
        json={"messages": [{"role": "user", "content": "hi"}], "return_token_strs": True},
        headers=headers,
    ).json()
    assert chat["count"] > body["count"] - 2 and len(chat["token_strs"]) == chat["count"]
    text = httpx.post(url + "/detokenize", json={"tokens": chat["tokens"]}, headers=headers)
    assert "hi" in text.json()["prompt"] and "user" in text.json()["prompt"]  # the template ran
    bad = httpx.post(url + "/detokenize", json={"tokens": [10**9]}, headers=headers)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"

    client = openai_client(url, headers)
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


def test_ollama_client_chat_generate_and_model_routes(front) -> None:
    url, headers = front
    client = ollama.Client(host=url, headers=headers)
    opts = {"temperature": 0, "num_predict": 8}
    msgs = [{"role": "user", "content": "Tell me a story"}]
    whole = client.chat(model=MODEL, messages=msgs, options=opts)
    assert whole.done and whole.message.role == "assistant" and whole.message.content
    assert whole.eval_count == 8 and whole.done_reason == "length"
    parts = list(client.chat(model=MODEL, messages=msgs, options=opts, stream=True))
    assert parts[-1].done and "".join(p.message.content for p in parts) == whole.message.content

    gen = client.generate(model=MODEL, prompt="Once", options=opts)
    assert gen.done and gen.eval_count == 8
    for loaded in (client.generate(model=MODEL, prompt=""), client.chat(model=MODEL, messages=[])):
        assert loaded.done and loaded.done_reason == "load"

    assert [m.model for m in client.list().models] == [MODEL]
    assert [m.model for m in client.ps().models] == [MODEL]
    assert "{%" in (client.show(MODEL).template or "")
    with pytest.raises(ollama.ResponseError):
        client.show("no-such-model")
    assert httpx.get(url + "/api/version", headers=headers).json()["version"]


def test_ollama_chat_format_is_json(front) -> None:
    url, headers = front
    schema = {"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"]}
    r = ollama.Client(host=url, headers=headers).chat(
        model=MODEL,
        messages=[{"role": "user", "content": "json please"}],
        format=schema,
        options={"temperature": 0, "num_predict": 40},
    )
    assert isinstance(json.loads(r.message.content)["a"], bool)


def test_generate_and_encode_routes(front) -> None:
    url, headers = front
    g = httpx.post(
        url + "/generate",
        json={"prompt": "Once", "max_tokens": 4, "temperature": 0},
        headers=headers,
        timeout=60,
    )
    assert g.status_code == 200, g.text
    assert g.json()["meta_info"]["completion_tokens"] == 4
    e = httpx.post(url + "/v1/encode", json={"input": "hello"}, headers=headers)
    assert e.json()["length"] == len(e.json()["input_ids"]) > 0


def test_request_id_is_honoured_generated_and_carried(stack, front) -> None:
    url, headers = front
    both = stack[0]
    r = httpx.post(
        url + "/v1/completions",
        json={"model": MODEL, "prompt": "Once", "max_tokens": 2},
        headers={**headers, "X-Request-Id": "trace-abc.1"},
        timeout=60,
    )
    assert r.headers["x-request-id"] == "trace-abc.1"
    assert r.json()["id"] == "trace-abc.1"  # the engine used it (carried by the proxy)
    fresh = httpx.get(url + "/health")
    assert len(fresh.headers["x-request-id"]) >= 16
    junk = httpx.get(url + "/health", headers={"X-Request-Id": "bad id\twith spaces"})
    assert junk.headers["x-request-id"] != "bad id\twith spaces"
    assert both.health()  # engine still fine


def test_cors_is_off_by_default_and_on_with_allowed_origins(stack) -> None:
    both, aggregated, _ = stack
    pre = {"Origin": "http://ui.example", "Access-Control-Request-Method": "POST"}
    on = httpx.options(both.url + "/v1/chat/completions", headers=pre)
    assert on.status_code == 200
    assert on.headers["access-control-allow-origin"] == "http://ui.example"
    other = httpx.options(
        both.url + "/v1/chat/completions", headers={**pre, "Origin": "http://evil.example"}
    )
    assert "access-control-allow-origin" not in other.headers
    off = httpx.options(aggregated.url + "/v1/chat/completions", headers=pre)
    assert "access-control-allow-origin" not in off.headers


@pytest.mark.skipif(shutil.which("curl") is None, reason="needs curl")
def test_huge_body_is_refused_while_health_answers(stack, tmp_path) -> None:
    """20 MB of prompt while /health is polled: the prompt is 413 (longer than the context,
    found without tokenizing) and /health answered while it was read and parsed (the parse
    runs off the event loop; how long a poll waits is a figure for a benchmark, not a test);
    33 MiB is over the body limit: 413 at once."""
    both = stack[0]
    body = tmp_path / "big.json"
    body.write_bytes(
        json.dumps({"model": MODEL, "prompt": "word " * 4_000_000, "max_tokens": 1}).encode()
    )

    def big() -> tuple[int, dict]:
        # curl in its own process, so the test's own sending never holds this process's GIL
        out = subprocess.run(
            ["curl", "-s", "-H", "content-type: application/json", "--data-binary"]
            + [f"@{body}", "-w", "\n%{http_code}", both.url + "/v1/completions"],
            capture_output=True,
            timeout=120,
            check=True,
        ).stdout.decode()
        text, status = out.rsplit("\n", 1)
        return int(status), json.loads(text)

    busy, (status, answer) = polls(both.url, big)
    assert status == 413 and answer["error"]["code"] == "context_length_exceeded", answer
    assert busy, "no /health poll was answered while the big body was handled"
    over = httpx.post(
        both.url + "/v1/completions",
        content=b"x" * (33 * 1024 * 1024),
        headers={"content-type": "application/json"},
        timeout=120,
    )
    assert over.status_code == 413 and over.json()["error"]["code"] == "request_too_large"


def test_abort_at_the_proxy_reaches_the_engine(stack) -> None:
    both, aggregated, _ = stack
    with httpx.Client(timeout=60) as c:  # open until the request's thread has its answer
        with held(both):
            result: dict = {}

            def run() -> None:
                result["r"] = c.post(
                    aggregated.url + "/generate",
                    json={"prompt": "Once", "max_tokens": 50, "session_id": 7},
                    headers=aggregated.headers,
                )

            t = threading.Thread(target=run)
            t.start()

            def aborted() -> bool:
                a = httpx.post(
                    aggregated.url + "/abort_request",
                    json={"session_id": 7},
                    headers=aggregated.admin_headers,
                )
                assert a.status_code == 200, a.text
                return a.json()["aborted"] == 1

            wait_until(aborted, what="the proxy's abort reached the engine")
        t.join()
    assert result["r"].json()["meta_info"]["finish_reason"] == {"type": "abort"}


def test_nodes_add_validates_the_url(stack) -> None:
    proxy = stack[1]
    for bad in ("not a url", "ftp://x:1", "http://", "http://host:notaport", "http://h:99999"):
        r = proxy.post("/nodes/add", json={"url": bad, "status": {"role": "both"}})
        assert r.status_code == 400, (bad, r.text)
        assert r.json()["error"]["param"] == "url"
