"""Speculative decoding, the scheduler's half: --speculative-config (vLLM's keys) and the n-gram
proposer (prompt lookup), which drafts from the request's own tokens where the scheduler holds
them, so the step loop pays a vectorised search per drafted request and nothing else.

A drafted request is scheduled 1 + k tokens: its last token and k drafts. The executor samples
at each of the k + 1 positions from the target model exactly as it would without speculation
(same processing, same per-position seed) and keeps the samples up to and including the first
that differs from its draft. For a draft that is one token with certainty (n-gram), that is
rejection sampling: a draft d is kept with probability p(d), and a rejected position's sample
is p conditioned on not d, which is the residual max(p - q, 0) normalised. Outputs therefore
follow the target's distribution, and with a seed they are the very tokens the request gets
without speculation (docs/speculative_decoding.md).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import numpy as np

METHODS = ("ngram", "draft_model", "eagle", "eagle3")
BUILT = ("ngram",)
DEFAULT_LOOKUP = (2, 5)  # (prompt_lookup_min, prompt_lookup_max) when neither is given
KEYS = ("method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "model",
        "draft_tensor_parallel_size", "num_speculative_tokens_per_batch_size")


class SpeculativeConfigError(ValueError):
    """--speculative-config is malformed or asks for what cannot run; the message says why."""


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = DEFAULT_LOOKUP[0]
    prompt_lookup_max: int = DEFAULT_LOOKUP[1]
    # (first, last, k): with first <= running <= last requests, k drafts each (0: none)
    per_batch_size: tuple[tuple[int, int, int], ...] = ()
    source: dict = field(default_factory=dict, compare=False)  # the JSON as given

    @classmethod
    def parse(cls, text: str) -> SpeculativeConfig | None:
        """The flag's JSON (an object); None for "" (speculation off)."""
        if not text or not text.strip():
            return None
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as e:
            raise SpeculativeConfigError(f"--speculative-config: not JSON ({e})") from None
        if not isinstance(raw, dict):
            raise SpeculativeConfigError("--speculative-config: a JSON object is needed")
        return cls.of(raw)

    @classmethod
    def of(cls, raw: dict) -> SpeculativeConfig:
        unknown = sorted(set(raw) - set(KEYS))
        if unknown:
            raise SpeculativeConfigError(f"--speculative-config: unknown key {unknown[0]!r} "
                                         f"(known: {', '.join(KEYS)})")
        method = raw.get("method", "ngram" if "model" not in raw else "draft_model")
        if method not in METHODS:
            raise SpeculativeConfigError(f"--speculative-config: unknown method {method!r} "
                                         f"(one of {', '.join(METHODS)})")
        if method not in BUILT:
            raise SpeculativeConfigError(
                f"--speculative-config: method {method!r} is not built yet; this version "
                f"speculates with {', '.join(BUILT)} (docs/speculative_decoding.md)")
        k = _int(raw, "num_speculative_tokens", None, 1)
        lo = raw.get("prompt_lookup_min")
        hi = raw.get("prompt_lookup_max")
        if lo is None and hi is None:
            lo, hi = DEFAULT_LOOKUP
        lo = _int({"prompt_lookup_min": lo if lo is not None else hi}, "prompt_lookup_min",
                  None, 1)
        hi = _int({"prompt_lookup_max": hi if hi is not None else lo}, "prompt_lookup_max",
                  None, 1)
        if lo > hi:
            raise SpeculativeConfigError(f"--speculative-config: prompt_lookup_min {lo} is "
                                         f"more than prompt_lookup_max {hi}")
        ranges = []
        for item in raw.get("num_speculative_tokens_per_batch_size") or ():
            if (not isinstance(item, list | tuple) or len(item) != 3
                    or not all(isinstance(v, int) and not isinstance(v, bool) for v in item)
                    or item[0] < 1 or item[1] < item[0] or not 0 <= item[2] <= k):
                raise SpeculativeConfigError(
                    f"--speculative-config: num_speculative_tokens_per_batch_size: {item!r} "
                    f"is not [first, last, k] with 1 <= first <= last and 0 <= k <= "
                    f"num_speculative_tokens ({k})")
            ranges.append(tuple(item))
        return cls(method, k, lo, hi, tuple(ranges), dict(raw))

    def tokens_for(self, running: int) -> int:
        """Drafts per request in a step of `running` requests."""
        for first, last, k in self.per_batch_size:
            if first <= running <= last:
                return k
        return self.num_speculative_tokens

    def check(self, max_model_len: int, max_num_batched_tokens: int) -> None:
        """Refuse a lookahead the model or the step budget cannot hold."""
        k = self.num_speculative_tokens
        if k + 1 >= max_model_len:
            raise SpeculativeConfigError(f"--speculative-config: num_speculative_tokens {k} "
                                         f"does not fit max_model_len {max_model_len}")
        if k + 1 > max_num_batched_tokens:
            raise SpeculativeConfigError(f"--speculative-config: num_speculative_tokens {k} "
                                         f"does not fit --max-num-batched-tokens "
                                         f"{max_num_batched_tokens} (a drafted request takes "
                                         f"k + 1)")


def _int(raw: dict, key: str, default: int | None, least: int) -> int:
    v = raw.get(key, default)
    if not isinstance(v, int) or isinstance(v, bool) or v < least:
        raise SpeculativeConfigError(f"--speculative-config: {key} must be an integer >= "
                                     f"{least}, got {v!r}")
    return v


class NgramProposer:
    """Prompt lookup: the longest suffix of a request's tokens (prompt_lookup_max down to
    prompt_lookup_min tokens) that occurs earlier in them; the tokens that followed its latest
    earlier occurrence are the drafts. Each request's tokens are kept as a growing numpy array,
    appended to (never rebuilt) as tokens arrive."""

    def __init__(self, lookup_min: int, lookup_max: int) -> None:
        self.lo, self.hi = lookup_min, lookup_max
        self._arrays: dict[int, tuple[np.ndarray, int]] = {}

    def forget(self, req_id: int) -> None:
        self._arrays.pop(req_id, None)

    def tokens(self, req_id: int, token_ids: list[int]) -> np.ndarray:
        """token_ids (all known: no placeholder among them) as an array, kept between calls."""
        arr, n = self._arrays.get(req_id, (None, 0))
        total = len(token_ids)
        if arr is None or total < n:  # new, or its tokens were cut (recomputed from less)
            arr, n = np.empty(max(64, 2 * total), np.int64), 0
        elif total > len(arr):
            arr = np.concatenate([arr[:n], np.empty(total, np.int64)])
        if total > n:
            arr[n:total] = token_ids[n:]
        self._arrays[req_id] = (arr, total)
        return arr[:total]

    def propose(self, req_id: int, token_ids: list[int], k: int) -> list[int]:
        """Up to k drafts to follow token_ids (none if no suffix recurs)."""
        if k <= 0 or len(token_ids) <= self.lo:
            return []
        return propose(self.tokens(req_id, token_ids), k, self.lo, self.hi)


def propose(toks: np.ndarray, k: int, lo: int, hi: int) -> list[int]:
    """The n-gram lookup on one array: candidates are the earlier positions where the last lo
    tokens occur; each is extended backwards to at most hi matching tokens; the longest match,
    latest among equals, gives the k tokens after it (fewer at the end of the array)."""
    n = len(toks)
    if n <= lo:
        return []
    suffix = toks[n - lo:]
    # windows ending before the last token: starts 0 .. n - lo - 1, so a continuation exists
    windows = np.lib.stride_tricks.sliding_window_view(toks[:n - 1], lo)
    hits = np.flatnonzero((windows == suffix).all(axis=1))
    if not hits.size:
        return []
    length = np.full(hits.size, lo)
    alive = np.ones(hits.size, bool)
    for extra in range(1, min(hi, n - 1) - lo + 1):  # one more token back each round
        before = hits - extra
        ok = alive & (before >= 0)
        ok[ok] = toks[before[ok]] == toks[n - lo - extra]
        length += ok
        alive = ok
        if not alive.any():
            break
    best = int(np.flatnonzero(length == length.max())[-1])
    start = int(hits[best]) + lo
    return toks[start:start + k].tolist()
