"""Which grammar a request asks for, from every field that can ask: OpenAI's ``response_format``
(``json_object``, ``json_schema``; LMDeploy's ``regex_schema``), vLLM's ``guided_json`` /
``guided_regex`` / ``guided_choice`` / ``guided_grammar`` and ``structured_outputs``, Ollama's
``format``, and a chat's ``tool_choice`` of ``required`` or a named function. Pure: the
compile (and its 400) happens in ``generation.submit``."""

from __future__ import annotations

import json
from typing import Any

from tandem.server.engine.structured import GrammarSpec
from tandem.server.wire.errors import APIError
from tandem.server.wire.protocol import ResponseFormat, SamplingFields

_STRUCTURED_OUTPUT_KEYS = {
    "json": "json_schema",
    "regex": "regex",
    "choice": "choice",
    "grammar": "grammar",
}


def _schema_spec(schema: Any, param: str) -> GrammarSpec:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as exc:
            raise APIError(400, f"{param} is not valid JSON: {exc}", param=param) from exc
    if not isinstance(schema, dict):
        raise APIError(400, f"{param} must be a JSON schema object", param=param)
    return GrammarSpec("json_schema", json.dumps(schema))


def _choice_spec(choices: Any, param: str) -> GrammarSpec:
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) for c in choices):
        raise APIError(400, f"{param} must be a non-empty list of strings", param=param)
    return GrammarSpec("choice", json.dumps(choices))


def response_format_spec(fmt: ResponseFormat | None) -> GrammarSpec | None:
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return GrammarSpec("json")
    if fmt.type == "regex_schema":
        if not fmt.regex_schema:
            raise APIError(400, "response_format.regex_schema is required", param="response_format")
        return GrammarSpec("regex", fmt.regex_schema)
    if fmt.json_schema is None:
        raise APIError(400, "response_format.json_schema is required", param="response_format")
    if fmt.json_schema.schema_ is None:
        return GrammarSpec("json")
    return _schema_spec(fmt.json_schema.schema_, "response_format.json_schema.schema")


def _structured_outputs_spec(so: dict[str, Any]) -> GrammarSpec | None:
    asked = [k for k in ("json", "regex", "choice", "grammar") if so.get(k) is not None]
    if so.get("json_object"):
        asked.append("json_object")
    if len(asked) > 1:
        raise APIError(
            400,
            f"structured_outputs asks for {' and '.join(asked)}; pick one",
            param="structured_outputs",
        )
    if not asked:
        return None
    key = asked[0]
    value = so.get(key)
    if key == "json_object":
        return GrammarSpec("json")
    if key == "json":
        return _schema_spec(value, "structured_outputs.json")
    if key == "choice":
        return _choice_spec(value, "structured_outputs.choice")
    if not isinstance(value, str):
        raise APIError(
            400, f"structured_outputs.{key} must be a string", param="structured_outputs"
        )
    return GrammarSpec(_STRUCTURED_OUTPUT_KEYS[key], value)


def request_spec(req: SamplingFields) -> GrammarSpec | None:
    """The one grammar the request's fields ask for; asking in two ways is a 400."""
    found: list[tuple[str, GrammarSpec]] = []
    if (spec := response_format_spec(req.response_format)) is not None:
        found.append(("response_format", spec))
    if req.guided_json is not None:
        found.append(("guided_json", _schema_spec(req.guided_json, "guided_json")))
    if req.guided_regex is not None:
        found.append(("guided_regex", GrammarSpec("regex", req.guided_regex)))
    if req.guided_choice is not None:
        found.append(("guided_choice", _choice_spec(req.guided_choice, "guided_choice")))
    if req.guided_grammar is not None:
        found.append(("guided_grammar", GrammarSpec("grammar", req.guided_grammar)))
    if req.structured_outputs is not None:
        if (spec := _structured_outputs_spec(req.structured_outputs)) is not None:
            found.append(("structured_outputs", spec))
    if len(found) > 1:
        names = ", ".join(name for name, _ in found)
        raise APIError(
            400, f"only one structured-output field may be set, got {names}", param=found[1][0]
        )
    return found[0][1] if found else None


def ollama_format_spec(fmt: str | dict[str, Any] | None) -> GrammarSpec | None:
    """Ollama's ``format``: ``"json"`` or a JSON schema."""
    if fmt is None or fmt == "":
        return None
    if fmt == "json":
        return GrammarSpec("json")
    if isinstance(fmt, dict):
        return _schema_spec(fmt, "format")
    raise APIError(400, f"format must be 'json' or a JSON schema, got {fmt!r}", param="format")
