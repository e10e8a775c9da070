"""Generates the gRPC/protobuf stubs from protos/ before the normal build (protos/__init__.py)."""

import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py


class BuildWithProtos(build_py):
    def run(self) -> None:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from protos import generate

        generate(force=True)
        super().run()


setup(cmdclass={"build_py": BuildWithProtos})
