"""A real agent framework against Tandem with no adapter code: the OpenAI Agents SDK
(``openai-agents``) with its Responses model pointed at ``tandem serve`` on the shipped
default model runs a two-step function-tool loop (``utils.run_weather_agent``); the same
loop through ``tandem up``'s P/D plane is in ``test_up_agent_apis.py``."""

from __future__ import annotations

import pytest

from tandem.server.engine.default_model import NAME, default_model_path

from ..utils import ENGINE_FLAGS, ServerProcess
from .utils import check_two_step_loop, run_weather_agent

pytestmark = pytest.mark.timeout(600)


def test_agents_sdk_runs_a_two_step_tool_loop(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("OPENAI_AGENTS_DISABLE_TRACING", "1")
    srv = ServerProcess(
        str(default_model_path()),
        *ENGINE_FLAGS,
        served_model_name=NAME,
        log_path=tmp_path / "e.log",
    )
    try:
        srv.wait_ready()
        check_two_step_loop(*run_weather_agent(srv.url + "/v1", NAME))
    finally:
        srv.stop()
