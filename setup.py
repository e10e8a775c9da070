"""Generates the gRPC/protobuf stubs (protos/pagedserve/codegen.py) before the normal build."""

import importlib.util
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py


class BuildWithProtos(build_py):
    def run(self) -> None:
        path = Path(__file__).resolve().parent / "protos" / "pagedserve" / "codegen.py"
        spec = importlib.util.spec_from_file_location("_pagedserve_codegen", path)
        codegen = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(codegen)
        codegen.generate(force=True)
        super().run()


setup(cmdclass={"build_py": BuildWithProtos})
