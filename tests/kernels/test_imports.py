"""The kernels package's import graph: one-way (no circle, also through imports inside functions
or under TYPE_CHECKING), and no module reaching for another's private names."""

from __future__ import annotations

import ast
from pathlib import Path

KERNELS = Path(__file__).resolve().parents[2] / "kernels"
PACKAGE = "pagedserve.kernels"
MODULES = {p.stem for p in KERNELS.glob("*.py")} - {"__init__"}


def _imports(tree: ast.Module) -> tuple[set[str], list[str], dict[str, str]]:
    """Sibling modules imported anywhere in a file, private names imported from them, and the
    local names bound to sibling modules."""
    deps, private, aliases = set(), [], {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith(PACKAGE + "."):
                    mod = a.name.removeprefix(PACKAGE + ".")
                    deps.add(mod)
                    if a.asname:
                        aliases[a.asname] = mod
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: within the package
                base = f"{PACKAGE}.{base}" if base else PACKAGE
            if base == PACKAGE:
                for a in node.names:
                    if a.name in MODULES:
                        deps.add(a.name)
                        aliases[a.asname or a.name] = a.name
            elif base.startswith(PACKAGE + "."):
                mod = base.removeprefix(PACKAGE + ".")
                deps.add(mod)
                private += [f"{mod}.{a.name}" for a in node.names if a.name.startswith("_")]
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and node.value.id in aliases and node.attr.startswith("_")
                and not node.attr.startswith("__")):
            private.append(f"{aliases[node.value.id]}.{node.attr}")
    return deps, private, aliases


def _graph() -> tuple[dict[str, set[str]], dict[str, list[str]]]:
    graph, private = {}, {}
    for path in sorted(KERNELS.glob("*.py")):
        deps, priv, _ = _imports(ast.parse(path.read_text(), str(path)))
        graph[path.stem] = deps & MODULES - {path.stem}
        if priv:
            private[path.stem] = priv
    return graph, private


def test_no_import_circle():
    graph, _ = _graph()
    assert "w4a16_gluon" in graph["w4a16"]  # imports were found at all
    done, path = set(), []

    def visit(mod: str) -> None:
        assert mod not in path, f"import circle: {' -> '.join(path[path.index(mod):] + [mod])}"
        if mod in done:
            return
        path.append(mod)
        for dep in sorted(graph[mod]):
            visit(dep)
        path.pop()
        done.add(mod)

    for mod in sorted(graph):
        visit(mod)


def test_no_private_names_across_files():
    """A name another file needs is public; a module named _x (the package's helpers) is fine."""
    _, private = _graph()
    assert private == {}
