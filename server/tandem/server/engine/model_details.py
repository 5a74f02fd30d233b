"""What a model file is, as Ollama's ``/api/tags`` and ``/api/show`` describe it: its format,
family (architecture), parameter count, quantisation and size on disk, read from the GGUF
header or the safetensors headers and ``config.json``, never by loading a weight."""

from __future__ import annotations

import json
import math
import struct
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from .gguf_loader import is_gguf, open_gguf


@dataclass(frozen=True)
class ModelDetails:
    format: str  # "gguf" or "safetensors"
    family: str  # the architecture: llama, qwen2, qwen3
    parameter_count: int
    quantization_level: str  # Q4_1, Q8_0, F16, BF16, F32 ...
    size: int  # bytes on disk of the weights

    @property
    def parameter_size(self) -> str:
        """Ollama's spelling: 134.52M, 8.03B."""
        n = self.parameter_count
        return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "parameter_size": self.parameter_size}


def describe(model: str | Path) -> ModelDetails:
    """The details of a ``.gguf`` file or an HF-format directory (safetensors)."""
    return _gguf(Path(model)) if is_gguf(model) else _safetensors(Path(model))


def _gguf(path: Path) -> ModelDetails:
    from gguf import LlamaFileType

    reader = open_gguf(path)
    arch = reader.fields["general.architecture"].contents()
    file_type = reader.fields.get("general.file_type")
    quant = LlamaFileType(file_type.contents()).name if file_type is not None else "unknown"
    return ModelDetails(
        format="gguf",
        family=str(arch),
        parameter_count=sum(int(t.n_elements) for t in reader.tensors),
        quantization_level=quant.removeprefix("MOSTLY_").removeprefix("ALL_"),
        size=path.stat().st_size,
    )


def _safetensors(root: Path) -> ModelDetails:
    config = json.loads((root / "config.json").read_text())
    files = sorted(root.glob("*.safetensors"))
    count, dtypes = 0, set()
    for f in files:
        for name, meta in _header(f).items():
            if name != "__metadata__":
                count += math.prod(meta["shape"])
                dtypes.add(meta["dtype"])
    return ModelDetails(
        format="safetensors",
        family=str(config.get("model_type", "")),
        parameter_count=count,
        quantization_level="/".join(sorted(dtypes)),
        size=sum(f.stat().st_size for f in files),
    )


def _header(path: Path) -> dict[str, Any]:
    """A safetensors file's JSON header (8-byte little-endian length, then the JSON)."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(n))
