"""One-way layers: no module of the project imports, directly or through others, itself; and the
package folders install as one `specdec` namespace."""

from __future__ import annotations

import ast
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parent.parent
# Source folder -> the package it installs as (pyproject.toml's package-dir).
PACKAGES = {
    "specdec": "specdec",
    "engine": "specdec.engine",
    "api": "specdec.api",
    "evals": "specdec.evals",
}


def _package_name(path: Path) -> str:
    folder, *rest = path.relative_to(ROOT).with_suffix("").parts
    return ".".join([PACKAGES[folder], *rest]).removesuffix(".__init__")


def _modules() -> dict[str, Path]:
    return {_package_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}


def import_graph() -> dict[str, set[str]]:
    """Module -> project modules it imports anywhere in its body (type-checking and function-level
    imports included: a cycle through them is still a cycle of the design)."""
    mods = _modules()

    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        for node in ast.walk(ast.parse(path.read_text())):
            names: list[str] = []
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            for name in names:
                target = resolve(name)
                if target and target != mod:
                    graph[mod].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles():
    assert cycles(import_graph()) == []


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_speculation_core_knows_nothing_of_http_or_evals():
    graph = import_graph()
    for mod, deps in graph.items():
        if not mod.startswith(("specdec.api", "specdec.evals")):
            assert not any(d.startswith(("specdec.api", "specdec.evals")) for d in deps), (
                mod,
                deps,
            )


def test_every_package_folder_is_installed_under_the_namespace():
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert setuptools["package-dir"] == {pkg: folder for folder, pkg in PACKAGES.items()}
    folders = {
        _package_name(p.parent / "__init__.py")
        for pkg in PACKAGES
        for p in (ROOT / pkg).rglob("*.py")
    }
    assert folders <= set(setuptools["packages"]), folders - set(setuptools["packages"])


def test_nothing_is_imported_by_its_folder_name():
    """`engine`, `api` and `evals` are not top-level packages once installed."""
    bare = {
        (mod, name)
        for mod, path in _modules().items()
        for node in ast.walk(ast.parse(path.read_text()))
        for name in _imported_names(node)
        if name.split(".")[0] in ("engine", "api", "evals")
    }
    assert bare == set()


def _imported_names(node: ast.AST) -> list[str]:
    if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
        return [node.module]
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    return []
