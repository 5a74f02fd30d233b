"""Tool-call and reasoning parsers, and the request fields that ask for a grammar: pure
functions, fed whole and character by character (the streamed deltas must add up to the
non-streamed message)."""

from __future__ import annotations

import json

import pytest

from tandem.server.api.chat_choice import ChoiceStream, chat_message
from tandem.server.api.grammar_request import request_spec
from tandem.server.api.reasoning import split_qwen3
from tandem.server.api.tool_parsers import (
    hermes,
    json_array,
    llama3_json,
    message_tool_calls,
    parser_for_template,
    tool_plan,
)
from tandem.server.wire.errors import APIError
from tandem.server.wire.protocol import ChatCompletionRequest, CompletionRequest

HERMES = (
    "Let me check.<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2]}}\n'
    "</tool_call>\n<tool_call>\n"
    '{"name": "get_time", "arguments": {"zone": "utc"}}\n</tool_call>'
)
LLAMA = (
    '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
    '{"name": "get_time", "parameters": {}}'
)
ARRAY = '[{"name": "get_weather", "parameters": {"city": "Rome"}}, {"name": "get_time", "parameters": {"zone": "cet"}}]'


def streamed(parser, text: str, reasoning: bool = False) -> tuple[str, str, list[dict]]:
    s = ChoiceStream(parser, reasoning)
    content, thought, deltas = "", "", []
    for i in range(1, len(text) + 1):
        d = s.delta(text[:i], final=i == len(text))
        content += d.get("content", "")
        thought += d.get("reasoning_content", "")
        deltas += d.get("tool_calls", [])
    return content, thought, message_tool_calls(deltas)


@pytest.mark.parametrize(
    "parser,text,content",
    [(hermes, HERMES, "Let me check."), (llama3_json, LLAMA, ""), (json_array, ARRAY, "")],
)
def test_calls_streamed_equal_whole(parser, text: str, content: str) -> None:
    msg, reason = chat_message(text, "stop", parser, False)
    assert reason == "tool_calls"
    assert (msg["content"] or "") == content
    names = [c["function"]["name"] for c in msg["tool_calls"]]
    assert names[0] == "get_weather" and names[1] == "get_time"
    assert all(json.loads(c["function"]["arguments"]) is not None for c in msg["tool_calls"])
    got_content, _, calls = streamed(parser, text)
    assert got_content == content
    assert [c["function"] for c in calls] == [c["function"] for c in msg["tool_calls"]]
    assert len({c["id"] for c in calls}) == 2


def test_plain_text_and_a_cut_off_call_are_content() -> None:
    msg, reason = chat_message("Just prose, no <tool", "stop", hermes, False)
    assert msg["content"] == "Just prose, no <tool" and "tool_calls" not in msg
    assert streamed(hermes, "Just prose, no <tool")[0] == "Just prose, no <tool"
    cut = '<tool_call>{"name": "f", "arguments": {"a": '
    msg, reason = chat_message(cut, "length", hermes, False)
    assert msg["content"] == cut and reason == "length"


def test_reasoning_split_and_streamed() -> None:
    text = "<think>\nweigh it up\n</think>\n\nThe answer."
    assert split_qwen3(text, True) == ("weigh it up", "The answer.")
    content, thought, _ = streamed(None, text, reasoning=True)
    assert content == "The answer." and thought.strip() == "weigh it up"
    assert split_qwen3("No thinking here.", True) == ("", "No thinking here.")
    msg, _ = chat_message(text.replace("The answer.", HERMES), "stop", hermes, True)
    assert msg["reasoning_content"] == "weigh it up" and len(msg["tool_calls"]) == 2


def test_parser_by_template_family() -> None:
    assert parser_for_template("{{ '<tool_call>' }}") == "hermes"
    assert parser_for_template("<|python_tag|>{{ ipython }}") == "llama3_json"
    assert parser_for_template(None) == "hermes"


def test_request_fields_map_to_one_grammar() -> None:
    chat = ChatCompletionRequest.model_validate(
        {
            "messages": "hi",
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "object"}},
            },
        }
    )
    assert request_spec(chat).kind == "json_schema"
    for extra, kind in [
        ({"guided_json": {"type": "object"}}, "json_schema"),
        ({"guided_regex": "a+"}, "regex"),
        ({"guided_choice": ["a", "b"]}, "choice"),
        ({"guided_grammar": 'root ::= "a"'}, "grammar"),
        ({"structured_outputs": {"json_object": True}}, "json"),
        ({"response_format": {"type": "regex_schema", "regex_schema": "a"}}, "regex"),
        ({"response_format": {"type": "json_object"}}, "json"),
        ({"response_format": {"type": "text"}}, None),
    ]:
        spec = request_spec(CompletionRequest.model_validate({"prompt": "x", **extra}))
        assert (spec.kind if spec else None) == kind
    with pytest.raises(APIError):
        request_spec(
            CompletionRequest.model_validate(
                {"prompt": "x", "guided_regex": "a", "guided_choice": ["b"]}
            )
        )
    with pytest.raises(APIError):
        request_spec(CompletionRequest.model_validate({"prompt": "x", "guided_choice": []}))


def test_tool_choice_plans() -> None:
    tools = ChatCompletionRequest.model_validate(
        {
            "messages": "hi",
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
        }
    ).tools
    assert tool_plan(tools, "none", True, "hermes") == (None, None)
    spec, parse = tool_plan(tools, "required", False, "hermes")
    assert json.loads(spec.source)["maxItems"] == 1 and parse is json_array
    spec, parse = tool_plan(tools, {"type": "function", "function": {"name": "f"}}, True, "hermes")
    assert spec.kind == "json_schema" and parse('{"a": 1}', True)[1][0].name == "f"
    with pytest.raises(APIError):
        tool_plan(tools, {"type": "function", "function": {"name": "g"}}, True, "hermes")
    with pytest.raises(APIError):
        tool_plan(None, "required", True, "hermes")
    _, first = tool_plan(tools, "auto", False, "hermes")
    assert len(first(HERMES, True)[1]) == 1
