"""Read a GGUF file (llama.cpp's and Ollama's format) as a model: config, weights, tokenizer.

The metadata becomes the same HF-style config dict ``loader.read_model_config`` reads, so a GGUF
model runs through exactly the code an HF directory does. Weights are dequantized once at load
with the ``gguf`` package's own dequantizers (float32, then the engine's dtype) and renamed to
HuggingFace's names; llama.cpp stores a Llama's q/k projections with their rows permuted for
its interleaved RoPE, which is undone here exactly as llama.cpp's converter did it. The
tokenizer and chat template come from the file through transformers' GGUF support.
``gguf_blocks`` also hands out the Q8_0 / Q4_0 / Q4_1 weights still in their blocks, for the
CPU layers that multiply by them directly (``models.layers.Linear.use_quantized``).

Anything this engine cannot run (another architecture, a quantization type without a
dequantizer here, a damaged file) is a ``ModelLoadError`` naming what, raised before any
weight is dequantized.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .kernels import QUANT_BLOCK_BYTES
from .models.config import ModelConfig, ModelLoadError
from .paths import cache_dir

# llama.cpp's architecture name -> the HF architecture our model families register.
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
# Quantization types dequantized at load (names as gguf.GGMLQuantizationType spells them).
QUANT_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")
QUANT_TYPES += ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")

_LAYER = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def is_gguf(model: str | Path) -> bool:
    """A model given as a path to a ``.gguf`` file rather than an HF-format directory."""
    return str(model).lower().endswith(".gguf")


def open_gguf(path: str | Path) -> Any:
    """A ``GGUFReader`` over the file (memory-mapped); a damaged or foreign file is a load error."""
    from gguf import GGUFReader

    path = Path(path)
    if not path.is_file():
        raise ModelLoadError(f"no GGUF file at {path}")
    try:
        return GGUFReader(path)
    except Exception as exc:  # noqa: BLE001 - the reader raises anything on a damaged file
        raise ModelLoadError(
            f"{path} is not a readable GGUF file (truncated or corrupt?): {exc}"
        ) from None


def hf_config(reader: Any, path: str | Path) -> dict[str, Any]:
    """The file's metadata as the HF ``config.json`` dict of the same model."""
    arch = _field(reader, "general.architecture", path)
    if arch not in ARCHITECTURES:
        raise ModelLoadError(
            f"{path}: GGUF architecture {arch!r} is not supported; supported: {sorted(ARCHITECTURES)}"
        )
    _check_tensors(reader, path)

    def meta(key: str, default: Any = None) -> Any:
        return _field(reader, f"{arch}.{key}", path, default)

    names = {t.name for t in reader.tensors}
    heads = meta("attention.head_count")
    hidden = meta("embedding_length")
    tokens = _field(reader, "tokenizer.ggml.tokens", path, ())
    raw: dict[str, Any] = {
        "architectures": [ARCHITECTURES[arch]],
        "vocab_size": meta("vocab_size") or len(tokens) or _rows(reader, "token_embd.weight"),
        "hidden_size": hidden,
        "intermediate_size": meta("feed_forward_length"),
        "num_hidden_layers": meta("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": meta("attention.head_count_kv") or heads,
        "head_dim": meta("attention.key_length") or hidden // heads,
        "rms_norm_eps": meta("attention.layer_norm_rms_epsilon", 1e-6),
        "max_position_embeddings": meta("context_length", 2048),
        "tie_word_embeddings": "output.weight" not in names,
        "rope_theta": meta("rope.freq_base", 10000.0),
        "attention_bias": "blk.0.attn_q.bias" in names,
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id", path, None),
    }
    if None in (raw["hidden_size"], raw["intermediate_size"], raw["num_hidden_layers"], heads):
        raise ModelLoadError(f"{path}: GGUF metadata lacks the {arch} model dimensions")
    scaling = meta("rope.scaling.type")
    if scaling not in (None, "none"):
        if scaling not in ("linear", "yarn"):
            raise ModelLoadError(f"{path}: RoPE scaling {scaling!r} is not supported")
        raw["rope_scaling"] = {
            "rope_type": scaling,
            "factor": meta("rope.scaling.factor", 1.0),
            "original_max_position_embeddings": meta("rope.scaling.original_context_length"),
        }
    if "rope_freqs.weight" in names:
        raise ModelLoadError(
            f"{path}: per-dimension RoPE frequency factors (rope_freqs, Llama 3.1-style scaling) "
            "are not supported yet"
        )
    return raw


def gguf_tensors(path: str | Path, cfg: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """Every weight, dequantized to float32, under its HuggingFace name."""
    from gguf import dequantize

    reader = open_gguf(path)
    arch = _field(reader, "general.architecture", path)
    _check_tensors(reader, path)
    for t in reader.tensors:
        name = hf_name(t.name)
        if name is None:
            raise ModelLoadError(f"{path}: unexpected tensor {t.name} for a {arch} model")
        try:
            weights = dequantize(t.data, t.tensor_type)
        except Exception as exc:  # noqa: BLE001 - a short data section fails here
            raise ModelLoadError(f"{path}: cannot read tensor {t.name}: {exc}") from None
        weights = _hf_rows(weights.reshape([int(d) for d in reversed(t.shape)]), name, arch, cfg)
        yield name, torch.from_numpy(np.array(weights, dtype=np.float32))  # off the memmap


def gguf_blocks(path: str | Path, cfg: ModelConfig) -> Iterator[tuple[str, int, torch.Tensor]]:
    """The 2-D weights stored in a block format ``quant_gemv`` multiplies by (Q8_0, Q4_0,
    Q4_1), as they are in the file: HF name, ggml type id, uint8 ``[rows, row bytes]`` (a
    row's blocks are independent of other rows', so q/k's row permutation applies as is)."""
    reader = open_gguf(path)
    arch = _field(reader, "general.architecture", path)
    for t in reader.tensors:
        name = hf_name(t.name)
        if name is None or t.tensor_type.value not in QUANT_BLOCK_BYTES or len(t.shape) != 2:
            continue
        blocks = _hf_rows(t.data.reshape(int(t.shape[1]), -1), name, arch, cfg)
        yield name, int(t.tensor_type.value), torch.from_numpy(np.array(blocks))  # off the memmap


def _hf_rows(weights: np.ndarray, name: str, arch: str, cfg: ModelConfig) -> np.ndarray:
    """A tensor's rows in HF's order: llama's q/k rows were permuted by llama.cpp's converter."""
    if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
        heads = cfg.num_attention_heads if "q_proj" in name else cfg.num_key_value_heads
        return unpermute_qk(weights, heads)
    return weights


def hf_name(gguf_name: str) -> str | None:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _LAYER.match(gguf_name)
    if m is None or m.group(2) not in _LAYER_NAMES:
        return None
    return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}"


def unpermute_qk(weights: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's ``permute``: it stored each head's rows as (2, d/2) halves interleaved
    pairwise ((d/2, 2)) for its RoPE, while HF's rotate_half wants the halves contiguous."""
    rows = weights.shape[0]
    w = weights.reshape(heads, rows // heads // 2, 2, *weights.shape[1:])
    return w.swapaxes(1, 2).reshape(weights.shape)


def load_gguf_tokenizer(path: str | Path) -> Any:
    """The file's tokenizer and chat template, built by transformers' GGUF converter.

    Converting a 50k-token vocabulary takes seconds and a server loads its tokenizer more
    than once, so the result is saved in the cache, keyed by the file (path, size, mtime)
    and the transformers version, and later loads read that.
    """
    import transformers
    from transformers import AutoTokenizer

    path = Path(path).resolve()
    stat = path.stat()
    key = f"{path}:{stat.st_size}:{stat.st_mtime_ns}:{transformers.__version__}"
    saved = cache_dir() / "tokenizers" / hashlib.sha256(key.encode()).hexdigest()[:20]
    if (saved / "tokenizer.json").is_file():
        return AutoTokenizer.from_pretrained(str(saved))
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as exc:  # noqa: BLE001 - transformers raises many kinds on unsupported files
        raise ModelLoadError(f"{path}: cannot build a tokenizer from the file: {exc}") from None
    tmp = saved.with_name(f"{saved.name}.tmp{os.getpid()}")
    tokenizer.save_pretrained(str(tmp))
    try:
        tmp.rename(saved)
    except OSError:  # another process saved it first
        shutil.rmtree(tmp, ignore_errors=True)
    return tokenizer


def _check_tensors(reader: Any, path: str | Path) -> None:
    unsupported = sorted(
        {t.tensor_type.name for t in reader.tensors if t.tensor_type.name not in QUANT_TYPES}
    )
    if unsupported:
        raise ModelLoadError(
            f"{path}: GGUF quantization type(s) {', '.join(unsupported)} not supported; "
            f"supported: {', '.join(QUANT_TYPES)}"
        )


def _rows(reader: Any, tensor: str) -> int | None:
    found = [int(t.shape[-1]) for t in reader.tensors if t.name == tensor]
    return found[0] if found else None


def _field(reader: Any, key: str, path: str | Path, default: Any = ...) -> Any:
    field = reader.fields.get(key)
    if field is None:
        if default is ...:
            raise ModelLoadError(f"{path}: GGUF metadata has no {key}")
        return default
    return field.contents()
