"""The sampler's exponential race as one Triton launch for the whole batch: each program takes
a row, draws its Exp(1) variables from the row's key on the fly (nothing is written to memory
but the sampled id) and keeps the running argmax of p / E over the vocabulary. The generator and
its bit-exactness with the torch path: kernels/sampling_reference.py."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedserve.kernels.sampling_reference import GAMMA, MIX1, MIX2


@triton.jit
def _race_kernel(probs_ptr, keys_ptr, out_ptr, vocab, stride, GAMMA_C: tl.constexpr,
                 MIX1_C: tl.constexpr, MIX2_C: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    key = tl.load(keys_ptr + row).to(tl.uint64, bitcast=True)
    best = tl.full([], -1.0, tl.float32)
    best_id = tl.full([], 0, tl.int64)
    for start in range(0, vocab, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        inside = offs < vocab
        p = tl.load(probs_ptr + row * stride + offs, mask=inside, other=0.0).to(tl.float32)
        z = key + (offs.to(tl.uint64) + 1) * GAMMA_C
        z = (z ^ (z >> 30)) * MIX1_C
        z = (z ^ (z >> 27)) * MIX2_C  # (the last xor-shift leaves the top 23 bits alone)
        u = ((z >> 41).to(tl.float32) + 0.5) * (1.0 / 8388608.0)
        q = tl.where(inside, p / -tl.log(u), -1.0)
        m = tl.max(q, axis=0)
        i = tl.argmax(q, axis=0)  # the lowest index of the block's maximum
        take = m > best  # strictly: an earlier block wins a tie
        best_id = tl.where(take, (start + i).to(tl.int64), best_id)
        best = tl.where(take, m, best)
    tl.store(out_ptr + row, best_id)


def exponential_race(probs: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """As kernels.sampling_reference.exponential_race, in one launch."""
    if (probs.dim() != 2 or probs.stride(1) != 1 or keys.shape != (probs.shape[0],)
            or keys.dtype != torch.int64):
        raise ValueError(f"exponential_race: probs [R, V] row-contiguous and keys [R] int64, "
                         f"got {tuple(probs.shape)} and {tuple(keys.shape)} {keys.dtype}")
    rows, vocab = probs.shape
    out = torch.empty(rows, dtype=torch.int64, device=probs.device)
    if rows:
        _race_kernel[(rows,)](probs, keys.contiguous(), out, vocab, probs.stride(0),
                              GAMMA, MIX1, MIX2, BLOCK=1024, num_warps=4)
    return out
