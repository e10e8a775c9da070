"""Host-side pieces every W4A16 launcher shares (w4a16_decode, w4a16_prefill, w4a16_gluon and
the dispatcher w4a16): argument checks, output and split-K buffers, the shape rules of the
dispatch bands, x's plane-major order and the bf16/fp16 fill of the packed-pair asm templates.
The packed layout itself is documented in kernels/w4a16.py."""

from __future__ import annotations

import torch
import triton.language as tl

from pagedserve.kernels._checks import (
    FLOAT_DTYPES,
    check_contiguous,
    check_inner_contiguous,
    check_tensor,
)

PLANE_BLOCK = 128  # K block of the plane-major order: 16 words of 8 nibbles per column


def large_weight(n: int, k: int) -> bool:
    """Whether the weight is one of the wide MLP shapes (Llama-3.1-8B gate_up and down, N or K =
    14336) rather than attention's q/k/v/o: the bands differ where the GPU is short of tiles."""
    return n * k > 32 * 1024 * 1024


def split_for(tiles: int, target: int, cap: int) -> int:
    """The smallest power-of-two split-K with at least `target` programs, at most `cap`."""
    split = 1
    while tiles * split < target and split < cap:
        split *= 2
    return split


def planes_split(tiles: int, k: int, target: int) -> int:
    """Split-K for the plane-major kernels: at least `target` programs, and no program with more
    than 16 K tiles of 128 (a long serial K loop is what made the K=14336 shapes slow)."""
    split = split_for(tiles, target, 16)
    while k > 16 * PLANE_BLOCK * split and split < 16:
        split *= 2
    return split


def packed_pairs(x: torch.Tensor) -> bool:
    """Whether the inline-PTX (packed-pair) dequantization can run for x: CUDA and 16-bit
    activations. The interpreter and fp32 activations take the fp32 (2^23 trick) path."""
    return x.is_cuda and x.dtype in (torch.bfloat16, torch.float16)


def check_gemm_args(x, qweight, scales, zeros, group_size, bias, perm) -> tuple[int, int, int]:
    """Validates a W4A16 GEMM's arguments (ValueError on misuse); returns (M, N, K)."""
    check_tensor("x", x, 2, FLOAT_DTYPES)
    check_inner_contiguous("x", x)
    m, k = x.shape
    check_tensor("qweight", qweight, 2, (torch.int32,), x.device)
    check_contiguous("qweight", qweight)
    n = qweight.shape[1]
    if k % 8 or qweight.shape[0] * 8 != k:
        raise ValueError(f"qweight shape {tuple(qweight.shape)} does not pack K={k} (K/8 rows)")
    if group_size < 16 or group_size & (group_size - 1):
        raise ValueError(f"group_size must be a power of two >= 16, got {group_size}")
    groups = -(-k // group_size)
    for name, t in (("scales", scales), ("zeros", zeros)):
        check_tensor(name, t, 2, FLOAT_DTYPES, x.device)
        check_contiguous(name, t)
        if tuple(t.shape) != (groups, n):
            raise ValueError(f"{name} shape {tuple(t.shape)} != ({groups}, {n})")
    if bias is not None:
        check_tensor("bias", bias, 1, FLOAT_DTYPES, x.device)
        if bias.shape[0] != n or bias.stride(0) != 1:
            raise ValueError(f"bias must be contiguous [{n}], got {tuple(bias.shape)}")
    if perm is not None:
        check_tensor("perm", perm, 1, (torch.int32, torch.int64), x.device)
        if perm.shape[0] != k:
            raise ValueError(f"perm has {perm.shape[0]} entries, K={k}")
    return m, n, k


def gemm_out(out: torch.Tensor | None, m: int, n: int, x: torch.Tensor) -> torch.Tensor:
    """`out` checked as an [M, N] result in x's dtype (rows may be strided), or a new one."""
    if out is None:
        return torch.empty((m, n), dtype=x.dtype, device=x.device)
    check_tensor("out", out, 2, (x.dtype,), x.device)
    if tuple(out.shape) != (m, n):
        raise ValueError(f"out shape {tuple(out.shape)} != ({m}, {n})")
    check_inner_contiguous("out", out)
    return out


def split_k_partials(split: int, m: int, n: int, device: torch.device) -> torch.Tensor:
    """The fp32 [split, M, N] buffer of split-K partial sums (the kernels index it in int32)."""
    if split * m * n >= 2**31:
        raise ValueError(f"split-K partials of {split}x{m}x{n} overflow int32 offsets")
    return torch.empty((split, m, n), dtype=torch.float32, device=device)


_LOCKS: dict[torch.device, torch.Tensor] = {}


def split_k_locks(device: torch.device, count: int) -> torch.Tensor:
    """Split-K arrival counters, zero between calls (the last program of a tile resets its own);
    a cache, not state: any zeroed buffer of this size works."""
    locks = _LOCKS.get(device)
    if locks is None or locks.numel() < count:
        locks = torch.zeros(max(count, 4096), dtype=torch.int32, device=device)
        _LOCKS[device] = locks
    return locks


def plane_major(x: torch.Tensor) -> torch.Tensor:
    """x's columns reordered within each block of 128 so that the rows one nibble plane of a
    128-row weight tile holds (8i + j, i = 0..15) are contiguous: column 8i + j moves to
    16j + i. K is zero-padded to a multiple of 128 (the weight's missing rows then meet zeros).
    One copy of x ([M, K], small next to the weight)."""
    m, k = x.shape
    kp = -(-k // PLANE_BLOCK) * PLANE_BLOCK
    if kp != k:
        x = torch.nn.functional.pad(x, (0, kp - k))
    return x.reshape(m, kp // PLANE_BLOCK, 16, 8).transpose(2, 3).reshape(m, kp)


def x2_variants(asm: str) -> tuple[tl.constexpr, tl.constexpr]:
    """The bf16x2 and f16x2 versions of a packed-pair asm template: TY, MAGIC (the exponent of
    128 in bf16, of 1024 in fp16), ONE and NEGZERO filled in."""
    fill = {"bf16x2": ("0x43004300", "0x3f803f80"), "f16x2": ("0x64006400", "0x3c003c00")}
    return tuple(tl.constexpr(asm.replace("TY", ty).replace("MAGIC", magic)
                              .replace("ONE", one).replace("NEGZERO", "0x80008000"))
                 for ty, (magic, one) in fill.items())
