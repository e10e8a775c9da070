"""Generates the Python modules (`*_pb2.py`, `*_pb2_grpc.py`, `*.pyi`) from the `.proto` files
beside them. They are never committed: `setup.py` calls `generate(force=True)` on every build,
and importing `pagedserve.protos` from a source checkout regenerates a stale one.

The `.proto` files sit at `protos/pagedserve/...`, the path other languages compile them from
(`protoc -I protos pagedserve/v1/generate.proto`), while the Python package is
`pagedserve.protos`. protoc names a generated module after the file's path under its include
root, so the files are compiled through a temporary root where this folder appears as
`pagedserve/protos`: the stubs then import each other as `pagedserve.protos.v1...`.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
PROTO_FILES = ("v1/generate.proto", "internal/v1/executor.proto",  # relative to HERE
               "internal/v1/engine.proto")


def generate(force: bool = False) -> None:
    """Compile every stale proto (every proto with force) into modules next to it."""
    stale = [p for p in PROTO_FILES if force or is_stale(p)]
    if not stale:
        return
    from grpc_tools import protoc  # build-time dependency only

    include = str(Path(protoc.__file__).parent / "_proto")
    with tempfile.TemporaryDirectory() as root:
        (Path(root) / "pagedserve").mkdir()
        os.symlink(HERE, Path(root) / "pagedserve" / "protos")
        for proto in stale:
            args = ["protoc", f"-I{root}", f"-I{include}", f"--python_out={root}",
                    f"--pyi_out={root}", f"--grpc_python_out={root}",
                    f"pagedserve/protos/{proto}"]
            if protoc.main(args) != 0:
                raise RuntimeError(f"protoc failed on {HERE / proto}")


def is_stale(proto: str) -> bool:
    """Whether the stub is missing or older than its .proto or than this generator."""
    stub = HERE / proto.replace(".proto", "_pb2.py")
    sources = (HERE / proto, Path(__file__))
    return not stub.exists() or stub.stat().st_mtime < max(p.stat().st_mtime for p in sources)
