"""Packages and modules import each other in one direction only: the import graphs, read from the source.

The package graph: every ``import`` and ``from ... import`` in every module (function-level
ones included, relative ones resolved) is an edge between the packages named in the issue:
engine, disagg, api, wire, proxy and operator. It must have no cycle, the engine imports none
of the packages that do I/O for it, the HTTP vocabulary (wire) is a leaf, and the proxy speaks
only that vocabulary (never the engine, its server or the KV transport).

The module graph: every module under ``server/`` and ``operator/`` and the Tandem modules it
imports at module level, that is, in statements that run when it is imported (its top level,
and ``if``/``try``/``with``/class bodies there). Imports inside functions are left out (they
run later, when everything is loaded), and so are those under ``if TYPE_CHECKING:`` (they
never run). ``from pkg import name`` imports the submodule ``pkg.name`` when there is one, and
importing ``a.b.c`` runs the packages ``a`` and ``a.b`` (their ``__init__``) first, so it is an
edge to each of them too, except to the importer's own packages, which are already loading.
No module may reach itself: a cycle makes which half of it is initialised depend on which
module was imported first.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = [ROOT / "server", ROOT / "operator"]
PACKAGES = {
    "tandem.server.engine": "engine",
    "tandem.server.disagg": "disagg",
    "tandem.server.api": "api",
    "tandem.server.wire": "wire",
    "tandem.server.proxy": "proxy",
    "tandem.server.picker": "picker",
    "tandem.operator": "operator",
}


def package_of(module: str) -> str | None:
    for prefix, name in PACKAGES.items():
        if module == prefix or module.startswith(prefix + "."):
            return name
    return None


def source_modules() -> dict[str, Path]:
    """Every module under the source roots, by its dotted name (a package by its own)."""
    found = {}
    for root in SOURCES:
        for path in root.rglob("*.py"):
            rel = path.relative_to(root).with_suffix("")
            parts = list(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
            found[".".join(parts)] = path
    return found


def _targets(node: ast.Import | ast.ImportFrom, module: str, is_pkg: bool) -> list[str]:
    """The absolute names one import statement names: the modules, and for ``from x import
    a`` also ``x.a`` (a submodule, or just a name, which matches no module)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if node.level:
        base = module.split(".")
        base = base[: len(base) - node.level + (1 if is_pkg else 0)]
        target = ".".join(base + ([node.module] if node.module else []))
    else:
        target = node.module or ""
    return [target] + [f"{target}.{alias.name}" for alias in node.names]


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _module_level(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    """The statements that run on import: not function bodies, not ``if TYPE_CHECKING:``."""
    for node in body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        if isinstance(node, ast.If):
            if not _is_type_checking(node.test):
                yield from _module_level(node.body)
            yield from _module_level(node.orelse)
        elif isinstance(node, ast.Try):
            for block in (node.body, node.orelse, node.finalbody, *(h.body for h in node.handlers)):
                yield from _module_level(block)
        elif isinstance(node, ast.With | ast.ClassDef):
            yield from _module_level(node.body)
        else:
            yield node


def imports_of(path: Path, module: str, module_level: bool = False) -> set[str]:
    """The absolute names ``path`` (module ``module``) imports: everywhere, or only at
    module level."""
    is_pkg = path.name == "__init__.py"
    tree = ast.parse(path.read_text())
    nodes = _module_level(tree.body) if module_level else ast.walk(tree)
    found: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.Import | ast.ImportFrom):
            found.update(_targets(node, module, is_pkg))
    return found


def package_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {name: set() for name in PACKAGES.values()}
    for module, path in source_modules().items():
        src = package_of(module)
        if src is None:
            continue
        for target in imports_of(path, module):
            dst = package_of(target)
            if dst is not None and dst != src:
                graph[src].add(dst)
    return graph


def module_graph() -> dict[str, set[str]]:
    """Each module's module-level imports of other source modules, the packages they run
    included (see the module docstring)."""
    modules = source_modules()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for module, path in modules.items():
        for target in imports_of(path, module, module_level=True):
            parts = target.split(".")
            for i in range(1, len(parts) + 1):
                name = ".".join(parts[:i])
                if name in modules and name != module and not module.startswith(name + "."):
                    graph[module].add(name)
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


def test_the_picker_scores_with_the_proxys_routing_and_speaks_only_the_wire() -> None:
    """The gateway's picker is a second front door over the proxy's routing and registry."""
    assert package_graph()["picker"] == {"proxy", "wire"}


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


def test_the_module_graph_is_read_from_the_source() -> None:
    graph = module_graph()
    engine = "tandem.server.engine"
    # A plain relative import, a submodule named by ``from .. import``, and the packages an
    # import runs first; a module's own package is not an edge, nor a TYPE_CHECKING import.
    assert f"{engine}.scheduler" in graph[f"{engine}.llm_engine"]
    assert f"{engine}.kernels" in graph[f"{engine}.models.rope"]
    assert {engine, f"{engine}.models.config"} <= graph["tandem.server.api.engine_loop"]
    assert engine not in graph[f"{engine}.llm_engine"]
    assert f"{engine}.request" not in graph[f"{engine}.pooling"]


def test_no_module_level_import_cycles() -> None:
    cycle = find_cycle(module_graph())
    assert cycle is None, "module-level import cycle: " + " -> ".join(cycle or [])


def test_find_cycle_finds_one() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) is not None
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
