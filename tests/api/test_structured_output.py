"""Structured output and tool calling through the official ``openai`` client, against
``tandem serve`` and against the proxy disaggregating onto a prefill and a decode engine.

The model has random weights: only the grammar makes its output valid, so an output that
finishes with ``stop`` and validates is the proof the grammar held (through P/D too, where the
prefill engine samples the first token and the decode engine resumes the matcher from it).
"""

from __future__ import annotations

import json
from typing import Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from ..proxy.utils import PROXY_KEY, ProxyProcess, stop_all, wait_free
from ..utils import ENGINE_FLAGS, ServerProcess
from .utils import WEATHER_SCHEMA

pytestmark = pytest.mark.timeout(600)

MODEL = "tiny"


class Owner(BaseModel):
    team: str = Field(max_length=6)
    oncall: bool


class Component(BaseModel):
    name: str = Field(max_length=8)
    kind: Literal["cache", "sampler", "proxy"]
    owner: Owner
    priority: int = Field(ge=0, le=9)


SCHEMA = WEATHER_SCHEMA
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather", "parameters": SCHEMA},
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "parameters": {
                "type": "object",
                "properties": {"zone": {"type": "string", "enum": ["utc", "cet"]}},
                "required": ["zone"],
                "additionalProperties": False,
            },
        },
    },
]
PARAMS_OF = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module", params=["serve", "pd"])
def target(request, llama_dir, tmp_path_factory: pytest.TempPathFactory):
    """``(base_url, api_key, engines)``: one engine, or the proxy over a prefill and a decode."""
    logs = tmp_path_factory.mktemp(f"structured-{request.param}")
    if request.param == "serve":
        srv = ServerProcess(str(llama_dir), *ENGINE_FLAGS, log_path=logs / "serve.log")
        try:
            srv.wait_ready()
            yield srv.url, "unused", [srv]
        finally:
            stop_all([srv])
        return
    p, d = (
        ServerProcess(str(llama_dir), *ENGINE_FLAGS, "--role", r, log_path=logs / f"{r}.log")
        for r in ("prefill", "decode")
    )
    proxy = ProxyProcess(
        "--node", f"{p.url}=prefill", "--node", f"{d.url}=decode",
        "--disagg-threshold", "0", "--health-interval", "0.5",
        log_path=logs / "proxy.log",
    )  # fmt: skip
    try:
        for e in (p, d):
            e.wait_ready()
        proxy.wait_healthy([p.url, d.url])
        yield proxy.url, PROXY_KEY, [p, d]
    finally:
        stop_all([proxy, p, d])


@pytest.fixture(scope="module")
def client(target) -> openai.OpenAI:
    url, key, _ = target
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=120)


def _stream_chat(client: openai.OpenAI, **kw) -> tuple[str, list[dict], str | None]:
    """Content, tool calls merged from their deltas, finish_reason of a streamed choice 0."""
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(model=MODEL, stream=True, **kw):
        for ch in chunk.choices:
            content += ch.delta.content or ""
            for tc in ch.delta.tool_calls or []:
                call = calls.setdefault(tc.index, {"id": None, "name": None, "arguments": ""})
                call["id"] = tc.id or call["id"]
                if tc.function is not None:
                    call["name"] = tc.function.name or call["name"]
                    call["arguments"] += tc.function.arguments or ""
            finish = ch.finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_parse_with_a_pydantic_model(client: openai.OpenAI, stream: bool) -> None:
    kw = dict(model=MODEL, messages=ASK, response_format=Component, max_tokens=120, seed=3)
    if stream:
        with client.beta.chat.completions.stream(**kw) as s:
            for _ in s:
                pass
            done = s.get_final_completion()
    else:
        done = client.beta.chat.completions.parse(**kw)
    choice = done.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, Component)


def test_n4_json_schema_every_stop_validates(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        n=4,
        max_tokens=80,
        temperature=1.0,
        seed=5,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "w", "schema": SCHEMA, "strict": True},
        },
    )
    stops = [c for c in r.choices if c.finish_reason == "stop"]
    assert len(r.choices) == 4 and len(stops) >= 3
    for c in stops:
        jsonschema.validate(json.loads(c.message.content), SCHEMA)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_every_request_shape(client: openai.OpenAI, stream: bool) -> None:
    """vLLM's guided_* and structured_outputs, LMDeploy's regex_schema, on completions and chat."""

    def complete(**extra) -> str:
        kw = dict(model=MODEL, prompt="Answer:", max_tokens=60, seed=1)
        if not stream:
            r = client.completions.create(extra_body=extra, **kw)
            assert r.choices[0].finish_reason == "stop"
            return r.choices[0].text
        text, finish = "", None
        for c in client.completions.create(stream=True, extra_body=extra, **kw):
            text += c.choices[0].text if c.choices else ""
            finish = (c.choices[0].finish_reason if c.choices else None) or finish
        assert finish == "stop"
        return text

    assert complete(guided_choice=["alpha", "beta"]) in ("alpha", "beta")
    assert complete(structured_outputs={"choice": ["up", "down"]}) in ("up", "down")
    assert complete(guided_regex=r"[0-9]{3}").isdigit()
    jsonschema.validate(json.loads(complete(guided_json=SCHEMA)), SCHEMA)
    out = complete(response_format={"type": "regex_schema", "regex_schema": "(yes|no)!"})
    assert out in ("yes!", "no!")
    assert complete(guided_grammar='root ::= "x" [0-9] [0-9]')[0] == "x"
    chat = client.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=40, extra_body={"guided_choice": ["sun", "rain"]}
    )
    assert chat.choices[0].message.content in ("sun", "rain")


def test_bad_grammars_are_400s(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(
            model=MODEL, prompt="x", max_tokens=5, extra_body={"guided_regex": "(unclosed"}
        )
    assert "regex" in str(e.value)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(
            model=MODEL, messages=ASK, max_tokens=5, response_format={"type": "yaml"}
        )
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=MODEL,
            messages=ASK,
            max_tokens=5,
            response_format={"type": "json_object"},
            extra_body={"guided_regex": "a"},
        )
    assert "only one" in str(e.value)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_tool_calling_loop(client: openai.OpenAI, stream: bool) -> None:
    """required -> a call the client parses -> the tool's result -> a final answer (auto)."""
    kw = dict(
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,  # random weights would otherwise go on calling
        max_tokens=80,
        seed=2,
    )
    if stream:
        content, calls, finish = _stream_chat(client, **kw)
        assert all(c["id"] and c["id"].startswith("call_") for c in calls)
    else:
        r = client.chat.completions.create(model=MODEL, **kw)
        msg, finish = r.choices[0].message, r.choices[0].finish_reason
        calls = [
            {"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
            for c in msg.tool_calls
        ]
    assert finish == "tool_calls" and len(calls) == 1
    for call in calls:
        jsonschema.validate(json.loads(call["arguments"]), PARAMS_OF[call["name"]])
    history = ASK + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": c["id"],
                    "type": "function",
                    "function": {"name": c["name"], "arguments": c["arguments"]},
                }
                for c in calls
            ],
        }
    ]
    history += [{"role": "tool", "tool_call_id": c["id"], "content": "18C, cloudy"} for c in calls]
    final = dict(messages=history, tools=TOOLS, tool_choice="auto", max_tokens=16, seed=2)
    if stream:
        content, calls, finish = _stream_chat(client, **final)
    else:
        r = client.chat.completions.create(model=MODEL, **final)
        finish = r.choices[0].finish_reason
    assert finish in ("stop", "length")  # random weights write prose, not a Hermes call


def test_named_function_and_parallel_calls(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        max_tokens=40,
    )
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_time" and r.choices[0].finish_reason == "tool_calls"
    jsonschema.validate(json.loads(call.function.arguments), PARAMS_OF["get_time"])
    r = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=200, seed=2
    )
    choice = r.choices[0]  # parallel calls allowed: the model may write several
    if choice.finish_reason == "tool_calls":
        assert len(choice.message.tool_calls) >= 1
    else:  # cut off mid-call: the partial array is returned as content, as written
        assert choice.finish_reason == "length" and choice.message.content.startswith("[{")


def test_ollama_format(target) -> None:
    url, key, engines = target
    if len(engines) > 1:
        pytest.skip("the proxy does not route Ollama's /api/generate")
    body = {"model": MODEL, "prompt": "Weather?", "stream": False, "format": SCHEMA}
    r = httpx.post(
        url + "/api/generate",
        json={**body, "options": {"num_predict": 80, "seed": 1}},
        headers={"Authorization": f"Bearer {key}"},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    if r.json()["done_reason"] == "stop":
        jsonschema.validate(json.loads(r.json()["response"]), SCHEMA)
    for e in engines:
        wait_free(e)


def test_reasoning_parser_and_template_kwargs(llama_dir, tmp_path_factory) -> None:
    """``--reasoning-parser qwen3``: ``reasoning_content`` is part of the message; with thinking
    switched off through ``chat_template_kwargs`` the grammar holds from the first token (with it
    on, the grammar would wait for ``</think>``, which random weights never write)."""
    log = tmp_path_factory.mktemp("reasoning") / "serve.log"
    srv = ServerProcess(
        str(llama_dir),
        *ENGINE_FLAGS,
        "--reasoning-parser",
        "qwen3",
        "--tool-call-parser",
        "hermes",
        log_path=log,
    )
    try:
        srv.wait_ready()
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        off = {"chat_template_kwargs": {"enable_thinking": False}, "guided_choice": ["a1", "b2"]}
        r = c.chat.completions.create(model=MODEL, messages=ASK, max_tokens=20, extra_body=off)
        assert r.choices[0].message.content in ("a1", "b2")
        on = c.chat.completions.create(
            model=MODEL, messages=ASK, max_tokens=8, extra_body={"guided_choice": ["a1", "b2"]}
        )
        message = on.choices[0].message.model_dump()
        assert "reasoning_content" in message  # no <think> written: all of it is content
        assert message["reasoning_content"] is None and message["content"]
        text, reasoning = "", ""
        for chunk in c.chat.completions.create(
            model=MODEL, messages=ASK, max_tokens=20, stream=True, extra_body=off
        ):
            for ch in chunk.choices:
                text += ch.delta.content or ""
                reasoning += getattr(ch.delta, "reasoning_content", None) or ""
        assert text in ("a1", "b2") and reasoning == ""
    finally:
        stop_all([srv])


class GetWeather(BaseModel):
    city: str = Field(max_length=10)
    unit: Literal["c", "f"]


def test_client_parses_pydantic_tools(client: openai.OpenAI) -> None:
    """The client's own helpers: strict pydantic tools, parsed arguments, whole and streamed."""
    tools = [openai.pydantic_function_tool(GetWeather)]
    r = client.beta.chat.completions.parse(
        model=MODEL,
        messages=ASK,
        tools=tools,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=60,
    )
    assert r.choices[0].finish_reason == "tool_calls"
    assert isinstance(r.choices[0].message.tool_calls[0].function.parsed_arguments, GetWeather)
    named = {"type": "function", "function": {"name": "GetWeather"}}
    with client.beta.chat.completions.stream(
        model=MODEL, messages=ASK, tools=tools, tool_choice=named, max_tokens=60
    ) as s:
        for _ in s:
            pass
        done = s.get_final_completion()
    assert done.choices[0].finish_reason == "tool_calls"
    assert isinstance(done.choices[0].message.tool_calls[0].function.parsed_arguments, GetWeather)
