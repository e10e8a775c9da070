"""The engine client of an API process whose engine core runs in a process of its own
(`pagedserve api`): the same verbs as EngineClient (submit, abort, compile, model_info, the
stream of output batches), spoken over the engine socket (engine_host.py is the other end).

It holds each request it has in flight, with its output tokens so far. When the engine core is
lost (its connection closes, or no state comes for state_timeout_s) readiness turns NOT_SERVING
at once and new requests get UNAVAILABLE with a retry hint; when an engine core answers with a
new session (a restarted one), every request still in flight is resubmitted with its tokens so
far, so that its stream continues where it was (identical output: the sampler's draws depend on
the seed and the position only), unless its deadline passed first.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import os
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import zmq
import zmq.asyncio
from prometheus_client import generate_latest
from zmq.utils.monitor import parse_monitor_message

from pagedserve.core.link_liveness import close_link, keep_alive
from pagedserve.core.link_security import KeyPair
from pagedserve.protos.internal.v1 import engine_pb2 as pb
from pagedserve.scheduler import engine_wire as wire
from pagedserve.scheduler.engine_io import EngineError, EngineOutput, EngineRequest, ModelInfo
from pagedserve.scheduler.metrics import API_FAMILIES, Metrics
from pagedserve.scheduler.request import Constraint

log = logging.getLogger("pagedserve.scheduler")
Subscriber = Callable[[list[EngineOutput]], None]
ENGINE_GONE = "the engine core is restarting; retry shortly (or on another replica)"
SYNC_HELLO_S = 0.02  # sync_state's hellos: at most one this often


@dataclass(eq=False, slots=True)
class InFlight:
    """A request submitted and not ended, as this process resubmits it to a new engine."""

    request: EngineRequest
    sibling_of: int | None  # its completion 0's local id
    deadline: float | None  # monotonic
    tokens: list[int] = field(default_factory=list)  # output tokens received
    got_first: bool = False  # its first output came (cached tokens, prompt logprobs)


class _ApiFamilies:
    """The families an API process counts, for the hello that carries them to the engine."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics, self.registry = metrics, metrics.registry
        self._cpu = 0.0  # this process's CPU seconds counted so far

    def collect(self):
        t = os.times()
        cpu = t.user + t.system
        self.metrics.api_process_cpu.inc(max(0.0, cpu - self._cpu))
        self._cpu = max(self._cpu, cpu)
        return [f for f in self.registry.collect() if f.name in API_FAMILIES]


class RemoteEngineClient:
    def __init__(self, address: str, metrics: Metrics, hello_s: float = 0.25,
                 state_timeout_s: float = 2.0, link_timeout_s: float = 2.0,
                 on_readiness: Callable[[bool], None] | None = None,
                 key: KeyPair | None = None, engine_public_key: bytes = b"") -> None:
        """key, engine_public_key: this process's CURVE key pair and the engine core's public
        key, for an engine socket keyed (EngineHost's key_file); None: no keys."""
        self.address, self.metrics = address, metrics
        self.hello_s, self.state_timeout_s = hello_s, state_timeout_s
        self.on_readiness = on_readiness
        self.api_id = f"api-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.draining = False  # this process's own drain
        self.leaving = False  # and its shutdown delay
        self._subscriber: Subscriber | None = None
        self._ids = itertools.count(1)
        self._inflight: dict[int, InFlight] = {}
        self._replies: dict[int, asyncio.Future] = {}
        self._early: dict[int, list[EngineOutput]] = {}  # outputs before submit() returned
        self._orphans: set[int] = set()  # ids aborted as orphans
        self._info: ModelInfo | None = None
        self._state: pb.EngineState | None = None
        self._session = ""
        self._resubmit_due = False  # a new session began with requests in flight
        # LoRA adapters loaded at run time live in the engine core's memory: those a new
        # session does not serve are loaded into it again (by this process, or another API
        # process first) before this process resubmits its requests
        self._lora_served: dict[str, str] = {}  # name -> path, as of the last state
        self._lora_lost: dict[str, str] = {}  # served by the previous session, not this one
        self._restoring: asyncio.Task | None = None
        self._last_state = 0.0
        self._states = 0  # states received (sync_state waits for one more)
        self._sync_hello = 0.0  # when sync_state last sent a hello
        self._connected = False
        self._last_serving: bool | None = None
        self._families = _ApiFamilies(metrics)
        self._ctx = zmq.asyncio.Context()
        self.sock = self._ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.IDENTITY, self.api_id.encode())
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDHWM, 0)
        self.sock.setsockopt(zmq.RCVHWM, 0)
        self.sock.setsockopt(zmq.IMMEDIATE, 1)  # nothing queued for a peer not connected
        if key is not None:
            self.sock.curve_secretkey, self.sock.curve_publickey = key.secret, key.public
            self.sock.curve_serverkey = engine_public_key
        keep_alive(self.sock, link_timeout_s)
        self._monitor: zmq.asyncio.Socket | None = None
        self._tasks: list[asyncio.Task] = []

    # ----------------------------------------------------------------- lifecycle
    async def start(self) -> list[asyncio.Task]:
        self._monitor = self.sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self.sock.connect(self.address)
        self._tasks = [asyncio.create_task(self._recv_loop(), name="engine-link-recv"),
                       asyncio.create_task(self._hello_loop(), name="engine-link-hello"),
                       asyncio.create_task(self._disconnects(self._monitor),
                                           name="engine-link-monitor")]
        return self._tasks

    async def wait_connected(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while not self._connected and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return self._connected

    async def close(self) -> None:
        await close_link(self._tasks, self.sock, self._monitor)
        self._ctx.term()

    def subscribe(self, subscriber: Subscriber) -> None:
        self._subscriber = subscriber

    @property
    def serving(self) -> bool:
        st = self._state
        return bool(self._connected and st is not None and st.serving and not self.draining
                    and not self.leaving)

    @property
    def connected(self) -> bool:
        return self._connected

    def leave_soon(self) -> None:
        self.leaving = True
        self._notify()

    def model_info(self) -> ModelInfo | None:
        return self._info

    def __len__(self) -> int:
        return len(self._inflight)

    # ----------------------------------------------------------------- verbs
    async def submit(self, request: EngineRequest) -> int:
        """Queue a request in the engine core; its id, which its outputs carry. Raises
        EngineError (UNAVAILABLE while draining or while the engine core is gone,
        RESOURCE_EXHAUSTED when its queue is full) or InvalidRequest (a constraint that does
        not compile)."""
        if self.draining:
            raise EngineError("UNAVAILABLE", "server is draining")
        if not self._connected:
            raise EngineError("UNAVAILABLE", ENGINE_GONE, retry_after_s=1.0)
        local = next(self._ids)
        deadline = None if request.timeout is None else time.monotonic() + request.timeout
        self._inflight[local] = InFlight(request, request.sibling_of, deadline)
        fut = self._replies[local] = asyncio.get_running_loop().create_future()
        self._early[local] = []
        self._send_submit(local, self._inflight[local])
        try:
            await fut
        except BaseException:
            self._inflight.pop(local, None)
            self._early.pop(local, None)
            refused = fut.done() and not fut.cancelled() and fut.exception() is not None
            if not refused:  # cancelled while waiting (or after it was accepted): end it there
                self._send_abort([local], ["abort"])
            raise
        finally:
            self._replies.pop(local, None)
        asyncio.get_running_loop().call_soon(self._flush_early, local)
        return local

    async def compile(self, constraint: Constraint) -> None:
        """Check a constraint in the engine core (it caches the compiled grammar for the
        submit that follows); InvalidRequest naming the field if it does not compile."""
        if not self._connected:
            raise EngineError("UNAVAILABLE", ENGINE_GONE, retry_after_s=1.0)
        local = next(self._ids)
        fut = self._replies[local] = asyncio.get_running_loop().create_future()
        msg = pb.ApiMessage(compile=pb.Compile(id=local, constraint=pb.Constraint(
            kind=constraint.kind, spec=constraint.spec)))
        self._send(msg.SerializeToString())
        try:
            await fut
        finally:
            self._replies.pop(local, None)

    def lora_modules(self) -> list[tuple[str, str]]:
        """The LoRA adapters the engine core serves, as its last state said."""
        st = self._state
        return [] if st is None else [(m.name, m.path) for m in st.lora_adapters]

    async def sync_state(self, timeout_s: float = 1.0) -> None:
        """Until the next state from the engine core has arrived (at most timeout_s). Another
        API process's load of a LoRA adapter returns once the engine core has sent every
        process the new list, not once each has read it: a request that names the adapter
        here at once may come before this process read it, and the next state it reads is
        that one or a later one. A hello asks for it now (the engine core answers one with
        its state), at most one each SYNC_HELLO_S, so that requests naming unknown models
        cannot make it send states faster than that; else the periodic hello's comes."""
        if not self._connected:
            return
        seen = self._states
        now = time.monotonic()
        if now - self._sync_hello >= SYNC_HELLO_S:
            self._sync_hello = now
            self._hello(with_metrics=False)
        deadline = now + timeout_s
        while self._states == seen and self._connected and time.monotonic() < deadline:
            await asyncio.sleep(0.002)

    async def load_lora(self, name: str, path: str) -> None:
        await self._lora_admin(name, path)

    async def unload_lora(self, name: str) -> None:
        await self._lora_admin(name, "")

    async def _lora_admin(self, name: str, path: str) -> None:
        """Load (path) or unload a LoRA adapter in the engine core; its answer comes after
        the state naming the adapters, so this process serves the change once it returns."""
        if not self._connected:
            raise EngineError("UNAVAILABLE", ENGINE_GONE, retry_after_s=1.0)
        local = next(self._ids)
        fut = self._replies[local] = asyncio.get_running_loop().create_future()
        self._send(pb.ApiMessage(lora_admin=pb.LoraAdmin(id=local, name=name, path=path))
                   .SerializeToString())
        try:
            await fut
        finally:
            self._replies.pop(local, None)

    def abort(self, req_id: int, reason: str = "abort") -> None:
        if self._inflight.pop(req_id, None) is not None:
            self._early.pop(req_id, None)
            self._send_abort([req_id], [reason])

    # ----------------------------------------------------------------- outgoing
    def _send(self, data: bytes) -> None:
        # zmq.Again: no engine connected (IMMEDIATE); what was in flight is resubmitted when
        # one answers. (The asyncio socket reports it on the future it returns.)
        self.sock.send(data, flags=zmq.NOBLOCK).add_done_callback(_retrieved)

    def _send_submit(self, local: int, f: InFlight, resubmitted: bool = False) -> None:
        timeout = None if f.deadline is None else f.deadline - time.monotonic()
        request = f.request
        if f.got_first and request.params.prompt_logprobs is not None:
            request = dataclasses.replace(request, params=dataclasses.replace(
                request.params, prompt_logprobs=None))  # delivered with its first output
        self._send(wire.encode_submit(local, request, f.sibling_of, f.tokens, timeout,
                                      resubmitted))

    def _send_abort(self, ids: list[int], reasons: list[str]) -> None:
        self._send(pb.ApiMessage(abort=pb.Abort(ids=ids, reasons=reasons)).SerializeToString())

    def _hello(self, with_metrics: bool, pull_seq: int = 0) -> None:
        hello = pb.ApiHello(api_id=self.api_id, pull_seq=pull_seq)
        if with_metrics:
            hello.metrics = generate_latest(self._families)
        self._send(pb.ApiMessage(hello=hello).SerializeToString())

    async def _hello_loop(self) -> None:
        beats = 0
        while True:
            self._hello(with_metrics=beats % 4 == 0)  # the metrics once a second
            beats += 1
            await asyncio.sleep(self.hello_s)
            if not self._connected or self._resubmit_due:  # nobody else checks deadlines
                self._expire()
            if self._connected and time.monotonic() - self._last_state > self.state_timeout_s:
                self._lost(f"no state for {self.state_timeout_s:g} s")

    # ----------------------------------------------------------------- incoming
    async def _recv_loop(self) -> None:
        while True:
            frames = await self.sock.recv_multipart(copy=False)
            msg, why = wire.decode(frames, pb.EngineMessage)
            if msg is None:
                log.warning("dropped a malformed frame from the engine core: %s", why)
                continue
            kind = msg.WhichOneof("kind")
            if kind == "state":
                self._on_state(msg.state)
            elif kind == "reply":
                self._on_reply(msg.reply)
            elif kind == "pull":
                self._hello(with_metrics=True, pull_seq=msg.pull.seq)
            elif kind == "outputs":
                batch, why = wire.decode_outputs(msg.outputs)
                if batch is None:
                    log.warning("dropped malformed outputs from the engine core: %s", why)
                    continue
                self._deliver(batch)

    def _on_state(self, st: pb.EngineState) -> None:
        self._last_state = time.monotonic()
        self._state = st
        self._states += 1
        if st.HasField("model_info"):
            self._info = wire.decode_model_info(st.model_info)
        self._connected = True
        served = {m.name: m.path for m in st.lora_adapters}
        if st.session != self._session:  # what was not accepted yet may never be: retried
            self._fail_pending()
            if self._session:  # a restarted engine core: what it no longer serves
                self._lora_lost = {n: p for n, p in self._lora_served.items() if n not in served}
            self._session, self._resubmit_due = st.session, bool(self._inflight)
        self._lora_served = {**served, **self._lora_lost}
        if (self._resubmit_due or self._lora_lost) and self._restoring is None \
                and st.HasField("model_info"):  # an executor has joined it
            log.warning("a new engine core session (engine %s): %sresubmitting %d requests",
                        st.engine_id, f"loading LoRA adapters {sorted(self._lora_lost)} "
                        "again, then " if self._lora_lost else "", len(self._inflight))
            self._resubmit_due = False
            if self._lora_lost:
                self._restoring = asyncio.get_running_loop().create_task(self._restore_lora())
            else:
                self._resubmit()
        self._notify()

    async def _restore_lora(self) -> None:
        """Load the adapters the previous session served into this one (another API process
        may be doing it: then wait until the state names them), then resubmit."""
        session = self._session
        try:
            for name, path in list(self._lora_lost.items()):
                try:
                    await self._lora_admin(name, path)
                except EngineError as e:
                    if e.code != "ALREADY_EXISTS":
                        raise
                    await self._until_served(name)
                self._lora_lost.pop(name, None)
        except Exception as e:  # the engine core lost again (the next session retries),
            if getattr(e, "code", "") == "UNAVAILABLE" or self._session != session:
                return
            log.error("LoRA adapter %s could not be loaded again: %s; its requests fail",
                      list(self._lora_lost), e)  # (refused by the new executor)
            self._lora_lost.clear()
        finally:
            self._restoring = None
        if self._session == session and self._connected:
            self._resubmit()

    async def _until_served(self, name: str, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        while name not in {m.name for m in self._state.lora_adapters}:
            if not self._connected or time.monotonic() > deadline:
                raise EngineError("UNAVAILABLE", f"LoRA adapter {name!r} was not loaded again")
            await asyncio.sleep(0.05)

    def _resubmit(self) -> None:
        """Every request accepted by an earlier session, with its tokens so far (completion 0
        of n before its siblings: ids ascend)."""
        self._expire()
        for local, f in sorted(self._inflight.items()):
            self._send_submit(local, f, resubmitted=True)

    def _expire(self) -> None:
        """End the requests whose deadline passed (while no engine core runs them)."""
        now = time.monotonic()
        expired = [i for i, f in self._inflight.items()
                   if f.deadline is not None and f.deadline <= now and i not in self._replies]
        if expired:
            self._deliver([EngineOutput(i, error=EngineError(
                "DEADLINE_EXCEEDED", "the request's deadline passed")) for i in expired])

    def _on_reply(self, r: pb.Reply) -> None:
        fut = self._replies.get(r.id)
        if fut is None:  # a resubmission's: refused, it ends its stream
            if r.HasField("error") and r.id in self._inflight:
                e = wire.decode_error(r.error)
                self._deliver([EngineOutput(r.id, error=e if isinstance(e, EngineError)
                                            else EngineError("INTERNAL", str(e)))])
            elif not r.HasField("error") and r.id not in self._inflight:
                self._orphan(r.id)  # accepted after this process gave it up
            return
        if fut.done():
            return
        if r.HasField("error"):
            fut.set_exception(wire.decode_error(r.error))
        else:
            fut.set_result(None)

    def _flush_early(self, local: int) -> None:
        early = self._early.pop(local, None)
        if early and self._subscriber is not None:
            self._subscriber(early)

    def _deliver(self, batch: list[EngineOutput]) -> None:
        now_out = []
        for out in batch:
            f = self._inflight.get(out.req_id)
            if f is None:  # aborted here meanwhile, or given up before it was accepted
                if not (out.finish_reason or out.error):
                    self._orphan(out.req_id)
                continue
            f.tokens.extend(out.token_ids)
            f.got_first = True
            if out.finish_reason or out.error is not None:
                del self._inflight[out.req_id]
            early = self._early.get(out.req_id)
            if early is not None:
                early.append(out)
            else:
                now_out.append(out)
        if now_out and self._subscriber is not None:
            self._subscriber(now_out)

    async def _disconnects(self, monitor: zmq.asyncio.Socket) -> None:
        while True:
            parse_monitor_message(await monitor.recv_multipart())
            if self._connected:
                self._lost("its connection closed")

    def _lost(self, why: str) -> None:
        log.error("engine core lost (%s): not serving until it is back", why)
        self._connected = False
        self._fail_pending()
        self._notify()

    def _fail_pending(self) -> None:
        """Submits and compiles not answered yet get UNAVAILABLE with a retry hint (the client
        retries, here or on another replica); accepted ones stay, to be resubmitted."""
        for local, fut in list(self._replies.items()):
            if not fut.done():
                self._inflight.pop(local, None)
                self._early.pop(local, None)
                fut.set_exception(EngineError("UNAVAILABLE", ENGINE_GONE, retry_after_s=1.0))

    def _orphan(self, local: int) -> None:
        """A request running in the engine core that this process no longer follows: abort
        it there (once)."""
        if local not in self._orphans:
            if len(self._orphans) > 4096:
                self._orphans.clear()
            self._orphans.add(local)
            self._send_abort([local], ["abort"])

    def _notify(self) -> None:
        """Readiness to on_readiness, when it changed."""
        serving = self.serving
        if serving != self._last_serving and self.on_readiness is not None:
            self.on_readiness(serving)
        self._last_serving = serving



def _retrieved(fut: asyncio.Future) -> None:
    """A send's outcome, looked at (zmq.Again while no engine core is connected is expected:
    nothing is lost that is not resubmitted)."""
    if not fut.cancelled():
        fut.exception()
