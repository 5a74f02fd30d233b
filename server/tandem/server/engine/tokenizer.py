"""The model's tokenizer (with its chat template): from an HF directory or from a GGUF file."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .gguf_loader import is_gguf, load_gguf_tokenizer


def load_tokenizer(model: str | Path) -> Any:
    from transformers import AutoTokenizer

    if is_gguf(model):
        return load_gguf_tokenizer(model)
    return AutoTokenizer.from_pretrained(str(model))
