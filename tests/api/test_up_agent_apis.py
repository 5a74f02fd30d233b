"""The Responses and Messages APIs through ``tandem up``'s default plane (the default model,
one prefill and one decode engine behind the proxy), with the official ``openai`` and
``anthropic`` clients and the OpenAI Agents SDK, unchanged: what an agent pointed at a
local Tandem meets."""

from __future__ import annotations

import json
import os
import signal
import subprocess

import anthropic
import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tandem.server.engine.default_model import NAME, default_model_path

from ..utils import start_up
from .utils import (
    ASK,
    TOOL_RESULT,
    WEATHER_SCHEMA,
    chat_text,
    check_two_step_loop,
    run_weather_agent,
)

pytestmark = pytest.mark.timeout(900)

KEY = "sk-up"
GREEDY = {"extra_body": {"temperature": 0}}


class Capital(BaseModel):
    country: str = Field(max_length=20)
    city: str = Field(max_length=20)


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory):
    """``tandem up``'s base URL (``.../v1``); P/D: the proxy hands every prompt off."""
    default_model_path()  # in the cache before tandem up looks
    logs = tmp_path_factory.mktemp("up-agent-apis")
    env = dict(os.environ, OPENAI_AGENTS_DISABLE_TRACING="1")
    proc, base, _ = start_up(
        ["--port", "0", "--api-key", KEY, "--log-dir", str(logs), "--grace", "10"], env, 400
    )
    try:
        yield base
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


def test_responses_through_pd(up: str) -> None:
    client = openai.OpenAI(base_url=up, api_key=KEY, max_retries=0, timeout=120)
    kw = dict(model=NAME, input="What is the capital of France?", max_output_tokens=16)
    r = client.responses.create(temperature=0, **kw)
    proxy = up.removesuffix("/v1")
    text, _ = chat_text(proxy, KEY, [{"role": "user", "content": kw["input"]}], 16, model=NAME)
    assert r.output_text == text
    with client.responses.stream(temperature=0, **kw) as s:
        deltas = "".join(e.delta for e in s if e.type == "response.output_text.delta")
    assert deltas == text
    parsed = client.responses.parse(
        model=NAME, input=kw["input"], text_format=Capital, max_output_tokens=60, temperature=0
    )
    assert isinstance(parsed.output_parsed, Capital)
    tools = [{"type": "function", "name": "get_weather", "parameters": WEATHER_SCHEMA}]
    first = client.responses.create(
        model=NAME, input=ASK, tools=tools, tool_choice="required", parallel_tool_calls=False,
        max_output_tokens=80, temperature=0,
    )  # fmt: skip
    call = next(o for o in first.output if o.type == "function_call")
    jsonschema.validate(json.loads(call.arguments), WEATHER_SCHEMA)
    result = {"type": "function_call_output", "call_id": call.call_id, "output": TOOL_RESULT}
    step = dict(model=NAME, tools=tools, max_output_tokens=16, temperature=0)
    by_id = client.responses.create(previous_response_id=first.id, input=[result], **step)
    items = [{"role": "user", "content": ASK}, *[o.model_dump() for o in first.output], result]
    assert client.responses.create(input=items, **step).output_text == by_id.output_text
    metrics = httpx.get(proxy + "/metrics", timeout=10).text
    assert 'mode="disaggregated"' in metrics


def test_messages_through_pd(up: str) -> None:
    proxy = up.removesuffix("/v1")
    client = anthropic.Anthropic(base_url=proxy, api_key=KEY, max_retries=0, timeout=120)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    m = client.messages.create(model=NAME, messages=messages, max_tokens=16, **GREEDY)
    text, _ = chat_text(proxy, KEY, messages, 16, model=NAME)
    assert m.content[0].text == text
    with client.messages.stream(model=NAME, messages=messages, max_tokens=16, **GREEDY) as s:
        assert s.get_final_message().content[0].text == text
    counted = client.messages.count_tokens(model=NAME, messages=messages)
    assert counted.input_tokens == m.usage.input_tokens + m.usage.cache_read_input_tokens
    tools = [{"name": "get_weather", "input_schema": WEATHER_SCHEMA}]
    ask = [{"role": "user", "content": ASK}]
    first = client.messages.create(
        model=NAME, messages=ask, tools=tools, tool_choice={"type": "any"}, max_tokens=80, **GREEDY
    )
    use = next(b for b in first.content if b.type == "tool_use")
    jsonschema.validate(use.input, WEATHER_SCHEMA)
    reply = [{"type": "tool_result", "tool_use_id": use.id, "content": TOOL_RESULT}]
    turns = [
        *ask,
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
        {"role": "user", "content": reply},
    ]
    answer = client.messages.create(
        model=NAME, messages=turns, tools=tools, max_tokens=16, **GREEDY
    )
    assert answer.stop_reason in ("end_turn", "max_tokens", "tool_use")


def test_agents_sdk_through_pd(up: str) -> None:
    check_two_step_loop(*run_weather_agent(up, NAME, KEY))
