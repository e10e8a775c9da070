"""A request the engine tracks from submit until it leaves: its deadline, the timings its
metrics and log line need, and the prompt logprobs gathered for its first output."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from pagedserve.scheduler.metrics import priority_class
from pagedserve.scheduler.outputs import TokenLogprob
from pagedserve.scheduler.request import Request


@dataclass(eq=False, slots=True)
class Tracked:
    req: Request
    finished: bool = False
    arrival: float = field(default_factory=time.monotonic)
    scheduled_at: float = 0.0  # first scheduled (0: not yet)
    first_token_at: float = 0.0
    last_token_at: float = 0.0
    deadline: float = float("inf")
    priority_class: str = "0"  # the metrics' priority label
    cached_tokens: int = 0  # prompt tokens found in the prefix cache when first scheduled
    tenant: str = ""  # the API key's tenant ("" when the service runs without keys)
    sent_first: bool = False  # its first output went out (with cached_tokens, prompt logprobs)
    # params.prompt_logprobs: by prompt position, filled as the executor scores them
    prompt_logprobs: list[TokenLogprob | None] | None = None
    prompt_logprobs_missing: int = 0

    @classmethod
    def open(cls, req: Request, timeout: float | None = None, tenant: str = "") -> Tracked:
        """`timeout`: seconds the request may live (the client's deadline)."""
        t = cls(req, tenant=tenant, priority_class=priority_class(req.priority))
        if timeout is not None:
            t.deadline = t.arrival + timeout
        if req.params.prompt_logprobs is not None:
            t.prompt_logprobs = [None] * req.prompt_len
            t.prompt_logprobs_missing = req.prompt_len - 1
            req.needs_prompt_logprobs = req.prompt_len > 1
        return t

    def record_prompt_logprobs(self, start: int, entries: list[TokenLogprob]) -> None:
        """Prompt tokens start.. scored by a step (again, after a preemption: same values)."""
        if self.prompt_logprobs is None or start + len(entries) > self.req.prompt_len:
            return
        for i, e in enumerate(entries, start):
            self.prompt_logprobs_missing -= self.prompt_logprobs[i] is None
            self.prompt_logprobs[i] = e
        if not self.prompt_logprobs_missing:
            self.req.needs_prompt_logprobs = False
