"""Shared fixtures: the default model (converted once from its GGUF) and its tokenizer."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # tests share 2 cores with server processes


@pytest.fixture(scope="session")
def model_dir():
    from pagedserve.models import resolve_model

    return resolve_model("default")


@pytest.fixture(scope="session")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))
