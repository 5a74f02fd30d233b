"""Helpers for the Responses and Messages API tests (no tests here): the tool both APIs are
asked to call, and the Chat Completions text they must equal."""

from __future__ import annotations

from typing import Any

import openai

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
    url: str, key: str, messages: list[dict[str, Any]], max_tokens: int, **kw: Any
) -> tuple[str, str | None]:
    """Greedy Chat Completions text (and finish reason) of ``messages``: what the other APIs'
    text must equal for the same conversation."""
    client = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=120)
    r = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=max_tokens, temperature=0, **kw
    )
    return r.choices[0].message.content or "", r.choices[0].finish_reason
