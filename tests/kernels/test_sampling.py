"""The sampler's exponential race: the Triton kernel against the torch path, and the generator
against SplitMix64 itself."""

from __future__ import annotations

import torch

from pagedserve.kernels.sampling import exponential_race
from pagedserve.kernels.sampling_reference import exponential_race as reference
from pagedserve.kernels.sampling_reference import race_uniforms

CUDA = torch.cuda.is_available()
M64 = (1 << 64) - 1
KEYS = [0, 1, -1, 2**62, -2**63, 12345, 2**63 - 1, -987654321]


def splitmix64_output(key: int, n: int) -> int:
    """SplitMix64's n-th output (n from 1) from state `key`, in plain Python integers."""
    z = (key + n * 0x9E3779B97F4A7C15) & M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def test_uniforms_are_splitmix64_bits():
    u = race_uniforms(torch.tensor(KEYS), 7)
    want = [[((splitmix64_output(k & M64, v + 1) >> 41) + 0.5) / 2**23 for v in range(7)]
            for k in KEYS]
    assert u.tolist() == want


def test_kernel_equals_the_torch_path(device):
    """Rows of a vocabulary that is not a multiple of the kernel's block, with masked (zero)
    tokens; the same ids, row by row."""
    rows, vocab = (256, 128256) if CUDA else (len(KEYS), 2500)
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(rows, vocab, generator=gen) * 2
    logits[:, ::3] = float("-inf")  # a grammar's mask: never drawn
    probs = torch.softmax(logits, -1)
    keys = torch.tensor((KEYS * (rows // len(KEYS) + 1))[:rows]) * 31 + torch.arange(rows)
    got = exponential_race(probs.to(device), keys.to(device)).cpu()
    want = reference(probs, keys)
    assert got.tolist() == want.tolist()
    assert (got % 3 != 0).all()


def test_a_row_draws_from_its_key_alone(device):
    """Batch invariance: a row's id does not depend on the rows beside it."""
    probs = torch.softmax(torch.randn(3, 3000, generator=torch.Generator().manual_seed(1)), -1)
    keys = torch.tensor([5, 6, 7])
    together = exponential_race(probs.to(device), keys.to(device)).tolist()
    alone = exponential_race(probs[1:2].to(device), keys[1:2].to(device)).tolist()
    assert alone == together[1:2]
