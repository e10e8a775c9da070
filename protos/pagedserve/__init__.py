"""Protocol buffers of pagedserve (Python package `pagedserve.protos`): `v1` is the public gRPC
API, `internal.v1` the scheduler<->executor messages. The modules are generated (codegen.py).
"""

from pathlib import Path

if (Path(__file__).resolve().parents[2] / "pyproject.toml").exists():
    # a source checkout (editable install): keep the stubs as fresh as their .proto files
    from pagedserve.protos.codegen import generate

    generate()
