"""MXFP4 checkpoints (gpt-oss's releases) for the native decoder: each expert projection
arrives as `<name>_blocks` [E, out, in / 32, 16] uint8 (OCP MX FP4 e2m1 codes, two a byte,
the low nibble first) and `<name>_scales` [E, out, in / 32] uint8 (one power of two per 32
values, stored as exponent + 127). They are dequantized at load, exactly (every value is a
bfloat16), and yielded as HF's own parameter holds it ([E, in, out]: `<name>` transposed, a
view), so the loader reads one layout whether the checkpoint was MXFP4 or saved in float.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

from pagedserve.executor.checkpoint import checkpoint_shapes
from pagedserve.executor.quantization.config import QuantizationError
from pagedserve.executor.quantization.layer import gathered

# e2m1: the 16 codes' values
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
              -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
_PARTS = ("_blocks", "_scales")


def dequantize(blocks: torch.Tensor, scales: torch.Tensor,
               dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """blocks [..., G, 16] uint8 and scales [..., G] uint8 -> [..., G * 32] in `dtype`."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise QuantizationError(f"MXFP4 blocks and scales are uint8, got {blocks.dtype} and "
                                f"{scales.dtype}")
    if blocks.shape[-1] != 16 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise QuantizationError(f"MXFP4 blocks {tuple(blocks.shape)} do not match scales "
                                f"{tuple(scales.shape)} (blocks [..., G, 16], scales [..., G])")
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=blocks.device)
    out = torch.empty((*scales.shape, 32), dtype=dtype, device=blocks.device)
    for i in range(blocks.shape[0]):  # one expert at a time: float32 temporaries stay small
        b = blocks[i].long()
        codes = torch.stack([b & 0xF, b >> 4], dim=-1).flatten(-2)  # [..., G, 32]
        exp = scales[i].to(torch.int32) - 127
        out[i] = torch.ldexp(lut[codes], exp[..., None].float()).to(dtype)
    return out.flatten(-2)


def dequantize_mxfp4(weights: Iterable[tuple[str, torch.Tensor]],
                     dtype: torch.dtype = torch.bfloat16, device: torch.device | None = None
                     ) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors with each `_blocks` / `_scales` pair (in any order and file)
    replaced by the float tensor they hold, [E, in, out] as HF's parameter, made on `device`
    (the model's: the codes travel at half a byte a value and a GPU expands them in
    milliseconds, where a CPU takes seconds a layer); the rest as they are. A pair left
    incomplete at the end raises QuantizationError."""
    for base, parts, whole in gathered(weights, _PARTS, split=_base_and_part):
        if not base:  # any other tensor
            yield from parts.items()
        elif not whole:
            missing = sorted(f"{base}{p}" for p in _PARTS if p not in parts)
            raise QuantizationError(f"MXFP4 checkpoint lacks {', '.join(missing)}")
        else:
            blocks, scales = (parts[p].to(device) for p in _PARTS)
            yield base, dequantize(blocks, scales, dtype).transpose(1, 2)


def _base_and_part(name: str) -> tuple[str, str]:
    """`<base>_blocks` / `<base>_scales` -> (base, the part); other names -> (name, "")."""
    part = next((p for p in _PARTS if name.endswith(p)), "")
    return (name[: -len(part)], part) if part else (name, "")


def dequantized_bytes(weights_dir: Path, dtype: torch.dtype) -> int:
    """The bytes of an MXFP4 checkpoint's weights once dequantized to `dtype`: two values a
    byte of each `*_blocks` tensor, its `*_scales` gone, every other tensor in `dtype`."""
    total = 0
    for name, shape in checkpoint_shapes(weights_dir).items():
        if name.endswith("_scales"):
            continue
        total += math.prod(shape) * (2 if name.endswith("_blocks") else 1)
    return total * dtype.itemsize


def check_dequantized_fits(weights_dir: Path, dtype: torch.dtype, device: torch.device,
                           ranks: int = 1) -> None:
    """QuantizationError in one line where a rank's share of the dequantized weights (about
    1 / ranks of them under tensor parallelism) exceeds the device's free memory."""
    if device.type != "cuda":
        return
    need = dequantized_bytes(weights_dir, dtype) // ranks
    free = torch.cuda.mem_get_info(device)[0]
    if need > free:
        share = f" (a {ranks}th of them a rank)" if ranks > 1 else ""
        raise QuantizationError(
            f"{weights_dir}: MXFP4 weights are served dequantized to {str(dtype)[6:]}, "
            f"{need / 2**30:.1f} GiB{share}, and {device} has {free / 2**30:.1f} GiB free")
