"""The scheduler's end of the executor link: the ZeroMQ ROUTER socket, the handshake, liveness,
and the one codec of the internal messages (plans out, results in).

An executor connects a DEALER and says hello (with its capacity) once a second until welcomed,
then as a heartbeat while idle. One executor is adopted at a time; a hello with a new
executor_id replaces the current one (a restarted executor holds no KV).

What the engine sees:
    on_joined(capacity)  an executor was welcomed: whatever ran on an earlier one is lost
    on_lost(reason)      the executor went silent while idle, or left a step unanswered past
                         step_timeout_s
    results              step results, in the order the steps were sent; a LinkDown item
                         wakes a step loop that waits on an executor that is gone (one that
                         waits on no step of its generation skips it)
    generation           counts executors joined and lost: a step sent under another
                         generation will never be answered
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import zmq
import zmq.asyncio
from pagedserve.protos.internal.v1 import executor_pb2 as pb
from pagedserve.scheduler.outputs import SchedulerOutput
from pagedserve.scheduler.request import GenerationParams

log = logging.getLogger("pagedserve.scheduler")


@dataclass(frozen=True, slots=True)
class LinkConfig:
    """When the executor counts as lost (then readiness is NOT_SERVING until a new one joins)."""

    step_timeout_s: float = 120.0  # a step unanswered this long: its requests fail UNAVAILABLE
    heartbeat_timeout_s: float = 10.0  # silence of an idle executor (it beats every second)


@dataclass(frozen=True, slots=True)
class LinkDown:
    """On the results queue when the executor that steps were sent to is gone: no step sent
    under `generation` will be answered."""

    reason: str
    generation: int
    timed_out_step: int = 0  # the step left unanswered, if that was why (0: another reason)


class ExecutorLink:
    def __init__(self, address: str, cfg: LinkConfig | None = None) -> None:
        self.address, self.cfg = address, cfg or LinkConfig()
        self.on_joined: Callable[[pb.Capacity], None] = lambda cap: None
        self.on_lost: Callable[[str], None] = lambda why: None
        self.results: asyncio.Queue[pb.StepResult | LinkDown] = asyncio.Queue()
        self.connected = asyncio.Event()
        self.capacity: pb.Capacity | None = None
        self.generation = 0
        self._ident: bytes | None = None  # the adopted executor's ZeroMQ identity
        self._executor_id = ""
        self._last_seen = 0.0  # monotonic time of the executor's last message
        self._in_flight: deque[int] = deque()  # step ids sent and not answered, oldest first
        self._head_since = 0.0  # when the executor started on the oldest of them
        self._tasks: list[asyncio.Task] = []
        self.sock = zmq.asyncio.Context.instance().socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a restarted executor may reuse its slot

    def attach(self, on_joined: Callable[[pb.Capacity], None],
               on_lost: Callable[[str], None]) -> None:
        """The engine's two callbacks (called on the event loop, between awaits)."""
        self.on_joined, self.on_lost = on_joined, on_lost

    async def start(self) -> list[asyncio.Task]:
        self.sock.bind(self.address)
        self._tasks = [asyncio.create_task(self._recv_loop(), name="link-recv"),
                       asyncio.create_task(self._watchdog(), name="link-watchdog")]
        return self._tasks

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self.sock.close()

    async def send(self, step_id: int, out: SchedulerOutput) -> None:
        """Encode and send one step's plan to the executor (encoded before the first await,
        so the caller may change the requests once this returns)."""
        if not self._in_flight:
            self._head_since = time.monotonic()
        self._in_flight.append(step_id)
        await self.sock.send_multipart([self._ident, encode_plan(step_id, out)])

    # ----------------------------------------------------------------- incoming
    async def _recv_loop(self) -> None:
        while True:
            ident, data = await self.sock.recv_multipart()
            msg = pb.ExecutorMessage.FromString(data)
            kind = msg.WhichOneof("kind")
            if kind == "hello":
                self._on_hello(ident, msg.hello)
            elif kind == "result" and ident == self._ident:
                self._last_seen = time.monotonic()
                self._on_result(msg.result)

    def _on_result(self, result: pb.StepResult) -> None:
        while self._in_flight and self._in_flight[0] <= result.step_id:
            self._in_flight.popleft()
        self._head_since = time.monotonic()  # the executor starts on the next one now
        self.results.put_nowait(result)

    def _on_hello(self, ident: bytes, hello: pb.Hello) -> None:
        if ident == self._ident:
            self._last_seen = time.monotonic()
        if hello.executor_id == self._executor_id:
            return  # resent hello or heartbeat of the executor we have
        cap = hello.capacity
        log.info("executor %s joined: %d blocks x %d tokens, max_model_len %d, %s %s",
                 hello.executor_id, cap.num_kv_blocks, cap.block_size, cap.max_model_len,
                 cap.dtype, cap.device)
        replaced = self._ident is not None
        self._ident, self._executor_id, self.capacity = ident, hello.executor_id, cap
        self._last_seen = time.monotonic()
        self._forget_steps("replaced by a new executor" if replaced else "")
        self.on_joined(cap)
        self.sock.send_multipart(
            [ident, pb.SchedulerMessage(welcome=pb.Welcome(executor_id=hello.executor_id))
             .SerializeToString()])
        self.connected.set()

    async def _watchdog(self) -> None:
        """Declare the executor lost when an idle one stops beating or a step runs too long."""
        cfg = self.cfg
        period = max(0.05, min(0.5, cfg.heartbeat_timeout_s / 4, cfg.step_timeout_s / 4))
        while True:
            await asyncio.sleep(period)
            if not self.connected.is_set():
                continue
            now = time.monotonic()
            if self._in_flight:
                if now - self._head_since > cfg.step_timeout_s:
                    step = self._in_flight[0]
                    self._lose(f"step {step} took longer than {cfg.step_timeout_s:g} s", step)
            elif now - self._last_seen > cfg.heartbeat_timeout_s:
                self._lose(f"no heartbeat for {cfg.heartbeat_timeout_s:g} s")

    def _lose(self, why: str, timed_out_step: int = 0) -> None:
        log.error("executor %s lost: %s; waiting for a new one", self._executor_id, why)
        self._ident, self._executor_id = None, ""
        self.connected.clear()
        self._forget_steps(why, timed_out_step)
        self.on_lost(why)

    def _forget_steps(self, why: str, timed_out_step: int = 0) -> None:
        """No step sent so far will be answered: wake whoever waits for one."""
        if why:
            self.results.put_nowait(LinkDown(why, self.generation, timed_out_step))
        self.generation += 1
        self._in_flight.clear()


def wire_sampling(params: GenerationParams) -> pb.Sampling:
    return pb.Sampling(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
                       has_seed=params.seed is not None, seed=params.seed or 0)


def encode_plan(step_id: int, out: SchedulerOutput) -> bytes:
    plan = pb.StepPlan(step_id=step_id, finished_req_ids=out.finished_req_ids,
                       preempted_req_ids=out.preempted_req_ids)
    if out.swap_out:
        plan.swap_out_src[:], plan.swap_out_dst[:] = zip(*out.swap_out, strict=True)
    if out.swap_in:
        plan.swap_in_src[:], plan.swap_in_dst[:] = zip(*out.swap_in, strict=True)
    for s in out.new:
        plan.new_requests.add(req_id=s.req.req_id, token_ids=s.req.token_ids,
                              num_computed_tokens=s.start, block_ids=s.block_ids,
                              sampling=wire_sampling(s.req.params))
        plan.new_num_scheduled_tokens.append(s.num_tokens)
    if out.cached:  # column by column: one extend per field, not one append per request
        cached = out.cached
        plan.cached_req_ids.extend([s.req.req_id for s in cached])
        plan.cached_num_computed_tokens.extend([s.start for s in cached])
        plan.cached_num_scheduled_tokens.extend([s.num_tokens for s in cached])
        plan.cached_num_new_blocks.extend([len(s.block_ids) for s in cached])
        plan.cached_new_block_ids.extend([i for s in cached for i in s.block_ids])
    return pb.SchedulerMessage(plan=plan).SerializeToString()
