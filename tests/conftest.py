"""Shared fixtures: tiny models made once per test session, and HuggingFace references."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tandem.server.engine.tiny_model import ARCHS, TinyModelSpec, make_tiny_model

from .model_specs import GPU_SPECS, on_gpu

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {arch: make_tiny_model(root / arch, TinyModelSpec(arch=arch, seed=1)) for arch in ARCHS}


@pytest.fixture(scope="session")
def gpu_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gpu-models")
    return {arch: make_tiny_model(root / arch, spec) for arch, spec in GPU_SPECS.items()}


@pytest.fixture(scope="session")
def llama_dir(request: pytest.FixtureRequest, tiny_models: dict[str, Path]) -> Path:
    if on_gpu():
        return request.getfixturevalue("gpu_models")["llama"]
    return tiny_models["llama"]


@pytest.fixture()
def pd(llama_dir: Path):
    """A prefill and a decode engine and the KV transport between them (the P/D tests'
    engines, driven by hand with ``tests/disagg/utils.py``)."""
    from tandem.server.disagg.transport import KVTransportClient, KVTransportServer
    from tandem.server.engine import LLMEngine
    from tandem.server.engine.config import EngineConfig

    cfg = EngineConfig(
        model=str(llama_dir), kv_cache_tokens=2048, block_size=8, kv_lease_seconds=30.0
    )
    prefill, decode = LLMEngine(cfg), LLMEngine(cfg)
    server = KVTransportServer(
        prefill.kv_cache,
        prefill.leased_blocks,
        prefill.release_lease,
        layout=prefill.kv_layout,
    ).start()
    prefill.transport_address = server.address
    client = KVTransportClient(server.address, timeout_s=5)
    yield prefill, decode, client
    client.close()
    server.close()
