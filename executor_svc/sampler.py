"""Token sampling for the whole batch on the device: logit bias, min_tokens, penalties, then
greedy or temperature / min-p / top-k / top-p sampling with per-request seeds, and logprobs.

A seeded request draws its randomness from (seed, position of the token being sampled) alone,
so it gets the same tokens whatever else shares the batch, and after a preemption too.
Sampling uses the exponential race: argmax(p / E) with E ~ Exp(1) picks i with probability p_i;
the whole batch draws in one launch from a counter-based generator keyed per row
(kernels/sampling_reference.py), so a seeded row costs what an unseeded one does.

Order (vLLM's): logprobs are taken from the raw logits; then logit_bias is added, the
min_tokens ids masked, the penalties applied, and what is left is sampled. Every stage works on
the rows that need it with a few batched tensor ops (their per-row parameters travel in one
small host-to-device copy per stage); a batch where no row needs a stage skips it, so a plain
batch costs what it did before these existed. Last, the rows constrained by a grammar
(structured outputs) have every token their bitmask does not allow set to -inf: the bits are
unpacked on the device, so a step's masks cost one copy of R * vocab / 8 bytes. Logprobs stay
those of the raw logits (the mask is not a model probability, as vLLM's default).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np
import torch

from pagedserve.executor.penalties import TokenCounts
from pagedserve.executor.transfer import to_device
from pagedserve.kernels.sampling_reference import GAMMA, MIX1, MIX2

_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    """A bijection of 64-bit integers that scatters nearby inputs (SplitMix64's finalizer)."""
    x = (x + GAMMA) & _MASK64
    x = ((x ^ (x >> 30)) * MIX1) & _MASK64
    x = ((x ^ (x >> 27)) * MIX2) & _MASK64
    return x ^ (x >> 31)


def _splitmix64_np(x: np.ndarray) -> np.ndarray:
    """_splitmix64 over a uint64 array (numpy's array arithmetic wraps)."""
    x = x + np.uint64(GAMMA)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(MIX1)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(MIX2)
    return x ^ (x >> np.uint64(31))


def position_seed(seed: int, position: int) -> int:
    """The generator key of a seeded request's draw at a position: for a given position,
    distinct 64-bit seeds give distinct keys (no two seeds alias). Sampler.keys computes the
    same over a batch in numpy."""
    return _splitmix64(_splitmix64(seed & _MASK64) ^ position)


# SamplingSpec.features bits: the stages beyond a greedy argmax a row needs. A batch that
# carries the OR of its rows' bits skips the per-row scan of each stage no row needs.
RANDOM, LOGPROBS, BIAS, MIN_TOKENS, PENALTY = 1, 2, 4, 8, 16


@dataclass(frozen=True, slots=True)
class SamplingSpec:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias)
    min_tokens: int = 0
    min_tokens_masked_ids: tuple[int, ...] = ()  # masked while output < min_tokens
    logprobs: int = -1  # -1: none; 0: the sampled token's; k: and the k most likely

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)

    @property
    def features(self) -> int:
        return ((RANDOM if not self.greedy else 0) | (LOGPROBS if self.logprobs >= 0 else 0)
                | (BIAS if self.logit_bias else 0) | (MIN_TOKENS if self.min_tokens else 0)
                | (PENALTY if self.penalized else 0))


MAX_TOP_LOGPROBS = 20


@dataclass(slots=True)
class SamplingBatch:
    """One step's sampling rows ([S] parallel lists) and the per-row extras some rows need."""

    specs: list[SamplingSpec]
    positions: list[int]  # position each sampled token will occupy (the seeds' input)
    # output tokens each row has before this one (min_tokens); None: no row has min_tokens
    num_output: list[int] | None = None
    # each row's TokenCounts slot (-1: no penalty); None: no row has a penalty
    count_slots: list[int] | None = None
    counts: TokenCounts | None = None
    # structured outputs: [R, ceil(V / 32)] int32 allowed-token bits on the device (bit b of
    # word w allows token 32 w + b) for the rows bitmask_rows; None: no row is constrained
    bitmask: torch.Tensor | None = None
    bitmask_rows: list[int] | None = None
    # the OR of the rows' SamplingSpec.features; None: unknown (every stage scans every row)
    features: int | None = None

    def wants(self, feature: int) -> bool:
        """Whether any row may need this stage."""
        return self.features is None or bool(self.features & feature)


@dataclass(slots=True)
class SampleOutput:
    tokens: torch.Tensor  # [S] int64 on the device
    logprob_rows: list[int] = field(default_factory=list)  # rows that asked, ascending
    logprob_ks: list[int] = field(default_factory=list)  # alternatives each asked for
    # [R, 1 + 2 * max k] float32 on the device: sampled logprob, top logprobs, top ids
    logprobs: torch.Tensor | None = None


@dataclass(slots=True)
class HostLogprobs:
    """SampleOutput's logprobs read back, in StepResult's packed layout."""

    rows: list[int]
    sampled: list[float]
    num_top: list[int]
    top_ids: list[int]
    top_logprobs: list[float]

    def select(self, keep: list[bool]) -> HostLogprobs:
        """These logprobs for the sampled rows kept (speculative decoding drops the rejected
        ones), their rows renumbered among those kept."""
        index = list(itertools.accumulate(keep))  # a kept row's new index + 1
        out = HostLogprobs([], [], [], [], [])
        at = 0
        for row, lp, k in zip(self.rows, self.sampled, self.num_top, strict=True):
            if keep[row]:
                out.rows.append(index[row] - 1)
                out.sampled.append(lp)
                out.num_top.append(k)
                out.top_ids.extend(self.top_ids[at:at + k])
                out.top_logprobs.extend(self.top_logprobs[at:at + k])
            at += k
        return out


def read_logprobs(out: SampleOutput) -> HostLogprobs | None:
    if out.logprobs is None:
        return None
    packed = out.logprobs.tolist()
    kmax = (len(packed[0]) - 1) // 2 if packed else 0
    top_ids, top_lps = [], []
    for row, k in zip(packed, out.logprob_ks, strict=True):
        top_lps.extend(row[1:1 + k])
        top_ids.extend(int(t) for t in row[1 + kmax:1 + kmax + k])
    return HostLogprobs(out.logprob_rows, [r[0] for r in packed], out.logprob_ks, top_ids,
                        top_lps)


class Sampler:
    def __init__(self, device: torch.device, seed: int | None = None,
                 backend: str | None = None) -> None:
        """backend: the kernels' ("triton" on a GPU, "torch" elsewhere by default)."""
        from pagedserve.kernels import get_ops

        self.device = device
        # the keys of the unseeded rows' draws (seeded rows' keys are position_seed's)
        self.unseeded = np.random.default_rng(seed)
        self._race = get_ops(backend or ("triton" if device.type == "cuda" else "torch")
                             ).exponential_race

    def __call__(
        self,
        logits: torch.Tensor,  # [S, V] float32
        specs: list[SamplingSpec],
        positions: list[int],  # position each sampled token will occupy
    ) -> list[int]:
        return self.sample(logits, SamplingBatch(specs, positions)).tokens.tolist()

    def sample(self, logits: torch.Tensor, batch: SamplingBatch) -> SampleOutput:
        """The sampled ids [S] int64 on the logits' device (and logprobs of the rows that ask),
        without waiting for them."""
        specs = batch.specs
        x = self.process(logits, batch)
        out = x.argmax(dim=-1)
        rows = [i for i, s in enumerate(specs) if not s.greedy] if batch.wants(RANDOM) else []
        if rows:
            out[to_device(rows, out.device)] = self._sample(x[rows], [specs[i] for i in rows],
                                     [batch.positions[i] for i in rows])
        if batch.count_slots is not None:
            pen = [i for i, slot in enumerate(batch.count_slots) if slot >= 0]
            idx = to_device(pen, logits.device)
            slots = to_device([batch.count_slots[i] for i in pen], logits.device)
            batch.counts.record(slots, out[idx])
        result = SampleOutput(out)
        lp_rows = ([i for i, s in enumerate(specs) if s.logprobs >= 0]
                   if batch.wants(LOGPROBS) else [])
        if lp_rows:
            result.logprob_rows = lp_rows
            result.logprob_ks = [specs[i].logprobs for i in lp_rows]
            result.logprobs = _logprobs(logits, out, lp_rows, max(result.logprob_ks))
        return result

    def process(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """The logits after logit_bias, min_tokens and penalties: a new tensor if any row has
        one of them, else the same."""
        specs, dev = batch.specs, logits.device
        bias = ([(i, t, v) for i, s in enumerate(specs) for t, v in s.logit_bias]
                if batch.wants(BIAS) else [])
        masked = ([(i, t) for i, (s, n) in enumerate(zip(specs, batch.num_output, strict=True))
                   if n < s.min_tokens for t in s.min_tokens_masked_ids]
                  if batch.num_output is not None else [])
        pen = ([i for i, slot in enumerate(batch.count_slots) if slot >= 0]
               if batch.count_slots is not None else [])
        if not (bias or masked or pen or batch.bitmask is not None):
            return logits
        x = logits.clone()
        if bias:
            rows, ids, vals = zip(*bias, strict=True)
            x.index_put_((to_device(rows, dev), to_device(ids, dev)),
                         to_device(vals, dev, x.dtype), accumulate=True)
        if masked:
            rows_ids = to_device(masked, dev)
            x[rows_ids[:, 0], rows_ids[:, 1]] = float("-inf")
        if pen:
            params = np.array([(specs[i].repetition_penalty, specs[i].frequency_penalty,
                                specs[i].presence_penalty) for i in pen], np.float32)
            slots = to_device([batch.count_slots[i] for i in pen], dev)
            which = (bool((params[:, 0] != 1.0).any()), bool(params[:, 1].any()),
                     bool(params[:, 2].any()))
            params_t = to_device(params, dev)
            if len(pen) == len(specs):  # every row: no gather and scatter back
                x = batch.counts.apply(x, slots, params_t, which)
            else:
                idx = to_device(pen, dev)
                x[idx] = batch.counts.apply(x[idx], slots, params_t, which)
        if batch.bitmask is not None:
            allowed = unpack_bitmask(batch.bitmask, x.shape[-1])
            if len(batch.bitmask_rows) == len(specs):
                x.masked_fill_(~allowed, float("-inf"))
            else:
                idx = to_device(batch.bitmask_rows, dev)
                x[idx] = x[idx].masked_fill(~allowed, float("-inf"))
        return x

    def _sample(
        self, logits: torch.Tensor, specs: list[SamplingSpec], positions: list[int]
    ) -> torch.Tensor:
        temps = to_device([s.temperature for s in specs], logits.device, torch.float32)
        logits = logits / temps[:, None]
        if any(s.min_p > 0.0 for s in specs):
            logits = self._min_p(logits, specs)
        if any(s.top_k > 0 or s.top_p < 1.0 for s in specs):
            logits = self._top_k_top_p(logits, specs)
        probs = torch.softmax(logits, dim=-1)
        return self._race(probs, to_device(self.keys(specs, positions), probs.device))

    def keys(self, specs: list[SamplingSpec], positions: list[int]) -> np.ndarray:
        """[R] int64: each row's generator key. A seeded row's is a function of its seed and
        position alone (its draw is batch-invariant, and the same after a preemption); the
        unseeded rows' come from this sampler's own generator."""
        keys = self.unseeded.integers(-2**63, 2**63 - 1, len(specs), dtype=np.int64,
                                      endpoint=True)
        seeded = [i for i, spec in enumerate(specs) if spec.seed is not None]
        if seeded:
            seeds = np.array([specs[i].seed & _MASK64 for i in seeded], np.uint64)
            at = np.array([positions[i] for i in seeded], np.uint64)
            keys[seeded] = _splitmix64_np(_splitmix64_np(seeds) ^ at).view(np.int64)
        return keys

    @staticmethod
    def _min_p(logits: torch.Tensor, specs: list[SamplingSpec]) -> torch.Tensor:
        min_p = to_device([s.min_p for s in specs], logits.device, torch.float32)
        probs = torch.softmax(logits, dim=-1)
        floor = probs.amax(dim=-1, keepdim=True) * min_p[:, None]
        return logits.masked_fill(probs < floor, float("-inf"))

    @staticmethod
    def _top_k_top_p(logits: torch.Tensor, specs: list[SamplingSpec]) -> torch.Tensor:
        vocab = logits.shape[-1]
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        ks = to_device([s.top_k if s.top_k > 0 else vocab for s in specs], logits.device)
        ranks = torch.arange(vocab, device=logits.device)[None, :]
        drop = ranks >= ks[:, None]
        ps = to_device([s.top_p for s in specs], logits.device, torch.float32)
        probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
        before = probs.cumsum(dim=-1) - probs  # mass of strictly more likely tokens
        drop |= before >= ps[:, None]
        drop[:, 0] = False
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def unpack_bitmask(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """[R, W] int32 bits -> [R, vocab] bool (True: allowed), on the bitmask's device. Rows
    narrower than the vocabulary (W * 32 < vocab: the tokenizer's ids end before the logits
    do) allow none of the ids past them."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask[:, :, None] >> shifts) & 1  # arithmetic shift: &1 keeps bit 31 right
    allowed = bits.view(bitmask.shape[0], -1)[:, :vocab].bool()
    if allowed.shape[1] < vocab:
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]), value=False)
    return allowed


def _logprobs(logits: torch.Tensor, tokens: torch.Tensor, rows: list[int], k: int
              ) -> torch.Tensor:
    """[R, 1 + 2k]: each row's sampled token's logprob under the raw logits, then its k most
    likely tokens' logprobs and ids (ids as float32: exact below 2**24, any vocabulary)."""
    if len(rows) == logits.shape[0]:  # every row: no gather
        lp, chosen = torch.log_softmax(logits.float(), dim=-1), tokens
    else:
        idx = to_device(rows, logits.device)
        lp, chosen = torch.log_softmax(logits[idx].float(), dim=-1), tokens[idx]
    parts = [lp.gather(1, chosen[:, None])]
    if k:
        top = lp.topk(k, dim=-1)
        parts += [top.values, top.indices.float()]
    return torch.cat(parts, dim=1)
