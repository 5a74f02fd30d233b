"""Ollama's model-list vocabulary: the API version reported and the shape of one model entry,
shared by the engine's Ollama routes and the proxy (which answers the lists from its registry)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

# The Ollama API version these routes follow (the client only checks that one is reported).
OLLAMA_VERSION = "0.6.0"


def ollama_model(name: str, modified: datetime | None = None) -> dict[str, Any]:
    """One ``/api/tags`` or ``/api/ps`` entry. Sizes and digests are Ollama's blob bookkeeping,
    which Tandem has no counterpart for: reported as 0 and empty."""
    return {
        "name": name,
        "model": name,
        "modified_at": (modified or datetime.now(UTC)).isoformat(),
        "size": 0,
        "digest": "",
        "details": {
            "format": "safetensors",
            "family": "",
            "parameter_size": "",
            "quantization_level": "",
        },
    }
