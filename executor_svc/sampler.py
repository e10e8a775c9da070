"""Token sampling: greedy, temperature, top-k, top-p, and per-request seeds.

A seeded request draws its randomness from (seed, position of the token being sampled) alone,
so it gets the same tokens whatever else shares the batch, and after a preemption too.
Sampling uses the exponential race: argmax(p / E) with E ~ Exp(1) picks i with probability p_i.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    """A bijection of 64-bit integers that scatters nearby inputs (SplitMix64's finalizer)."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def position_seed(seed: int, position: int) -> int:
    """The generator seed of a seeded request's draw at a position: for a given position,
    distinct 64-bit seeds give distinct generator seeds (no two seeds alias)."""
    return _splitmix64(_splitmix64(seed & _MASK64) ^ position)


@dataclass(frozen=True, slots=True)
class SamplingSpec:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class Sampler:
    def __init__(self, device: torch.device, seed: int | None = None) -> None:
        self.device = device
        self.unseeded = torch.Generator(device=device)
        if seed is not None:
            self.unseeded.manual_seed(seed)
        else:
            self.unseeded.seed()

    def __call__(
        self,
        logits: torch.Tensor,  # [S, V] float32
        specs: list[SamplingSpec],
        positions: list[int],  # position each sampled token will occupy
    ) -> list[int]:
        return self.sample(logits, specs, positions).tolist()

    def sample(self, logits: torch.Tensor, specs: list[SamplingSpec],
               positions: list[int]) -> torch.Tensor:
        """The sampled ids [S] int64 on the logits' device, without waiting for them."""
        out = logits.argmax(dim=-1)
        rows = [i for i, s in enumerate(specs) if not s.greedy]
        if rows:
            out[rows] = self._sample(logits[rows], [specs[i] for i in rows],
                                     [positions[i] for i in rows])
        return out

    def _sample(
        self, logits: torch.Tensor, specs: list[SamplingSpec], positions: list[int]
    ) -> torch.Tensor:
        temps = torch.tensor([s.temperature for s in specs], device=logits.device)
        logits = logits / temps[:, None]
        if any(s.top_k > 0 or s.top_p < 1.0 for s in specs):
            logits = self._top_k_top_p(logits, specs)
        probs = torch.softmax(logits, dim=-1)
        noise = torch.empty_like(probs)
        for i, (spec, pos) in enumerate(zip(specs, positions, strict=True)):
            gen = self.unseeded
            if spec.seed is not None:
                gen = torch.Generator(device=probs.device)
                gen.manual_seed(position_seed(spec.seed, pos))
            noise[i].exponential_(generator=gen)
        return (probs / noise).argmax(dim=-1)

    @staticmethod
    def _top_k_top_p(logits: torch.Tensor, specs: list[SamplingSpec]) -> torch.Tensor:
        vocab = logits.shape[-1]
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        ks = torch.tensor([s.top_k if s.top_k > 0 else vocab for s in specs], device=logits.device)
        ranks = torch.arange(vocab, device=logits.device)[None, :]
        drop = ranks >= ks[:, None]
        ps = torch.tensor([s.top_p for s in specs], device=logits.device)
        probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
        before = probs.cumsum(dim=-1) - probs  # mass of strictly more likely tokens
        drop |= before >= ps[:, None]
        drop[:, 0] = False
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        return torch.empty_like(logits).scatter_(-1, order, sorted_logits)
