"""How long the proxy takes to start, against a baseline revision in the same run: the import
of ``tandem.server.proxy.app`` (timed inside a fresh interpreter) and the wall time of
``tandem proxy --help`` (the whole process), each the median of ``--runs`` subprocesses.

The baseline (default ``6e23a3d``, where the proxy imported the engine and torch) is
extracted with ``git archive`` into a temporary directory. Both trees are imported the same
way: their ``server`` and ``operator`` roots first on ``PYTHONPATH``, the virtualenv's editable
finder for this checkout removed, a neutral working directory; each run prints which
``tandem.server`` it imported, and a run that imported the wrong tree is an error.

    python bench/import_time.py [--base 6e23a3d] [--runs 7]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Run first in every child: forget the editable install's finder (it maps ``tandem.server``
# to this checkout), so the tree on PYTHONPATH is the one imported.
PRELUDE = (
    "import sys; "
    "sys.meta_path[:] = [f for f in sys.meta_path if 'editable' not in repr(f).lower()]; "
    "sys.path_hooks[:] = [h for h in sys.path_hooks if 'editable' not in repr(h).lower()]; "
    "sys.path_importer_cache.clear()\n"
)
IMPORT = PRELUDE + (
    "import json, time\n"
    "t = time.perf_counter()\n"
    "import tandem.server.proxy.app\n"
    "dt = time.perf_counter() - t\n"
    "import tandem.server\n"
    "print(json.dumps({'seconds': dt, 'file': tandem.server.__file__, "
    "'torch': 'torch' in sys.modules}))\n"
)
HELP = PRELUDE + (
    "import tandem.server\n"
    "sys.stderr.write('TREE ' + tandem.server.__file__ + '\\n')\n"
    "from tandem.server.cli import main\n"
    "sys.argv = ['tandem', 'proxy', '--help']\n"
    "main()\n"
)


def _env(tree: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = f"{tree / 'server'}{os.pathsep}{tree / 'operator'}"
    env["HF_HUB_OFFLINE"] = "1"
    return env


def _check_tree(file: str, tree: Path) -> None:
    if not Path(file).resolve().is_relative_to(tree.resolve()):
        raise SystemExit(f"imported {file}, not the tree under {tree}")


def import_seconds(tree: Path, cwd: Path) -> tuple[float, bool]:
    """One fresh interpreter's import of the proxy app: seconds, and whether torch came."""
    r = subprocess.run(
        [sys.executable, "-s", "-c", IMPORT],
        env=_env(tree),
        cwd=cwd,
        capture_output=True,
        text=True,
        check=True,
    )
    out = json.loads(r.stdout.splitlines()[-1])
    _check_tree(out["file"], tree)
    return out["seconds"], out["torch"]


def help_seconds(tree: Path, cwd: Path) -> float:
    """The wall time of one ``tandem proxy --help`` process, interpreter start included."""
    start = time.perf_counter()
    r = subprocess.run(
        [sys.executable, "-s", "-c", HELP], env=_env(tree), cwd=cwd, capture_output=True, text=True
    )
    seconds = time.perf_counter() - start
    if r.returncode != 0 or "usage:" not in r.stdout:
        raise SystemExit(f"tandem proxy --help failed under {tree}:\n{r.stderr[-2000:]}")
    _check_tree(r.stderr.split("TREE ", 1)[1].split()[0], tree)
    return seconds


def measure(tree: Path, runs: int, cwd: Path) -> dict[str, float | bool]:
    import_seconds(tree, cwd)  # warm-up: compiles the tree's bytecode, fills the page cache
    imports = [import_seconds(tree, cwd) for _ in range(runs)]
    helps = [help_seconds(tree, cwd) for _ in range(runs)]
    return {
        "import": statistics.median(s for s, _ in imports),
        "help": statistics.median(helps),
        "torch": any(t for _, t in imports),
    }


def extract(rev: str, into: Path) -> Path:
    """``rev``'s ``server`` and ``operator`` trees, as files under ``into``."""
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", rev, "server", "operator"],
        capture_output=True,
        check=True,
    ).stdout
    into.mkdir(parents=True)
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", default="6e23a3d", help="baseline git revision")
    parser.add_argument("--runs", type=int, default=7, help="subprocesses per measurement")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        base_tree = extract(args.base, Path(tmp) / "base")
        neutral = Path(tmp) / "cwd"
        neutral.mkdir()
        base = measure(base_tree, args.runs, neutral)
        work = measure(ROOT, args.runs, neutral)
    print(f"median of {args.runs} runs each ({sys.executable})")
    print(f"{'tree':<16}{'import proxy.app':>18}{'proxy --help':>15}  torch imported")
    for name, m in ((args.base, base), ("working tree", work)):
        print(f"{name:<16}{m['import']:>16.3f} s{m['help']:>13.3f} s  {m['torch']}")
    ratio_import = base["import"] / work["import"]
    ratio_help = base["help"] / work["help"]
    print(f"{'ratio base/now':<16}{ratio_import:>17.1f}x{ratio_help:>14.1f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
