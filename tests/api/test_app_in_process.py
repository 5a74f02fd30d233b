"""The API's pure pieces and the app in-process: request mapping, loading (503), auth, terminate."""

from __future__ import annotations

import threading

import pydantic
import pytest
from fastapi.testclient import TestClient
from pydantic import ValidationError

from tandem.server.api import mapping
from tandem.server.api.app import build_app
from tandem.server.api.native_routes import ollama_sampling_params
from tandem.server.api.ops_routes import format_uptime
from tandem.server.api.state import ServerSettings
from tandem.server.api.tool_parsers import tool_plan
from tandem.server.engine import CompletionOutput, EngineConfig, LLMEngine, RequestOutput
from tandem.server.wire import tenancy
from tandem.server.wire.errors import APIError
from tandem.server.wire.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    GenerateRequest,
    OllamaOptions,
)

from ..utils import make_model


# ----- mapping ------------------------------------------------------------------------------
def _chat(**kw: object) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "x"}], **kw}
    )


def test_sampling_defaults_follow_openai() -> None:
    p = mapping.sampling_params(_chat(), vocab_size=100, default_max_tokens=None)
    assert (p.n, p.temperature, p.top_p, p.top_k, p.max_tokens, p.logprobs) == (
        1,
        1.0,
        1.0,
        -1,
        None,
        None,
    )
    c = mapping.sampling_params(
        CompletionRequest(prompt="x"), vocab_size=100, default_max_tokens=16
    )
    assert c.max_tokens == 16


def test_sampling_aliases_and_overrides() -> None:
    p = mapping.sampling_params(
        _chat(
            max_tokens=50,
            max_completion_tokens=7,
            min_new_tokens=3,
            stop="END",
            top_k=0,
            seed=-5,
            logit_bias={"3": 2.5},
        ),
        vocab_size=100,
        default_max_tokens=None,
    )
    assert p.max_tokens == 7 and p.min_tokens == 3 and p.stop == ["END"] and p.top_k == -1
    assert p.seed is not None and p.seed >= 0
    assert p.logit_bias == {3: 2.5}


@pytest.mark.parametrize(
    "kw,param",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_completion_tokens": -3}, "max_completion_tokens"),
        ({"logit_bias": {"x": 1.0}}, "logit_bias"),
        ({"logit_bias": {"100": 1.0}}, "logit_bias"),
        ({"top_p": 1.5}, "top_p"),
        ({"min_tokens": 9, "max_tokens": 3}, "min_tokens"),
    ],
)
def test_sampling_rejects_with_param(kw: dict, param: str) -> None:
    try:
        req = _chat(**kw)
    except ValidationError as exc:  # a range the OpenAPI document declares: refused by the model
        assert exc.errors()[0]["loc"][0] == param
        return
    with pytest.raises(APIError) as e:
        mapping.sampling_params(req, vocab_size=100, default_max_tokens=None)
    assert e.value.status == 400 and e.value.param == param


def test_chat_logprob_count_and_checks() -> None:
    assert mapping.chat_logprobs_count(_chat()) is None
    assert mapping.chat_logprobs_count(_chat(logprobs=True)) == 0
    assert mapping.chat_logprobs_count(_chat(logprobs=True, top_logprobs=4)) == 4
    with pytest.raises(APIError):
        mapping.chat_logprobs_count(_chat(top_logprobs=2))
    with pytest.raises(APIError):  # required without tools
        tool_plan(None, "required", True, "hermes")
    mapping.check_chat_request(_chat(response_format={"type": "text"}, tool_choice="auto"))


def test_session_keys() -> None:
    assert [tenancy.session_key(v) for v in (None, "", -1, 0, 7, "abc")] == [
        None,
        None,
        None,
        "0",
        "7",
        "abc",
    ]


def test_completion_prompt_shapes() -> None:
    assert mapping.completion_prompts("a") == ["a"]
    assert mapping.completion_prompts(["a", "b"]) == ["a", "b"]
    assert mapping.completion_prompts([1, 2]) == [[1, 2]]
    assert mapping.completion_prompts([[1], [2, 3]]) == [[1], [2, 3]]
    with pytest.raises(APIError):
        mapping.completion_prompts([])


def test_generate_and_ollama_params() -> None:
    p = mapping.generate_sampling_params(
        GenerateRequest(prompt="x", top_k=0, return_logprob=True), vocab_size=10
    )
    assert p.top_k == -1 and p.logprobs == 0 and p.max_tokens == 128
    o = ollama_sampling_params(
        OllamaOptions.model_validate(
            {"num_predict": -1, "temperature": 0, "top_k": 0, "stop": "x", "num_ctx": 4096}
        )
    )
    assert o.max_tokens is None and o.temperature == 0 and o.top_k == -1 and o.stop == ["x"]
    for bad in ({"seed": "1"}, {"temperature": 1e9}, {"stop": ["s"] * 10_000}, {"top_p": True}):
        with pytest.raises(pydantic.ValidationError):
            OllamaOptions.model_validate(bad)


def test_stream_deltas_merge_into_the_whole_output() -> None:
    """A consumer that fell behind takes several deltas as one; choices keep their order."""

    def delta(*choices: CompletionOutput) -> RequestOutput:
        return RequestOutput("r", [9], list(choices), finished=False)

    merged = (
        delta(CompletionOutput(1, "x", [5], None))
        .merge(delta(CompletionOutput(0, "He", [1], None, logprobs=[])))
        .merge(delta(CompletionOutput(0, "llo", [2], "stop", "o")))
    )
    assert [(c.index, c.text, c.token_ids, c.finish_reason) for c in merged.outputs] == [
        (0, "Hello", [1, 2], "stop"),
        (1, "x", [5], None),
    ]
    assert merged.outputs[0].stop_reason == "o" and merged.outputs[0].logprobs == []


def test_response_shapes_and_usage() -> None:
    class Tok:
        def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
            return "".join(chr(97 + i) for i in ids)

    out = RequestOutput(
        "r",
        [5, 6, 7],
        [CompletionOutput(0, "ab", [0, 1], "length"), CompletionOutput(1, "c", [2], "stop")],
        True,
        num_cached_tokens=2,
    )
    body = mapping.chat_response(
        request_id="r", created=1, model="m", outputs=[out], tokenizer=Tok(), top_logprobs=None
    )
    assert body["usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": 3,
        "total_tokens": 6,
        "prompt_tokens_details": {"cached_tokens": 2},
    }
    assert [c["finish_reason"] for c in body["choices"]] == ["length", "stop"]
    cmpl = mapping.completion_response(
        request_id="r",
        created=1,
        model="m",
        outputs=[out, out],
        tokenizer=Tok(),
        logprobs=None,
        echo_texts=["P", None],
    )
    assert [c["index"] for c in cmpl["choices"]] == [0, 1, 2, 3]
    assert cmpl["choices"][0]["text"] == "Pab" and cmpl["choices"][2]["text"] == "ab"
    assert cmpl["usage"]["prompt_tokens"] == 6


def test_uptime_format() -> None:
    assert format_uptime(5) == "0m 5s"
    assert format_uptime(2 * 3600 + 15 * 60 + 3) == "2h 15m"


# ----- the app in-process -------------------------------------------------------------------
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_model(tmp_path_factory.mktemp("api-unit-model"))


def _app(model_dir: str, build, **settings: object):
    from transformers import AutoTokenizer

    s = ServerSettings(model_dir=model_dir, served_model_name="unit", **settings)
    return build_app(s, build, tokenizer=AutoTokenizer.from_pretrained(model_dir), vocab_size=1024)


def test_503_while_loading_then_serves(model_dir: str) -> None:
    release = threading.Event()
    config = EngineConfig(model=model_dir, kv_cache_tokens=1024, max_model_len=256)

    def slow_build() -> LLMEngine:
        release.wait(30)
        return LLMEngine(config)

    app = _app(model_dir, slow_build)
    with TestClient(app) as c:
        h = c.get("/health")
        assert h.status_code == 503 and h.json()["status"] == "loading"
        r = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_loading"
        assert "vllm:num_requests_waiting" in c.get("/metrics").text
        release.set()
        assert app.state.tandem.engine.wait_ready(30)
        assert c.get("/health").status_code == 200
        r = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


def test_failed_engine_is_503_and_reported(model_dir: str) -> None:
    failures: list[BaseException] = []

    def broken() -> LLMEngine:
        raise RuntimeError("no such weights")

    from transformers import AutoTokenizer

    app = build_app(
        ServerSettings(model_dir=model_dir, served_model_name="unit"),
        broken,
        tokenizer=AutoTokenizer.from_pretrained(model_dir),
        vocab_size=1024,
        on_engine_failure=failures.append,
    )
    with TestClient(app) as c:
        assert not app.state.tandem.engine.wait_ready(10)
        assert c.get("/health").json()["status"] == "failed"
        assert c.post("/v1/completions", json={"prompt": "x"}).status_code == 503
    assert len(failures) == 1


def test_auth_terminate_and_env_key(model_dir: str) -> None:
    config = EngineConfig(model=model_dir, kv_cache_tokens=1024, max_model_len=256)
    app = _app(model_dir, lambda: LLMEngine(config), api_key="k1", admin_api_key="adm")
    admin = {"Authorization": "Bearer adm"}
    with TestClient(app) as c:
        assert app.state.tandem.engine.wait_ready(30)
        assert c.get("/v1/models").status_code == 401
        assert c.get("/openapi.json").status_code == 401
        assert (
            c.get("/v1/models", headers={"Authorization": "Bearer k1"}).json()["data"][0]["id"]
            == "unit"
        )
        assert c.get("/health").status_code == 200
        # an admin route: a client key is refused
        r = c.get("/terminate", headers={"Authorization": "Bearer k1"})
        assert r.status_code == 403 and r.json()["error"]["code"] == "forbidden"
        # not started by `tandem serve`: terminate says it cannot
        assert c.get("/terminate", headers=admin).status_code == 501
        called = threading.Event()
        app.state.tandem.shutdown = called.set
        r = c.get("/terminate", headers=admin)
        assert r.status_code == 200
        assert called.wait(5)
        # draining: new work is refused
        r = c.post("/v1/completions", json={"prompt": "x"}, headers={"Authorization": "Bearer k1"})
        assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down"


def test_serve_cli_flags() -> None:
    import argparse

    from tandem.server.api import serve_cli

    parser = argparse.ArgumentParser()
    serve_cli.add_arguments(parser)
    args = parser.parse_args(
        [
            "--role",
            "prefill",
            "--max-waiting-requests",
            "3",
            "--session-ttl",
            "5",
            "--block-size",
            "32",
            "--api-key",
            "k",
        ]
    )
    assert (args.role, args.max_waiting_requests, args.session_ttl, args.block_size) == (
        "prefill",
        3,
        5.0,
        32,
    )
    with pytest.raises(SystemExit):
        parser.parse_args(["--role", "sideways"])
    s = serve_cli.settings_from_args(args, "/m/x", "x", environ={"TANDEM_API_KEY": "env"})
    assert (s.api_key, s.role, s.max_waiting_requests, s.served_model_name) == (
        "k",
        "prefill",
        3,
        "x",
    )
    args.api_key = None
    assert (
        serve_cli.settings_from_args(args, "/m/x", "x", environ={"TANDEM_API_KEY": "env"}).api_key
        == "env"
    )
    assert serve_cli.settings_from_args(args, "/m/x", "x", environ={}).api_key is None
    with pytest.raises(ValueError):
        ServerSettings(model_dir="m", served_model_name="n", session_ttl=0)
