"""``tandem make-draft SRC OUT --layers N``: a draft model for ``--speculative-method draft``
made from the target itself, its first ``N`` decoder layers with its own embeddings, final
norm and LM head ("LayerSkip"-style self-speculation, without the early-exit training).

It shares the target's vocabulary and tokenizer by construction, and costs about ``N`` /
layers of a target step plus the LM head's product. From an HF folder it writes an HF folder
(``config.json``'s ``num_hidden_layers`` set to ``N``); from a GGUF file a GGUF file whose
tensors are the target's own blocks, still quantized, copied byte for byte.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
from pathlib import Path

from ..gguf_loader import is_gguf, open_gguf
from ..loader import checkpoint_files

_HF_LAYER = re.compile(r"\.layers\.(\d+)\.")
_GGUF_LAYER = re.compile(r"^blk\.(\d+)\.")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("src", help="the target: an HF folder or a .gguf file")
    parser.add_argument("out", help="the draft to write (a folder, or a .gguf file for a .gguf)")
    parser.add_argument("--layers", type=int, required=True, help="decoder layers to keep")


def run(args: argparse.Namespace) -> int:
    print(make_layer_draft(args.src, args.out, args.layers))
    return 0


def make_layer_draft(src: str | Path, out: str | Path, layers: int) -> Path:
    """Write the first ``layers`` layers of ``src`` as a model at ``out``; returns ``out``."""
    if layers < 1:
        raise ValueError("a draft keeps at least one layer")
    if is_gguf(src):
        return _gguf_draft(Path(src), Path(out), layers)
    return _hf_draft(Path(src), Path(out), layers)


def _keep(name: str, pattern: re.Pattern[str], layers: int) -> bool:
    m = pattern.search(name)
    return m is None or int(m.group(1)) < layers


def _hf_draft(src: Path, out: Path, layers: int) -> Path:
    from safetensors.torch import load_file, save_file

    config = json.loads((src / "config.json").read_text())
    if layers >= config["num_hidden_layers"]:
        raise ValueError(f"{src} has only {config['num_hidden_layers']} layers")
    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and "safetensors" not in f.name:
            shutil.copy(f, out / f.name)
    config["num_hidden_layers"] = layers
    (out / "config.json").write_text(json.dumps(config, indent=2))
    tensors = {}
    for path in checkpoint_files(src):
        tensors.update(
            (k, v) for k, v in load_file(str(path)).items() if _keep(k, _HF_LAYER, layers)
        )
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def _gguf_draft(src: Path, out: Path, layers: int) -> Path:
    import gguf

    reader = open_gguf(src)
    arch = str(reader.fields[gguf.Keys.General.ARCHITECTURE].contents())
    count_key = gguf.Keys.LLM.BLOCK_COUNT.format(arch=arch)
    if layers >= int(reader.fields[count_key].contents()):
        raise ValueError(f"{src} has only {reader.fields[count_key].contents()} layers")
    writer = gguf.GGUFWriter(str(out), arch)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue  # the writer writes these itself
        vtype = field.types[0]
        value = layers if field.name == count_key else field.contents()
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, value, vtype, sub_type=sub)
    kept = [t for t in reader.tensors if _keep(t.name, _GGUF_LAYER, layers)]
    for t in kept:
        writer.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for t in kept:
        writer.write_tensor_data(t.data)
    writer.close()
    return out
