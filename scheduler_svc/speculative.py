"""Speculative decoding, the scheduler's half: the n-gram proposer (prompt lookup), which drafts
from the request's own tokens where the scheduler holds them, so the step loop pays a vectorised
search per drafted request and nothing else. (--speculative-config: pagedserve.core.speculative;
a draft model proposes in the executor: executor_svc/draft.py.)

A drafted request is scheduled 1 + k tokens: its last token and k drafts. The executor samples
at each of the k + 1 positions from the target model exactly as it would without speculation
(same processing, same per-position seed) and keeps the samples up to and including the first
that differs from its draft. For a draft that is one token with certainty (n-gram, or a draft
model's argmax), that is rejection sampling: a draft d is kept with probability p(d), and a
rejected position's sample is p conditioned on not d, which is the residual max(p - q, 0)
normalised. Outputs therefore follow the target's distribution, and with a seed they are the
very tokens the request gets without speculation (docs/speculative_decoding.md).
"""

from __future__ import annotations

import numpy as np


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
