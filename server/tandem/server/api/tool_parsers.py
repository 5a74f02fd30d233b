"""Tool calls out of the model's text, for ``message.tool_calls`` and streamed ``delta.tool_calls``.

Formats by chat-template family: ``hermes`` (``<tool_call>{"name", "arguments"}</tool_call>``:
Qwen2.5, Qwen3, SmolLM2, ChatML) and ``llama3_json`` (a bare ``{"name", "parameters"}``,
``;``-separated, after an optional ``<|python_tag|>``). With ``tool_choice`` ``required`` the
grammar makes the model write a JSON array of ``{"name", "parameters"}`` (``array``); with a
named function it writes that function's arguments object and nothing else (``named``).

Every parser reads the whole text so far and returns the content and the calls found, the last
one possibly incomplete; ``ToolCallStream`` turns successive parses into deltas (a call's id and
name once, then its arguments as they grow), so streamed and non-streamed output come from
the same code. Arguments are the model's own JSON text, never re-serialised, so the streamed
pieces concatenate to exactly the final arguments.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tandem.server.engine.structured import GrammarSpec
from tandem.server.wire.errors import APIError
from tandem.server.wire.protocol import Tool

PARSERS = ("hermes", "llama3_json")
_CALL_HEAD = re.compile(
    r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*'
)
_DECODER = json.JSONDecoder()


@dataclass(frozen=True)
class Call:
    name: str | None  # None until the model has written it
    arguments: str
    complete: bool


Parser = Callable[[str, bool], tuple[str, list[Call]]]


def parser_for_template(chat_template: str | None) -> str:
    """The format a model's chat template teaches (Hermes unless it is Llama 3's)."""
    template = chat_template or ""
    if "<tool_call>" not in template and ("<|python_tag|>" in template or "ipython" in template):
        return "llama3_json"
    return "hermes"


def _scan_call(text: str, pos: int) -> tuple[Call, int | None]:
    """One ``{"name": ..., "arguments": {...}}`` at ``pos``; the end index once complete."""
    m = _CALL_HEAD.match(text, pos)
    if m is None:
        return Call(None, "", False), None
    name = json.loads(f'"{m.group(1)}"')
    start = m.end()
    try:
        _, end = _DECODER.raw_decode(text, start)
    except ValueError:
        return Call(name, text[start:], False), None
    close = re.compile(r"\s*\}").match(text, end)
    if close is None:
        return Call(name, text[start:end], False), None
    return Call(name, text[start:end], True), close.end()


def partial_tag_len(text: str, tag: str) -> int:
    """How many trailing characters could be the start of ``tag``."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


def hermes(text: str, final: bool) -> tuple[str, list[Call]]:
    open_tag = "<tool_call>"
    i = text.find(open_tag)
    if i < 0:
        return (text if final else text[: len(text) - partial_tag_len(text, open_tag)]), []
    calls = []
    pos = i
    while pos >= 0:
        call, end = _scan_call(text, pos + len(open_tag))
        calls.append(call)
        if end is None:
            break
        pos = text.find(open_tag, end)
    return text[:i], calls


def llama3_json(text: str, final: bool) -> tuple[str, list[Call]]:
    body = text.lstrip()
    tag = "<|python_tag|>"
    if body.startswith(tag):
        body = body[len(tag) :]
    elif not final and tag.startswith(body):
        return "", []
    if not body.lstrip().startswith("{"):
        return (text if final or body else ""), []
    calls, pos = [], 0
    while True:
        call, end = _scan_call(body, pos)
        calls.append(call)
        if end is None:
            return "", calls
        nxt = re.compile(r"\s*;\s*").match(body, end)
        if nxt is None or nxt.end() >= len(body):
            return "", calls
        pos = nxt.end()


def json_array(text: str, final: bool) -> tuple[str, list[Call]]:
    """``tool_choice: required``: the grammar forces ``[{"name", "parameters"}, ...]``."""
    m = re.compile(r"\s*\[").match(text)
    if m is None:
        return "", []
    calls, pos = [], m.end()
    while True:
        call, end = _scan_call(text, pos)
        if call.name is None and not calls:
            return "", []
        calls.append(call)
        if end is None:
            return "", calls
        sep = re.compile(r"\s*,").match(text, end)
        if sep is None:
            return "", calls
        pos = sep.end()


def named(name: str) -> Parser:
    """A named ``tool_choice``: the whole output is the function's arguments."""

    def parse(text: str, final: bool) -> tuple[str, list[Call]]:
        return "", [Call(name, text, final)]

    return parse


class ToolCallStream:
    """Successive parses of one choice's growing text, as OpenAI deltas."""

    def __init__(self, parse: Parser) -> None:
        self._parse = parse
        self._content_sent = 0
        self._sent: list[list[Any]] = []  # per call: [id, arguments characters sent]
        self.incomplete = False

    @property
    def called(self) -> bool:
        return bool(self._sent)

    def delta(self, text: str, final: bool) -> tuple[str, list[dict[str, Any]]]:
        content, calls = self._parse(text, final)
        new_content = content[self._content_sent :]
        self._content_sent = max(self._content_sent, len(content))
        out: dict[int, dict[str, Any]] = {}
        for i, call in enumerate(calls):
            if call.name is None:
                break
            if i >= len(self._sent):
                cid = f"call_{uuid.uuid4().hex[:24]}"
                self._sent.append([cid, 0])
                out[i] = {
                    "index": i,
                    "id": cid,
                    "type": "function",
                    "function": {"name": call.name, "arguments": ""},
                }
            sent = self._sent[i][1]
            if len(call.arguments) > sent:
                entry = out.setdefault(i, {"index": i, "function": {"arguments": ""}})
                entry["function"]["arguments"] += call.arguments[sent:]
                self._sent[i][1] = len(call.arguments)
        self.incomplete = any(not c.complete for c in calls)
        return new_content, list(out.values())


def message_tool_calls(deltas: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Merge streamed tool-call deltas into ``message.tool_calls``."""
    calls: dict[int, dict[str, Any]] = {}
    for d in deltas:
        call = calls.setdefault(
            d["index"],
            {"id": d.get("id"), "type": "function", "function": {"name": None, "arguments": ""}},
        )
        call["function"]["name"] = d["function"].get("name") or call["function"]["name"]
        call["function"]["arguments"] += d["function"].get("arguments", "")
    return [calls[i] for i in sorted(calls)]


# ----- tool_choice -> grammar and parser ----------------------------------------------------
def _named_function(tool_choice: Any, tools: list[Tool]) -> Tool | None:
    if not isinstance(tool_choice, dict):
        return None
    name = (tool_choice.get("function") or {}).get("name")
    for tool in tools:
        if tool.function.name == name:
            return tool
    raise APIError(400, f"tool_choice names {name!r}, which is not in tools", param="tool_choice")


def _parameters(tool: Tool) -> dict[str, Any]:
    return tool.function.parameters or {"type": "object", "properties": {}}


def tool_plan(
    tools: list[Tool] | None, tool_choice: Any, parallel: bool | None, default_format: str
) -> tuple[GrammarSpec | None, Parser | None]:
    """The grammar (for ``required`` and a named function) and the parser of a chat request;
    ``(None, None)`` when tool calls are not parsed (no tools, or ``tool_choice: "none"``)."""
    if tool_choice not in (None, "none", "auto", "required") and not isinstance(tool_choice, dict):
        raise APIError(
            400,
            f"tool_choice must be none, auto, required or a function, got {tool_choice!r}",
            param="tool_choice",
        )
    if not tools:
        if tool_choice not in (None, "none"):
            raise APIError(400, "tool_choice needs tools", param="tool_choice")
        return None, None
    if tool_choice == "none":
        return None, None
    if (tool := _named_function(tool_choice, tools)) is not None:
        schema = json.dumps(_parameters(tool))
        return GrammarSpec("json_schema", schema), named(tool.function.name)
    if tool_choice == "required":
        one = {
            "anyOf": [
                {
                    "type": "object",
                    "properties": {
                        "name": {"type": "string", "enum": [t.function.name]},
                        "parameters": _parameters(t),
                    },
                    "required": ["name", "parameters"],
                    "additionalProperties": False,
                }
                for t in tools
            ]
        }
        array: dict[str, Any] = {"type": "array", "items": one, "minItems": 1}
        if parallel is False:
            array["maxItems"] = 1
        return GrammarSpec("json_schema", json.dumps(array)), json_array
    parse = hermes if default_format == "hermes" else llama3_json
    if parallel is False:
        return None, _first_call(parse)
    return None, parse


def _first_call(parse: Parser) -> Parser:
    """``parallel_tool_calls: false``: only the first call counts."""

    def first(text: str, final: bool) -> tuple[str, list[Call]]:
        content, calls = parse(text, final)
        return content, calls[:1]

    return first


def arguments_as_objects(tool_calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Assistant ``tool_calls`` for a chat template: arguments as objects where they parse
    (templates such as Qwen's render them with ``tojson``)."""
    out = []
    for call in tool_calls:
        fn = dict(call.get("function") or {})
        if isinstance(fn.get("arguments"), str):
            try:
                fn["arguments"] = json.loads(fn["arguments"])
            except ValueError:
                pass
        out.append({**call, "function": fn})
    return out
