"""The engine core's end of the engine socket (protos/pagedserve/internal/v1/engine.proto): a
ZeroMQ ROUTER the API processes connect to. It admits their requests into the Engine, aborts
what they end, and sends each one step's outputs for its own requests as one message.

An API process is known by its ZeroMQ identity from its first hello. One that goes away (its
connection closes: killed, or silent past libzmq's heartbeat timeout; or it stops saying hello)
loses its requests: they are aborted, their blocks free before the next step. Frames that do
not decode, or requests that do not check (engine_wire.check_submit), are dropped and logged;
the engine keeps serving."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
import uuid
from dataclasses import dataclass, field

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from pagedserve.core.link_liveness import close_link, keep_alive
from pagedserve.core.link_security import curve_server, is_local
from pagedserve.protos.internal.v1 import engine_pb2 as pb
from pagedserve.scheduler import engine_wire as wire
from pagedserve.scheduler.engine import Engine
from pagedserve.scheduler.engine_io import EngineError, EngineOutput
from pagedserve.scheduler.invalid import InvalidRequest
from pagedserve.scheduler.request import Constraint

log = logging.getLogger("pagedserve.scheduler")
NO_EXECUTOR = "no executor has joined the engine yet"


class EngineBindError(Exception):
    """The engine socket's address cannot be bound; the message names --engine-address."""


def local_only(address: str) -> str:
    return (f"--engine-address {address}: the engine socket is for this host only (ipc://, or "
            "tcp:// on a loopback address): it carries users' prompts, with no keys (give "
            "the engine core --engine-key and --engine-allowed-keys, and each API process "
            "--engine-key and --engine-public-key, to reach it from other hosts)")


@dataclass(eq=False, slots=True)
class ApiPeer:
    """An API process, by its ZeroMQ identity."""

    ident: bytes
    api_id: str
    fd: int = -1  # its connection's descriptor (to notice the close)
    last_seen: float = field(default_factory=time.monotonic)
    by_local: dict[int, int] = field(default_factory=dict)  # its request ids -> the engine's
    metrics: bytes = b""  # its latest metrics text
    pulled: int = 0  # the latest MetricsPull it answered
    session: str = field(default_factory=lambda: uuid.uuid4().hex[:12])


class EngineHost:
    def __init__(self, engine: Engine, address: str, hello_timeout_s: float = 5.0,
                 link_timeout_s: float = 2.0, key_file: str = "",
                 allowed_keys_dir: str = "") -> None:
        """key_file, allowed_keys_dir: the engine core's CURVE key pair and the API processes'
        public keys it accepts (pagedserve.core.link_security); without them the address
        must stay on this host."""
        self.engine, self.address = engine, address
        self.key_file, self.allowed_keys_dir = key_file, allowed_keys_dir
        self._auth = None
        engine.lora.on_change = self.broadcast_state  # (an adapter a new executor lost too)
        self.hello_timeout_s = hello_timeout_s
        self.engine_id = uuid.uuid4().hex[:12]
        self.peers: dict[bytes, ApiPeer] = {}
        self._owner: dict[int, tuple[ApiPeer, int]] = {}  # engine id -> (peer, its id)
        # the last metrics of API processes gone, by api_id: their counters stay counted (until
        # the same process says hello again and reports them itself)
        self.retired_metrics: dict[str, bytes] = {}
        self._ctx = zmq.asyncio.Context()
        self.sock = self._ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDHWM, 0)  # never drop an output to a slow API process
        self.sock.setsockopt(zmq.RCVHWM, 0)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a peer gone raises, not a silent drop
        keep_alive(self.sock, link_timeout_s)
        self._monitor: zmq.asyncio.Socket | None = None
        self._tasks: list[asyncio.Task] = []
        self._pull_seq = 0
        self._pull_waiters: list[tuple[int, asyncio.Event]] = []  # scrapes waiting for answers
        engine.streams.emit = self._emit

    async def start(self) -> list[asyncio.Task]:
        """Bind (EngineBindError: an address of another host without keys, or one in use;
        LinkSecurityError: bad keys)."""
        if self.key_file:
            self._auth, allowed = curve_server(self._ctx, self.sock, self.key_file,
                                               self.allowed_keys_dir, "API process",
                                               "--engine-allowed-keys")
            log.info("engine socket: CURVE, %d allowed API process keys in %s", allowed,
                     self.allowed_keys_dir)
        elif not is_local(self.address):
            raise EngineBindError(local_only(self.address))
        self._monitor = self.sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        try:
            self.sock.bind(self.address)
        except zmq.ZMQError as e:
            raise EngineBindError(f"--engine-address {self.address}: cannot bind: {e}") from None
        self._tasks = [asyncio.create_task(self._recv_loop(), name="engine-recv"),
                       asyncio.create_task(self._watchdog(), name="engine-watchdog"),
                       asyncio.create_task(self._disconnects(self._monitor),
                                           name="engine-monitor")]
        return self._tasks

    async def close(self) -> None:
        await close_link(self._tasks, self.sock, self._monitor)
        if self._auth is not None:
            self._auth.stop()
        self._ctx.term()

    # ----------------------------------------------------------------- outgoing
    def _send(self, peer: ApiPeer, data: bytes) -> None:
        def sent(fut: asyncio.Future) -> None:  # the asyncio socket reports errors here
            if not fut.cancelled() and (e := fut.exception()) is not None:
                log.warning("API process %s unreachable (%s)", peer.api_id, e)
                self._drop(peer, "its connection is gone")  # EHOSTUNREACH

        self.sock.send_multipart([peer.ident, data], flags=zmq.NOBLOCK).add_done_callback(sent)

    def _emit(self, batch: list[EngineOutput]) -> None:
        """A step's outputs, one message per API process (its requests' ids)."""
        by_peer: dict[bytes, tuple[ApiPeer, list[EngineOutput], list[int]]] = {}
        owner = self._owner
        for out in batch:
            got = owner.get(out.req_id)
            if got is None:
                continue
            peer, local = got
            if out.finish_reason or out.error is not None:
                del owner[out.req_id]
                peer.by_local.pop(local, None)
            entry = by_peer.get(peer.ident)
            if entry is None:
                entry = by_peer[peer.ident] = (peer, [], [])
            entry[1].append(out)
            entry[2].append(local)
        for peer, outs, ids in by_peer.values():
            self._send(peer, wire.encode_outputs(outs, ids))

    def state(self, peer: ApiPeer) -> bytes:
        e = self.engine
        st = pb.EngineState(engine_id=self.engine_id, serving=e.serving, draining=e.draining,
                            leaving=e.leaving, session=peer.session)
        if (info := e.model_info()) is not None:
            st.model_info.CopyFrom(wire.encode_model_info(info))
        for name, path in e.lora.registry.modules():
            st.lora_adapters.add(name=name, path=path)
        return pb.EngineMessage(state=st).SerializeToString()

    def broadcast_state(self) -> None:
        """Readiness or the model changed: every API process hears it now."""
        for peer in list(self.peers.values()):
            self._send(peer, self.state(peer))

    def _reply(self, peer: ApiPeer, local: int,
               error: EngineError | InvalidRequest | None = None) -> None:
        r = pb.Reply(id=local)
        if error is not None:
            r.error.CopyFrom(wire.encode_error(error))
        self._send(peer, pb.EngineMessage(reply=r).SerializeToString())

    async def pull_metrics(self, timeout_s: float = 0.5) -> list[bytes]:
        """The metrics texts of every API process (and of those gone), fresh: each is asked
        and answers at once; one that does not within timeout_s counts with its last text."""
        self._pull_seq += 1
        seq, waiter = self._pull_seq, asyncio.Event()
        self._pull_waiters.append((seq, waiter))
        data = pb.EngineMessage(pull=pb.MetricsPull(seq=seq)).SerializeToString()
        for peer in list(self.peers.values()):
            self._send(peer, data)
        self._pulls_answered()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(waiter.wait(), timeout_s)
        self._pull_waiters = [(q, w) for q, w in self._pull_waiters if w is not waiter]
        return self.metrics_texts()

    def metrics_texts(self) -> list[bytes]:
        """The API processes' metrics as last received (those gone included)."""
        return [*self.retired_metrics.values(), *(p.metrics for p in self.peers.values())]

    def _pulls_answered(self) -> None:
        """Wake the scrapes every API process has answered."""
        done = min((p.pulled for p in self.peers.values()), default=self._pull_seq)
        for seq, waiter in self._pull_waiters:
            if seq <= done:
                waiter.set()

    # ----------------------------------------------------------------- incoming
    async def _recv_loop(self) -> None:
        while True:
            frames = await self.sock.recv_multipart(copy=False)
            ident = frames[0].bytes
            msg, why = wire.decode(frames[1:], pb.ApiMessage)
            peer = self.peers.get(ident)
            if msg is None:
                log.warning("dropped a malformed frame on the engine socket: %s", why)
                continue
            kind = msg.WhichOneof("kind")
            if kind == "hello":
                if peer is None:
                    peer = self.peers[ident] = ApiPeer(ident, msg.hello.api_id[:64],
                                                       frames[1].get(zmq.SRCFD))
                    self.retired_metrics.pop(peer.api_id, None)  # it reports them itself
                    log.info("API process %s connected", peer.api_id)
                peer.last_seen = time.monotonic()
                if msg.hello.metrics:  # (not in every hello)
                    peer.metrics = msg.hello.metrics
                    peer.pulled = max(peer.pulled, min(msg.hello.pull_seq, self._pull_seq))
                    self._pulls_answered()
                self._send(peer, self.state(peer))
            elif peer is None:
                log.warning("dropped a %s from a peer that has not said hello", kind)
            elif kind == "submit":
                self._on_submit(peer, msg.submit)
            elif kind == "abort":
                self._on_abort(peer, msg.abort)
            elif kind == "compile":
                asyncio.get_running_loop().create_task(self._compile(peer, msg.compile))
            elif kind == "lora_admin":
                asyncio.get_running_loop().create_task(self._lora_admin(peer, msg.lora_admin))

    async def _lora_admin(self, peer: ApiPeer, a: pb.LoraAdmin) -> None:
        """Load or unload a LoRA adapter; every API process hears the new list (the state)
        before the one that asked hears the answer."""
        try:
            await (self.engine.lora.load(a.name, a.path) if a.path else
                   self.engine.lora.unload(a.name))
        except EngineError as e:
            self._reply(peer, a.id, e)
            return
        except Exception as e:  # noqa: BLE001 (answered, never left waiting)
            log.exception("LoRA %s of %r failed", "load" if a.path else "unload", a.name)
            self._reply(peer, a.id, EngineError("INTERNAL", f"LoRA {a.name!r}: {e}"))
            return
        self.broadcast_state()
        self._reply(peer, a.id)

    def _on_submit(self, peer: ApiPeer, s: pb.Submit) -> None:
        if s.id in peer.by_local:
            return  # resent (the API process could not know that the first got through)
        info = self.engine.model_info()
        if why := wire.check_submit(s, info):
            log.warning("refused a request from API process %s: %s", peer.api_id, why)
            self._reply(peer, s.id, EngineError("INVALID_ARGUMENT", why))
            return
        if info is None or self.engine.scheduler is None:
            self._reply(peer, s.id, EngineError("UNAVAILABLE", NO_EXECUTOR, 1.0))
            return
        request = wire.decode_submit(s)
        if s.HasField("sibling_of"):
            # (0: completion 0 still compiles; None: it ended; either way no waiting for it)
            request = dataclasses.replace(
                request, sibling_of=peer.by_local.get(s.sibling_of) or None)
        if s.resubmitted:
            request = dataclasses.replace(request, resume_tokens=tuple(s.resume_tokens),
                                          resubmitted=True)
        if request.params.constraint is None:
            self._admit(peer, s.id, request, None)
        else:
            peer.by_local[s.id] = 0  # taken (a resend is ignored) while it compiles
            asyncio.get_running_loop().create_task(self._admit_constrained(peer, s.id, request))

    async def _admit_constrained(self, peer: ApiPeer, local: int, request) -> None:
        try:
            grammar = await self.engine.compile(request.params.constraint)
        except Exception as e:  # noqa: BLE001 (InvalidRequest; anything else is refused too)
            peer.by_local.pop(local, None)
            self._reply(peer, local, e if isinstance(e, InvalidRequest) else
                        InvalidRequest(f"sampling.{request.params.constraint.kind}", str(e)))
            return
        if self.peers.get(peer.ident) is not peer or peer.by_local.get(local) != 0:
            return  # it went away, or aborted it, meanwhile
        self._admit(peer, local, request, grammar)

    def _admit(self, peer: ApiPeer, local: int, request, grammar) -> None:
        try:
            rid = self.engine.submit(request, grammar)
        except EngineError as e:
            peer.by_local.pop(local, None)
            self._reply(peer, local, e)
            return
        except Exception as e:  # noqa: BLE001 (a request that passed check_submit and still
            # broke submit must not end the engine core, whose restart would meet it again)
            log.exception("refused a request from API process %s", peer.api_id)
            peer.by_local.pop(local, None)
            self._reply(peer, local, EngineError("INTERNAL", f"the engine refused it: {e}"))
            return
        peer.by_local[local] = rid
        self._owner[rid] = (peer, local)
        self._reply(peer, local)  # before any output of it: the same pipe keeps the order

    def _on_abort(self, peer: ApiPeer, a: pb.Abort) -> None:
        reasons = list(a.reasons) + ["abort"] * (len(a.ids) - len(a.reasons))
        for local, reason in zip(a.ids, reasons, strict=False):
            rid = peer.by_local.pop(local, None)
            if rid:
                self._owner.pop(rid, None)
                self.engine.abort(rid, reason if reason in _ABORT_REASONS else "abort")

    async def _compile(self, peer: ApiPeer, c: pb.Compile) -> None:
        if self.engine.grammars is None:
            self._reply(peer, c.id, EngineError("UNAVAILABLE", NO_EXECUTOR, 1.0))
            return
        try:
            await self.engine.compile(Constraint(c.constraint.kind, c.constraint.spec))
        except Exception as e:  # noqa: BLE001 (InvalidRequest; anything else is refused too)
            self._reply(peer, c.id, e if isinstance(e, InvalidRequest) else
                        InvalidRequest(f"sampling.{c.constraint.kind}", str(e)))
            return
        self._reply(peer, c.id)

    # ----------------------------------------------------------------- peers lost
    async def _disconnects(self, monitor: zmq.asyncio.Socket) -> None:
        while True:
            event = parse_monitor_message(await monitor.recv_multipart())
            for peer in list(self.peers.values()):
                if peer.fd == event["value"]:
                    self._drop(peer, "its connection closed")

    async def _watchdog(self) -> None:
        period = max(0.05, self.hello_timeout_s / 4)
        while True:
            await asyncio.sleep(period)
            now = time.monotonic()
            for peer in list(self.peers.values()):
                if now - peer.last_seen > self.hello_timeout_s:
                    self._drop(peer, f"no hello for {self.hello_timeout_s:g} s")

    def _drop(self, peer: ApiPeer, why: str) -> None:
        """An API process is gone: its requests end now (blocks freed before the next step)."""
        if self.peers.get(peer.ident) is not peer:
            return  # (already dropped; a new peer of that identity is not this one)
        del self.peers[peer.ident]
        if peer.metrics:
            self.retired_metrics[peer.api_id] = peer.metrics
        log.warning("API process %s lost (%s): aborting its %d requests", peer.api_id, why,
                    len(peer.by_local))
        for rid in peer.by_local.values():
            if rid:
                self._owner.pop(rid, None)
                self.engine.abort(rid, "abort")
        peer.by_local.clear()


_ABORT_REASONS = frozenset({"abort", "stop", "deadline_exceeded"})

