"""The repository's shape as a newcomer meets it: no folder shadows the standard library from
the repository root, the code passes the project's linter and formatter, and no function is
longer than a reader can hold (60 lines)."""

from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
from importlib.metadata import PackageNotFoundError, packages_distributions, requires
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_stdlib_operator_wins_from_the_repository_root() -> None:
    # -S: no site-packages, so no .pth file can import the real `operator` first by luck.
    r = _run(sys.executable, "-S", "-c", "import collections, operator; assert operator.eq(1, 1)")
    assert r.returncode == 0, r.stderr
    r = _run(
        sys.executable,
        "-c",
        "import operator, tandem.operator.spec.inference_service; print(operator.__file__)",
    )
    assert r.returncode == 0, r.stderr
    assert "site-packages" not in r.stdout and str(ROOT) not in r.stdout


def test_import_paths_mirror_the_tree() -> None:
    r = _run(
        sys.executable,
        "-c",
        "import tandem.server.engine.llm_engine as a, tandem.operator.topology as b;"
        "print(a.__file__); print(b.__file__)",
    )
    assert r.returncode == 0, r.stderr
    engine, plan = r.stdout.split()
    assert Path(engine).relative_to(ROOT) == Path("server/tandem/server/engine/llm_engine.py")
    assert Path(plan).relative_to(ROOT) == Path("operator/tandem/operator/topology.py")


def test_ruff_lint_and_format_are_clean() -> None:
    check = _run(sys.executable, "-m", "ruff", "check", ".")
    assert check.returncode == 0, check.stdout + check.stderr
    fmt = _run(sys.executable, "-m", "ruff", "format", "--check", ".")
    assert fmt.returncode == 0, fmt.stdout + fmt.stderr


def test_serve_extra_holds_everything_tandem_up_and_serve_import() -> None:
    """``pip install ".[serve]"`` (the README's first command) must be enough for
    ``tandem up`` and the servers it starts: every distribution their modules import is a
    base dependency or in the ``serve`` extra. (``tandem up`` renders the operator's plan,
    which imports the kubernetes models, so a missing one only failed at run time.)"""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = {
        _dist(Requirement(r).name)
        for r in project["dependencies"] + project["optional-dependencies"]["serve"]
    }
    modules = [
        "tandem.server.cli",
        "tandem.server.local",
        "tandem.operator.topology",
        "tandem.operator.spec.inference_service",
        "tandem.server.api.app",
        "tandem.server.api.serve_cli",
        "tandem.server.proxy.app",
        "tandem.server.proxy.cli",
    ]
    script = (
        "import importlib, sys\n"
        "before = set(sys.modules)  # the interpreter's own start-up (.pth hooks) excluded\n"
        f"for m in {modules!r}: importlib.import_module(m)\n"
        "print('\\n'.join(sorted({n.split('.')[0] for n in set(sys.modules) - before})))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, cwd=ROOT
    ).stdout.split()
    owners = packages_distributions()
    used = {_dist(d) for m in out for d in owners.get(m, [])}
    reachable = _with_requirements(declared)
    # Imported when installed, run without: anyio's sniffio; starlette's python-multipart
    # (the test extra's openai-agents brings it); requests' chardet, httpx's zstandard and
    # torch's datapipes' dill (the test extra's lm-eval brings them).
    optional = {"sniffio", "python-multipart", "chardet", "zstandard", "dill"}
    missing = sorted(used - reachable - optional - {"tandem"})
    assert not missing, f"imported by tandem up/serve but not in [serve]: {missing}"


def _dist(name: str) -> str:
    return name.lower().replace("_", "-")


def _with_requirements(names: set[str]) -> set[str]:
    """The distributions ``names`` install: themselves and what they require, transitively."""
    seen: set[str] = set()
    todo = list(names)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            reqs = requires(name) or []
        except PackageNotFoundError:  # declared for another platform or Python: nothing below
            continue
        todo += [
            _dist(req.name)
            for req in map(Requirement, reqs)
            if req.marker is None or req.marker.evaluate({"extra": ""})
        ]
    return seen


MAX_FUNCTION_LINES = 60


def long_functions(root: Path, limit: int = MAX_FUNCTION_LINES) -> list[str]:
    """Every function (methods and nested ones included) under ``root`` longer than ``limit``
    lines, decorators not counted, as ``path:line name (lines)``."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = node.end_lineno - node.lineno + 1
                if lines > limit:
                    found.append(f"{path.relative_to(root)}:{node.lineno} {node.name} ({lines})")
    return found


@pytest.mark.parametrize(
    "package",
    [
        "server/tandem/server/proxy",
        "server/tandem/server/wire",
        "operator/tandem/operator",
    ],
)
def test_no_function_is_longer_than_60_lines(package: str) -> None:
    assert long_functions(ROOT / package) == []


def test_every_operator_module_is_under_400_lines() -> None:
    """The operator is read file by file when a reconcile goes wrong; no file holds two concepts."""
    root = ROOT / "operator/tandem/operator"
    long = {
        str(p.relative_to(root)): n
        for p in root.rglob("*.py")
        if (n := len(p.read_text().splitlines())) >= 400
    }
    assert long == {}


def test_long_functions_finds_nested_ones(tmp_path: Path) -> None:
    body = "\n".join(f"        x{i} = {i}" for i in range(60))
    (tmp_path / "m.py").write_text(f"def outer():\n    def inner():\n{body}\n")
    found = long_functions(tmp_path)
    assert [f.split()[-2] for f in found] == ["outer", "inner"]


def test_a_request_holds_at_most_20_fields() -> None:
    """The scheduler's ``Request`` keeps what every step reads; sampling, output, P/D,
    timings and pooling live in their parts (engine/request.py)."""
    from dataclasses import fields

    from tandem.server.engine.request import Request

    assert len(fields(Request)) <= 20, [f.name for f in fields(Request)]
