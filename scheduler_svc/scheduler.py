"""Plans each step under a token budget: there is no prefill phase and no decode phase.

Every request has num_computed_tokens and num_tokens; a step gives each request up to
num_tokens - num_computed_tokens tokens, running requests first (in priority order), then
waiting ones, within max_num_batched_tokens and max_num_seqs. Long prompts are therefore
prefilled in chunks, decodes and prefill chunks share a step, and a preempted request simply
starts again from num_computed_tokens = 0 (recompute). When blocks run out, the least important
running request (highest (priority, arrival)) is preempted.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from scheduler_svc.block_manager import BlockManager
from scheduler_svc.request import Request, RequestStatus


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    # Cap on one request's prefill chunk per step (0: no cap beyond the budget), so one long
    # prompt cannot take a whole step from the others.
    long_prefill_token_threshold: int = 0
    enable_prefix_caching: bool = True


@dataclass(slots=True)
class SchedulerOutput:
    new: list[tuple[Request, int]] = field(default_factory=list)  # (request, tokens)
    cached: list[tuple[Request, int, list[int]]] = field(default_factory=list)  # + new blocks
    finished_req_ids: list[int] = field(default_factory=list)
    preempted_req_ids: list[int] = field(default_factory=list)
    num_batched_tokens: int = 0

    @property
    def is_empty(self) -> bool:
        return not (self.new or self.cached or self.finished_req_ids or self.preempted_req_ids)

    def scheduled(self) -> list[tuple[Request, int]]:
        return self.new + [(r, n) for r, n, _ in self.cached]


class Scheduler:
    def __init__(self, cfg: SchedulerConfig, blocks: BlockManager) -> None:
        self.cfg = cfg
        self.blocks = blocks
        self.waiting: list[Request] = []  # sorted by sort_key
        self.running: list[Request] = []  # sorted by sort_key
        self.requests: dict[int, Request] = {}
        self._finished_ids: list[int] = []  # to tell the executor in the next plan
        self._preempted_ids: list[int] = []
        self.num_preemptions = 0
        self.prefix_queried_tokens = 0  # prompt tokens looked up in the prefix cache
        self.prefix_hit_tokens = 0  # of which found cached

    def add(self, req: Request) -> None:
        self.requests[req.req_id] = req
        bisect.insort(self.waiting, req, key=lambda r: r.sort_key)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._finished_ids or self._preempted_ids)

    def finish(self, req_id: int) -> Request | None:
        """Remove a request (finished or aborted) and free its blocks at once."""
        req = self.requests.pop(req_id, None)
        if req is None:
            return None
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.status == RequestStatus.WAITING:
            self.waiting.remove(req)
        self.blocks.free(req_id)
        if req.on_executor:
            self._finished_ids.append(req_id)
        req.status = RequestStatus.FINISHED
        return req

    def preempt_all(self) -> None:
        """The executor lost its state (a new one joined): every running request recomputes."""
        for req in list(self.running):
            self._preempt(req)
        self._preempted_ids.clear()
        self._finished_ids.clear()
        for req in self.waiting:
            req.on_executor = False

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(finished_req_ids=self._finished_ids,
                              preempted_req_ids=self._preempted_ids)
        self._finished_ids, self._preempted_ids = [], []
        budget = self.cfg.max_num_batched_tokens
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = self._chunk(req, budget)
            if n <= 0:
                i += 1
                continue
            new_blocks = self.blocks.allocate_slots(req.req_id, req.num_computed_tokens + n)
            while new_blocks is None:
                victim = self.running[-1]
                self._preempt(victim)
                preempted = True
                if victim is req:
                    break
                new_blocks = self.blocks.allocate_slots(req.req_id, req.num_computed_tokens + n)
            if new_blocks is None:
                break
            self._emit(out, req, n, new_blocks)
            budget -= n
            i += 1
        out.preempted_req_ids.extend(self._preempted_ids)
        self._preempted_ids = []
        while (self.waiting and budget > 0 and not preempted
               and len(self.running) < self.cfg.max_num_seqs):
            req = self.waiting[0]
            prefix = self.blocks.cached_prefix(req.token_ids)
            req.num_computed_tokens = len(prefix) * self.blocks.block_size
            n = self._chunk(req, budget)
            new_blocks = self.blocks.allocate_slots(req.req_id, req.num_computed_tokens + n,
                                                    admit=bool(self.running), prefix=prefix)
            if new_blocks is None:
                req.num_computed_tokens = 0
                break
            if self.blocks.enable_caching:
                self.prefix_queried_tokens += req.num_tokens
                self.prefix_hit_tokens += req.num_computed_tokens
            self.waiting.pop(0)
            req.status = RequestStatus.RUNNING
            bisect.insort(self.running, req, key=lambda r: r.sort_key)
            self._emit(out, req, n, new_blocks)
            budget -= n
        out.num_batched_tokens = self.cfg.max_num_batched_tokens - budget
        return out

    def update(self, req_ids: list[int], token_ids: list[int]) -> list[Request]:
        """Append sampled tokens; return the requests that got one (aborted ones are skipped)."""
        updated = []
        for rid, tok in zip(req_ids, token_ids, strict=True):
            req = self.requests.get(rid)
            if req is None or req.status != RequestStatus.RUNNING:
                continue
            req.token_ids.append(tok)
            updated.append(req)
        return updated

    def _chunk(self, req: Request, budget: int) -> int:
        n = min(req.num_tokens - req.num_computed_tokens, budget)
        if self.cfg.long_prefill_token_threshold > 0:
            n = min(n, self.cfg.long_prefill_token_threshold)
        return n

    def _emit(self, out: SchedulerOutput, req: Request, n: int, new_blocks: list[int]) -> None:
        if req.on_executor:
            out.cached.append((req, n, new_blocks))
        else:
            out.new.append((req, n))
            req.on_executor = True
        req.num_computed_tokens += n
        self.blocks.cache_full_blocks(req.req_id, req.token_ids, req.num_computed_tokens)

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.blocks.free(req.req_id)
        if req.on_executor:
            self._preempted_ids.append(req.req_id)
        req.on_executor = False
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        req.status = RequestStatus.WAITING
        bisect.insort(self.waiting, req, key=lambda r: r.sort_key)
