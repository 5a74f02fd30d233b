"""Shared fixtures: tiny models made once per test session, and HuggingFace references."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tandem.server.engine.tiny_model import ARCHS, TinyModelSpec, make_tiny_model

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {arch: make_tiny_model(root / arch, TinyModelSpec(arch=arch, seed=1)) for arch in ARCHS}


@pytest.fixture(scope="session")
def llama_dir(tiny_models: dict[str, Path]) -> Path:
    return tiny_models["llama"]
