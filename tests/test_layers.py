"""The package reads bottom-up: core and protos, then kernels, then the two processes, then the
CLI and the client; inside the scheduler, the API front ends (pagedserve.scheduler.api) sit on
the engine core (the scheduler's other modules), which imports no front end. Checked on the
import statements themselves (ast), so an import inside a function or under TYPE_CHECKING
counts too."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SETUPTOOLS = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
# what each layer may import from pagedserve (besides itself)
ALLOWED = {
    "pagedserve.core": set(),
    "pagedserve.protos": set(),
    "pagedserve.kernels": {"pagedserve.core"},
    "pagedserve.scheduler": {"pagedserve.core", "pagedserve.protos"},
    "pagedserve.executor": {"pagedserve.core", "pagedserve.protos", "pagedserve.kernels"},
}
API = "pagedserve.scheduler.api"  # the front ends: nothing of the engine core imports them
TOP = {"pagedserve.cli", "pagedserve.client", "pagedserve.quantize",  # nothing imports these
       "pagedserve.supervise"}


def package_dir(package: str) -> Path:
    """The folder of a package, through pyproject's package-dir mapping."""
    mapping = SETUPTOOLS["package-dir"]
    parts = package.split(".")
    for i in range(len(parts), 0, -1):
        if ".".join(parts[:i]) in mapping:
            return ROOT / mapping[".".join(parts[:i])] / Path(*parts[i:])
    raise KeyError(package)


def modules() -> dict[str, Path]:
    out = {}
    for package in SETUPTOOLS["packages"]:
        for f in package_dir(package).glob("*.py"):
            if f.name.endswith(("_pb2.py", "_pb2_grpc.py")):
                continue
            out[package if f.stem == "__init__" else f"{package}.{f.stem}"] = f
    return out


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The pagedserve modules `name` imports (a package's submodule where one is named)."""
    package = name if path.stem == "__init__" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1]
                                + ([base] if base else []))
            found |= {f"{base}.{a.name}" if f"{base}.{a.name}" in known else base
                      for a in node.names}
    return {m for m in found if m in known and m != name}


def graph() -> dict[str, set[str]]:
    mods = modules()
    return {name: imports(name, path, set(mods)) for name, path in mods.items()}


def layer(module: str) -> str | None:
    return next((p for p in ALLOWED if module == p or module.startswith(p + ".")), None)


def test_pyproject_lists_every_package_folder():
    listed = {package_dir(p) for p in SETUPTOOLS["packages"]}
    folders = {init.parent for top in set(SETUPTOOLS["package-dir"].values())
               for init in (ROOT / top).rglob("__init__.py")}
    assert folders == listed


def test_layers_import_only_downwards():
    bad = []
    for module, deps in graph().items():
        mine = layer(module)
        for dep in deps:
            if dep in TOP and module not in TOP:
                bad.append(f"{module} -> {dep} (the CLI/client layer)")
            elif mine is not None and layer(dep) not in (mine, *ALLOWED[mine]) \
                    and dep != "pagedserve":
                bad.append(f"{module} -> {dep}")
    assert bad == []


def test_the_engine_core_imports_no_front_end():
    def in_api(module: str) -> bool:
        return module == API or module.startswith(API + ".")

    bad = [f"{module} -> {dep}" for module, deps in graph().items()
           if layer(module) == "pagedserve.scheduler" and not in_api(module)
           for dep in deps if in_api(dep)]
    assert bad == []


def test_no_import_cycles():
    g = graph()
    cycles, state = [], {}

    def visit(m: str, path: list[str]) -> None:
        state[m] = "open"
        for d in sorted(g[m]):
            if state.get(d) == "open":
                cycles.append(path[path.index(d):] + [d])
            elif d not in state:
                visit(d, [*path, d])
        state[m] = "done"

    for m in sorted(g):
        if m not in state:
            visit(m, [m])
    assert cycles == []

