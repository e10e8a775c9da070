"""Prompt logprobs (vLLM's prompt_logprobs): each prompt token's log-probability given the
tokens before it, its rank, and the k most likely tokens at its position, from the positions a
prefill chunk computes anyway.

    prompt:  t0  t1  t2 ... t(P-1)
    logits:  l0  l1  l2 ... l(P-1)      l(p) scores t(p+1); l(P-1) is the first sample's

A chunk computing positions [s, e) scores tokens s+1 .. min(e, P-1); t0 has no context and is
never scored. Chunked prefill thus scores the prompt piece by piece, each token once (a request
asking for them does not read the prefix cache: the scheduler sees to it).

The rows' logits are computed from the final hidden states in slices of SLICE rows, so that a
2048-token chunk of a 128k-token vocabulary never holds more than SLICE x vocab floats at once:
the memory profile covers the sampler's rows, not a whole chunk of logits.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from pagedserve.executor.transfer import to_device

SLICE = 64


@dataclass(slots=True)
class PromptRows:
    """The prompt tokens a step scores, grouped by request (StepResult's layout)."""

    req_ids: list[int] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)  # the first scored token's position
    counts: list[int] = field(default_factory=list)
    ks: list[int] = field(default_factory=list)
    flat: list[int] = field(default_factory=list)  # per scored token: the batch row scoring it
    targets: list[int] = field(default_factory=list)  # per scored token: its id

    def add(self, req_id: int, token_ids: list[int], num_prompt: int, k: int, start: int,
            end: int, first_row: int) -> None:
        """A request computing positions [start, end) from batch row first_row on."""
        first, last = start + 1, min(end, num_prompt - 1)
        if last < first:
            return
        self.req_ids.append(req_id)
        self.starts.append(first)
        self.counts.append(last - first + 1)
        self.ks.append(k)
        self.flat.extend(range(first_row + first - 1 - start, first_row + last - start))
        self.targets.extend(token_ids[first:last + 1])


@dataclass(slots=True)
class PromptLogprobs:
    """A step's prompt logprobs: on the device until read()."""

    rows: PromptRows
    packed: torch.Tensor  # [Q, 2 + 2 * max k]: logprob, rank, top logprobs, top ids (float32)

    def read(self) -> tuple[list[int], list[float]]:
        """StepResult's prompt_logprob_ints and _floats."""
        packed = self.packed.tolist()
        kmax = (self.packed.shape[1] - 2) // 2
        ints: list[int] = []
        floats: list[float] = []
        at = 0
        for count, k in zip(self.rows.counts, self.rows.ks, strict=True):
            for row in packed[at:at + count]:
                ints.append(int(row[1]))
                ints.extend(int(t) for t in row[2 + kmax:2 + kmax + k])
                floats.append(row[0])
                floats.extend(row[2:2 + k])
            at += count
        return ints, floats


def score(rows: PromptRows, logits_of: Callable[[torch.Tensor], torch.Tensor],
          device: torch.device) -> PromptLogprobs:
    """logits_of(flat row indices) -> [R, vocab] float32 logits of those batch rows."""
    kmax = max(rows.ks)
    flat = to_device(rows.flat, device, torch.int64)
    targets = to_device(rows.targets, device, torch.int64)
    parts = []
    for i in range(0, len(rows.flat), SLICE):
        lp = torch.log_softmax(logits_of(flat[i:i + SLICE]), dim=-1)
        tok = lp.gather(1, targets[i:i + SLICE, None])
        rank = (lp >= tok).sum(dim=-1, keepdim=True).float()  # vLLM's: ties rank together
        cols = [tok, rank]
        if kmax:
            top = lp.topk(kmax, dim=-1)
            cols += [top.values, top.indices.float()]  # ids exact below 2**24
        parts.append(torch.cat(cols, dim=1))
    return PromptLogprobs(rows, torch.cat(parts))
