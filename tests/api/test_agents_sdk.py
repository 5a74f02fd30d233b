"""A real agent framework against Tandem with no adapter code: the OpenAI Agents SDK
(``openai-agents``) with its Responses model pointed at ``tandem serve`` on the shipped
default model runs a two-step function-tool loop (the model calls the tool, the SDK runs it
and sends the result back, the model answers).

The first step is forced (``tool_choice="required"``, which the grammar enforces; the SDK
resets it to ``auto`` once the tool ran), since a 135M model need not choose to call a
tool. Tracing is off and the model is the one in the local cache: only loopback is
contacted."""

from __future__ import annotations

import asyncio
import json

import openai
import pytest

from tandem.server.engine.default_model import NAME, default_model_path

from ..utils import ENGINE_FLAGS, ServerProcess

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    logs = tmp_path_factory.mktemp("agents")
    srv = ServerProcess(
        str(default_model_path()), *ENGINE_FLAGS, served_model_name=NAME, log_path=logs / "e.log"
    )
    try:
        with pytest.MonkeyPatch.context() as env:
            env.setenv("OPENAI_AGENTS_DISABLE_TRACING", "1")
            srv.wait_ready()
            yield srv
    finally:
        srv.stop()


def test_agents_sdk_runs_a_two_step_tool_loop(server: ServerProcess) -> None:
    from agents import (
        Agent,
        ModelSettings,
        OpenAIResponsesModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )
    from agents.items import MessageOutputItem, ToolCallItem, ToolCallOutputItem

    set_tracing_disabled(True)
    calls: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        calls.append(city)
        return f"It is sunny in {city}."

    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    agent = Agent(
        name="weather",
        instructions="You answer questions about the weather using the tool.",
        model=OpenAIResponsesModel(NAME, client),
        model_settings=ModelSettings(tool_choice="required", temperature=0, max_tokens=48),
        tools=[get_weather],
    )
    result = asyncio.run(Runner.run(agent, "What is the weather in Paris?", max_turns=4))

    assert len(calls) == 1 and calls[0]
    kinds = [type(item) for item in result.new_items]
    assert kinds[:2] == [ToolCallItem, ToolCallOutputItem]
    assert kinds[-1] is MessageOutputItem
    call = result.new_items[0].raw_item
    assert call.name == "get_weather" and json.loads(call.arguments)["city"] == calls[0]
    assert isinstance(result.final_output, str) and result.final_output
    assert len(result.raw_responses) == 2  # two model steps: the call, then the answer
