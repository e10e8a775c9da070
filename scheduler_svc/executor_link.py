"""The scheduler's end of the executor link: the ZeroMQ ROUTER socket, the handshake, liveness,
and the one codec of the internal messages (plans out, results in).

An executor connects a DEALER and says hello (with its capacity) once a second until welcomed,
then as a heartbeat while idle. One executor is adopted at a time: another one is refused
(it keeps saying hello) until the adopted one is lost. A lost executor is one whose connection
closed: a process killed for real, or one that answered no ZeroMQ heartbeat for
link_timeout_s (stopped, hung host, cut network; libzmq answers them during long steps, see
pagedserve.core.link_liveness); that went silent while idle; or that left a step unanswered
past step_timeout_s. A lost executor that comes back reconnects as a new peer: its late
results are dropped, and it is adopted again only through a new hello. With keys
(pagedserve.core.link_security) the socket is a CURVE server and only executors whose public
key is in the allow-list get through the handshake; without, the link must stay on this host.

What the engine sees:
    on_joined(capacity)  an executor was welcomed: whatever ran on an earlier one is lost
    on_lost(reason)      the executor was lost (above)
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

import numpy as np
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from pagedserve.core.link_liveness import close_link, keep_alive
from pagedserve.core.link_security import (
    LinkSecurityError,
    check_exposure,
    curve_server,
    load_keypair,
)
from pagedserve.protos.internal.v1 import executor_pb2 as pb
from pagedserve.scheduler.outputs import SchedulerOutput
from pagedserve.scheduler.request import Request

log = logging.getLogger("pagedserve.scheduler")


@dataclass(frozen=True, slots=True)
class LinkConfig:
    """When the executor counts as lost (then readiness is NOT_SERVING until a new one joins)."""

    step_timeout_s: float = 120.0  # a step unanswered this long: the executor is lost
    heartbeat_timeout_s: float = 10.0  # silence of an idle executor (it beats every second)
    key_file: str = ""  # the scheduler's NAME.key_secret (CURVE); empty: no keys
    allowed_keys_dir: str = ""  # the executors' public NAME.key files
    insecure: bool = False  # allow a link reachable from other hosts without keys
    link_timeout_s: float = 2.0  # ZeroMQ heartbeats: silence this long drops the connection


class LinkBindError(Exception):
    """The link's address cannot be bound; the message names --executor-bind."""


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
        self.on_lora_updated: Callable[[pb.LoraUpdated], None] = lambda u: None
        # sent right after a new executor's Welcome, before any plan (on_joined fills it)
        self.after_welcome: list[pb.SchedulerMessage] = []
        self.results: asyncio.Queue[pb.StepResult | LinkDown] = asyncio.Queue()
        # perf_counter when the oldest item now queued (or the last one taken) arrived
        self.result_at = 0.0
        self.connected = asyncio.Event()
        self.capacity: pb.Capacity | None = None
        self.generation = 0
        self._ident: bytes | None = None  # the adopted executor's ZeroMQ identity
        self._fd = -1  # its connection's file descriptor (to notice the connection close)
        self._executor_id = ""
        self._refused: set[str] = set()  # executor ids already told (logged once each)
        self._last_seen = 0.0  # monotonic time of the executor's last message
        self._in_flight: deque[int] = deque()  # step ids sent and not answered, oldest first
        self._head_since = 0.0  # when the executor started on the oldest of them
        self._tasks: list[asyncio.Task] = []
        self._ctx = zmq.asyncio.Context()  # its own: a CURVE authenticator is one per context
        self._auth = None
        self._monitor: zmq.asyncio.Socket | None = None
        self.sock = self._ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        keep_alive(self.sock, self.cfg.link_timeout_s)

    def attach(self, on_joined: Callable[[pb.Capacity], None],
               on_lost: Callable[[str], None]) -> None:
        """The engine's two callbacks (called on the event loop, between awaits)."""
        self.on_joined, self.on_lost = on_joined, on_lost

    async def start(self) -> list[asyncio.Task]:
        """Bind (raises LinkSecurityError for an exposed address without keys, or bad keys;
        LinkBindError for an address in use or not of this host)."""
        cfg = self.cfg
        check_exposure(self.address, bool(cfg.key_file), cfg.insecure)
        if cfg.key_file:
            self._secure(cfg.key_file, cfg.allowed_keys_dir)
        self._monitor = self.sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        try:
            self.sock.bind(self.address)
        except zmq.ZMQError as e:
            raise LinkBindError(f"--executor-bind {self.address}: cannot bind: {e}") from None
        self._tasks = [asyncio.create_task(self._recv_loop(), name="link-recv"),
                       asyncio.create_task(self._watchdog(), name="link-watchdog"),
                       asyncio.create_task(self._disconnects(self._monitor), name="link-monitor")]
        return self._tasks

    def _secure(self, key_file: str, allowed_dir: str) -> None:
        if not allowed_dir:
            load_keypair(key_file)  # (a bad key file is named first)
            raise LinkSecurityError("the scheduler has a link key but no allow-list of "
                                    "executor keys (--executor-allowed-keys)")
        self._auth, allowed = curve_server(self._ctx, self.sock, key_file, allowed_dir,
                                           "executor", "--executor-allowed-keys")
        log.info("executor link: CURVE, %d allowed executor keys in %s", allowed, allowed_dir)

    async def close(self) -> None:
        await close_link(self._tasks, self.sock, self._monitor)
        if self._auth is not None:
            self._auth.stop()
        self._ctx.term()

    async def send_lora_update(self, update: pb.LoraUpdate) -> None:
        """A LoRA adapter to add or remove (the executor answers with LoraUpdated)."""
        if self._ident is None:
            raise ConnectionError("no executor is joined")
        await self.sock.send_multipart(
            [self._ident, pb.SchedulerMessage(lora_update=update).SerializeToString()])

    async def send(self, step_id: int, out: SchedulerOutput) -> None:
        """Encode and send one step's plan to the executor (encoded before the first await,
        so the caller may change the requests once this returns)."""
        if not self._in_flight:
            self._head_since = time.monotonic()
        self._in_flight.append(step_id)
        await self.sock.send_multipart([self._ident, encode_plan(step_id, out)])

    async def send_bitmask(self, step_id: int, req_ids: list[int],
                           bits: bytes | np.ndarray) -> None:
        """A step's token bitmasks, after its plan (StepPlan.bitmask_follows): the rows go as a
        frame of their own, not copied (at 256 rows of a 128k vocabulary they are 4 MB, and
        putting them in the message and serializing it copied them twice on the loop)."""
        frames = [self._ident, encode_bitmask(step_id, req_ids, b"")]
        if len(bits):
            frames.append(memoryview(bits).cast("B"))
        await self.sock.send_multipart(frames, copy=False)

    # ----------------------------------------------------------------- incoming
    async def _recv_loop(self) -> None:
        while True:
            frames = await self.sock.recv_multipart(copy=False)
            ident = frames[0].bytes
            msg, why = decode_executor_message(frames[1:], self.capacity)
            if msg is None:  # logged and dropped; from the adopted executor it is a failure
                log.warning("dropped a malformed frame from %s: %s",
                            "the executor" if ident == self._ident else "a peer", why)
                if ident == self._ident and self.connected.is_set():
                    self._lose(f"it sent a malformed frame ({why})")
                continue
            kind = msg.WhichOneof("kind")
            if kind == "hello":
                self._on_hello(ident, msg.hello, frames[1].get(zmq.SRCFD))
            elif kind == "result" and ident == self._ident:
                self._last_seen = time.monotonic()
                self._on_result(msg.result)
            elif kind == "result":
                log.warning("dropped the result of step %d from a peer that is not the "
                            "adopted executor (one lost before, or a stranger)",
                            msg.result.step_id)
            elif kind == "lora_updated" and ident == self._ident:
                self.on_lora_updated(msg.lora_updated)

    def _on_result(self, result: pb.StepResult) -> None:
        while self._in_flight and self._in_flight[0] <= result.step_id:
            self._in_flight.popleft()
        self._head_since = time.monotonic()  # the executor starts on the next one now
        self._put(result)

    def _put(self, item: pb.StepResult | LinkDown) -> None:
        if self.results.empty():
            self.result_at = time.perf_counter()
        self.results.put_nowait(item)

    def _on_hello(self, ident: bytes, hello: pb.Hello, fd: int) -> None:
        if ident == self._ident:
            self._last_seen = time.monotonic()
        if hello.executor_id == self._executor_id:
            return  # resent hello or heartbeat of the executor we have
        if self._ident is not None:
            self._refuse(ident, hello.executor_id)
            return
        cap = hello.capacity
        log.info("executor %s joined: %d blocks x %d tokens, max_model_len %d, %s %s",
                 hello.executor_id, cap.num_kv_blocks, cap.block_size, cap.max_model_len,
                 cap.dtype, cap.device)
        self._ident, self._executor_id, self.capacity = ident, hello.executor_id, cap
        self._fd, self._last_seen = fd, time.monotonic()
        self._forget_steps("")
        self.on_joined(cap)
        self.sock.send_multipart(
            [ident, pb.SchedulerMessage(welcome=pb.Welcome(executor_id=hello.executor_id))
             .SerializeToString()])
        for msg in self.after_welcome:
            self.sock.send_multipart([ident, msg.SerializeToString()])
        self.after_welcome = []
        self.connected.set()

    def _refuse(self, ident: bytes, executor_id: str) -> None:
        why = f"executor {self._executor_id} is connected; one executor at a time"
        if executor_id not in self._refused:
            self._refused.add(executor_id)
            log.warning("refused executor %s: %s (adopted if that one is lost)", executor_id, why)
        self.sock.send_multipart(
            [ident, pb.SchedulerMessage(refuse=pb.Refuse(reason=why)).SerializeToString()])

    async def _disconnects(self, monitor: zmq.asyncio.Socket) -> None:
        """The adopted executor's connection closed (its process died, or libzmq gave up on
        its heartbeats): lost at once, so a restarted executor is adopted without waiting for
        a timeout."""
        why = "its connection closed (the process died"
        why += (f", or sent nothing, not even a heartbeat, for {self.cfg.link_timeout_s:g} s)"
                if self.cfg.link_timeout_s > 0 else ")")
        while True:
            event = parse_monitor_message(await monitor.recv_multipart())
            if event["value"] == self._fd and self.connected.is_set():
                self._lose(why)

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
        self._ident, self._executor_id, self._fd = None, "", -1
        self.connected.clear()
        self._forget_steps(why, timed_out_step)
        self.on_lost(why)

    def _forget_steps(self, why: str, timed_out_step: int = 0) -> None:
        """No step sent so far will be answered: wake whoever waits for one."""
        if why:
            self._put(LinkDown(why, self.generation, timed_out_step))
        self.generation += 1
        self._in_flight.clear()


def decode_executor_message(frames: list, capacity: pb.Capacity | None,
                            ) -> tuple[pb.ExecutorMessage | None, str]:
    """One message from a peer, checked so that nothing in it can break the scheduler: one
    frame of valid protobuf; a result's ids and tokens pair up and tokens lie in the
    vocabulary; a hello carries a usable capacity. (None, why) otherwise."""
    if len(frames) != 1:
        return None, f"{len(frames)} frames, expected 1"
    try:
        msg = pb.ExecutorMessage.FromString(frames[0].bytes)
    except Exception as e:  # DecodeError, and whatever else a hostile byte string provokes
        return None, f"not an ExecutorMessage: {e}"
    kind = msg.WhichOneof("kind")
    if kind == "result":
        r = msg.result
        if len(r.req_ids) != len(r.sampled_token_ids):
            return None, "a result whose request ids and tokens do not pair up"
        vocab = capacity.vocab_size if capacity is not None else 0
        if r.sampled_token_ids and (min(r.sampled_token_ids) < 0
                                    or (vocab and max(r.sampled_token_ids) >= vocab)):
            return None, "a result with a token outside the vocabulary"
        if why := (_bad_logprobs(r, vocab) or _bad_prompt_logprobs(r, vocab)
                   or _bad_proposals(r, vocab)):
            return None, why
    elif kind == "hello":
        cap = msg.hello.capacity
        if not msg.hello.executor_id or min(cap.num_kv_blocks, cap.block_size,
                                            cap.max_model_len, cap.vocab_size) < 1:
            return None, "a hello without an executor id or a usable capacity"
    elif kind is None:
        return None, "an empty message"
    return msg, ""


def wire_sampling(req: Request) -> pb.Sampling:
    p = req.params
    s = pb.Sampling(temperature=p.temperature, top_k=p.top_k, top_p=p.top_p,
                    has_seed=p.seed is not None, seed=p.seed or 0,
                    presence_penalty=p.presence_penalty, frequency_penalty=p.frequency_penalty,
                    repetition_penalty=p.repetition_penalty, min_p=p.min_p,
                    min_tokens=p.min_tokens, min_tokens_masked_ids=req.min_tokens_masked_ids,
                    logprobs=p.logprobs is not None, top_logprobs=p.logprobs or 0)
    if p.logit_bias:
        s.logit_bias_ids[:], s.logit_bias_values[:] = zip(*p.logit_bias, strict=True)
    if req.needs_prompt_logprobs:
        s.prompt_logprobs = p.prompt_logprobs
    return s


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
                              sampling=wire_sampling(s.req), num_prompt_tokens=s.req.prompt_len,
                              lora_slot=s.req.lora_slot, lora_adapter=s.req.lora_id)
        plan.new_num_scheduled_tokens.append(s.num_tokens)
    plan.bitmask_follows = out.bitmask_follows
    plan.after_idle = out.after_idle
    plan.num_lookahead_tokens = out.num_lookahead_tokens
    for slot, adapter_id in out.lora_loads:
        plan.lora_loads.add(slot=slot, adapter_id=adapter_id)
    if out.cached:  # column by column: one extend per field, not one append per request
        cached = out.cached
        plan.cached_req_ids.extend([s.req.req_id for s in cached])
        plan.cached_num_computed_tokens.extend([s.start for s in cached])
        plan.cached_num_scheduled_tokens.extend([s.num_tokens for s in cached])
        plan.cached_num_new_blocks.extend([len(s.block_ids) for s in cached])
        plan.cached_new_block_ids.extend([i for s in cached for i in s.block_ids])
        if any(s.spec_token_ids for s in cached):
            plan.cached_num_spec_tokens.extend([len(s.spec_token_ids) for s in cached])
            plan.cached_spec_token_ids.extend([t for s in cached for t in s.spec_token_ids])
    return pb.SchedulerMessage(plan=plan).SerializeToString()


def encode_bitmask(step_id: int, req_ids: list[int], bits: bytes = b"") -> bytes:
    return pb.SchedulerMessage(bitmask=pb.StepBitmask(step_id=step_id, req_ids=req_ids,
                                                      token_bitmask=bits)).SerializeToString()


def _bad_proposals(r: pb.StepResult, vocab: int) -> str:
    """Why a result's draft proposals do not fit together (see StepResult), or ""."""
    if not (r.draft_req_ids or r.num_draft_tokens or r.draft_token_ids):
        return ""
    if (len(r.draft_req_ids) != len(r.num_draft_tokens)
            or min(r.num_draft_tokens, default=0) < 0
            or sum(r.num_draft_tokens) != len(r.draft_token_ids)
            or len(set(r.draft_req_ids)) != len(r.draft_req_ids)):
        return "a result whose draft proposals do not add up"
    if r.draft_token_ids and (min(r.draft_token_ids) < 0
                              or (vocab and max(r.draft_token_ids) >= vocab)):
        return "a result with a draft token outside the vocabulary"
    return ""


def _bad_logprobs(r: pb.StepResult, vocab: int) -> str:
    """Why a result's packed logprobs do not fit together (see StepResult), or ""."""
    rows = r.logprob_rows
    if not (len(rows) == len(r.sampled_logprobs) == len(r.num_top_logprobs)):
        return "a result whose logprob rows do not pair up"
    if rows and (min(rows) < 0 or max(rows) >= len(r.req_ids)
                 or any(a >= b for a, b in zip(rows, rows[1:], strict=False))):
        return "a result with logprob rows outside its requests or out of order"
    total = sum(r.num_top_logprobs)
    if (min(r.num_top_logprobs, default=0) < 0 or total != len(r.top_logprob_token_ids)
            or total != len(r.top_logprobs)):
        return "a result whose top logprobs do not add up"
    ids = r.top_logprob_token_ids
    if ids and (min(ids) < 0 or (vocab and max(ids) >= vocab)):
        return "a result with a logprob token outside the vocabulary"
    return ""


def _bad_prompt_logprobs(r: pb.StepResult, vocab: int) -> str:
    """Why a result's packed prompt logprobs do not fit together (see StepResult), or ""."""
    n = len(r.prompt_logprob_req_ids)
    if not n == len(r.prompt_logprob_starts) == len(r.prompt_logprob_counts) == \
            len(r.prompt_logprob_ks):
        return "a result whose prompt logprob requests do not pair up"
    if n and (min(r.prompt_logprob_starts) < 1 or min(r.prompt_logprob_counts) < 1
              or min(r.prompt_logprob_ks) < 0):
        return "a result with prompt logprobs before the second token, or none"
    total = sum(c * (1 + k) for c, k in zip(r.prompt_logprob_counts, r.prompt_logprob_ks,
                                            strict=True))
    if total != len(r.prompt_logprob_ints) or total != len(r.prompt_logprob_floats):
        return "a result whose prompt logprobs do not add up"
    ints = r.prompt_logprob_ints  # ranks (1..vocab) and token ids (0..vocab-1)
    if ints and (min(ints) < 0 or (vocab and max(ints) > vocab)):
        return "a result with a prompt logprob token outside the vocabulary"
    return ""
