"""Replacing a running engine's weights: what new weights must share with the running model,
and the identity the server reports (``/update_weights``, ``/health``, ``/v1/models``).

Only the weights change: the tokenizer, the KV cache and its layout, ``max_model_len`` and
the attention backend stay, so everything that shapes them must be equal. The dtype a
checkpoint was saved in does not matter (weights are converted to the engine's), nor do
its EOS ids (the engine keeps the ones it started with, as it keeps the tokenizer).
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass
from pathlib import Path

from . import gguf_loader
from .loader import read_model_config
from .models.config import ModelConfig, ModelLoadError, WeightsMismatchError

# ModelConfig fields new weights may change without touching the running engine's shapes.
_FREE_FIELDS = frozenset({"torch_dtype", "eos_token_ids"})
# load_format values: how a request names the format of ``model_path``.
LOAD_FORMATS = ("auto", "safetensors", "gguf")


@dataclass(frozen=True)
class WeightsIdentity:
    """Which weights an engine runs: their path and a counter bumped by every update (0 for
    the weights it started with), plus the caller's own label when it gave one."""

    path: str
    version: int = 0
    label: str | None = None
    loaded_at: float = dataclasses.field(default_factory=time.time)

    def updated(self, path: str, label: str | None) -> WeightsIdentity:
        return WeightsIdentity(path, self.version + 1, label)

    def as_dict(self) -> dict[str, object]:
        return {
            "path": self.path,
            "version": self.version,
            "weight_version": self.label,
            "loaded_at": round(self.loaded_at, 3),
        }


def check_format(path: str | Path, load_format: str | None) -> None:
    """A ``load_format`` that names the other kind of checkpoint than ``path`` is is a
    ``ModelLoadError``."""
    fmt = load_format or "auto"
    if fmt not in LOAD_FORMATS:
        raise ModelLoadError(f"load_format must be one of {', '.join(LOAD_FORMATS)}, got {fmt!r}")
    is_gguf = gguf_loader.is_gguf(path)
    if (fmt == "gguf" and not is_gguf) or (fmt == "safetensors" and is_gguf):
        raise ModelLoadError(f"{path} is not a {fmt} checkpoint")


def check_compatible(running: ModelConfig, path: str | Path) -> ModelConfig:
    """The config of the weights at ``path``, if they can replace ``running``'s; else a
    ``WeightsMismatchError`` naming the fields that differ (``ModelLoadError`` when ``path``
    is not a model at all)."""
    new = read_model_config(path)
    differ = [
        f.name
        for f in dataclasses.fields(ModelConfig)
        if f.name not in _FREE_FIELDS and not _same(getattr(new, f.name), getattr(running, f.name))
    ]
    if differ:
        detail = ", ".join(
            f"{name}: {getattr(new, name)!r} (running {getattr(running, name)!r})"
            for name in differ
        )
        raise WeightsMismatchError(f"the weights at {path} do not fit the running model: {detail}")
    return new


def _same(a: object, b: object) -> bool:
    """Equal, floats to float32's precision (a GGUF stores ``rms_norm_eps`` as float32)."""
    if isinstance(a, float) and isinstance(b, float):
        return math.isclose(a, b, rel_tol=1e-6)
    return a == b
