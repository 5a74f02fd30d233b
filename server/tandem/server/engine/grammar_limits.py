"""Bounds on what a request may ask the grammar compiler to build (docs/structured.md).

xgrammar's compile cannot be interrupted once it runs, and its time grows faster than the
schema: a JSON schema of 10,000 optional properties took 264 s of a core on SmolLM2's
vocabulary. So a grammar is measured before it is compiled and refused, as the request's 400,
when it is larger than any real use needs; what passes compiles in seconds, and
``GrammarCache.budget_s`` bounds the wait for the rest. The limits are generous next to
OpenAI's own (5,000 properties and 10 levels of nesting per schema) where the compiler's cost
allows it.
"""

from __future__ import annotations

import json
from typing import Any

from .sampling_params import InvalidParamError

MAX_SOURCE_CHARS = 256 * 1024  # the schema's JSON text, the grammar, the choices' JSON list
MAX_REGEX_CHARS = 16 * 1024
MAX_SCHEMA_NODES = 10_000  # objects and arrays anywhere in a schema
MAX_SCHEMA_PROPERTIES = 1_000  # names under every "properties" of a schema, summed
MAX_SCHEMA_DEPTH = 64  # JSON nesting of the text (a nested object schema is 2 levels)
MAX_CHOICES = 1_000
COMPILE_BUDGET_S = 20.0  # how long a request waits for its grammar before a 400


class GrammarError(InvalidParamError):
    """The grammar library cannot compile what the request asked for, or the grammar is over
    the limits above: the API's 400, with ``code`` for the error body."""

    def __init__(self, param: str, message: str, code: str = "invalid_schema") -> None:
        super().__init__(param, message)
        self.code = code


def _too_large(what: str, value: int, limit: int) -> GrammarError:
    return GrammarError(
        "structured_outputs",
        f"the {what} is {value:,}, over the limit of {limit:,} (docs/structured.md)",
        code="grammar_too_large",
    )


def _measure(schema: Any) -> tuple[int, int, int]:
    """(nodes, properties, depth) of a parsed JSON value, iteratively: a deep schema must
    not exhaust Python's stack before it is refused."""
    nodes = properties = depth = 0
    stack: list[tuple[Any, int]] = [(schema, 1)]
    while stack:
        value, level = stack.pop()
        if isinstance(value, dict):
            children = list(value.values())
            props = value.get("properties")
            if isinstance(props, dict):
                properties += len(props)
        elif isinstance(value, list):
            children = value
        else:
            continue
        nodes += 1
        depth = max(depth, level)
        stack.extend((child, level + 1) for child in children)
    return nodes, properties, depth


def check_schema(source: str) -> None:
    """A JSON schema's text within every limit, else ``GrammarError``."""
    if len(source) > MAX_SOURCE_CHARS:
        raise _too_large("schema's JSON text, in characters,", len(source), MAX_SOURCE_CHARS)
    nodes, properties, depth = _measure(json.loads(source))
    if depth > MAX_SCHEMA_DEPTH:
        raise _too_large("schema's nesting depth", depth, MAX_SCHEMA_DEPTH)
    if nodes > MAX_SCHEMA_NODES:
        raise _too_large("number of objects and arrays in the schema", nodes, MAX_SCHEMA_NODES)
    if properties > MAX_SCHEMA_PROPERTIES:
        raise _too_large("number of properties in the schema", properties, MAX_SCHEMA_PROPERTIES)


def check_size(kind: str, source: str) -> None:
    """Refuse, before any compile, a grammar over the limits (``GrammarError``)."""
    if kind == "json_schema":
        check_schema(source)
    elif kind == "regex" and len(source) > MAX_REGEX_CHARS:
        raise _too_large("regex's length, in characters,", len(source), MAX_REGEX_CHARS)
    elif len(source) > MAX_SOURCE_CHARS:
        raise _too_large(f"{kind}'s length, in characters,", len(source), MAX_SOURCE_CHARS)
    elif kind == "choice" and len(json.loads(source)) > MAX_CHOICES:
        raise _too_large("number of choices", len(json.loads(source)), MAX_CHOICES)
