"""The exponential race of the sampler in torch (the CPU path, and the Triton kernel's oracle).

A row samples token argmax_v p[v] / E[v], with E[v] ~ Exp(1) independent: that picks v with
probability p[v]. E comes from a counter-based generator, so one launch serves every row of a
batch while each row's draw depends on its own 64-bit key alone (a seeded request's key is a
function of its seed and the position it samples, kernels-side nothing else):

    z = key + (v + 1) * GAMMA            (mod 2**64; SplitMix64's state after v + 1 steps)
    z = mix(z)                           (SplitMix64's finalizer, a bijection)
    u = ((z >> 41) + 0.5) / 2**23        (the top 23 bits: exact in a float32, in (0, 1))
    E = -log(u)

(The finalizer's last step, z ^ (z >> 31), does not change the top 23 bits: both paths skip
it. The sampler's position_seed uses the same constants.)

The integer part is bit-exact between this file and kernels/sampling.py; E is a float32 log, so
the two may differ in the last bit, and an argmax can then differ only between two candidates
within an ulp of each other.
"""

from __future__ import annotations

import torch

GAMMA = 0x9E3779B97F4A7C15
MIX1 = 0xBF58476D1CE4E5B9
MIX2 = 0x94D049BB133111EB


def _signed(c: int) -> int:
    """A 64-bit constant as the int64 with the same bits (torch has no full uint64 arithmetic;
    int64 multiplication and addition wrap the same way)."""
    return c - (1 << 64) if c >= 1 << 63 else c


def _shr(z: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 bits (torch's >> is arithmetic: clear the sign copies)."""
    return torch.bitwise_right_shift(z, k).bitwise_and_((1 << (64 - k)) - 1)


def race_uniforms(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """[R] int64 keys -> [R, vocab] float32 uniforms in (0, 1), as the kernel draws them (in
    place where it can: this is the CPU's per-step sampling cost)."""
    v = torch.arange(1, vocab + 1, dtype=torch.int64, device=keys.device)
    z = torch.add(keys[:, None], v[None, :], alpha=_signed(GAMMA))
    z.bitwise_xor_(_shr(z, 30)).mul_(_signed(MIX1))
    z.bitwise_xor_(_shr(z, 27)).mul_(_signed(MIX2))
    # SplitMix64's last step, z ^ (z >> 31), leaves the top 23 bits as they are
    z = _shr(z, 41).to(torch.float32)
    return z.add_(0.5).mul_(1.0 / (1 << 23))


def exponential_race(probs: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """[R, V] float32 probabilities (rows need not be normalized), [R] int64 keys -> [R] int64
    sampled ids: argmax p / E, the lowest id on a tie."""
    if probs.dim() != 2 or keys.shape != (probs.shape[0],) or keys.dtype != torch.int64:
        raise ValueError(f"exponential_race: probs [R, V] and keys [R] int64, got "
                         f"{tuple(probs.shape)} and {tuple(keys.shape)} {keys.dtype}")
    noise = race_uniforms(keys, probs.shape[1]).log_().neg_()
    return torch.div(probs.float(), noise, out=noise).argmax(dim=-1)
