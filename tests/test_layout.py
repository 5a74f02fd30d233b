"""The repository's shape as a newcomer meets it: no folder shadows the standard library from
the repository root, and the code passes the project's linter and formatter."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_stdlib_operator_wins_from_the_repository_root() -> None:
    # -S: no site-packages, so no .pth file can import the real `operator` first by luck.
    r = _run(sys.executable, "-S", "-c", "import collections, operator; assert operator.eq(1, 1)")
    assert r.returncode == 0, r.stderr
    r = _run(
        sys.executable, "-c", "import operator, tandem.operator.spec; print(operator.__file__)"
    )
    assert r.returncode == 0, r.stderr
    assert "site-packages" not in r.stdout and str(ROOT) not in r.stdout


def test_import_paths_mirror_the_tree() -> None:
    r = _run(
        sys.executable,
        "-c",
        "import tandem.server.engine.llm_engine as a, tandem.operator.plan as b;"
        "print(a.__file__); print(b.__file__)",
    )
    assert r.returncode == 0, r.stderr
    engine, plan = r.stdout.split()
    assert Path(engine).relative_to(ROOT) == Path("server/tandem/server/engine/llm_engine.py")
    assert Path(plan).relative_to(ROOT) == Path("operator/tandem/operator/plan.py")


def test_ruff_lint_and_format_are_clean() -> None:
    check = _run(sys.executable, "-m", "ruff", "check", ".")
    assert check.returncode == 0, check.stdout + check.stderr
    fmt = _run(sys.executable, "-m", "ruff", "format", "--check", ".")
    assert fmt.returncode == 0, fmt.stdout + fmt.stderr
