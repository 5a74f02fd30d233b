"""Ollama's model-list vocabulary: the API version reported and the shape of one model entry,
shared by the engine's Ollama routes and the proxy (which answers the lists from its registry)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

# The Ollama API version these routes follow (the client only checks that one is reported).
OLLAMA_VERSION = "0.6.0"


def ollama_model(
    name: str, details: dict[str, Any] | None = None, modified: datetime | None = None
) -> dict[str, Any]:
    """One ``/api/tags`` or ``/api/ps`` entry: ``details`` is the engine's description of its
    weights (``engine/model_details.py``: format, family, parameter size, quantisation, size
    on disk), empty while unknown. The digest is Ollama's blob bookkeeping, which Tandem has
    no counterpart for: empty."""
    d = details or {}
    family = d.get("family", "")
    return {
        "name": name,
        "model": name,
        "modified_at": (modified or datetime.now(UTC)).isoformat(),
        "size": int(d.get("size", 0)),
        "digest": "",
        "details": {
            "parent_model": "",
            "format": d.get("format", ""),
            "family": family,
            "families": [family] if family else None,
            "parameter_size": d.get("parameter_size", ""),
            "quantization_level": d.get("quantization_level", ""),
        },
    }
