"""Anthropic's Messages API through the official ``anthropic`` client, unchanged, against
``tandem serve``, the proxy over it (aggregated) and the proxy disaggregating (P/D): text
equal to Chat Completions', ``messages.stream`` with ``get_final_message()``, a ``tool_use``
→ ``tool_result`` round trip, ``count_tokens``, ``x-api-key``, and bad input answered 4xx
in Anthropic's error shape.

This SDK version has no ``temperature`` argument: greedy runs send it through
``extra_body``, as any client may. The model has random weights: tool calls are forced
(``tool_choice`` ``any`` / ``tool``)."""

from __future__ import annotations

import json
from pathlib import Path

import anthropic
import httpx
import jsonschema
import pytest

from ..proxy.utils import ProxyProcess, front_of, stop_all
from ..utils import ENGINE_FLAGS, ServerProcess
from .utils import ASK, TOOL_RESULT, WEATHER_SCHEMA, chat_text, leaving_aborts

pytestmark = pytest.mark.timeout(600)

MODEL = "tiny"
GREEDY = {"extra_body": {"temperature": 0}}
TOOLS = [{"name": "get_weather", "description": "Weather", "input_schema": WEATHER_SCHEMA}]
CHAT_TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER_SCHEMA},
    }
]


@pytest.fixture
def client(keyed_front) -> anthropic.Anthropic:
    url, key = keyed_front
    return anthropic.Anthropic(base_url=url, api_key=key, max_retries=0, timeout=120)


CONVERSATION = [{"role": "user", "content": "Tell me about Paris."}]


def test_create_text_equals_chat_completions(client: anthropic.Anthropic, keyed_front) -> None:
    m = client.messages.create(
        model=MODEL, system="Answer briefly.", messages=CONVERSATION, max_tokens=12, **GREEDY
    )
    text, finish = chat_text(
        *keyed_front, [{"role": "system", "content": "Answer briefly."}, *CONVERSATION], 12
    )
    assert [b.type for b in m.content] == ["text"]
    assert m.content[0].text == text
    assert m.stop_reason == ("max_tokens" if finish == "length" else "end_turn")
    assert m.type == "message" and m.role == "assistant" and m.model == MODEL
    assert m.usage.output_tokens > 0
    counted = client.messages.count_tokens(
        model=MODEL, system="Answer briefly.", messages=CONVERSATION
    )
    assert counted.input_tokens == m.usage.input_tokens + m.usage.cache_read_input_tokens


def test_stream_and_get_final_message(client: anthropic.Anthropic) -> None:
    kw = dict(model=MODEL, messages=CONVERSATION, max_tokens=12, **GREEDY)
    whole = client.messages.create(**kw)
    with client.messages.stream(**kw) as stream:
        events = [e.type for e in stream]
        final = stream.get_final_message()
    assert events[0] == "message_start"
    assert events[-2:] == ["message_delta", "message_stop"]
    assert "content_block_start" in events and "content_block_stop" in events
    assert final.content[0].text == whole.content[0].text
    assert final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_raw_stream_is_anthropics_event_sequence(keyed_front) -> None:
    url, key = keyed_front
    body = {"model": MODEL, "messages": CONVERSATION, "max_tokens": 6, "stream": True}
    with httpx.stream(
        "POST", url + "/v1/messages", json=body, headers={"x-api-key": key}, timeout=60
    ) as r:
        lines = [line for line in r.iter_lines() if line.startswith("event:")]
    kinds = [line.split(":", 1)[1].strip() for line in lines]
    assert kinds[:3] == ["message_start", "ping", "content_block_start"]
    assert set(kinds[3:-3]) == {"content_block_delta"}
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]


def _forced_tool_use(client: anthropic.Anthropic, stream: bool) -> anthropic.types.Message:
    kw = dict(
        model=MODEL,
        messages=[{"role": "user", "content": ASK}],
        tools=TOOLS,
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
        max_tokens=200,
        **GREEDY,
    )
    if stream:
        with client.messages.stream(**kw) as s:
            m = s.get_final_message()
    else:
        m = client.messages.create(**kw)
    assert m.stop_reason == "tool_use", m
    (use,) = [b for b in m.content if b.type == "tool_use"]
    assert use.name == "get_weather"
    jsonschema.validate(use.input, WEATHER_SCHEMA)
    return m


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_tool_use_tool_result_round_trip(client: anthropic.Anthropic, keyed_front, stream) -> None:
    first = _forced_tool_use(client, stream)
    use = next(b for b in first.content if b.type == "tool_use")
    messages = [
        {"role": "user", "content": ASK},
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": use.id, "content": TOOL_RESULT}],
        },
    ]
    m = client.messages.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=12, **GREEDY)
    text, _ = chat_text(
        *keyed_front,
        [
            {"role": "user", "content": ASK},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {
                        "id": use.id,
                        "type": "function",
                        "function": {"name": use.name, "arguments": json.dumps(use.input)},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": use.id, "content": TOOL_RESULT},
        ],
        12,
        tools=CHAT_TOOLS,
    )
    assert "".join(b.text for b in m.content if b.type == "text") == text


def test_named_tool_choice(client: anthropic.Anthropic) -> None:
    m = client.messages.create(
        model=MODEL,
        messages=[{"role": "user", "content": ASK}],
        tools=TOOLS,
        tool_choice={"type": "tool", "name": "get_weather"},
        max_tokens=200,
        **GREEDY,
    )
    (use,) = [b for b in m.content if b.type == "tool_use"]
    jsonschema.validate(use.input, WEATHER_SCHEMA)


def test_stop_sequence_is_reported(client: anthropic.Anthropic) -> None:
    """A stop sequence the greedy text contains ends it there, as ``stop_sequence``."""
    whole = client.messages.create(model=MODEL, messages=CONVERSATION, max_tokens=12, **GREEDY)
    text = whole.content[0].text
    stop = text[len(text) // 2 :][:3].strip() or text[-1]
    m = client.messages.create(
        model=MODEL, messages=CONVERSATION, max_tokens=12, stop_sequences=[stop], **GREEDY
    )
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop
    assert text.startswith(m.content[0].text if m.content else "")


BAD_BODIES = [
    {"messages": CONVERSATION},  # no max_tokens
    {"messages": CONVERSATION, "max_tokens": 0},
    {"messages": [], "max_tokens": 4},
    {"messages": [{"role": "robot", "content": "x"}], "max_tokens": 4},
    {"messages": [{"role": "user", "content": [{"type": "image"}]}], "max_tokens": 4},
    {"messages": [{"role": "user", "content": [{"type": "tool_result"}]}], "max_tokens": 4},
    {"messages": CONVERSATION, "max_tokens": 4, "tool_choice": {"type": "any"}},
    {"messages": CONVERSATION, "max_tokens": 4, "tools": TOOLS, "tool_choice": {"type": "x"}},
    {"messages": CONVERSATION, "max_tokens": 4, "tools": [{"type": "bash_20250124"}]},
    {"messages": CONVERSATION, "max_tokens": 4, "system": 7},
    {"messages": CONVERSATION, "max_tokens": 4, "top_p": 2},
]


@pytest.mark.parametrize("body", BAD_BODIES, ids=[json.dumps(b)[:60] for b in BAD_BODIES])
def test_bad_input_is_a_4xx_in_anthropics_shape(keyed_front, body: dict) -> None:
    url, key = keyed_front
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        r = httpx.post(url + path, json={"model": MODEL, **body}, headers={"x-api-key": key})
        if path.endswith("count_tokens") and r.status_code == 200:
            continue  # count_tokens takes no max_tokens nor sampling fields
        assert 400 <= r.status_code < 500, r.text
        error = r.json()
        assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
        assert error["error"]["message"]


def test_sdk_raises_typed_errors(client: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.BadRequestError) as bad:
        client.messages.create(model=MODEL, messages=[], max_tokens=4)
    assert bad.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="no-such-model", messages=CONVERSATION, max_tokens=4)


def test_x_api_key_and_bearer_both_authenticate(llama_dir, tmp_path: Path) -> None:
    internal = ("--internal-api-key", "sk-internal")  # the proxy's credential at the engine
    srv = ServerProcess(
        str(llama_dir), *ENGINE_FLAGS, *internal, api_key="sk-k", log_path=tmp_path / "e.log"
    )
    proxy = ProxyProcess("--node", srv.url, *internal, log_path=tmp_path / "p.log")
    try:
        srv.wait_ready()
        proxy.wait_healthy([srv.url])
        for url, key in ((srv.url, "sk-k"), (proxy.url, proxy.api_key)):
            ok = anthropic.Anthropic(base_url=url, api_key=key, max_retries=0)
            assert ok.messages.create(model=MODEL, messages=CONVERSATION, max_tokens=2).content
            bearer = anthropic.Anthropic(base_url=url, auth_token=key, max_retries=0)
            assert bearer.messages.count_tokens(model=MODEL, messages=CONVERSATION).input_tokens
            wrong = anthropic.Anthropic(base_url=url, api_key="sk-wrong", max_retries=0)
            with pytest.raises(anthropic.AuthenticationError) as denied:
                wrong.messages.create(model=MODEL, messages=CONVERSATION, max_tokens=2)
            assert denied.value.body["error"]["type"] == "authentication_error"
    finally:
        stop_all([proxy, srv])


def test_openapi_describes_the_messages_routes(keyed_front) -> None:
    url, key = keyed_front
    spec = httpx.get(url + "/openapi.json", headers={"x-api-key": key}, timeout=30).json()
    for path, model in [
        ("/v1/messages", "MessagesRequest"),
        ("/v1/messages/count_tokens", "CountTokensRequest"),
    ]:
        op = spec["paths"][path]["post"]
        ref = op["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        assert ref.endswith("/" + model)
        error = op["responses"]["400"]["content"]["application/json"]["schema"]["$ref"]
        assert error.endswith("/AnthropicError")
    assert {"max_tokens", "system", "tools", "tool_choice", "stop_sequences"} <= set(
        spec["components"]["schemas"]["MessagesRequest"]["properties"]
    )


def test_a_client_leaving_mid_stream_aborts_the_request(stack) -> None:
    """On the engine, at once, even while the engine holds the request (paused)."""
    url, headers = front_of(stack, "engine")
    body = {"model": MODEL, "messages": CONVERSATION, "max_tokens": 450}
    leaving_aborts(stack[0], url + "/v1/messages", body, headers)
