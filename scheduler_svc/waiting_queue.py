"""The waiting queue: requests not running (new, or preempted), best first.

Ordered by (effective priority, arrival): a request's effective priority improves by one level
for every `aging_steps` steps it has waited, so low-priority work cannot starve.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator

from pagedserve.scheduler.request import Request


def _order(r: Request) -> tuple[int, int]:
    return (r.effective_priority, r.arrival_seq)


class WaitingQueue:
    def __init__(self, aging_steps: int = 0) -> None:
        self.aging_steps = aging_steps  # 0: no aging
        self._reqs: list[Request] = []  # sorted by _order
        self.prompt_tokens = 0  # tokens of the queued requests (all of them: recomputed ones too)
        self.base = 0  # queued requests for the base model (no LoRA adapter)

    def __len__(self) -> int:
        return len(self._reqs)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._reqs)

    @property
    def head(self) -> Request:
        return self._reqs[0]

    def at(self, i: int) -> Request:
        """The i-th best (0: the head)."""
        return self._reqs[i]

    def push(self, req: Request, step: int) -> None:
        req.queued_at_step = step
        req.effective_priority = req.priority
        bisect.insort(self._reqs, req, key=_order)
        self.prompt_tokens += req.num_tokens
        self.base += not req.lora_id

    def remove(self, req: Request) -> None:
        self._reqs.remove(req)
        self.prompt_tokens -= req.num_tokens
        self.base -= not req.lora_id

    def age(self, step: int) -> None:
        """Improve the effective priority of those that waited long enough as of `step`."""
        if not self.aging_steps or not self._reqs:
            return
        changed = False
        for req in self._reqs:
            eff = req.priority - (step - req.queued_at_step) // self.aging_steps
            if eff != req.effective_priority:
                req.effective_priority, changed = eff, True
        if changed:
            self._reqs.sort(key=_order)
