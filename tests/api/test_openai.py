"""The API against a real ``tandem serve`` process, through the official ``openai`` client and raw HTTP."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

from ..utils import (
    ADMIN_KEY,
    API_KEY,
    ENGINE_FLAGS,
    ServerProcess,
    aborted_count,
    held,
    make_model,
    sse_events,
    wait_until,
    wait_until_async,
)

pytestmark = pytest.mark.timeout(300)

MODEL = "tiny"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_model(tmp_path_factory.mktemp("api-model"))


@pytest.fixture(scope="module")
def server(model_dir: str, tmp_path_factory: pytest.TempPathFactory):
    srv = ServerProcess(
        model_dir,
        *ENGINE_FLAGS,
        api_key=API_KEY,
        admin_key=ADMIN_KEY,
        log_path=tmp_path_factory.mktemp("api-log") / "server.log",
    )
    try:
        srv.wait_ready()
        yield srv
    finally:
        code = srv.stop()
        assert code == 0, srv.log_tail()


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def http(server: ServerProcess):
    with httpx.Client(base_url=server.url, headers=server.headers, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def llm(model_dir: str):
    from tandem.server.engine import LLM

    return LLM(model_dir, kv_cache_tokens=4096, max_num_seqs=64, max_model_len=512, block_size=16)


GREEDY = dict(temperature=0.0)


# ----- completions and chat through the openai client -------------------------------------
def test_completion_greedy_equals_offline_llm(client: openai.OpenAI, llm) -> None:
    from tandem.server.engine import SamplingParams

    prompts = ["The quick brown fox", "Once upon a time", "In the beginning"]
    offline = llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0.0))
    texts = set()
    for prompt, ref in zip(prompts, offline):
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, **GREEDY)
        assert r.choices[0].text == ref.text
        assert r.usage.completion_tokens == len(ref.token_ids)
        assert r.usage.prompt_tokens == len(ref.prompt_token_ids)
        assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
        texts.add(r.choices[0].text)
    assert len(texts) == len(prompts)  # the tiny model's greedy output varies with the prompt
    assert len(set(offline[0].token_ids)) > 4  # and is not one repeated token


def test_chat_greedy_equals_offline_llm(client: openai.OpenAI, llm) -> None:
    from tandem.server.engine import SamplingParams

    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Say hello"},
    ]
    ref = llm.chat(messages, SamplingParams(max_tokens=20, temperature=0.0))
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, **GREEDY)
    assert r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == ref.text
    assert r.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert r.usage.completion_tokens == len(ref.token_ids)
    assert r.choices[0].finish_reason in ("stop", "length")


def test_chat_stream_matches_non_stream_with_usage(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "Tell me a story"}]
    full = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=30, **GREEDY)
    stream = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=30,
        stream=True,
        stream_options={"include_usage": True},
        **GREEDY,
    )
    chunks = list(stream)
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    content_chunks = [c for c in chunks if c.choices]
    text = "".join(c.choices[0].delta.content or "" for c in content_chunks)
    assert text == full.choices[0].message.content
    finals = [c.choices[0].finish_reason for c in content_chunks if c.choices[0].finish_reason]
    assert finals == [full.choices[0].finish_reason]
    assert content_chunks[-1].choices[0].finish_reason is not None
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_completion_stream_matches_non_stream(client: openai.OpenAI) -> None:
    full = client.completions.create(model=MODEL, prompt="Hello world", max_tokens=20, **GREEDY)
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt="Hello world",
            max_tokens=20,
            stream=True,
            stream_options={"include_usage": True},
            **GREEDY,
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    assert (
        chunks[-1].usage.completion_tokens == full.usage.completion_tokens == 20
        or full.choices[0].finish_reason == "stop"
    )


def test_n2_nonstream_and_stream(client: openai.OpenAI) -> None:
    kw = dict(
        model=MODEL,
        messages=[{"role": "user", "content": "Hi"}],
        n=2,
        max_tokens=12,
        temperature=1.0,
        seed=7,
        extra_body={"ignore_eos": True},
    )
    r = client.chat.completions.create(**kw)
    assert sorted(c.index for c in r.choices) == [0, 1]
    assert r.choices[0].message.content != r.choices[1].message.content
    assert r.usage.completion_tokens == 24  # both choices count
    chunks = list(client.chat.completions.create(**kw, stream=True))
    texts = {0: "", 1: ""}
    finished = set()
    for c in chunks:
        for ch in c.choices:
            texts[ch.index] += ch.delta.content or ""
            if ch.finish_reason:
                finished.add(ch.index)
    assert finished == {0, 1}
    assert texts == {c.index: c.message.content for c in r.choices}  # same seed, same choices


def test_completions_n2_and_prompt_list(client: openai.OpenAI) -> None:
    r = client.completions.create(
        model=MODEL, prompt=["Alpha", "Beta"], n=2, max_tokens=5, temperature=0.0
    )
    assert sorted(c.index for c in r.choices) == [0, 1, 2, 3]
    by_index = {c.index: c.text for c in r.choices}
    assert (
        by_index[0] == by_index[1] and by_index[2] == by_index[3]
    )  # greedy: choices of a prompt agree
    assert by_index[0] != by_index[2]


def test_seed_reproducibility(client: openai.OpenAI) -> None:
    def sample(seed: int) -> str:
        return (
            client.completions.create(
                model=MODEL, prompt="Random words:", max_tokens=16, temperature=1.0, seed=seed
            )
            .choices[0]
            .text
        )

    a, b, c = sample(1234), sample(1234), sample(99)
    assert a == b
    assert a != c


def test_stop_strings(client: openai.OpenAI) -> None:
    full = client.completions.create(
        model=MODEL, prompt="The quick brown fox", max_tokens=24, **GREEDY
    )
    text = full.choices[0].text
    stop = text[8:11]
    assert stop.strip(), text
    r = client.completions.create(
        model=MODEL, prompt="The quick brown fox", max_tokens=24, stop=[stop], **GREEDY
    )
    assert r.choices[0].text == text[: text.index(stop)]
    assert r.choices[0].finish_reason == "stop"
    r2 = client.completions.create(
        model=MODEL,
        prompt="The quick brown fox",
        max_tokens=24,
        stop=stop,
        extra_body={"include_stop_str_in_output": True},
        **GREEDY,
    )
    assert r2.choices[0].text == text[: text.index(stop) + len(stop)]
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model=MODEL,
            prompt="The quick brown fox",
            max_tokens=24,
            stop=[stop],
            stream=True,
            **GREEDY,
        )
        if c.choices
    )
    assert streamed == r.choices[0].text


def test_logprobs_chat_and_completions(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=6,
        logprobs=True,
        top_logprobs=3,
        **GREEDY,
    )
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0.0
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob == pytest.approx(
            entry.logprob
        )  # greedy picks the top token
        assert entry.top_logprobs[0].token == entry.token
    assert "".join(e.token for e in content) == r.choices[0].message.content
    c = client.completions.create(model=MODEL, prompt="Hello", max_tokens=5, logprobs=2, **GREEDY)
    lp = c.choices[0].logprobs
    assert (
        len(lp.tokens)
        == len(lp.token_logprobs)
        == len(lp.top_logprobs)
        == c.usage.completion_tokens
    )
    assert all(len(t) <= 2 for t in lp.top_logprobs)
    assert lp.text_offset[0] == 0 and "".join(lp.tokens) == c.choices[0].text


def test_sampling_fields_accepted_and_applied(client: openai.OpenAI) -> None:
    base = dict(model=MODEL, prompt="Numbers", max_tokens=8, temperature=0.0)
    plain = client.completions.create(**base)
    first_token = client.completions.create(**base, extra_body={"return_token_ids": True}).choices[
        0
    ]
    tok = first_token.model_extra["token_ids"][0]
    banned = client.completions.create(
        **base, logit_bias={str(tok): -100}, extra_body={"return_token_ids": True}
    ).choices[0]
    assert banned.model_extra["token_ids"][0] != tok
    forced = client.completions.create(
        **base,
        extra_body={
            "min_tokens": 8,
            "ignore_eos": True,
            "top_k": 5,
            "min_p": 0.01,
            "repetition_penalty": 1.2,
            "skip_special_tokens": True,
        },
        presence_penalty=0.5,
        frequency_penalty=0.5,
    )
    assert forced.usage.completion_tokens == 8
    mct = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "x"}],
        max_completion_tokens=3,
        max_tokens=50,
        extra_body={"ignore_eos": True},
        **GREEDY,
    )
    assert mct.usage.completion_tokens == 3
    assert plain.choices[0].text
    echo = client.completions.create(**base, echo=True)
    assert echo.choices[0].text == "Numbers" + plain.choices[0].text


def test_model_default_and_list(client: openai.OpenAI) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    r = client.chat.completions.create(
        model="default", messages=[{"role": "user", "content": "x"}], max_tokens=2
    )
    assert r.model == MODEL


def test_chat_template_kwargs_reach_the_template(http: httpx.Client) -> None:
    base = {
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 1,
        "return_token_ids": True,
    }
    with_prompt = http.post("/v1/chat/completions", json=base).json()
    without = http.post(
        "/v1/chat/completions",
        json=base | {"chat_template_kwargs": {"add_generation_prompt": False}},
    ).json()
    assert without["usage"]["prompt_tokens"] < with_prompt["usage"]["prompt_tokens"]
    text_parts = http.post(
        "/v1/chat/completions",
        json=base
        | {
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "h"}, {"type": "text", "text": "i"}],
                }
            ]
        },
    )
    assert text_parts.json()["prompt_token_ids"] == with_prompt["prompt_token_ids"]


# ----- errors ------------------------------------------------------------------------------
def _assert_error(r: httpx.Response, status: int, param: str | None = "__any__") -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "code", "param"}
    assert isinstance(err["message"], str) and err["message"]
    if param != "__any__":
        assert err["param"] == param, err
    return err


CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def test_malformed_json_is_400(http: httpx.Client) -> None:
    r = http.post(
        "/v1/chat/completions",
        content=b'{"messages": [',
        headers={"content-type": "application/json"},
    )
    err = _assert_error(r, 400)
    assert "JSON" in err["message"]
    _assert_error(
        http.post(
            "/v1/completions", content=b"[1, 2]", headers={"content-type": "application/json"}
        ),
        400,
    )


@pytest.mark.parametrize(
    "field,value",
    [
        ("max_tokens", "5"),
        ("temperature", "hot"),
        ("stream", 1),
        ("n", 1.5),
        ("messages", 5),
        ("stop", 3),
        ("logit_bias", {"1": "x"}),
        ("seed", "1"),
        ("stream_options", {"include_usage": "yes"}),
    ],
)
def test_wrong_types_are_400(http: httpx.Client, field: str, value: object) -> None:
    err = _assert_error(http.post("/v1/chat/completions", json=CHAT | {field: value}), 400)
    assert err["param"] is not None and err["param"].startswith(field)
    assert err["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    "field,value,param",
    [
        ("max_tokens", -1, "max_tokens"),
        ("max_tokens", 0, "max_tokens"),
        ("n", 0, "n"),
        ("temperature", -0.5, "temperature"),
        ("top_p", 0.0, "top_p"),
        ("top_logprobs", 50, "top_logprobs"),  # the schema says le 20
        ("logit_bias", {"abc": 1}, "logit_bias"),
        ("logit_bias", {"99999999": 1}, "logit_bias"),
        ("presence_penalty", 5.0, "presence_penalty"),
        ("response_format", {"type": "yaml"}, "response_format.type"),  # an unknown type
        ("response_format", {"type": "regex_schema", "regex_schema": "("}, "response_format"),
    ],
)
def test_bad_values_are_400(http: httpx.Client, field: str, value: object, param: str) -> None:
    body = CHAT | {field: value}
    if field == "top_logprobs":
        body["logprobs"] = True
    _assert_error(http.post("/v1/chat/completions", json=body), 400, param)


def test_missing_fields_and_bad_prompts_are_400(http: httpx.Client) -> None:
    _assert_error(http.post("/v1/chat/completions", json={"model": MODEL}), 400, "messages")
    _assert_error(http.post("/v1/completions", json={"model": MODEL}), 400, "prompt")
    _assert_error(http.post("/v1/completions", json={"model": MODEL, "prompt": ""}), 400, "prompt")
    _assert_error(
        http.post("/v1/completions", json={"model": MODEL, "prompt": [5, 10**9]}), 400, "prompt"
    )
    _assert_error(http.post("/v1/chat/completions", json=CHAT | {"messages": []}), 400, "messages")


def test_unknown_fields_are_ignored(http: httpx.Client) -> None:
    r = http.post(
        "/v1/chat/completions",
        json=CHAT | {"parallel_tool_calls": False, "store": True, "some_future_field": {"x": 1}},
    )
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["role"] == "assistant"


def test_unknown_model_is_404(client: openai.OpenAI, http: httpx.Client) -> None:
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "x"}])
    err = _assert_error(
        http.post("/v1/completions", json={"model": "nope", "prompt": "x"}), 404, "model"
    )
    assert err["code"] == "model_not_found"
    _assert_error(http.get("/v1/no/such/route"), 404)


def test_auth(server: ServerProcess) -> None:
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0).models.list()
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        r = httpx.post(server.url + "/v1/chat/completions", json=CHAT, headers=headers)
        assert _assert_error(r, 401)["code"] == "invalid_api_key"
        _assert_error(
            httpx.post(server.url + "/generate", json={"prompt": "x"}, headers=headers), 401
        )
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/metrics").status_code == 200


def test_prompt_over_max_model_len_is_413(client: openai.OpenAI, http: httpx.Client) -> None:
    long_prompt = list(range(10, 10 + 600))
    err = _assert_error(
        http.post("/v1/completions", json={"prompt": long_prompt, "max_tokens": 1}), 413, "prompt"
    )
    assert err["code"] == "context_length_exceeded"
    with pytest.raises(openai.APIStatusError) as e:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "word " * 600}]
        )
    assert e.value.status_code == 413
    # a prompt that fits, with max_tokens that do not, is a 400 naming max_tokens
    _assert_error(
        http.post("/v1/completions", json={"prompt": list(range(10, 410)), "max_tokens": 200}),
        400,
        "max_tokens",
    )


# ----- native routes -----------------------------------------------------------------------
def test_generate_prompt_input_ids_and_stream(http: httpx.Client) -> None:
    ids = http.post("/v1/encode", json={"input": "Hello there", "add_bos": True}).json()
    assert ids["length"] == len(ids["input_ids"]) > 0
    body = {"max_tokens": 10, "temperature": 0.0, "top_k": 1}
    a = http.post("/generate", json=body | {"prompt": "Hello there", "return_logprob": True}).json()
    b = http.post("/generate", json=body | {"input_ids": ids["input_ids"]}).json()
    assert a["text"] == b["text"] and a["output_ids"] == b["output_ids"]
    assert a["meta_info"]["finish_reason"] == {"type": "length"}
    assert (
        a["meta_info"]["prompt_tokens"] == ids["length"]
        and a["meta_info"]["completion_tokens"] == 10
    )
    assert [t for _, t in a["meta_info"]["output_token_logprobs"]] == a["output_ids"]
    with http.stream(
        "POST", "/generate", json=body | {"prompt": "Hello there", "stream": True}
    ) as r:
        events = sse_events(list(r.iter_lines()))
    assert events[-1] == "[DONE]"
    parts = [json.loads(e) for e in events[:-1]]
    assert "".join(p["text"] for p in parts) == a["text"]
    assert sum((p["output_ids"] for p in parts), []) == a["output_ids"]
    assert parts[-1]["meta_info"]["finish_reason"] == {"type": "length"}
    _assert_error(http.post("/generate", json={"max_tokens": 3}), 400)
    many = http.post("/v1/encode", json={"input": ["a", "bb"]}).json()
    assert many["length"] == [len(x) for x in many["input_ids"]]


def test_ollama_generate_ndjson(http: httpx.Client) -> None:
    body = {
        "model": MODEL,
        "prompt": "Tell me a joke",
        "options": {"temperature": 0, "num_predict": 12},
    }
    with http.stream("POST", "/api/generate", json=body) as r:
        assert r.headers["content-type"].startswith("application/x-ndjson")
        lines = [json.loads(line) for line in r.iter_lines() if line]
    assert all({"model", "created_at", "response", "done"} <= set(x) for x in lines)
    assert [x["done"] for x in lines] == [False] * (len(lines) - 1) + [True]
    assert lines[-1]["eval_count"] == 12
    full = http.post("/api/generate", json=body | {"stream": False}).json()
    assert full["done"] is True and full["response"] == "".join(x["response"] for x in lines)
    _assert_error(http.post("/api/generate", json=body | {"options": {"temperature": "hot"}}), 400)


def test_abort_request_by_session_and_all(server: ServerProcess, http: httpx.Client) -> None:
    async def run() -> list[dict]:
        async with httpx.AsyncClient(base_url=server.url, headers=server.headers, timeout=60) as c:

            async def gen(session: int) -> dict:
                r = await c.post(
                    "/generate",
                    json={
                        "prompt": "Go",
                        "max_tokens": 400,
                        "ignore_eos": True,
                        "session_id": session,
                    },
                )
                return r.json()

            tasks = [asyncio.create_task(gen(s)) for s in (71, 72, 73)]
            await wait_until_async(lambda: _active_at_least(c, 3), what="the three requests to run")
            # an admin route: a client key cannot abort other clients' requests
            denied = await c.post("/abort_request", json={"abort_all": True})
            assert denied.status_code == 403
            admin = server.admin_headers
            one = (await c.post("/abort_request", json={"session_id": 71}, headers=admin)).json()
            rest = (await c.post("/abort_request", json={"abort_all": True}, headers=admin)).json()
            assert one["aborted"] == 1 and rest["aborted"] == 2
            return await asyncio.gather(*tasks)

    for out in asyncio.run(run()):
        assert out["meta_info"]["finish_reason"] == {"type": "abort"}
        assert out["meta_info"]["completion_tokens"] < 400
    for sid in (71, 72, 73):
        http.delete(f"/v1/sessions/{sid}")  # aborted turns leave an empty session behind
    server.wait_idle()


def test_ops_routes(http: httpx.Client, server: ServerProcess) -> None:
    h = server.health()
    assert h["status"] == "ok" and h["model"] == MODEL and h["role"] == "both"
    assert {"total_blocks", "free_blocks", "utilization"} == set(h["block_pool"])
    assert {"uptime", "active_requests", "pending_requests", "active_sessions"} <= set(h)
    assert http.get("/v1/gpu/info").json() == {"gpus": []}
    assert http.get("/is_sleeping").json() == {"is_sleeping": False}
    text = httpx.get(server.url + "/metrics").text
    for name in (
        "vllm:num_requests_waiting",
        "vllm:num_requests_running",
        "vllm:gpu_cache_usage_perc",
        "vllm:kv_cache_usage_perc",
        "tandem:num_requests_waiting",
        "tandem:time_to_first_token_seconds_count",
        "tandem:inter_token_latency_seconds_count",
        "tandem:e2e_request_latency_seconds_count",
        "tandem:prompt_tokens_total",
        "tandem:generation_tokens_total",
    ):
        assert f"\n{name}" in text, name
    ttft = [
        line
        for line in text.splitlines()
        if line.startswith("tandem:time_to_first_token_seconds_count")
    ]
    assert float(ttft[0].split()[-1]) > 0
    # earlier tests were refused with 400/401/404/413; each refusal is counted by status
    for status in ("400", "404", "413"):
        assert f'tandem:request_errors_total{{model_name="tiny",status="{status}"}}' in text, status


def test_openapi_describes_every_route(http: httpx.Client) -> None:
    spec = http.get("/openapi.json").json()
    paths = spec["paths"]
    for path, method in [
        ("/v1/chat/completions", "post"),
        ("/v1/completions", "post"),
        ("/v1/models", "get"),
        ("/health", "get"),
        ("/metrics", "get"),
        ("/v1/sessions/{session_id}", "delete"),
        ("/generate", "post"),
        ("/v1/encode", "post"),
        ("/abort_request", "post"),
        ("/is_sleeping", "get"),
        ("/sleep", "post"),
        ("/wakeup", "post"),
        ("/terminate", "get"),
        ("/api/generate", "post"),
        ("/v1/gpu/info", "get"),
    ]:
        assert method in paths.get(path, {}), path
    schemas = spec["components"]["schemas"]
    for path, model, fields in [
        (
            "/v1/chat/completions",
            "ChatCompletionRequest",
            {"messages", "session_id", "chat_template_kwargs"},
        ),
        ("/v1/completions", "CompletionRequest", {"prompt", "echo", "logprobs"}),
        ("/generate", "GenerateRequest", {"prompt", "input_ids", "session_id"}),
        ("/api/generate", "OllamaGenerateRequest", {"prompt", "options"}),
    ]:
        ref = paths[path]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        assert ref.endswith("/" + model)
        assert fields <= set(schemas[model]["properties"])


# ----- sessions ----------------------------------------------------------------------------
def _lcp(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_session_second_turn_prefills_only_new_tokens(
    http: httpx.Client, server: ServerProcess
) -> None:
    server.wait_idle()
    base = {"model": MODEL, "max_tokens": 12, "temperature": 0.0, "return_token_ids": True}
    turn1_msgs = [{"role": "user", "content": "My name is Ada. Remember it."}]
    t1 = http.post(
        "/v1/chat/completions", json=base | {"messages": turn1_msgs, "session_id": "conv-1"}
    ).json()
    reply = t1["choices"][0]["message"]["content"]
    h = server.health()
    assert h["active_sessions"] == 1
    assert (
        h["block_pool"]["free_blocks"] < h["block_pool"]["total_blocks"]
    )  # the session holds its blocks
    turn2_msgs = turn1_msgs + [
        {"role": "assistant", "content": reply},
        {"role": "user", "content": "Name?"},
    ]
    stateless = http.post("/v1/chat/completions", json=base | {"messages": turn2_msgs}).json()
    t2 = http.post(
        "/v1/chat/completions", json=base | {"messages": turn2_msgs, "session_id": "conv-1"}
    ).json()
    assert t2["choices"][0]["message"]["content"] == stateless["choices"][0]["message"]["content"]
    # The session held the K/V of turn 1's prompt and all but its last generated token.
    held = t1["prompt_token_ids"] + t1["choices"][0]["token_ids"][:-1]
    p2 = t2["prompt_token_ids"]
    expected_cached = min(_lcp(held, p2), len(p2) - 1)
    assert expected_cached >= len(t1["prompt_token_ids"])
    cached = t2["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached == expected_cached
    prefilled = t2["usage"]["prompt_tokens"] - cached
    assert prefilled == len(p2) - expected_cached < len(p2) // 2
    # deleting the session frees its blocks
    r = http.delete("/v1/sessions/conv-1")
    assert r.status_code == 200 and r.json()["deleted"] is True
    h = server.wait_idle()
    assert h["active_sessions"] == 0
    _assert_error(http.delete("/v1/sessions/conv-1"), 404)


def test_session_with_only_the_new_message_remembers_the_conversation(
    http: httpx.Client, server: ServerProcess
) -> None:
    """ZedInfer's style: each turn sends just the new user message under the session id."""
    server.wait_idle()
    base = {"model": MODEL, "max_tokens": 10, "temperature": 0.0, "ignore_eos": True}
    first = [{"role": "user", "content": "Remember the word tandem."}]
    t1 = http.post(
        "/v1/chat/completions", json=base | {"messages": first, "session_id": "zed"}
    ).json()
    reply = t1["choices"][0]["message"]["content"]
    second = [{"role": "user", "content": "Which word?"}]
    t2 = http.post(
        "/v1/chat/completions", json=base | {"messages": second, "session_id": "zed"}
    ).json()
    whole = first + [{"role": "assistant", "content": reply}] + second
    stateless = http.post("/v1/chat/completions", json=base | {"messages": whole}).json()
    assert t2["choices"][0]["message"]["content"] == stateless["choices"][0]["message"]["content"]
    assert t2["usage"]["prompt_tokens"] == stateless["usage"]["prompt_tokens"]
    assert t2["usage"]["prompt_tokens_details"]["cached_tokens"] >= t1["usage"]["prompt_tokens"]
    assert http.delete("/v1/sessions/zed").status_code == 200
    server.wait_idle()


def test_session_on_completions_and_generate(http: httpx.Client, server: ServerProcess) -> None:
    p1 = "Session text number one"
    a = http.post(
        "/v1/completions",
        json={
            "prompt": p1,
            "max_tokens": 6,
            "temperature": 0.0,
            "session_id": "s-cmpl",
            "return_token_ids": True,
        },
    ).json()
    p2 = p1 + a["choices"][0]["text"] + " and more"
    b = http.post(
        "/v1/completions",
        json={"prompt": p2, "max_tokens": 6, "temperature": 0.0, "session_id": "s-cmpl"},
    ).json()
    assert b["usage"]["prompt_tokens_details"]["cached_tokens"] >= len(
        a["choices"][0]["prompt_token_ids"]
    )
    g1 = http.post(
        "/generate", json={"prompt": p1, "max_tokens": 4, "session_id": 5, "temperature": 0.0}
    ).json()
    g2 = http.post(
        "/generate",
        json={
            "input_ids": http.post("/v1/encode", json={"input": p1}).json()["input_ids"]
            + g1["output_ids"],
            "max_tokens": 4,
            "session_id": 5,
        },
    ).json()
    assert g2["meta_info"]["cached_tokens"] >= g1["meta_info"]["prompt_tokens"]
    assert server.health()["active_sessions"] == 2
    assert http.delete("/v1/sessions/s-cmpl").status_code == 200
    assert http.delete("/v1/sessions/5").status_code == 200
    server.wait_idle()


# ----- concurrency and disconnects ---------------------------------------------------------
def test_32_concurrent_streams_with_a_third_dropped(server: ServerProcess) -> None:
    async def one(c: httpx.AsyncClient, i: int) -> str:
        drop = i % 3 == 0
        # dropped streams ask for far more tokens than they read, so only an abort ends them early
        body = {
            "model": MODEL,
            "prompt": f"Request {i} says",
            "max_tokens": 400 if drop else 48,
            "ignore_eos": True,
            "temperature": 0.8,
            "seed": i,
            "stream": True,
        }
        events = 0
        async with c.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                if line.strip() == "data: [DONE]":
                    return "done"
                chunk = json.loads(line[5:])
                events += 1
                if chunk["choices"] and chunk["choices"][0]["finish_reason"]:
                    assert chunk["choices"][0]["finish_reason"] == "length"
                if drop and events >= 3:
                    return "dropped"  # leaving the block closes the connection mid-stream
        return "truncated"

    async def run() -> list[str]:
        limits = httpx.Limits(max_connections=64, max_keepalive_connections=0)
        async with httpx.AsyncClient(
            base_url=server.url, headers=server.headers, timeout=120, limits=limits
        ) as c:
            return await asyncio.gather(*(one(c, i) for i in range(32)))

    aborted_before = _aborted(server)
    results = asyncio.run(run())
    assert results.count("dropped") == 11
    assert results.count("done") == 21
    h = server.wait_idle(timeout=30)
    assert _aborted(server) - aborted_before == 11
    assert h["block_pool"]["free_blocks"] == h["block_pool"]["total_blocks"]


def _aborted(server: ServerProcess) -> float:
    return aborted_count(server)


def test_non_streaming_client_disconnect_aborts(server: ServerProcess, http: httpx.Client) -> None:
    before = _aborted(server)
    with held(server):  # the engine steps nothing, so no answer can beat the client's timeout
        with pytest.raises(httpx.TimeoutException):
            httpx.post(
                server.url + "/v1/completions",
                headers=server.headers,
                timeout=0.5,
                json={"prompt": "long", "max_tokens": 490, "ignore_eos": True},
            )
        wait_until(lambda: _aborted(server) - before == 1, what="the engine aborting the request")
    h = server.wait_idle(timeout=10)
    assert h["block_pool"]["free_blocks"] == h["block_pool"]["total_blocks"]
    assert _aborted(server) - before == 1


async def _active_at_least(client: httpx.AsyncClient, n: int) -> bool:
    return (await client.get("/health")).json()["active_requests"] >= n
