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



# The API front ends sit side by side on the path they share (frontend.py and what it uses),
# which takes the neutral GenerationInput (api/generation_input.py): neither builds the
# other's request types. server.py and tls.py set both up.
HTTP_API = {"openai_api", "openai_errors", "openai_logprobs", "openai_protocol",
            "openai_responses", "openai_tools", "http_metrics", "http_server"}
GRPC_API = {"servicer", "errors", "reflection", "rpc_metrics"}
SHARED_API = {"frontend", "generation_input", "inputs", "chat", "tools", "parallel", "streams",
              "detokenizer", "tenants", "sampling_defaults"}
BOTH_API = {"server", "tls"}
# the public API's request messages (generate.proto) whose names are theirs alone
GRPC_REQUESTS = {"GenerateRequest", "TokenizeRequest", "GetModelInfoRequest", "SamplingParams",
                 "ChatMessages", "TokenIds", "Choices"}


def api_modules() -> dict[str, Path]:
    return {f.stem: f for f in package_dir(API).glob("*.py") if f.stem != "__init__"}


def test_every_api_module_belongs_to_one_front_end_or_the_shared_path():
    groups = [HTTP_API, GRPC_API, SHARED_API, BOTH_API]
    assert set(api_modules()) == set().union(*groups)
    assert sum(len(g) for g in groups) == len(set().union(*groups))


def test_the_http_api_and_the_shared_path_use_no_grpc_request_message():
    bad = []
    for stem in sorted(HTTP_API | SHARED_API):
        for node in ast.walk(ast.parse(api_modules()[stem].read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [f"{node.module}.{a.name}" for a in node.names]
            else:
                names = []
            bad += [f"{stem} imports {n}" for n in names
                    if n.startswith(("pagedserve.protos.", "google.protobuf"))]
            name = node.attr if isinstance(node, ast.Attribute) else \
                node.id if isinstance(node, ast.Name) else None
            if name in GRPC_REQUESTS:
                bad.append(f"{stem} names {name} (line {node.lineno})")
    assert bad == []


def test_neither_front_end_imports_the_other():
    g = graph()

    def of(stems: set[str]) -> set[str]:
        return {f"{API}.{s}" for s in stems}

    bad = [f"{m} -> {d}" for mine, others in ((HTTP_API, GRPC_API), (GRPC_API, HTTP_API),
                                              (SHARED_API, HTTP_API | GRPC_API | BOTH_API))
           for m in sorted(of(mine)) for d in sorted(g[m] & of(others))]
    assert bad == []
