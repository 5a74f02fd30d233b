"""Shared fixtures: tiny models made once per test session, and HuggingFace references."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tandem.server.engine.tiny_lora import TARGETS, TinyLoraSpec, make_tiny_lora
from tandem.server.engine.tiny_model import ARCHS, TinyModelSpec, make_tiny_model

from .model_specs import GPU_SPECS, on_gpu

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {arch: make_tiny_model(root / arch, TinyModelSpec(arch=arch, seed=1)) for arch in ARCHS}


# Adapters of several ranks and target sets (packed q|k|v and gate|up in part and in whole).
LORA_SPECS = {
    "qv-r4": TinyLoraSpec(rank=4, alpha=8, targets=("q_proj", "v_proj"), seed=11),
    "all-r8": TinyLoraSpec(rank=8, alpha=8, targets=TARGETS, seed=12),
    "mlp-r16": TinyLoraSpec(
        rank=16, alpha=4, targets=("gate_proj", "up_proj", "down_proj"), seed=13, use_rslora=True
    ),
    "ko-r2": TinyLoraSpec(rank=2, alpha=4, targets=("k_proj", "o_proj"), seed=14),
}


@pytest.fixture(scope="session")
def tiny_loras(
    tmp_path_factory: pytest.TempPathFactory, tiny_models: dict[str, Path]
) -> dict[str, dict[str, Path]]:
    """Per architecture, ``LORA_SPECS``' adapters (by name) made with PEFT for its tiny model."""
    root = tmp_path_factory.mktemp("loras")
    return {
        arch: {
            name: make_tiny_lora(model, root / arch / name, spec)
            for name, spec in LORA_SPECS.items()
        }
        for arch, model in tiny_models.items()
    }


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
