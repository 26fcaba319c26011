"""The import graph of src/refractor, read with ``ast`` (nothing is imported).

Rules: module-level imports form no cycle (imports inside functions and under ``if TYPE_CHECKING:``
run after every module has loaded, so they cannot break start-up); stricter, no cycle even when
those are counted (a lazy or type-only import that only dodges a cycle hides a layering problem:
the dependency should go one way); and no package module imports the drivers ``refractor.train`` /
``refractor.cli``, which sit on top of everything.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = "refractor"
DRIVERS = ("refractor.train", "refractor.cli")


@dataclass(frozen=True)
class Import:
    target: str  # the module imported (a submodule when ``from pkg import sub`` names one)
    lazy: bool  # inside a function body
    type_only: bool  # under ``if TYPE_CHECKING:``
    line: int


def module_files() -> dict[str, Path]:
    files = {}
    for path in sorted((SRC / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        files[".".join(parts)] = path
    return files


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _walk(nodes: list[ast.stmt], lazy: bool, type_only: bool) -> Iterator[tuple[ast.stmt, bool, bool]]:
    for node in nodes:
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node, lazy, type_only
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            yield from _walk(node.body, True, type_only)
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            yield from _walk(node.body, lazy, True)
            yield from _walk(node.orelse, lazy, type_only)
        else:
            for field in ("body", "orelse", "finalbody", "handlers", "cases"):
                children = getattr(node, field, None)
                if isinstance(children, list):
                    yield from _walk([c for c in children if isinstance(c, ast.AST)], lazy, type_only)


def imports_of(module: str, path: Path, modules: set[str]) -> list[Import]:
    """Every import of a ``refractor`` module in ``path``, resolved to the module it loads."""
    package = (module if path.name == "__init__.py" else module.rpartition(".")[0]).split(".")
    found = []
    for node, lazy, type_only in _walk(ast.parse(path.read_text()).body, False, False):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            base = node.module or ""
            if node.level:
                anchor = package[: len(package) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        for name in names:
            while name and name not in modules and name.startswith(PACKAGE):
                name = name.rpartition(".")[0]  # `import refractor.a.b.attr` style: the module part
            if name in modules:
                found.append(Import(name, lazy, type_only, node.lineno))
    return found


def import_graph() -> dict[str, list[Import]]:
    files = module_files()
    return {module: imports_of(module, path, set(files)) for module, path in files.items()}


def strongly_connected(edges: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm; components of more than one module, or a module importing itself."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []

    def visit(node: str) -> None:
        index[node] = len(index)
        low[node] = index[node]
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(edges.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1 or node in edges.get(node, ()):
                components.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return components


def import_cycles(graph: dict[str, list[Import]], *, module_level_only: bool) -> list[list[str]]:
    edges = {
        module: {i.target for i in imps if not module_level_only or not (i.lazy or i.type_only)}
        for module, imps in graph.items()
    }
    return strongly_connected(edges)


def driver_imports(graph: dict[str, list[Import]]) -> list[str]:
    """Imports of the drivers from any other module (lazy and type-only ones included)."""
    return sorted(
        f"{module}:{imp.line} -> {imp.target}"
        for module, imps in graph.items()
        if module not in DRIVERS
        for imp in imps
        if imp.target in DRIVERS
    )


# ----------------------------------------------------------------------------------------- tests
def test_the_graph_reader_resolves_relative_submodule_and_guarded_imports(tmp_path):
    pkg = tmp_path / PACKAGE / "pkg"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "from . import b\n"
        "from refractor.pkg.c import thing\n"
        "if TYPE_CHECKING:\n"
        "    from refractor.pkg import d\n"
        "def f():\n"
        "    import refractor.pkg.e\n"
    )
    for name in "bcde":
        (pkg / f"{name}.py").write_text("")
    modules = {"refractor", "refractor.pkg", *(f"refractor.pkg.{n}" for n in "abcde")}
    found = {(i.target, i.lazy, i.type_only) for i in imports_of("refractor.pkg.a", pkg / "a.py", modules)}
    assert found == {
        ("refractor.pkg.b", False, False),
        ("refractor.pkg.c", False, False),
        ("refractor.pkg.d", False, True),
        ("refractor.pkg.e", True, False),
    }


def test_cycles_are_found_by_strongly_connected_components():
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}}
    assert sorted(strongly_connected(edges)) == [["a", "b", "c"], ["e"]]


def test_records_and_environments_do_not_load_torch():
    import subprocess
    import sys

    code = "import sys, refractor.envs, refractor.records; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_no_module_level_import_cycles():
    assert import_cycles(import_graph(), module_level_only=True) == []


def test_no_import_cycles_even_through_function_level_or_type_only_imports():
    assert import_cycles(import_graph(), module_level_only=False) == []


def test_no_package_module_imports_the_drivers():
    assert driver_imports(import_graph()) == []
