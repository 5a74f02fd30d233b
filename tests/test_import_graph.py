"""Packages import each other in one direction only: the import graph, read from the source.

Every ``import`` and ``from ... import`` in every module (function-level ones included,
relative ones resolved) is an edge between the packages named in the issue: engine, disagg,
api, wire, proxy and operator. The graph must have no cycle, the engine imports none of the
packages that do I/O for it, the HTTP vocabulary (wire) is a leaf, and the proxy speaks only
that vocabulary (never the engine, its server or the KV transport).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = [ROOT / "server", ROOT / "operator"]
PACKAGES = {
    "tandem.server.engine": "engine",
    "tandem.server.disagg": "disagg",
    "tandem.server.api": "api",
    "tandem.server.wire": "wire",
    "tandem.server.proxy": "proxy",
    "tandem.operator": "operator",
}


def package_of(module: str) -> str | None:
    for prefix, name in PACKAGES.items():
        if module == prefix or module.startswith(prefix + "."):
            return name
    return None


def imports_of(path: Path, module: str) -> set[str]:
    """The absolute module names ``path`` (module ``module``) imports."""
    is_pkg = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")
                base = base[: len(base) - node.level + (1 if is_pkg else 0)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found.add(target)
            found.update(f"{target}.{alias.name}" for alias in node.names)
    return found


def package_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {name: set() for name in PACKAGES.values()}
    for root in SOURCES:
        for path in root.rglob("*.py"):
            rel = path.relative_to(root).with_suffix("")
            parts = list(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
            module = ".".join(parts)
            src = package_of(module)
            if src is None:
                continue
            for target in imports_of(path, module):
                dst = package_of(target)
                if dst is not None and dst != src:
                    graph[src].add(dst)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [node, nxt] if nxt in path else [node, nxt]
            if nxt not in state and (cycle := visit(nxt, path + [node])):
                return cycle
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node, [])):
            return cycle
    return None


def test_the_graph_is_read_from_the_source() -> None:
    graph = package_graph()
    # The arrows a reader expects: the API serves the engine, the disagg I/O moves the
    # engine's blocks, the API starts the transport.
    assert "engine" in graph["api"] and "engine" in graph["disagg"] and "disagg" in graph["api"]


def test_no_import_cycles_among_the_packages() -> None:
    assert find_cycle(package_graph()) is None


def test_the_engine_imports_no_io_package() -> None:
    assert package_graph()["engine"] == set()


def test_the_wire_vocabulary_is_a_leaf() -> None:
    assert package_graph()["wire"] == set()


def test_the_proxy_imports_only_the_wire_vocabulary() -> None:
    assert package_graph()["proxy"] == {"wire"}


def test_the_wire_imports_no_tandem_module_but_its_own_and_logsafe() -> None:
    """Finer than the package graph: not even a top-level module of ``tandem.server`` that
    could pull a package in, only the log-escaping helper the edge uses."""
    root = ROOT / "server"
    allowed = ("tandem.server.wire", "tandem.server.logsafe")
    for path in (root / "tandem" / "server" / "wire").rglob("*.py"):
        rel = path.relative_to(root).with_suffix("")
        parts = list(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
        for target in imports_of(path, ".".join(parts)):
            if target.startswith("tandem"):
                assert target.startswith(allowed), f"{path.name} imports {target}"


def test_find_cycle_finds_one() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) is not None
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
