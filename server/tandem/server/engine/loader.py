"""Load a HuggingFace-format model directory, or a GGUF file, into our model classes.

A GGUF file's weights come dequantized and renamed from ``gguf_loader``; a directory's:
reads ``model.safetensors`` or the shards named by ``model.safetensors.index.json``, packs
q/k/v and gate/up into their fused layers, converts to the target dtype, and ties the
output embedding when the config says so. Under tensor parallelism each rank keeps only its
slice: the rows of every packed shard (q, k, v, gate, up: split per shard, not over the
packed tensor) and the input columns of the row-parallel layers (o_proj, down_proj); the
rest (embeddings, norms, lm_head, row-parallel biases) is replicated.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from . import gguf_loader, kernels
from .config import QuantizedWeights
from .models.config import (
    DTYPES,
    ModelConfig,
    ModelLoadError,
    WeightsMismatchError,
    architecture_of,
)
from .models.families import family_of
from .models.layers import Linear, PackedLinear, RowParallelLinear
from .models.rope import RotaryEmbedding
from .parallel import SINGLE, TensorParallel

_PACKED = re.compile(r"^(.*)\.(q_proj|k_proj|v_proj|gate_proj|up_proj)\.(weight|bias)$")
_PACKED_PARENT = {
    "q_proj": "qkv_proj",
    "k_proj": "qkv_proj",
    "v_proj": "qkv_proj",
    "gate_proj": "gate_up_proj",
    "up_proj": "gate_up_proj",
}
_IGNORED = re.compile(r"rotary_emb\.inv_freq$")
log = logging.getLogger(__name__)


def resolve_dtype(requested: str, cfg: ModelConfig, device: torch.device) -> torch.dtype:
    """``auto`` takes the checkpoint's dtype on GPU, and float32 on CPU where half precision is slow."""
    if requested != "auto":
        return DTYPES[requested]
    if device.type == "cpu":
        return torch.float32
    return DTYPES.get(cfg.torch_dtype, torch.bfloat16)


def checkpoint_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / n for n in names]
    single = model_dir / "model.safetensors"
    if single.exists():
        return [single]
    found = sorted(model_dir.glob("*.safetensors"))
    if not found:
        raise ModelLoadError(f"no safetensors weights in {model_dir}")
    return found


def read_model_config(model: str | Path) -> ModelConfig:
    """From ``model/config.json``, or from the metadata when ``model`` is a .gguf, with the
    flags of the family its architecture names: the one place a model path becomes a
    ``ModelConfig``, so the config imports neither the GGUF reader nor the model code."""
    if gguf_loader.is_gguf(model):
        return model_config(gguf_loader.hf_config(gguf_loader.open_gguf(model), model))
    path = Path(model) / "config.json"
    if not path.is_file():
        raise ModelLoadError(f"{model} has no config.json (an HF-format model directory)")
    try:
        return model_config(json.loads(path.read_text()))
    except ValueError as exc:  # bad JSON, or an architecture we have no family for
        raise ModelLoadError(f"{path}: {exc}") from None


def model_config(raw: dict[str, Any]) -> ModelConfig:
    """An HF ``config.json`` dict (or a GGUF file's metadata as one) as a ``ModelConfig``."""
    family = family_of(architecture_of(raw))
    return ModelConfig.from_dict(raw, family.flags(raw))


def _checkpoint_tensors(model_dir: Path, cfg: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    if gguf_loader.is_gguf(model_dir):
        yield from gguf_loader.gguf_tensors(model_dir, cfg)
        return
    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def load_model(
    model_dir: str | Path,
    dtype: torch.dtype,
    device: torch.device,
    tp: TensorParallel = SINGLE,
    quantized: QuantizedWeights = "off",
) -> nn.Module:
    """The model with its weights; unless ``quantized`` (``EngineConfig.quantized_weights``)
    is off, a GGUF file's block-format linear weights are also kept as blocks where a CPU
    kernel can multiply by them, the mode's kernel chosen (``kernels.quant_kernel``; see
    ``attach_quantized``)."""
    model_dir = Path(model_dir)
    cfg = read_model_config(model_dir)
    with torch.device("meta"):
        model = family_of(cfg.architecture)(cfg, tp)
    model.to_empty(device=device)
    model.to(dtype)
    model.tie_weights()
    _reset_buffers(model, cfg, device)
    params = dict(model.named_parameters(remove_duplicate=False))
    modules = dict(model.named_modules())
    loaded: set[str] = set()
    for name, tensor in _checkpoint_tensors(model_dir, cfg):
        if _IGNORED.search(name) or (cfg.tie_word_embeddings and name == "lm_head.weight"):
            continue
        loaded.add(_load_tensor(name, tensor, params, modules))
    expected = {n for n in params if not (cfg.tie_word_embeddings and n == "lm_head.weight")}
    missing = expected - loaded
    if missing:
        raise ModelLoadError(f"checkpoint in {model_dir} lacks {sorted(missing)[:8]}")
    kernel = kernels.quant_kernel(quantized, device, dtype)
    if kernel is not None and gguf_loader.is_gguf(model_dir) and tp.size == 1:
        attach_quantized(model, model_dir, cfg, kernel)
    return model.eval()


def attach_quantized(model: nn.Module, path: str | Path, cfg: ModelConfig, kernel: str) -> int:
    """Give each linear layer whose weights the file holds in Q8_0 / Q4_0 / Q4_1 blocks
    those blocks, to be multiplied by ``kernel`` (``Linear.use_quantized``); returns how
    many layers got them.

    The dequantized weights stay: they are the reference, and the faster product for
    prefill-sized batches. Keeping both costs the blocks' size on top (4.5 to 8.5 bits a
    weight, an eighth to a quarter of the float32 weights); dropping the float weights and
    dequantizing per call would make every prefill pay a dequantization. A packed layer
    (q|k|v, gate|up) gets blocks only when all its shards are in one type (a K-quant mix
    leaves it dequantized); the lm_head takes the embedding's blocks when tied.
    """
    modules = dict(model.named_modules())
    shards: dict[str, dict[str, tuple[int, torch.Tensor]]] = {}
    attached = 0
    for name, qtype, blocks in gguf_loader.gguf_blocks(path, cfg):
        if name == "model.embed_tokens.weight" and cfg.tie_word_embeddings:
            name = "lm_head.weight"
        m = _PACKED.match(name)
        if m is None:
            layer = modules.get(name.removesuffix(".weight"))
            if isinstance(layer, Linear):
                layer.use_quantized(blocks, qtype, kernel)
                attached += 1
            continue
        prefix, shard, _ = m.groups()
        parent = f"{prefix}.{_PACKED_PARENT[shard]}"
        layer = modules.get(parent)
        if not isinstance(layer, PackedLinear):
            continue
        got = shards.setdefault(parent, {})
        got[shard] = (qtype, blocks)
        if len(got) == len(layer.shard_offsets) and len({t for t, _ in got.values()}) == 1:
            blocks = torch.cat([got[s][1] for s in layer.shard_offsets])
            layer.use_quantized(blocks, qtype, kernel)
            attached += 1
    log.info("%d linear layers multiply by their GGUF blocks at decode batch sizes", attached)
    return attached


def reload_weights(
    model: nn.Module,
    model_dir: str | Path,
    dtype: torch.dtype,
    tp: TensorParallel = SINGLE,
    quantized: QuantizedWeights = "off",
) -> None:
    """Replace ``model``'s weights with ``model_dir``'s in place, so what points at the
    parameters (the runner, captured CUDA graphs) stays valid. The new weights are read into
    host memory first: a checkpoint that fails to load, or whose shapes differ, leaves
    ``model`` as it was. Quantized blocks follow the new file's (a layer whose new weights
    come without blocks goes back to its dequantized weight: its old blocks no longer match)."""
    loaded = load_model(model_dir, dtype, torch.device("cpu"), tp, quantized)
    fresh = dict(loaded.named_parameters())
    params = dict(model.named_parameters())
    for name, param in params.items():
        if name not in fresh or fresh[name].shape != param.shape:
            got = tuple(fresh[name].shape) if name in fresh else None
            raise WeightsMismatchError(
                f"{model_dir}: tensor {name} is {got}, the running model's {tuple(param.shape)}"
            )
    with torch.no_grad():
        for name, param in params.items():
            param.copy_(fresh[name])
    fresh_layers = dict(loaded.named_modules())
    for name, layer in model.named_modules():
        new = fresh_layers.get(name)
        if isinstance(layer, Linear) and isinstance(new, Linear) and new.quantized is not None:
            layer.use_quantized(new.quantized, new.qtype, new.kernel)


def _load_tensor(
    name: str, tensor: torch.Tensor, params: dict[str, nn.Parameter], modules: dict[str, nn.Module]
) -> str:
    m = _PACKED.match(name)
    if m is not None:
        prefix, shard, kind = m.groups()
        parent = f"{prefix}.{_PACKED_PARENT[shard]}"
        layer = modules.get(parent)
        if not isinstance(layer, PackedLinear):
            raise ModelLoadError(f"unexpected tensor {name}")
        offset, size = layer.shard_offsets[shard]
        target = getattr(layer, kind)
        _copy(
            target.data[offset : offset + size],
            _rank_slice(tensor, 0, layer.tp_rank, layer.tp_size, name),
            name,
        )
        return f"{parent}.{kind}"
    if name not in params:
        raise ModelLoadError(f"unexpected tensor {name} in checkpoint")
    owner = modules.get(name.rpartition(".")[0])
    if isinstance(owner, RowParallelLinear) and name.endswith(".weight"):
        tensor = _rank_slice(tensor, 1, owner.tp_rank, owner.tp_size, name)
    _copy(params[name].data, tensor, name)
    return name


def _rank_slice(tensor: torch.Tensor, dim: int, rank: int, size: int, name: str) -> torch.Tensor:
    """Rank ``rank``'s equal part of ``tensor`` along ``dim`` (the whole tensor with one rank)."""
    if size == 1:
        return tensor
    if tensor.dim() <= dim or tensor.shape[dim] % size:
        raise ModelLoadError(
            f"tensor {name} of shape {tuple(tensor.shape)} cannot be split {size} ways "
            f"along dim {dim}"
        )
    return tensor.narrow(dim, rank * (tensor.shape[dim] // size), tensor.shape[dim] // size)


def _copy(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if dst.shape != src.shape:
        raise WeightsMismatchError(
            f"tensor {name} has shape {tuple(src.shape)}, the config implies {tuple(dst.shape)}"
        )
    dst.copy_(src.to(dst.dtype))


def _reset_buffers(model: nn.Module, cfg: ModelConfig, device: torch.device) -> None:
    """Buffers were created on the meta device; compute the RoPE tables for real (in float32)."""
    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            real = RotaryEmbedding(cfg.rope, cfg.head_dim, cfg.max_position_embeddings)
            for name, table in real.named_buffers():
                setattr(module, name, table.to(device))
