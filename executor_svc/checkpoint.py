"""Which files of a model folder hold its weights, and each tensor in them by name."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open


class CheckpointFilesError(FileNotFoundError):
    """A model folder with no weights in a format the loader reads."""


def checkpoint_files(path: Path) -> list[Path]:
    """The weight files of the HF checkpoint in `path`: its *.safetensors, else its
    pytorch_model*.bin. Where an index (model.safetensors.index.json,
    pytorch_model.bin.index.json) names the shards, only those: a folder downloaded whole may
    also hold the same weights in another layout (Mistral's consolidated.safetensors beside
    model-0000N-of-0000M.safetensors), which would load twice or under foreign names. Without
    an index, consolidated*.safetensors is left out where other safetensors are there."""
    for pattern, index in (("*.safetensors", "model.safetensors.index.json"),
                           ("pytorch_model*.bin", "pytorch_model.bin.index.json")):
        files = sorted(path.glob(pattern))
        if files and (path / index).exists():
            named = set(json.loads((path / index).read_text()).get("weight_map", {}).values())
            files = [f for f in files if f.name in named]
        elif any(not f.name.startswith("consolidated") for f in files):
            files = [f for f in files if not f.name.startswith("consolidated")]
        if files:
            return files
    raise CheckpointFilesError(f"no *.safetensors or pytorch_model*.bin weights in {path}")


def iter_checkpoint(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Each tensor of the checkpoint in `path` by name (checkpoint_files picks the files)."""
    for f in checkpoint_files(path):
        if f.suffix == ".bin":  # tensors only (no pickled code), memory-mapped
            yield from torch.load(f, map_location="cpu", weights_only=True, mmap=True).items()
            continue
        with safe_open(str(f), framework="pt", device="cpu") as st:
            for name in st.keys():  # noqa: SIM118 (safe_open is not a Mapping)
                yield name, st.get_tensor(name)


def checkpoint_names(path: Path) -> list[str]:
    """The tensor names of the checkpoint in `path`, no tensor read (checkpoint_shapes)."""
    return list(checkpoint_shapes(path))


def checkpoint_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Each tensor's shape by name, no tensor read (safetensors' headers; a .bin
    memory-mapped)."""
    shapes: dict[str, tuple[int, ...]] = {}
    for f in checkpoint_files(path):
        if f.suffix == ".bin":
            tensors = torch.load(f, map_location="cpu", weights_only=True, mmap=True)
            shapes.update((n, tuple(t.shape)) for n, t in tensors.items())
        else:
            with safe_open(str(f), framework="pt", device="cpu") as st:
                shapes.update((n, tuple(st.get_slice(n).get_shape())) for n in st.keys())  # noqa: SIM118
    return shapes
