"""Structured output overhead: 64 JSON-schema requests against the same 64 unconstrained.

SCHEMA_PLACEHOLDER
"""

from __future__ import annotations

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "kind": {"type": "string", "enum": ["cache", "scheduler", "sampler", "proxy"]},
        "owner": {
            "type": "object",
            "properties": {
                "team": {"type": "string", "maxLength": 16},
                "oncall": {"type": "boolean"},
            },
            "required": ["team", "oncall"],
            "additionalProperties": False,
        },
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
        "priority": {"type": "integer", "minimum": 0, "maximum": 9},
    },
    "required": ["name", "kind", "owner", "tags", "priority"],
    "additionalProperties": False,
}
