"""What a newcomer types as ``--model``: the default model's name and its aliases load it,
relative paths work in ``tandem serve``, ``generate`` and ``up``, every path that holds no
model is one line saying what was expected (never a traceback), and ``tandem up -f FILE
--model M`` serves M under M's own name."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tandem.server import local
from tandem.server.engine.default_model import (
    NAME,
    check_model_path,
    default_model_path,
    resolve_model,
)
from tandem.server.engine.models.config import ModelLoadError

from .utils import up_args

pytestmark = pytest.mark.timeout(300)
REPO = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(
    "name", [NAME, "SmolLM2-135M-Instruct", "smollm2:135m", "HuggingFaceTB/SmolLM2-135M-Instruct"]
)
def test_the_default_models_names_load_it(name: str, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)  # no folder of that name here
    assert resolve_model(name) == (str(default_model_path()), NAME)


def test_relative_paths_are_made_absolute(tiny_models, tmp_path: Path, monkeypatch) -> None:
    model = tiny_models["llama"]
    monkeypatch.chdir(model.parent)
    assert resolve_model(model.name) == (str(model), model.name)
    gguf = tmp_path / "models" / "x.gguf"
    gguf.parent.mkdir()
    gguf.symlink_to(default_model_path())
    monkeypatch.chdir(tmp_path)
    assert resolve_model("models/x.gguf") == (str(gguf), "x")
    topo = local.load_plan(up_args(model="models/x.gguf"))  # was "must be an absolute path"
    assert topo.served_model_name == "x" and topo.engines[0].args[2] == str(gguf)


def test_up_with_a_spec_file_serves_the_given_model_under_its_own_name(tiny_models) -> None:
    model = tiny_models["qwen3"]
    example = REPO / "examples" / "aggregated.yaml"
    topo = local.load_plan(up_args(file=str(example), model=str(model)))
    assert topo.served_model_name == model.name != "qwen3-0.6b"
    args = topo.engines[0].args
    assert args[2] == str(model) and args[args.index("--served-model-name") + 1] == model.name


def _bad_paths(root: Path) -> dict[str, str]:
    (root / "empty").mkdir()
    (root / "notes.txt").write_text("hi")
    (root / "config-only").mkdir()
    (root / "config-only" / "config.json").write_text("{}")
    (root / "no-tokenizer").mkdir()
    (root / "no-tokenizer" / "config.json").write_text("{}")
    (root / "no-tokenizer" / "model.safetensors").write_bytes(b"")
    return {
        "/missing.gguf": "nothing there",
        "Qwen/Qwen3-0.6B": "nothing there",
        str(root / "empty"): "without config.json",
        str(root / "notes.txt"): "not a .gguf",
        str(root / "config-only"): "no *.safetensors",
        str(root / "no-tokenizer"): "no tokenizer",
    }


def test_a_path_without_a_model_says_what_was_expected(tmp_path: Path) -> None:
    for path, why in _bad_paths(tmp_path).items():
        with pytest.raises(ModelLoadError, match="expected an HF-format model directory") as e:
            check_model_path(Path(path), path)
        assert why in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("command", ["serve", "generate", "up"])
def test_the_commands_answer_a_bad_model_in_one_line(command: str, tmp_path: Path) -> None:
    cases = _bad_paths(tmp_path)
    for path in ("/missing.gguf", str(tmp_path / "empty"), str(tmp_path / "no-tokenizer")):
        extra = ["--prompt", "hi"] if command == "generate" else ["--port", "0"]
        r = subprocess.run(
            [sys.executable, "-m", "tandem.server.cli", command, "--model", path, *extra],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=tmp_path,
        )
        lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
        assert r.returncode in (1, 2), r.stderr
        assert "Traceback" not in r.stderr and len(lines) == 1, r.stderr
        assert cases[path] in lines[0] and "expected" in lines[0], lines[0]


def test_generate_takes_the_default_models_name_and_a_relative_path(
    tiny_models, tmp_path: Path
) -> None:
    model = tmp_path / "m"
    shutil.copytree(tiny_models["llama"], model)
    r = subprocess.run(
        [sys.executable, "-m", "tandem.server.cli", "generate", "--model", "m"]
        + ["--prompt", "Hello", "--max-tokens", "3"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr
