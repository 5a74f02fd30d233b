"""Helpers for the Responses and Messages API tests (no tests here): the tool both APIs are
asked to call, the Chat Completions text they must equal, a client leaving mid-stream, and the Agents
SDK's tool loop; and the LoRA tests' engine and prompt."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import openai

from ..utils import ADMIN_KEY, API_KEY, ENGINE_FLAGS, ServerProcess, aborted_count, held, wait_until

WEATHER_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 10},
        "unit": {"type": "string", "enum": ["c", "f"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
ASK = "What is the weather in Paris?"
TOOL_RESULT = "sunny, 21 degrees"


def chat_text(
    url: str,
    key: str,
    messages: list[dict[str, Any]],
    max_tokens: int,
    model: str = "tiny",
    **kw: Any,
) -> tuple[str, str | None]:
    """Greedy Chat Completions text (and finish reason) of ``messages``: what the other APIs'
    text must equal for the same conversation."""
    client = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=120)
    r = client.chat.completions.create(
        model=model, messages=messages, max_tokens=max_tokens, temperature=0, **kw
    )
    return r.choices[0].message.content or "", r.choices[0].finish_reason


def run_weather_agent(base_url: str, model: str, api_key: str = "unused") -> tuple[Any, list[str]]:
    """The OpenAI Agents SDK's two-step loop against ``base_url`` (``.../v1``): its Responses
    model calls ``get_weather`` (forced: ``tool_choice="required"``, which the SDK resets to
    ``auto`` once the tool ran), the SDK runs it and sends the result back, the model
    answers. Tracing is off: only loopback is contacted. The run's result and the cities
    the tool was called with."""
    from agents import (
        Agent,
        ModelSettings,
        OpenAIResponsesModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )

    set_tracing_disabled(True)
    calls: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        calls.append(city)
        return f"It is sunny in {city}."

    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    agent = Agent(
        name="weather",
        instructions="You answer questions about the weather using the tool.",
        model=OpenAIResponsesModel(model, client),
        model_settings=ModelSettings(tool_choice="required", temperature=0, max_tokens=48),
        tools=[get_weather],
    )
    return asyncio.run(Runner.run(agent, "What is the weather in Paris?", max_turns=4)), calls


def check_two_step_loop(result: Any, calls: list[str]) -> None:
    """One tool call (with the city the tool got), its output, then the model's answer."""
    from agents.items import MessageOutputItem, ToolCallItem, ToolCallOutputItem

    assert len(calls) == 1 and calls[0]
    kinds = [type(item) for item in result.new_items]
    assert kinds[:2] == [ToolCallItem, ToolCallOutputItem]
    assert kinds[-1] is MessageOutputItem
    call = result.new_items[0].raw_item
    assert call.name == "get_weather" and json.loads(call.arguments)["city"] == calls[0]
    assert isinstance(result.final_output, str) and result.final_output
    assert len(result.raw_responses) == 2  # two model steps: the call, then the answer


def leaving_aborts(engine: Any, url: str, body: dict[str, Any], headers: dict[str, str]) -> None:
    """A client that hangs up mid-stream (``url``: the engine, or a proxy in front of it):
    once its first event came, ``engine`` is paused (so the request cannot finish on its
    own), the client leaves, and the engine aborts the request (its metrics count it)."""
    before = aborted_count(engine)
    with httpx.stream("POST", url, json={**body, "stream": True}, headers=headers, timeout=60) as r:
        lines = r.iter_lines()
        assert any(next(lines).startswith("data:") for _ in range(6))
        with held(engine):
            r.close()
            wait_until(lambda: aborted_count(engine) > before, what="the engine aborting")


LORA_BASE = "tiny"  # the base model's served name in the LoRA tests
LORA_PROMPT = "The scheduler decides, at every step, which requests run"


def lora_engine(model_dir: Path, log_dir: Path, *flags: str) -> ServerProcess:
    """``tandem serve`` of a tiny model with LoRA ``flags``, the client and admin keys."""
    return ServerProcess(
        str(model_dir),
        *ENGINE_FLAGS,
        *flags,
        api_key=API_KEY,
        admin_key=ADMIN_KEY,
        served_model_name=LORA_BASE,
        log_path=log_dir / "server.log",
    )
