"""A PEFT LoRA adapter (``adapter_config.json`` + ``adapter_model.safetensors``) read and
checked against the base model, laid out for Tandem's packed linears.

PEFT names each low-rank pair after the HuggingFace module it adapts
(``base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight``: A is ``[r, in]``, B is
``[out, r]``, and the update is ``x @ A.T @ B.T * scaling``). Tandem packs q|k|v into
``qkv_proj`` and gate|up into ``gate_up_proj``, whose shards all read the same input, so an
adapter's shards of one packed layer become one pair: their A's stacked (``[k * r, in]``) and
one B (``[packed out, k * r]``) holding each shard's B in its own rows and columns, zeros
elsewhere. One product then updates every adapted shard and leaves the others exactly as the
base computed them. Everything that does not fit (a rank over the limit, a module Tandem does
not adapt, a shape that disagrees with the base, DoRA, per-module ranks) is a
``LoraLoadError`` naming it, raised before anything is made resident.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from ..models.config import ModelConfig

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
SHARDS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# HF module -> (Tandem's layer, the shards it packs in order)
PACKED = {
    "q_proj": ("qkv_proj", ("q_proj", "k_proj", "v_proj")),
    "k_proj": ("qkv_proj", ("q_proj", "k_proj", "v_proj")),
    "v_proj": ("qkv_proj", ("q_proj", "k_proj", "v_proj")),
    "o_proj": ("o_proj", ("o_proj",)),
    "gate_proj": ("gate_up_proj", ("gate_proj", "up_proj")),
    "up_proj": ("gate_up_proj", ("gate_proj", "up_proj")),
    "down_proj": ("down_proj", ("down_proj",)),
}
_KEY = re.compile(
    r"^base_model\.model\.model\.layers\.(\d+)\.(?:self_attn|mlp)\."
    r"(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)\.lora_([AB])\.weight$"
)


class LoraLoadError(ValueError):
    """Not an adapter this engine can serve; the message names the file, tensor or field
    (the API answers 400 with it and keeps serving)."""


@dataclass(frozen=True)
class LoraPair:
    """One packed layer's update: ``y += (x @ a.T) @ b.T * scaling``."""

    a: torch.Tensor  # [k * r, in]
    b: torch.Tensor  # [out, k * r]


@dataclass(frozen=True, eq=False)
class LoraAdapter:
    """A checked adapter in host memory. ``identity`` (its name and a digest of its files)
    enters the prefix-cache hash, so KV computed through one adapter is never reused by
    another, nor by a different adapter loaded later under the same name."""

    name: str
    path: str
    rank: int
    scaling: float
    identity: str
    pairs: dict[tuple[int, str], LoraPair]  # (layer, packed layer name) -> pair
    num_bytes: int


def shard_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """Each adaptable HF module's (in, out) in the base model."""
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    h, i = cfg.hidden_size, cfg.intermediate_size
    return {
        "q_proj": (h, q),
        "k_proj": (h, kv),
        "v_proj": (h, kv),
        "o_proj": (q, h),
        "gate_proj": (h, i),
        "up_proj": (h, i),
        "down_proj": (i, h),
    }


def load_adapter(name: str, path: str | Path, cfg: ModelConfig, max_rank: int) -> LoraAdapter:
    """Read and check the adapter at ``path`` (a PEFT directory) for the base ``cfg``."""
    root = Path(path)
    config = _read_config(root)
    rank, scaling = _rank_and_scaling(config, root, max_rank)
    weights_file = root / WEIGHTS_FILE
    if not weights_file.is_file():
        raise LoraLoadError(f"{root} has no {WEIGHTS_FILE}")
    try:
        tensors = load_file(str(weights_file))
    except (SafetensorError, OSError) as exc:
        raise LoraLoadError(f"{weights_file}: not a safetensors file ({exc})") from None
    shards = _shards(tensors, weights_file, cfg, rank)
    pairs = {key: _pack(key[1], found, cfg, rank) for key, found in _by_layer(shards).items()}
    digest = hashlib.sha256((root / CONFIG_FILE).read_bytes())
    digest.update(weights_file.read_bytes())
    return LoraAdapter(
        name=name,
        path=str(root),
        rank=rank,
        scaling=scaling,
        identity=f"{name}@{digest.hexdigest()[:16]}",
        pairs=pairs,
        num_bytes=sum(t.numel() * t.element_size() for t in tensors.values()),
    )


def _read_config(root: Path) -> dict:
    file = root / CONFIG_FILE
    if not file.is_file():
        raise LoraLoadError(f"{root} has no {CONFIG_FILE} (a PEFT LoRA adapter directory)")
    try:
        config = json.loads(file.read_text())
    except (ValueError, OSError) as exc:
        raise LoraLoadError(f"{file}: {exc}") from None
    if not isinstance(config, dict) or config.get("peft_type", "LORA") != "LORA":
        raise LoraLoadError(f"{file}: not a LoRA adapter (peft_type {config.get('peft_type')!r})")
    return config


def _rank_and_scaling(config: dict, root: Path, max_rank: int) -> tuple[int, float]:
    """The rank and ``lora_alpha / r`` (``/ sqrt(r)`` with rsLoRA), as PEFT computes them."""
    rank, alpha = config.get("r"), config.get("lora_alpha", config.get("r"))
    if not isinstance(rank, int) or rank < 1:
        raise LoraLoadError(f"{root / CONFIG_FILE}: r must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise LoraLoadError(f"{root}: rank {rank} is over this engine's max_lora_rank {max_rank}")
    unsupported = {
        "use_dora": bool(config.get("use_dora")),
        "rank_pattern": bool(config.get("rank_pattern")),
        "alpha_pattern": bool(config.get("alpha_pattern")),
        "modules_to_save": bool(config.get("modules_to_save")),
        "bias": config.get("bias", "none") != "none",
        "fan_in_fan_out": bool(config.get("fan_in_fan_out")),
    }
    if any(unsupported.values()):
        which = ", ".join(k for k, v in unsupported.items() if v)
        raise LoraLoadError(f"{root / CONFIG_FILE}: {which} is not supported")
    if not isinstance(alpha, (int, float)):
        raise LoraLoadError(f"{root / CONFIG_FILE}: lora_alpha must be a number")
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return rank, float(scale)


def _shards(
    tensors: dict[str, torch.Tensor], file: Path, cfg: ModelConfig, rank: int
) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    """(layer, HF module) -> (A, B) in float32, every shape checked against the base."""
    halves: dict[tuple[int, str, str], torch.Tensor] = {}
    for key, tensor in tensors.items():
        m = _KEY.match(key)
        if m is None:
            raise LoraLoadError(f"{file}: {key} is not a q/k/v/o/gate/up/down LoRA weight")
        layer = int(m.group(1))
        if layer >= cfg.num_hidden_layers:
            raise LoraLoadError(f"{file}: {key}: the base has {cfg.num_hidden_layers} layers")
        halves[(layer, m.group(2), m.group(3))] = tensor
    shapes = shard_shapes(cfg)
    out: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    for layer, module in sorted({(k[0], k[1]) for k in halves}):
        a, b = halves.get((layer, module, "A")), halves.get((layer, module, "B"))
        if a is None or b is None:
            raise LoraLoadError(f"{file}: layer {layer} {module} lacks lora_A or lora_B")
        fan_in, fan_out = shapes[module]
        if tuple(a.shape) != (rank, fan_in) or tuple(b.shape) != (fan_out, rank):
            raise LoraLoadError(
                f"{file}: layer {layer} {module}: A {tuple(a.shape)} and B {tuple(b.shape)} "
                f"do not fit the base (A ({rank}, {fan_in}), B ({fan_out}, {rank}))"
            )
        out[(layer, module)] = (a.float(), b.float())
    if not out:
        raise LoraLoadError(f"{file}: no LoRA weights")
    return out


def _by_layer(
    shards: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]],
) -> dict[tuple[int, str], dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    grouped: dict[tuple[int, str], dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}
    for (layer, module), pair in shards.items():
        grouped.setdefault((layer, PACKED[module][0]), {})[module] = pair
    return grouped


def _pack(
    packed: str, found: dict[str, tuple[torch.Tensor, torch.Tensor]], cfg: ModelConfig, rank: int
) -> LoraPair:
    """The adapted shards of one packed layer as one pair (see the module's docstring)."""
    shapes = shard_shapes(cfg)
    members = next(m for p, m in PACKED.values() if p == packed)
    present = [m for m in members if m in found]
    total_out = sum(shapes[m][1] for m in members)
    b = torch.zeros(total_out, rank * len(present))
    row = 0
    for m in members:
        if m in found:
            col = present.index(m) * rank
            b[row : row + shapes[m][1], col : col + rank] = found[m][1]
        row += shapes[m][1]
    return LoraPair(torch.cat([found[m][0] for m in present]), b)
