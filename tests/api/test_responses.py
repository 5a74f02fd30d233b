"""OpenAI's Responses API through the official ``openai`` client, unchanged, against
``tandem serve``, the proxy over it (aggregated) and the proxy disaggregating (P/D): text
equal to Chat Completions', the typed event stream, ``responses.parse``, a function-tool
round trip by ``previous_response_id`` and by explicit items, stored responses per key, and
bad input answered 4xx in OpenAI's shape.

The model has random weights: tool calls are forced (``tool_choice: required``) and
structured output holds only by the grammar, as in ``test_structured_output.py``.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from ..proxy.utils import ProxyProcess, front_of, stop_all
from ..utils import ENGINE_FLAGS, ServerProcess
from .utils import ASK, TOOL_RESULT, WEATHER_SCHEMA, chat_text, leaving_aborts

pytestmark = pytest.mark.timeout(600)

MODEL = "tiny"
TOOLS = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "Weather",
        "parameters": WEATHER_SCHEMA,
        "strict": True,
    }
]
CHAT_TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER_SCHEMA},
    }
]


class Forecast(BaseModel):
    city: str = Field(max_length=8)
    unit: str = Field(pattern="^(c|f)$")
    high: int = Field(ge=-50, le=60)


@pytest.fixture
def client(keyed_front) -> openai.OpenAI:
    url, key = keyed_front
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=120)


def test_create_text_equals_chat_completions(client: openai.OpenAI, keyed_front) -> None:
    r = client.responses.create(
        model=MODEL,
        instructions="Answer briefly.",
        input="Tell me about Paris.",
        max_output_tokens=12,
        temperature=0,
    )
    text, finish = chat_text(
        *keyed_front,
        [
            {"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": "Tell me about Paris."},
        ],
        12,
    )
    assert r.output_text == text
    assert r.status == ("incomplete" if finish == "length" else "completed")
    assert r.object == "response" and r.id.startswith("resp_")
    assert r.usage.input_tokens > 0 and r.usage.output_tokens > 0
    assert r.usage.input_tokens_details.cached_tokens >= 0


def test_stream_emits_the_typed_events_in_order(client: openai.OpenAI) -> None:
    kw = dict(model=MODEL, input="Tell me about Paris.", max_output_tokens=12, temperature=0)
    whole = client.responses.create(**kw)
    with client.responses.stream(**kw) as stream:
        events = list(stream)
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete" if whole.status == "incomplete" else "response.completed",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == whole.output_text
    assert events[-1].response.output[0].content[0].text == whole.output_text
    assert events[-1].response.usage.output_tokens == whole.usage.output_tokens


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_parse_with_a_pydantic_model(client: openai.OpenAI, stream: bool) -> None:
    kw = dict(model=MODEL, input=ASK, text_format=Forecast, max_output_tokens=120, temperature=0)
    if stream:
        with client.responses.stream(**kw) as s:
            for _ in s:
                pass
            r = s.get_final_response()
    else:
        r = client.responses.parse(**kw)
    assert r.status == "completed"
    assert isinstance(r.output_parsed, Forecast)


def _forced_call(client: openai.OpenAI) -> openai.types.responses.Response:
    r = client.responses.create(
        model=MODEL,
        input=ASK,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=200,
        temperature=0,
    )
    calls = [o for o in r.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather", r.output
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER_SCHEMA)
    return r


def test_function_tool_round_trip(client: openai.OpenAI, keyed_front) -> None:
    """The tool's result goes back by ``previous_response_id`` and by explicit items; both
    are the same conversation, so greedy text equals Chat Completions' for it."""
    first = _forced_call(client)
    call = next(o for o in first.output if o.type == "function_call")
    result = {"type": "function_call_output", "call_id": call.call_id, "output": TOOL_RESULT}
    kw = dict(model=MODEL, tools=TOOLS, max_output_tokens=12, temperature=0)
    by_id = client.responses.create(previous_response_id=first.id, input=[result], **kw)
    items = [{"role": "user", "content": ASK}, *[o.model_dump() for o in first.output], result]
    by_items = client.responses.create(input=items, **kw)
    assert by_id.previous_response_id == first.id
    assert by_id.output_text == by_items.output_text
    text, _ = chat_text(
        *keyed_front,
        [
            {"role": "user", "content": ASK},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": call.call_id,
                        "type": "function",
                        "function": {"name": call.name, "arguments": call.arguments},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": call.call_id, "content": TOOL_RESULT},
        ],
        12,
        tools=CHAT_TOOLS,
    )
    assert by_id.output_text == text


def test_stored_response_can_be_read_and_deleted(client: openai.OpenAI) -> None:
    r = client.responses.create(model=MODEL, input="Hi", max_output_tokens=4, temperature=0)
    got = client.responses.retrieve(r.id)
    assert got.id == r.id and got.output_text == r.output_text
    with pytest.raises(openai.BadRequestError):
        client.responses.cancel(r.id)  # only background responses can be cancelled
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    unstored = client.responses.create(
        model=MODEL, input="Hi", max_output_tokens=4, temperature=0, store=False
    )
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(
            model=MODEL, input="Hi", max_output_tokens=4, previous_response_id=unstored.id
        )


BAD_BODIES = [
    {},
    {"input": ""},
    {"input": []},
    {"input": 5},
    {"input": "x", "max_output_tokens": 0},
    {"input": [{"type": "message", "role": "robot", "content": "x"}]},
    {"input": [{"type": "message", "role": "user", "content": [{"type": "input_image"}]}]},
    {"input": [{"type": "function_call", "name": "f"}]},
    {"input": [{"type": "web_search_call"}]},
    {"input": "x", "tools": [{"type": "web_search"}]},
    {"input": "x", "tool_choice": {"type": "file_search"}, "tools": TOOLS},
    {"input": "x", "tool_choice": "required"},
    {"input": "x", "text": {"format": {"type": "yaml"}}},
    {"input": "x", "text": {"format": {"type": "json_schema", "schema": 3}}},
    {"input": "x", "background": True},
    {"input": "x", "temperature": "hot"},
]


@pytest.mark.parametrize("body", BAD_BODIES, ids=[json.dumps(b)[:60] for b in BAD_BODIES])
def test_bad_input_is_a_4xx_in_openais_shape(keyed_front, body: dict) -> None:
    url, key = keyed_front
    r = httpx.post(
        url + "/v1/responses",
        json={"model": MODEL, **body},
        headers={"Authorization": f"Bearer {key}"},
        timeout=60,
    )
    assert 400 <= r.status_code < 500, r.text
    assert set(r.json()["error"]) >= {"message", "type"}


def test_stored_responses_belong_to_their_key(llama_dir, tmp_path: Path) -> None:
    """Another key never sees (or continues) a stored response, on the engine or the proxy."""
    keys = tmp_path / "keys"
    keys.write_text("sk-alice\nsk-bob\n")
    internal = ("--internal-api-key", "sk-internal")  # the proxy's credential at the engine
    srv = ServerProcess(
        str(llama_dir), *ENGINE_FLAGS, "--api-key-file", str(keys), *internal,
        log_path=tmp_path / "e.log",
    )  # fmt: skip
    proxy = ProxyProcess(
        "--node", srv.url, "--api-key-file", str(keys), *internal, log_path=tmp_path / "p.log"
    )
    try:
        srv.wait_ready()
        proxy.wait_healthy([srv.url])
        for url in (srv.url, proxy.url):
            alice, bob = (
                openai.OpenAI(base_url=url + "/v1", api_key=k, max_retries=0)
                for k in ("sk-alice", "sk-bob")
            )
            r = alice.responses.create(model=MODEL, input="Hi", max_output_tokens=4)
            assert alice.responses.retrieve(r.id).id == r.id
            with pytest.raises(openai.NotFoundError):
                bob.responses.retrieve(r.id)
            with pytest.raises(openai.NotFoundError):
                bob.responses.create(
                    model=MODEL, input="Hi", max_output_tokens=4, previous_response_id=r.id
                )
            with pytest.raises(openai.NotFoundError):
                bob.responses.delete(r.id)
            assert alice.responses.retrieve(r.id).id == r.id
    finally:
        stop_all([proxy, srv])


def test_openapi_describes_the_responses_routes(keyed_front) -> None:
    url, key = keyed_front
    spec = httpx.get(url + "/openapi.json", headers={"Authorization": f"Bearer {key}"}).json()
    paths = spec["paths"]
    op = paths["/v1/responses"]["post"]
    ref = op["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    assert ref.endswith("/ResponsesRequest")
    assert "text/event-stream" in op["responses"]["200"]["content"]
    assert {"get", "delete"} <= set(paths["/v1/responses/{response_id}"])
    assert "post" in paths["/v1/responses/{response_id}/cancel"]
    assert {"input", "instructions", "previous_response_id", "store", "text", "tools"} <= set(
        spec["components"]["schemas"]["ResponsesRequest"]["properties"]
    )


def test_a_client_leaving_mid_stream_aborts_the_request(stack) -> None:
    """On the engine, at once, even while the engine holds the request (paused)."""
    url, headers = front_of(stack, "engine")
    body = {"model": MODEL, "input": "Hi", "max_output_tokens": 450}
    leaving_aborts(stack[0], url + "/v1/responses", body, headers)
