"""The scheduler's engine loop: plan a step, send it to the executor, turn sampled tokens into
streamed text. Runs on the gRPC server's asyncio loop, so there are no locks: state changes only
between awaits.
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

import zmq
import zmq.asyncio
from pagedserve.protos.internal.v1 import executor_pb2 as pb
from pagedserve.scheduler.block_manager import BlockManager, HostBlockPool
from pagedserve.scheduler.detokenizer import IncrementalDetokenizer, StopStringMatcher, decoder_of
from pagedserve.scheduler.metrics import Metrics, priority_class
from pagedserve.scheduler.request import Request, SamplingParams
from pagedserve.scheduler.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from pagedserve.scheduler.telemetry import Telemetry

log = logging.getLogger("pagedserve.scheduler")
INTEGRITY_CHECK_S = 10.0  # least time between two full block-accounting checks when idle


@dataclass(slots=True)
class Chunk:
    """What one step produced for one request (see GenerateResponse)."""

    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length"
    stop_reason: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0

    def then(self, later: Chunk) -> Chunk:
        """This chunk followed by a later one, as one (the later one's finish and usage win)."""
        return Chunk(self.text + later.text, self.token_ids + later.token_ids,
                     later.finish_reason, later.stop_reason, later.prompt_tokens,
                     later.completion_tokens)


class EngineError(Exception):
    """A request failed inside the engine; `code` is a grpc.StatusCode name."""

    def __init__(self, code: str, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.retry_after_s = retry_after_s


@dataclass(eq=False, slots=True)
class RequestStream:
    req: Request
    detok: IncrementalDetokenizer
    matcher: StopStringMatcher
    sampling: pb.Sampling
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    finished: bool = False
    arrival: float = field(default_factory=time.monotonic)
    scheduled_at: float = 0.0  # first scheduled (0: not yet)
    first_token_at: float = 0.0
    last_token_at: float = 0.0
    deadline: float = float("inf")
    priority_class: str = "0"  # the metrics' priority label
    held: Chunk | None = None  # tokens not yet queued (stream_interval)


@dataclass(slots=True)
class StepTiming:
    num_reqs: int
    num_tokens: int
    plan_s: float  # schedule() + encoding
    round_trip_s: float  # send -> result, including executor time
    execute_s: float  # executor-reported


@dataclass(slots=True)
class InFlight:
    """A step sent to the executor whose result has not arrived."""

    step_id: int
    out: SchedulerOutput
    generation: int  # the executor it went to
    t0: float  # planning started
    t1: float  # planned (perf_counter)


@dataclass(frozen=True, slots=True)
class LinkConfig:
    """When the executor counts as lost (then readiness is NOT_SERVING until a new one joins)."""

    step_timeout_s: float = 120.0  # a step unanswered this long: its requests fail UNAVAILABLE
    heartbeat_timeout_s: float = 10.0  # silence of an idle executor (it beats every second)


class Engine:
    def __init__(self, cfg: SchedulerConfig, address: str, tokenizer: Any,
                 eos_token_ids: list[int], kv_watermark: float = 0.01,
                 metrics: Metrics | None = None, link: LinkConfig | None = None,
                 telemetry: Telemetry | None = None,
                 on_readiness: Callable[[bool], None] | None = None,
                 stream_interval: int = 1, async_scheduling: bool = False) -> None:
        self.metrics = metrics or Metrics()
        self.telemetry = telemetry or Telemetry(self.metrics, tokenizer)
        self.link = link or LinkConfig()
        self.on_readiness = on_readiness
        self.draining = False
        self.cfg = cfg
        if stream_interval < 1:
            raise ValueError(f"stream_interval must be >= 1, got {stream_interval}")
        self.stream_interval = stream_interval
        self.async_scheduling = async_scheduling
        self.address = address
        self.tokenizer = tokenizer
        self._decode = decoder_of(tokenizer)
        self.eos_token_ids = frozenset(eos_token_ids)
        self.kv_watermark = kv_watermark
        self.capacity: pb.Capacity | None = None
        self._peak_blocks_used = 0
        self._checked_at = -INTEGRITY_CHECK_S  # last full block-accounting check when idle
        self.scheduler: Scheduler | None = None
        self.streams: dict[int, RequestStream] = {}
        self.timings: deque[StepTiming] = deque(maxlen=4096)
        self._ids = itertools.count(1)
        self._step_ids = itertools.count(1)
        self._ready = asyncio.Event()  # set once the first executor joined (limits known)
        self._connected = asyncio.Event()  # an executor is connected now
        self._last_seen = 0.0  # monotonic time of the executor's last message
        self._in_flight_since = 0.0  # when the step being waited for was sent (0: none)
        self._timed_out_step = 0
        self._current_step = 0
        self._wake = asyncio.Event()
        self._results: asyncio.Queue[pb.StepResult | None] = asyncio.Queue()
        self._executor_ident: bytes | None = None
        self._executor_id = ""
        self._generation = 0
        self._counters_seen: dict = {}  # scheduler totals already added to counters
        self._tasks: list[asyncio.Task] = []
        self.sock = zmq.asyncio.Context.instance().socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a restarted executor may reuse its slot

    # ----------------------------------------------------------------- lifecycle
    async def start(self) -> None:
        self.sock.bind(self.address)
        self._tasks = [asyncio.create_task(self._recv_loop(), name="engine-recv"),
                       asyncio.create_task(self._step_loop(), name="engine-step"),
                       asyncio.create_task(self._watchdog(), name="engine-watchdog")]
        for t in self._tasks:
            t.add_done_callback(_crash_on_error)

    async def wait_ready(self, timeout: float | None = None) -> bool:
        try:
            await asyncio.wait_for(self._ready.wait(), timeout)
        except TimeoutError:
            return False
        return True

    @property
    def ready(self) -> bool:
        return self._ready.is_set()

    @property
    def serving(self) -> bool:
        """Readiness: a warmed-up executor is connected and new requests are admitted."""
        return self._connected.is_set() and not self.draining

    def begin_drain(self) -> None:
        """Refuse new requests from now on; those admitted run on."""
        self.draining = True
        self._notify_readiness()

    async def drain(self, timeout: float) -> int:
        """Wait up to timeout for the admitted requests to end, then fail the rest with
        UNAVAILABLE. Returns how many were cut short."""
        deadline = time.monotonic() + timeout
        while self.streams and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        left = list(self.streams.values())
        for stream in left:
            self._fail(stream, "UNAVAILABLE", "the server shut down before the request finished")
        return len(left)

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self.sock.close()

    # ----------------------------------------------------------------- requests
    def submit(self, external_id: str, prompt: list[int], params: SamplingParams,
               priority: int = 0, timeout: float | None = None) -> RequestStream:
        """Queue a request; `timeout` (seconds, the client's gRPC deadline) bounds its life."""
        assert self.scheduler is not None, "submit before the executor joined"
        if self.draining:
            raise EngineError("UNAVAILABLE", "server is draining")
        refusal = self.scheduler.admission_error(len(prompt))
        if refusal is not None:
            self.metrics.refused["queue_full"].inc()
            retry = self._retry_after_s()
            raise EngineError("RESOURCE_EXHAUSTED", f"server busy: {refusal}; retry in about "
                              f"{retry:.0f} s", retry_after_s=retry)
        rid = next(self._ids)
        req = Request(rid, external_id or f"req-{rid}", len(prompt), list(prompt), params,
                      priority, arrival_seq=rid)
        sampling = pb.Sampling(temperature=params.temperature, top_k=params.top_k,
                               top_p=params.top_p, has_seed=params.seed is not None,
                               seed=params.seed or 0)
        stream = RequestStream(req, IncrementalDetokenizer(self.tokenizer,
                                                           params.skip_special_tokens,
                                                           self._decode),
                               StopStringMatcher(params.stop), sampling)
        if timeout is not None:
            stream.deadline = stream.arrival + timeout
        stream.priority_class = priority_class(priority)
        self.streams[rid] = stream
        self.scheduler.add(req)
        self.metrics.prompt_tokens.inc(len(prompt))
        self._wake.set()
        return stream

    def abort(self, stream: RequestStream) -> None:
        """Drop a request (client gone); its blocks are free before the next step is planned."""
        if not stream.finished and self.scheduler is not None:
            self._end(stream, "abort", time.monotonic())
            self._update_gauges(self.scheduler)
            self._wake.set()

    # ----------------------------------------------------------------- executor link
    async def _recv_loop(self) -> None:
        while True:
            ident, data = await self.sock.recv_multipart()
            msg = pb.ExecutorMessage.FromString(data)
            kind = msg.WhichOneof("kind")
            if ident == self._executor_ident:
                self._last_seen = time.monotonic()
            if kind == "hello":
                self._on_hello(ident, msg.hello)
            elif kind == "result" and ident == self._executor_ident:
                self._results.put_nowait(msg.result)

    async def _watchdog(self) -> None:
        """Declare the executor lost when an idle one stops beating or a step runs too long."""
        link = self.link
        period = max(0.05, min(0.5, link.heartbeat_timeout_s / 4, link.step_timeout_s / 4))
        while True:
            await asyncio.sleep(period)
            if not self._connected.is_set():
                continue
            now = time.monotonic()
            if self._in_flight_since:
                if now - self._in_flight_since > link.step_timeout_s:
                    self._timed_out_step = self._current_step
                    self._executor_lost(f"step {self._current_step} took longer than "
                                        f"{link.step_timeout_s:g} s")
            elif now - self._last_seen > link.heartbeat_timeout_s:
                self._executor_lost(f"no heartbeat for {link.heartbeat_timeout_s:g} s")

    def _executor_lost(self, why: str) -> None:
        log.error("executor %s lost: %s; waiting for a new one", self._executor_id, why)
        self._executor_ident, self._executor_id = None, ""
        self._connected.clear()
        self._generation += 1
        self._results.put_nowait(None)  # wake a step waiting on it
        self._notify_readiness()

    def _notify_readiness(self) -> None:
        self.metrics.executor_connected.set(1 if self._connected.is_set() else 0)
        if self.on_readiness is not None:
            self.on_readiness(self.serving)

    def _on_hello(self, ident: bytes, hello: pb.Hello) -> None:
        if hello.executor_id == self._executor_id:
            return  # resend or heartbeat of the executor we have
        self._last_seen = time.monotonic()
        cap = hello.capacity
        log.info("executor %s joined: %d blocks x %d tokens, max_model_len %d, %s %s",
                 hello.executor_id, cap.num_kv_blocks, cap.block_size, cap.max_model_len,
                 cap.dtype, cap.device)
        self._executor_ident, self._executor_id, self.capacity = ident, hello.executor_id, cap
        watermark = int(cap.num_kv_blocks * self.kv_watermark)
        blocks = BlockManager(cap.num_kv_blocks, cap.block_size, watermark,
                              enable_caching=self.cfg.enable_prefix_caching)
        host_blocks = HostBlockPool(cap.num_swap_blocks)
        if self.scheduler is None:
            self.scheduler = Scheduler(fit_step_bounds(self.cfg, cap), blocks, host_blocks)
        else:  # a new executor has none of the KV: everything running is recomputed
            self.scheduler.preempt_all(blocks, host_blocks)
            self.scheduler.cfg = fit_step_bounds(self.cfg, cap)
            for stream in list(self.streams.values()):
                if stream.req.prompt_len + stream.req.params.max_tokens > cap.max_model_len:
                    self._fail(stream, "UNAVAILABLE", "the new executor's max_model_len is "
                               "too small for this request")
            self._generation += 1
            self._results.put_nowait(None)  # wake a step waiting on the old executor
        self.metrics.total_blocks.set(cap.num_kv_blocks)
        self.metrics.kv_capacity_tokens.set(cap.num_kv_blocks * cap.block_size)
        self.metrics.weight_bytes.set(cap.weight_bytes)
        self.sock.send_multipart(
            [ident, pb.SchedulerMessage(welcome=pb.Welcome(executor_id=hello.executor_id))
             .SerializeToString()])
        self._ready.set()
        self._connected.set()
        self._notify_readiness()
        self._wake.set()

    # ----------------------------------------------------------------- step loop
    async def _step_loop(self) -> None:
        # Tokens of step N are delivered (detokenized, stop strings matched, queued for their
        # streams) after step N+1 is sent, while the executor runs it: the scheduler's
        # per-token work hides behind the GPU. EOS, stop tokens and max_tokens are checked
        # before N+1 is planned, so only a stop *string* costs one extra token of compute.
        # With async scheduling, step N+1 is also planned and sent before N's result arrives
        # (requests sampling in N get placeholder tokens; see Scheduler.schedule(ahead=True)).
        pending: list[tuple[RequestStream, int, str | None, str]] = []
        arrived = 0.0
        inflight: deque[InFlight] = deque()
        depth = 2 if self.async_scheduling else 1
        while True:
            if not self._connected.is_set():
                await self._connected.wait()
            sched = self.scheduler
            assert sched is not None
            self._expire_deadlines()
            self._update_gauges(sched)
            if len(inflight) < depth and sched.has_work():
                t0 = time.perf_counter()
                out = sched.schedule(ahead=bool(inflight))
                if not out.is_empty:
                    step_id = next(self._step_ids)
                    data = self._encode(step_id, out)
                    if self.async_scheduling:  # after encoding: new requests' ids go as they are
                        sched.expect_tokens(out)
                    t1 = time.perf_counter()
                    for req, _ in out.new:
                        self.telemetry.scheduled(self.streams[req.req_id], time.monotonic())
                    if not inflight:
                        while not self._results.empty():  # a wake-up left by a lost executor
                            self._results.get_nowait()
                        self._current_step, self._in_flight_since = step_id, time.monotonic()
                    inflight.append(InFlight(step_id, out, self._generation, t0, t1))
                    await self.sock.send_multipart([self._executor_ident, data])
                    self.metrics.plan_time.observe(t1 - t0)
                    continue  # deliver, or plan one more ahead, then wait
            if pending:
                self._deliver(pending, arrived)
                pending = []
                # let the streams' servicers write what was just queued: with a result already
                # waiting (async scheduling, a host-bound loop) this loop would otherwise go on
                # to deliver the next step first, and a stream's first message would carry two
                # tokens (one step of TTFT)
                await asyncio.sleep(0)
            if not inflight:
                if not sched.has_work():
                    # the full check is O(blocks): tens of ms on a GPU-sized pool, which a
                    # request arriving meanwhile would wait for; so at most every
                    # INTEGRITY_CHECK_S
                    if time.monotonic() - self._checked_at >= INTEGRITY_CHECK_S:
                        sched.blocks.check_integrity()
                        self._checked_at = time.monotonic()
                    if sched.blocks.num_free_blocks != sched.blocks.num_blocks:
                        raise AssertionError("idle engine holds KV blocks: leak")
                # idle, or nothing fits right now: wait for a request, a finish or an abort
                self._wake.clear()
                await self._wake.wait()
                continue
            step = inflight[0]
            result = await self._results.get()
            while result is not None and result.step_id < step.step_id:
                result = await self._results.get()  # a stale reply
            inflight.popleft()
            if inflight:  # the executor starts on the next one now
                self._current_step, self._in_flight_since = inflight[0].step_id, time.monotonic()
            else:
                self._in_flight_since = 0.0
            if self._timed_out_step == step.step_id:
                self._fail_step(step.out, "UNAVAILABLE", f"the executor did not answer step "
                                f"{step.step_id} within {self.link.step_timeout_s:g} s")
                inflight.clear()  # the executor is gone; its requests were preempted
                continue
            if step.generation != self._generation or result is None \
                    or result.step_id != step.step_id:
                inflight.clear()  # the executor was replaced mid-step; requests were preempted
                continue
            t2 = time.perf_counter()
            out = step.out
            self.timings.append(StepTiming(len(out.new) + len(out.cached), out.num_batched_tokens,
                                           step.t1 - step.t0, t2 - step.t1,
                                           result.execute_seconds))
            self.metrics.round_trip.observe(t2 - step.t1)
            if result.error:
                self._fail_step(out, "INTERNAL", f"executor step failed: {result.error}")
                continue
            updated = sched.update(list(result.req_ids), list(result.sampled_token_ids))
            self.telemetry.step(result, out.num_batched_tokens, len(updated))
            arrived = time.monotonic()
            tokens = dict(zip(result.req_ids, result.sampled_token_ids, strict=True))
            for req in updated:
                stream = self.streams[req.req_id]
                token = tokens[req.req_id]
                finish, stop_reason = self._finish_reason(stream, token)
                if finish:  # out of the next plan; the stream ends when the token is delivered
                    sched.finish(req.req_id)
                pending.append((stream, token, finish, stop_reason))

    def _fail_step(self, out: SchedulerOutput, code: str, message: str) -> None:
        for req, _ in out.scheduled():
            if (stream := self.streams.get(req.req_id)) is not None:
                self._fail(stream, code, message)

    def _expire_deadlines(self) -> None:
        now = time.monotonic()
        for stream in [s for s in self.streams.values() if s.deadline < now]:
            self._fail(stream, "DEADLINE_EXCEEDED", "the request's deadline passed")

    def _retry_after_s(self) -> float:
        """How long the current queue should take to drain, from recent step throughput."""
        recent = list(self.timings)[-64:]
        busy = sum(t.round_trip_s for t in recent)
        rate = sum(t.num_tokens for t in recent) / busy if busy > 0 else 0.0
        queued = self.scheduler.waiting_prompt_tokens if self.scheduler else 0
        return max(1.0, min(60.0, queued / rate if rate > 0 else 1.0))

    def _update_gauges(self, sched: Scheduler) -> None:
        m = self.metrics
        m.running.set(len(sched.running))
        m.waiting.set(len(sched.waiting))
        blocks = sched.blocks
        m.kv_usage.set(blocks.usage())
        m.free_blocks.set(blocks.num_free_blocks)
        used = blocks.num_blocks - blocks.num_free_blocks
        if used:
            tokens = sum(r.num_computed_tokens for r in sched.running)
            util = tokens / (used * blocks.block_size)
            m.kv_token_util.set(util)
            if used >= self._peak_blocks_used:
                self._peak_blocks_used = used
                m.kv_token_util_at_peak.set(util)
        seen = self._counters_seen
        swaps = sched.num_swap_preemptions
        m.swapped.set(sum(1 for r in sched.waiting if r.swapped_blocks))
        for counter, value in ((m.preemptions["swap"], swaps),
                               (m.preemptions["recompute"], sched.num_preemptions - swaps),
                               (m.priority_preemptions, sched.num_priority_preemptions),
                               (m.prefix_queries, sched.prefix_queried_tokens),
                               (m.prefix_hits, sched.prefix_hit_tokens)):
            counter.inc(value - seen.get(counter, 0))
            seen[counter] = value

    def _encode(self, step_id: int, out: SchedulerOutput) -> bytes:
        plan = pb.StepPlan(step_id=step_id, finished_req_ids=out.finished_req_ids,
                           preempted_req_ids=out.preempted_req_ids)
        if out.swap_out:
            plan.swap_out_src[:], plan.swap_out_dst[:] = zip(*out.swap_out, strict=True)
        if out.swap_in:
            plan.swap_in_src[:], plan.swap_in_dst[:] = zip(*out.swap_in, strict=True)
        blocks = self.scheduler.blocks
        for req, n in out.new:
            plan.new_requests.add(
                req_id=req.req_id, token_ids=req.token_ids,
                num_computed_tokens=req.num_computed_tokens - n,
                block_ids=blocks.block_table(req.req_id),
                sampling=self.streams[req.req_id].sampling)
            plan.new_num_scheduled_tokens.append(n)
        if out.cached:  # column by column: one extend per field, not one append per request
            cached = out.cached
            plan.cached_req_ids.extend([req.req_id for req, _, _ in cached])
            plan.cached_num_scheduled_tokens.extend([n for _, n, _ in cached])
            plan.cached_num_new_blocks.extend([len(b) for _, _, b in cached])
            plan.cached_new_block_ids.extend([i for _, _, b in cached for i in b])
        return pb.SchedulerMessage(plan=plan).SerializeToString()

    # ----------------------------------------------------------------- outputs
    def _finish_reason(self, stream: RequestStream, token: int) -> tuple[str | None, str]:
        """(finish reason, stop reason) from the token alone: stop tokens, EOS, max_tokens."""
        req, params = stream.req, stream.req.params
        if token in params.stop_token_ids or token in self.eos_token_ids and not params.ignore_eos:
            return "stop", str(token)
        if req.num_known_output_tokens >= params.max_tokens:
            return "length", ""
        return None, ""

    def _deliver(self, pending: list[tuple[RequestStream, int, str | None, str]],
                 now: float) -> None:
        """Detokenize each sampled token, match stop strings and queue the chunk for its
        stream; a stream that ended meanwhile (aborted, failed) gets nothing."""
        for stream, token, finish, stop_reason in pending:
            if stream.finished:
                continue
            delta = stream.detok.push(token)
            if finish:
                delta += stream.detok.flush()
            text, matched = stream.matcher.feed(delta, final=finish is not None)
            if matched is not None:
                finish, stop_reason = "stop", matched
            chunk = Chunk(text, [token])
            self.telemetry.token(stream, now)
            n = stream.req.num_known_output_tokens
            if finish:
                chunk.finish_reason, chunk.stop_reason = finish, stop_reason
                chunk.prompt_tokens, chunk.completion_tokens = stream.req.prompt_len, n
            if stream.held is not None:
                chunk = stream.held.then(chunk)
                stream.held = None
            if not finish and n > 1 and n % self.stream_interval:
                stream.held = chunk  # the first token goes out at once, then every interval
                continue
            if finish:
                self._end(stream, finish, now)
            stream.queue.put_nowait(chunk)
        self.telemetry.flush()

    def _fail(self, stream: RequestStream, code: str, message: str) -> None:
        self._end(stream, code.lower(), time.monotonic())
        stream.queue.put_nowait(EngineError(code, message))

    def _end(self, stream: RequestStream, reason: str, now: float) -> None:
        """The one way a request leaves the engine: logged, its blocks freed at once."""
        stream.finished = True
        self.telemetry.finished(stream, reason, now)
        self.scheduler.finish(stream.req.req_id)
        self.streams.pop(stream.req.req_id, None)


def fit_step_bounds(cfg: SchedulerConfig, cap: pb.Capacity) -> SchedulerConfig:
    """cfg with its step bounds lowered to what the executor's memory profile covered (a
    larger step could run it out of memory); 0 in cap means unbounded (CPU)."""
    for name in ("max_num_batched_tokens", "max_num_seqs"):
        limit, ours = getattr(cap, name), getattr(cfg, name)
        if 0 < limit < ours:
            log.warning("%s %d is more than the executor profiled its memory for; using %d",
                        name, ours, limit)
            cfg = replace(cfg, **{name: limit})
    return cfg


def _crash_on_error(task: asyncio.Task) -> None:
    """An engine task never ends on its own: if one dies the process exits, so that its
    supervisor (pagedserve serve, docker) restarts it instead of leaving a server that hangs."""
    if not task.cancelled() and task.exception() is not None:
        log.critical("engine task %s died", task.get_name(), exc_info=task.exception())
        os._exit(70)
