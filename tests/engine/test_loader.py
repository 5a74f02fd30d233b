"""Loading HF checkpoints: shards, dtypes, RoPE scaling; and make-tiny-model's determinism."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tandem.server.engine import LLM, SamplingParams
from tandem.server.engine.loader import ModelLoadError
from tandem.server.engine.tiny_model import TinyModelSpec, make_tiny_model

from ..hf_reference import hf_greedy

GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_make_tiny_model_cli_is_deterministic_per_seed(tmp_path: Path) -> None:
    for name, seed in (("a", "3"), ("b", "3"), ("c", "4")):
        subprocess.run(
            [
                sys.executable,
                "-m",
                "tandem.server.cli",
                "make-tiny-model",
                str(tmp_path / name),
                "--arch",
                "qwen3",
                "--seed",
                seed,
            ],
            check=True,
            capture_output=True,
        )
    files = ["model.safetensors", "tokenizer.json", "config.json", "tokenizer_config.json"]
    assert all(_digest(tmp_path / "a" / f) == _digest(tmp_path / "b" / f) for f in files)
    assert _digest(tmp_path / "a" / "model.safetensors") != _digest(
        tmp_path / "c" / "model.safetensors"
    )
    config = json.loads((tmp_path / "a" / "tokenizer_config.json").read_text())
    assert "<|im_start|>" in config["chat_template"]
    tokenizer = json.loads((tmp_path / "a" / "tokenizer.json").read_text())
    assert tokenizer["model"]["type"] == "BPE" and tokenizer["pre_tokenizer"]["type"] == "ByteLevel"


def test_sharded_checkpoint_loads_the_same_model(tmp_path: Path, llama_dir: Path) -> None:
    sharded = make_tiny_model(
        tmp_path / "sharded", TinyModelSpec(arch="llama", seed=1, max_shard_size="100KB")
    )
    assert (sharded / "model.safetensors.index.json").exists()
    assert len(list(sharded.glob("model-*.safetensors"))) > 1
    a = LLM(str(sharded), kv_cache_tokens=1024).generate("Hello there", GREEDY)[0].token_ids
    b = LLM(str(llama_dir), kv_cache_tokens=1024).generate("Hello there", GREEDY)[0].token_ids
    assert a == b


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_checkpoint_matches_transformers_in_its_dtype(
    tmp_path: Path, dtype: str
) -> None:
    path = make_tiny_model(tmp_path / dtype, TinyModelSpec(arch="qwen2", seed=2, dtype=dtype))
    llm = LLM(str(path), kv_cache_tokens=1024, dtype=dtype)
    assert llm.engine.worker.runner.model.lm_head.weight.dtype == getattr(torch, dtype)
    ids = llm.tokenizer.encode("The quick brown fox")
    ours = llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))[
        0
    ].token_ids
    ref = hf_greedy(path, ids, 16, dtype=getattr(torch, dtype))[0]
    assert ours[:8] == ref[:8]  # half precision: identical for the first tokens at least


ROPE_CASES = {
    "linear": {"rope_type": "linear", "factor": 2.0},
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
}


@pytest.mark.parametrize("kind", sorted(ROPE_CASES))
def test_rope_scaling_matches_transformers(tmp_path: Path, llama_dir: Path, kind: str) -> None:
    path = tmp_path / kind
    shutil.copytree(llama_dir, path)
    config = json.loads((path / "config.json").read_text())
    config["rope_parameters"] = {"rope_theta": 10000.0, **ROPE_CASES[kind]}
    (path / "config.json").write_text(json.dumps(config))
    llm = LLM(str(path), kv_cache_tokens=1024)
    ids = llm.tokenizer.encode(
        "Rivers run to the sea, mountains rise into the clouds, and the wind " * 3
    )
    assert len(ids) > 64  # past the original context, where the schemes differ
    ours = llm.generate([ids], GREEDY)[0].token_ids
    assert ours == hf_greedy(path, ids, 20)[0]


def test_missing_tensor_is_a_clear_error(tmp_path: Path, llama_dir: Path) -> None:
    from safetensors.torch import load_file, save_file

    path = tmp_path / "broken"
    shutil.copytree(llama_dir, path)
    tensors = load_file(path / "model.safetensors")
    del tensors["model.norm.weight"]
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(ModelLoadError, match="model.norm.weight"):
        LLM(str(path), kv_cache_tokens=1024)
