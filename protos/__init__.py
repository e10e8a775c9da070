"""Protocol buffers of pagedserve: the public gRPC API and the scheduler<->executor messages.

The Python modules (`*_pb2.py`, `*_pb2_grpc.py`) are generated from the `.proto` files by the
project's setup (`setup.py` calls `generate()`); they are never committed. Importing this
package regenerates them when a `.proto` file is newer than its stub, so editing a proto in a
checkout needs no extra step.
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_FILES = (
    "protos/pagedserve/v1/generate.proto",
    "protos/pagedserve/internal/v1/executor.proto",
)


def _stub(proto: str) -> Path:
    return ROOT / proto.replace(".proto", "_pb2.py")


def generate(force: bool = False) -> None:
    """Compile every proto into Python messages, typing stubs and gRPC stubs next to it."""
    stale = [p for p in PROTO_FILES if force or _is_stale(p)]
    if not stale:
        return
    from grpc_tools import protoc  # build-time dependency only

    include = str(Path(protoc.__file__).parent / "_proto")
    for proto in stale:
        args = ["protoc", f"-I{ROOT}", f"-I{include}", f"--python_out={ROOT}",
                f"--pyi_out={ROOT}", f"--grpc_python_out={ROOT}", str(ROOT / proto)]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed on {proto}")


def _is_stale(proto: str) -> bool:
    stub = _stub(proto)
    return not stub.exists() or stub.stat().st_mtime < (ROOT / proto).stat().st_mtime


if (ROOT / PROTO_FILES[0]).exists():  # a source checkout (editable install): keep stubs fresh
    generate()
