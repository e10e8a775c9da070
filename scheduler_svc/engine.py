"""The scheduler's engine: admits requests, runs the step loop (schedule -> send -> result ->
update -> deliver) and ends requests. Runs on one asyncio loop (the gRPC server's, or the
engine core process's), so there are no locks: state changes only between awaits. The executor
link (executor_link.py) owns the socket and the executor's liveness; the scheduler owns every
decision about requests and blocks; this file only wires them together. It speaks token ids:
each step's outputs go to its client (engine_client.py, or engine_host.py for API processes)
as one batch, and text, stop strings and API shapes are the front ends' (api/).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from pagedserve.core.memory import release_free_memory
from pagedserve.protos.internal.v1 import executor_pb2 as pb
from pagedserve.scheduler.capacity import adopt
from pagedserve.scheduler.delivery import Emit, StreamTable
from pagedserve.scheduler.engine_io import EngineError, EngineRequest, ModelInfo
from pagedserve.scheduler.executor_link import ExecutorLink, LinkDown
from pagedserve.scheduler.grammar import Grammars
from pagedserve.scheduler.lora_registry import LoraAdmin, LoraRegistry
from pagedserve.scheduler.metrics import Metrics
from pagedserve.scheduler.outputs import (
    Sampled,
    SchedulerOutput,
    logprobs_of,
    prompt_logprobs_of,
    proposals_of,
)
from pagedserve.scheduler.request import Constraint, Request, RequestStatus
from pagedserve.scheduler.scheduler import Scheduler, SchedulerConfig
from pagedserve.scheduler.telemetry import StepTiming, Telemetry
from pagedserve.scheduler.tracked import Tracked

log = logging.getLogger("pagedserve.scheduler")


@dataclass(slots=True)
class InFlight:
    """A step sent to the executor whose result has not arrived."""

    step_id: int
    out: SchedulerOutput
    generation: int  # the link's generation it was sent under
    t0: float  # planning started (perf_counter)
    t1: float  # sent
    # structured outputs: the constrained requests sampling in it, each with the number of its
    # tokens its matcher must have seen before its mask can be filled; sent once they have
    mask_rows: list[tuple[Request, int]] = field(default_factory=list)
    mask_sent: bool = True
    bitmask_s: float = 0.0  # filling them
    drafted: bool = False  # some request in it has speculative drafts


class Engine:
    def __init__(self, cfg: SchedulerConfig, link: ExecutorLink, tokenizer: Any,
                 eos_token_ids: list[int], kv_watermark: float = 0.01,
                 metrics: Metrics | None = None,
                 telemetry: Telemetry | None = None,
                 on_readiness: Callable[[bool], None] | None = None,
                 async_scheduling: bool = False, emit: Emit | None = None,
                 refuse_when_unready: bool = False) -> None:
        """emit(batch): where each step's EngineOutputs go (EngineClient sets it);
        refuse_when_unready: no executor joined means UNAVAILABLE for new requests."""
        self.cfg, self.tokenizer, self.kv_watermark = cfg, tokenizer, kv_watermark
        self.eos_token_ids = frozenset(eos_token_ids)
        self.async_scheduling = async_scheduling
        self.metrics = metrics or Metrics()
        self.telemetry = telemetry or Telemetry(self.metrics, tokenizer)
        self._result_at = 0.0  # when the last step result arrived (perf_counter)
        self.streams = StreamTable(self.telemetry, lambda rid: self.scheduler.finish(rid),
                                   emit)
        self.on_readiness = on_readiness
        self.link = link
        link.attach(self._joined, self._lost)
        self.draining = False
        self.leaving = False  # SIGTERM with a shutdown delay: not ready, still serving
        self.refuse_when_unready = refuse_when_unready
        self.scheduler: Scheduler | None = None
        self._ids, self._step_ids = itertools.count(1), itertools.count(1)
        self._ready = asyncio.Event()  # set once the first executor joined (limits known)
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        self._busy_since_trim = False
        self._after_idle = True  # the loop waited for work since the last plan
        self.grammars: Grammars | None = None  # structured outputs; made when an executor joins
        self.lora = LoraAdmin(LoraRegistry(cfg.lora_modules), link, lambda: self.scheduler)
        self.telemetry.lora_names = self.lora.registry.names

    # ----------------------------------------------------------------- lifecycle
    @property
    def serving(self) -> bool:
        """Readiness: a warmed-up executor is connected, new requests are admitted and the
        server is not about to leave."""
        return self.link.connected.is_set() and not self.draining and not self.leaving

    def leave_soon(self) -> None:
        """Report not ready from now on while still admitting requests (the shutdown delay:
        proxies see it and stop sending before the drain refuses anything)."""
        self.leaving = True
        self._notify_readiness()

    def model_info(self) -> ModelInfo | None:
        """The model's facts from the newest executor's capacity; None before one joined."""
        cap = self.link.capacity
        if cap is None:
            return None
        return ModelInfo(cap.max_model_len, cap.vocab_size, tuple(sorted(self.eos_token_ids)),
                         cap.block_size, cap.num_kv_blocks, cap.dtype, cap.device,
                         cap.attention_backend, cap.kv_cache_dtype,
                         spec.to_json() if (spec := self.cfg.speculative) is not None else "")

    async def start(self) -> None:
        self._tasks = [*await self.link.start(),
                       asyncio.create_task(self._step_loop(), name="engine-step")]
        for t in self._tasks:
            t.add_done_callback(_crash_on_error)

    async def wait_ready(self, timeout: float | None = None) -> bool:
        try:
            await asyncio.wait_for(self._ready.wait(), timeout)
        except TimeoutError:
            return False
        return True

    async def drain(self, timeout: float) -> int:
        """Refuse new requests from now on, wait up to timeout for the admitted ones to end,
        then fail the rest with UNAVAILABLE. Returns how many were cut short."""
        self.draining = True
        self._notify_readiness()
        deadline = time.monotonic() + timeout
        while self.streams and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        left = len(self.streams)
        self.streams.fail(self.streams, "UNAVAILABLE",
                          "the server shut down before the request finished")
        return left

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.link.close()
        if self.grammars is not None:
            self.grammars.close()

    # ----------------------------------------------------------------- requests
    async def compile(self, constraint: Constraint) -> Any:
        """A constraint's compiled grammar (cached; compiled off the step loop), for submit;
        InvalidRequest naming the field if the schema, regex or grammar is bad."""
        assert self.grammars is not None, "compile before the executor joined"
        return await self.grammars.compile(constraint)

    def submit(self, request: EngineRequest, grammar: Any = None) -> int:
        """Queue a request, and answer its id; its timeout bounds its life; `grammar`: the
        compiled params.constraint (compile()). Its outputs go to emit, step by step."""
        assert self.scheduler is not None, "submit before the executor joined"
        prompt, params = request.prompt, request.params
        if self.draining:
            raise EngineError("UNAVAILABLE", "server is draining")
        if self.refuse_when_unready and not self.link.connected.is_set():
            raise EngineError("UNAVAILABLE", "no executor is joined; retry on another "
                              "replica", retry_after_s=1.0)
        refusal = None if request.resubmitted else self.scheduler.admission_error(len(prompt))
        if refusal is not None:
            self.metrics.refused["queue_full"].inc()
            retry = self.telemetry.retry_after_s(self.scheduler.waiting.prompt_tokens)
            raise EngineError("RESOURCE_EXHAUSTED", f"server busy: {refusal}; retry in about "
                              f"{retry:.0f} s", retry_after_s=retry)
        sibling = None if request.sibling_of is None else self.streams.get(request.sibling_of)
        rid = next(self._ids)
        external_id = sibling.req.external_id if sibling is not None else \
            request.request_id or f"req-{rid}"
        lora_id = self._lora_id(request.adapter)
        matcher = None if grammar is None else Grammars.matcher(grammar)
        for token in request.resume_tokens if matcher is not None else ():
            matcher.accept_token(token)  # where the earlier engine core's had got to
        req = Request(rid, external_id, len(prompt), [*prompt, *request.resume_tokens],
                      params, request.priority, arrival_seq=rid, matcher=matcher,
                      first_sibling=None if sibling is None else sibling.req, lora_id=lora_id)
        tracked = Tracked.open(req, request.timeout, request.tenant)
        tracked.sent_first = bool(request.resume_tokens)  # its first output went out before
        self.streams.add(tracked)
        self._busy_since_trim = True
        self.scheduler.add(req)
        if request.sibling_of is None and not request.resubmitted:  # the prompt counts once
            self.metrics.prompt_tokens.inc(len(prompt))
        self._wake.set()
        return rid

    def _lora_id(self, adapter: str) -> int:
        """The adapter's id (0: the base model); the front ends validated the name (an
        unload may have come between)."""
        if not adapter:
            return 0
        adapter_id = self.lora.registry.id_of(adapter)
        if adapter_id is None:
            raise EngineError("INVALID_ARGUMENT", f"adapter: unknown LoRA adapter {adapter!r}")
        return adapter_id

    def abort(self, req_id: int, reason: str = "abort") -> None:
        """Drop a request (client gone, a stop string matched: reason "stop", or
        "deadline_exceeded"); its blocks are free before the next step is planned. No output
        follows."""
        t = self.streams.get(req_id)
        if t is not None and not t.finished:
            self.streams.leave(t, reason)
            self._wake.set()

    # ----------------------------------------------------------------- step loop
    async def _step_loop(self) -> None:
        # Step N's tokens are delivered (detokenized, stop strings matched, queued) after step
        # N+1 is sent, so that host work hides behind the executor's. With async scheduling
        # N+1 is also planned before N's result arrives (Scheduler.expect_tokens). A step's
        # token bitmasks go out after its plan, as soon as the tokens they depend on are in
        # (_send_bitmasks): the executor runs the forward pass meanwhile.
        # Each phase's time goes to pagedserve_scheduler_loop_seconds_total (the wait for work
        # with nothing in flight does not).
        inflight: deque[InFlight] = deque()
        depth = 2 if self.async_scheduling else 1
        sampled: list[Sampled] = []  # the last result's tokens, delivered after the next send
        loop, now = self.metrics.loop_time, time.perf_counter
        while True:
            if not self.link.connected.is_set():
                await self._outage()
                continue
            sched = self.scheduler
            t0 = now()
            self.streams.expire()
            self.telemetry.observe_scheduler(sched.stats())
            if len(inflight) < depth and self._may_plan(sched, inflight) and (
                    step := self._plan(sched, ahead=bool(inflight))):
                t1 = now()
                inflight.append(step)
                await self.link.send(step.step_id, step.out)
                await self._send_bitmasks(inflight)
                if self.async_scheduling:  # after encoding: a new request goes without them
                    sched.expect_tokens(step.out)
                loop["plan"].inc(t1 - t0)
                loop["send"].inc(now() - t1)
                continue  # plan one more ahead, or deliver and wait for the result
            t1 = now()
            loop["plan"].inc(t1 - t0)
            if sampled:
                self.streams.deliver(sampled)
                sampled = []
                t2 = now()
                # let the servicers write what was just queued before the loop takes the next
                # result (else, with a result already waiting, a stream's first message
                # carries two tokens)
                await asyncio.sleep(0)
                loop["deliver"].inc(t2 - t1)
                t1 = now()
                loop["other_tasks"].inc(t1 - t2)
            if not inflight:
                await self._idle(sched)
                continue
            waiting = self.link.results.empty()
            item = await self.link.results.get()
            t2 = now()
            # the result was read off the socket at link.result_at; from then on the loop
            # waited only for the event loop's other tasks
            came = min(max(self.link.result_at, t1), t2) if waiting else t1
            loop["await_executor"].inc(came - t1)
            loop["other_tasks"].inc(t2 - came)
            sampled = self._apply(inflight, item)
            t3 = now()
            loop["update"].inc(t3 - t2)
            await self._send_bitmasks(inflight)
            loop["bitmask"].inc(now() - t3)

    @staticmethod
    def _may_plan(sched: Scheduler, inflight: deque[InFlight]) -> bool:
        """Whether to plan now: always with nothing in flight; ahead of a result (async
        scheduling) only when no step in flight has drafts (how many tokens its requests keep
        is unknown until it returns) and the next step would draft none (a step planned ahead
        drafts nothing, so planning ahead while speculation is on would turn it off)."""
        return not inflight or not (inflight[-1].drafted or sched.num_drafts())

    def _plan(self, sched: Scheduler, ahead: bool) -> InFlight | None:
        if not sched.has_work():
            return None
        t0 = time.perf_counter()
        out = sched.schedule(ahead=ahead)
        if out.is_empty:
            return None
        # the constrained requests sampling here: each one's mask waits for every token
        # before the one it samples (with async scheduling the last may still be in flight)
        rows = [(s.req, s.start + s.num_tokens) for s in out.scheduled()
                if s.req.matcher is not None and s.start + s.num_tokens == s.req.num_tokens]
        out.bitmask_follows = bool(rows)
        out.after_idle, self._after_idle = self._after_idle, False
        for s in out.new:
            self.telemetry.scheduled(self.streams.get(s.req.req_id), time.monotonic(), s.start)
        step = InFlight(next(self._step_ids), out, self.link.generation, t0, time.perf_counter(),
                        rows, not rows,
                        drafted=sched.cfg.speculative is not None
                        and any(s.spec_token_ids for s in out.cached))
        self.metrics.plan_time.observe(step.t1 - t0)
        return step

    async def _send_bitmasks(self, inflight: deque[InFlight]) -> None:
        """Send the token bitmasks of the steps in flight whose constrained requests' matchers
        have seen every token they need, oldest first, stopping at one still waiting (the
        executor takes them in step order). Called after each send and each result: a step
        planned ahead of the previous one's result gets its masks as soon as that result is
        applied, before any later plan, while the executor still runs its forward pass."""
        for step in inflight:
            if step.mask_sent or step.generation != self.link.generation:
                continue  # (a step of a lost executor: nobody waits for its masks)
            # an ended request gets no row (a terminated matcher has no next token; its token
            # will be ignored)
            live = [(r, need) for r, need in step.mask_rows
                    if r.status != RequestStatus.FINISHED and not r.matcher.is_terminated()]
            if any(r.num_tokens - r.num_pending < need for r, need in live):
                return
            rows = [r for r, _ in live]
            t0 = time.perf_counter()
            bits = self.grammars.fill([r.matcher for r in rows])
            step.bitmask_s = time.perf_counter() - t0
            self.metrics.bitmask_time.observe(step.bitmask_s)
            step.mask_sent = True
            await self.link.send_bitmask(step.step_id, [r.req_id for r in rows], bits)

    def _apply(self, inflight: deque[InFlight], item: pb.StepResult | LinkDown) -> list[Sampled]:
        """Match a result (or the link going down) to the oldest step in flight; the tokens
        it sampled, recorded in the scheduler."""
        if isinstance(item, LinkDown):
            if item.generation != inflight[0].generation:
                return []  # about steps already given up
            for step in inflight:
                if step.step_id == item.timed_out_step:
                    self._timed_out(step)
        if isinstance(item, LinkDown) or inflight[0].generation != self.link.generation:
            inflight.clear()  # the executor is gone; its requests are recomputed
            return []
        if item.step_id < inflight[0].step_id:
            return []  # a stale reply
        step = inflight.popleft()
        now = time.perf_counter()
        # what the step's decoders waited for it: since the previous result, or since it was
        # sent if the loop was idle then
        took, self._result_at = now - max(self._result_at, step.t1), now
        timing = StepTiming(len(step.out.new) + len(step.out.cached),
                            step.out.num_batched_tokens, step.t1 - step.t0,
                            now - step.t1, item.execute_seconds, step.bitmask_s)
        if item.error:
            self.telemetry.step(item, timing, 0)
            self._fail_step(step, "INTERNAL", f"executor step failed: {item.error}")
            return []
        for rid, start, entries in (prompt_logprobs_of(item) if item.prompt_logprob_req_ids
                                    else ()):
            if (t := self.streams.get(rid)) is not None:
                t.record_prompt_logprobs(start, entries)
        try:
            sampled = self.scheduler.update(list(item.req_ids), list(item.sampled_token_ids),
                                            logprobs_of(item) if item.logprob_rows else None,
                                            proposals_of(item) if item.draft_req_ids else None)
        except ValueError as e:  # more tokens than a request's drafts allow: nothing changed
            self.telemetry.step(item, timing, 0)
            self._fail_step(step, "INTERNAL", f"executor step result refused: {e}")
            return []
        if self.scheduler.accept_s:
            self.metrics.accept_time.observe(self.scheduler.accept_s)
        if (share := self.scheduler.prefill_share) is not None:
            share.observe(took, decoding=step.out.decoding, chunked=step.out.chunked,
                          held=step.out.held_chunks > 0)
        self.telemetry.step(item, timing, len(sampled))
        return sampled

    async def _outage(self) -> None:
        """No executor: the queue still changes (new requests arriving, deadlines passing)
        and the gauges follow it until one joins; a loop that only waited for the link left
        them frozen at the last step's values. Nothing runs meanwhile: the lost executor's
        requests count as waiting (the next executor recomputes them)."""
        if self.scheduler is not None:
            self.streams.expire()
            st = self.scheduler.stats()
            self.telemetry.observe_scheduler(replace(st, running=0,
                                                     waiting=st.waiting + st.running))
        self._wake.clear()
        await self._wake.wait()  # a request, an abort, or an executor joining
        self._after_idle = True

    async def _idle(self, sched: Scheduler) -> None:
        """Nothing in flight: check the block accounting if there is no work at all, then
        wait for a request, a finish or an abort."""
        if not sched.has_work():
            sched.check_idle()
            if self._busy_since_trim:  # a burst ended: its freed memory goes back to the OS
                release_free_memory()
                self._busy_since_trim = False
        self._wake.clear()
        await self._wake.wait()
        self._after_idle = True

    # ----------------------------------------------------------------- executor
    def _joined(self, cap: pb.Capacity) -> None:
        if (spec := self.cfg.speculative) is not None:
            try:
                spec.check(cap.max_model_len, self.cfg.max_num_batched_tokens
                           or cap.max_num_batched_tokens or 1 << 62)
            except ValueError as e:  # a flag no executor can serve: say so and stop
                log.critical("%s", e)
                os._exit(2)
            if spec.drafts_in_executor and not cap.draft_model:
                log.critical("--speculative-config: method %s, but the executor that joined "
                             "loaded no draft model or head (start it with the same "
                             "--speculative-config)", spec.method)
                os._exit(2)
        static = tuple(name for name, _ in self.cfg.lora_modules)
        if (tuple(cap.lora_adapters), cap.max_loras) != (static, self.cfg.max_loras):
            log.critical("LoRA: the executor that joined holds adapters %s in %d slots, this "
                         "scheduler was started with %s in %d (start both with the same "
                         "--enable-lora, --lora-modules and --max-loras)",
                         list(cap.lora_adapters) or "none", cap.max_loras,
                         list(static) or "none", self.cfg.max_loras)
            os._exit(2)
        self.scheduler = adopt(self.scheduler, self.cfg, cap, self.kv_watermark,
                               self.eos_token_ids)
        self.scheduler.lora_names = self.lora.registry.names
        self.lora.rejoin()
        if self.grammars is None or self.grammars.vocab_size != cap.vocab_size:
            if self.grammars is not None:  # (the running requests' matchers stay valid)
                self.grammars.close()
            self.grammars = Grammars(self.tokenizer, cap.vocab_size, sorted(self.eos_token_ids))
        self.streams.fail([s for s in self.streams  # admitted under an earlier executor
                           if s.req.prompt_len + s.req.params.max_tokens > cap.max_model_len],
                          "UNAVAILABLE", "the new executor's max_model_len is too small for "
                          "this request")
        self.telemetry.executor_joined(cap, self.cfg.enable_prefix_caching)
        self._ready.set()
        self.link.connected.set()  # readiness below reads it
        self._notify_readiness()
        self._wake.set()

    def _lost(self, why: str) -> None:
        self.lora.fail_pending(why)
        self._notify_readiness()

    def _notify_readiness(self) -> None:
        self.metrics.executor_connected.set(1 if self.link.connected.is_set() else 0)
        if self.on_readiness is not None:
            self.on_readiness(self.serving)

    def _timed_out(self, step: InFlight) -> None:
        """A step went unanswered. A stall (a paused VM, a long GC) should cost its requests
        only a recompute on the next executor, but a request that makes the executor hang
        would hang every executor in turn: one in a second unanswered step fails."""
        again = []
        for s in step.out.scheduled():
            s.req.num_step_timeouts += 1
            if s.req.num_step_timeouts > 1:
                again.append(self.streams.get(s.req.req_id))
        self.streams.fail(again, "UNAVAILABLE",
                          f"the executor did not answer a step with this request within "
                          f"{self.link.cfg.step_timeout_s:g} s, twice")

    def _fail_step(self, step: InFlight, code: str, message: str) -> None:
        self.streams.fail([self.streams.get(s.req.req_id) for s in step.out.scheduled()],
                          code, message)
        if step.out.lora_loads and self.scheduler.lora is not None:
            self.scheduler.lora.invalidate(step.out.lora_loads)


def _crash_on_error(task: asyncio.Task) -> None:
    """An engine task never ends on its own: if one dies the process exits, so that its
    supervisor (pagedserve serve, docker) restarts it instead of leaving a server that hangs."""
    if not task.cancelled() and task.exception() is not None:
        log.critical("engine task %s died", task.get_name(), exc_info=task.exception())
        os._exit(70)
