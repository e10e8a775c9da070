"""The executor process: connects to the scheduler over ZeroMQ and runs the steps it plans."""

from __future__ import annotations

import argparse
import contextlib
import logging
import signal
import sys
import time
import traceback
import uuid
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import zmq

from pagedserve.core.collector import freeze_long_lived
from pagedserve.core.link_liveness import keep_alive
from pagedserve.core.link_security import (
    KeyPair,
    LinkSecurityError,
    check_exposure,
    load_keypair,
    load_public_key,
)
from pagedserve.core.readiness import EXIT_CONFIG, mark_ready
from pagedserve.executor.checkpoint import CheckpointFilesError
from pagedserve.executor.draft import DraftModelError
from pagedserve.executor.families import UnsupportedModelError
from pagedserve.executor.jit_watch import JitWatch
from pagedserve.executor.lora import LoraError
from pagedserve.executor.profiling import StepProfiler
from pagedserve.executor.quantization.config import QuantizationError
from pagedserve.executor.runner import Bitmask, Launched
from pagedserve.executor.step_clock import PhaseClock, take
from pagedserve.executor.worker import MemoryBudgetError, Worker, executor_config
from pagedserve.protos.internal.v1 import executor_pb2 as pb

log = logging.getLogger("pagedserve.executor")
HELLO_INTERVAL_S = 1.0  # resend hello until welcomed, and as a heartbeat while idle


class ExecutorServer:
    def __init__(self, worker: Worker, scheduler_address: str,
                 profiler: StepProfiler | None = None, key: KeyPair | None = None,
                 scheduler_key: bytes = b"", link_timeout_s: float = 2.0) -> None:
        """key and scheduler_key: this executor's CURVE key pair and the scheduler's public
        key (pagedserve.core.link_security); both or neither. link_timeout_s: ZeroMQ
        heartbeats (pagedserve.core.link_liveness)."""
        self.worker = worker
        self.profiler = profiler
        self.executor_id = uuid.uuid4().hex
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        keep_alive(self.sock, link_timeout_s)
        if key is not None:
            self.sock.curve_secretkey, self.sock.curve_publickey = key.secret, key.public
            self.sock.curve_serverkey = scheduler_key
        self.sock.connect(scheduler_address)
        self.stopping = False
        self._refused = False  # told once in the log
        self._launched: tuple[int, Launched, float] | None = None
        self._held: list | None = None  # a message's frames received while awaiting a bitmask
        self.clock = PhaseClock()  # host time by phase, sent with each result
        # LoRA adapters added at run time, read on a thread of their own so that steps go on
        # meanwhile: each one's update and read, held once done (_take_lora_reads)
        self._lora_reads: dict[int, tuple[pb.LoraUpdate, Future]] = {}
        self._reader: ThreadPoolExecutor | None = None
        self._last_hello = 0.0

    def _hello(self) -> None:
        self._last_hello = time.monotonic()
        hello = pb.Hello(capacity=self.worker.capacity, executor_id=self.executor_id)
        self.sock.send(pb.ExecutorMessage(hello=hello).SerializeToString())

    def serve_forever(self) -> None:
        # A launched step whose tokens are not read yet (self._launched): its result goes out
        # once the next plan (if one is already waiting: async scheduling) has been launched
        # behind it, so the device never waits for this process to build the next step's
        # inputs; or, when that plan waits for its token bitmasks, before the wait (the
        # scheduler needs that result to fill them).
        self._hello()
        while not self.stopping:
            if self._lora_reads:
                self._take_lora_reads()
            if self._held is None and not self._message_waiting():
                if self._launched is not None:
                    self._send_launched()
                elif time.monotonic() - self._last_hello >= HELLO_INTERVAL_S:
                    self._hello()
                continue
            if self._held is not None:
                msg, self._held = _decode(self._held[0]), None
            else:
                with self._phase("recv"):
                    msg = _decode(self._recv()[0])
            if msg is not None:
                self._handle(msg)
        self.sock.close()

    def _message_waiting(self) -> bool:
        """Whether a message came; with a step launched, see _next_message_first; without,
        whether one came within the hello interval (the wait counts as idle)."""
        if self._launched is not None:
            with self._phase("wait"):
                return self._next_message_first()
        with self._phase("idle"):  # (while adapters are read, short polls: each is held soon)
            return bool(self.sock.poll(20 if self._lora_reads else
                                       int(HELLO_INTERVAL_S * 1000)))

    def _next_message_first(self) -> bool:
        """With a step launched and its tokens not read: whether a message (the next plan,
        under async scheduling) arrives before the device finishes the step. A plan that does
        is launched behind the running step, so the device does not idle while this process
        builds it; tokens that are ready first go out at once, since the scheduler may be
        waiting for them to plan. Reading the tokens at once instead waited for the device and
        left it idle for every next step's launch. On the CPU a step has run by the end of its
        launch: its tokens go out at once (launching a waiting plan first would hold them for
        the whole next step)."""
        launched = self._launched[1]
        ready = launched.ready  # on CUDA None only with nothing to read back (prompt logprobs)
        if ready is None and not launched.tokens.is_cuda:
            return False
        while True:
            if self.sock.poll(0):
                return True
            if ready is None or ready.query() or self.stopping:
                return bool(self.sock.poll(0))

    def _handle(self, msg: pb.SchedulerMessage) -> None:
        kind = msg.WhichOneof("kind")
        if kind == "refuse":
            if not self._refused:
                log.warning("the scheduler refused this executor: %s; saying hello until "
                            "it is adopted", msg.refuse.reason)
                self._refused = True
        elif kind == "welcome":
            self._launched = None  # a new scheduler session: whatever ran is forgotten
            self._lora_reads.clear()  # (reads it asked for: it asks again for what it serves)
            self.worker.runner.reset()
            self.clock = PhaseClock()
            log.info("joined scheduler")
        elif kind == "plan":
            self._run_plan(msg.plan)
        elif kind == "lora_update":
            self._update_lora(msg.lora_update)
        elif kind == "bitmask":  # of a step that failed before it waited for it
            log.debug("dropped the bitmask of step %d, not awaited", msg.bitmask.step_id)

    def _update_lora(self, u: pb.LoraUpdate) -> None:
        """Add or remove a LoRA adapter at run time; the scheduler hears how it went. An
        adapter to add is read on a thread of its own (steps go on meanwhile) and held by the
        loop once read (_take_lora_reads), or before a plan that loads it into a slot."""
        lora = self.worker.runner.lora
        try:
            if lora is None:
                raise LoraError("this executor was started without --enable-lora")
            if u.remove:
                self._lora_reads.pop(u.adapter_id, None)
                lora.remove(u.adapter_id)
            else:
                if u.adapter_id in lora.host.sources or u.adapter_id in self._lora_reads:
                    raise LoraError(f"LoRA adapter id {u.adapter_id} is in use")
                if self._reader is None:
                    self._reader = ThreadPoolExecutor(1, thread_name_prefix="lora-read")
                lora.begin_read(u.adapter_id, u.name, u.path)
                self._lora_reads[u.adapter_id] = (u, self._reader.submit(lora.read, u.name,
                                                                         u.path))
                return
        except LoraError as e:
            return self._lora_updated(u, str(e))
        except Exception as e:  # noqa: BLE001 (whatever a file provokes: refused, not fatal)
            return self._lora_updated(u, f"LoRA adapter {u.name!r}: {type(e).__name__}: {e}")
        self._lora_updated(u, "")

    def _take_lora_reads(self, waiting: set[int] | frozenset = frozenset()) -> None:
        """Hold the adapters whose reads are done (and wait for those in `waiting`: a plan
        loads them); the scheduler hears how each went."""
        for adapter_id, (u, read) in list(self._lora_reads.items()):
            if not read.done() and adapter_id not in waiting:
                continue
            del self._lora_reads[adapter_id]
            lora = self.worker.runner.lora
            try:
                lora.add(u.adapter_id, u.name, u.path, read.result())
                log.info("LoRA adapter %r (id %d) added from %s", u.name, u.adapter_id, u.path)
            except Exception as e:  # noqa: BLE001 (as in _update_lora)
                if u.adapter_id not in lora.host.sources:  # tensor parallelism: followers
                    lora.remove(u.adapter_id)  # drop their read of it
                self._lora_updated(u, str(e) if isinstance(e, LoraError) else
                                   f"LoRA adapter {u.name!r}: {type(e).__name__}: {e}")
            else:
                self._lora_updated(u, "")

    def _lora_updated(self, u: pb.LoraUpdate, error: str) -> None:
        self.sock.send(pb.ExecutorMessage(lora_updated=pb.LoraUpdated(
            adapter_id=u.adapter_id, error=error)).SerializeToString())

    def _run_plan(self, plan: pb.StepPlan) -> None:
        start = time.perf_counter()
        if self.profiler is not None:
            self.profiler.step()
        if plan.after_idle:  # the scheduler had no work: that wait is not the loop's pace
            self.clock.forget("idle")
        if self._lora_reads and plan.lora_loads:
            self._take_lora_reads({load.adapter_id for load in plan.lora_loads})
        try:
            with self._phase("launch"):
                nxt = self.worker.runner.launch(plan, lambda: self._await_bitmask(plan.step_id))
        except Abandoned:
            return  # the scheduler gave this step up (lost this executor, or took another)
        except Exception as e:  # report, keep serving: the scheduler aborts the step
            self._send_launched()
            self._send(self._failed(plan.step_id, e))
            return
        self._send_launched()
        if nxt is None:  # nothing samples (prefill chunks only): answer at once
            self._send(self._result(plan.step_id, [], [], start, graphed=False))
        else:
            self._launched = (plan.step_id, nxt, start)

    def _send_launched(self) -> None:
        if self._launched is not None:
            launched, self._launched = self._launched, None
            self._send(self._finish(*launched))

    def _await_bitmask(self, step_id: int) -> Bitmask:
        """Called by the runner between a step's forward pass and its sampling: the result of
        the step before goes out (the masks may depend on its tokens), then this waits for
        the step's StepBitmask. While waiting it says hello every second, as when idle: a
        scheduler that gave the step up (step timeout) adopts this executor again and its
        welcome ends the wait, as does a refusal (Abandoned). A plan arriving first is the
        scheduler's error: this step fails, and the plan runs next."""
        self._send_launched()
        with self._phase("bitmask"):
            while True:
                if self.stopping:
                    raise Abandoned
                if not self.sock.poll(int(HELLO_INTERVAL_S * 1000)):
                    self._hello()
                    continue
                frames = self._recv()
                if (msg := _decode(frames[0])) is None:
                    continue
                kind = msg.WhichOneof("kind")
                if kind == "bitmask":
                    if msg.bitmask.step_id == step_id:
                        return Bitmask.of(msg.bitmask, frames[1] if len(frames) > 1 else None)
                    log.debug("dropped the bitmask of step %d while awaiting step %d's",
                              msg.bitmask.step_id, step_id)
                    continue
                if kind == "lora_update":  # (an admin's, sent between the plan and its mask)
                    self._update_lora(msg.lora_update)
                    continue
                self._held = frames
                if kind == "plan":
                    raise ValueError(f"step {msg.plan.step_id}'s plan arrived before step "
                                     f"{step_id}'s token bitmask")
                raise Abandoned

    def _recv(self) -> list:
        """One message's frames: its SchedulerMessage, then for a StepBitmask the mask rows as
        a frame of their own (a buffer over ZeroMQ's memory, not copied)."""
        frames = self.sock.recv_multipart(copy=False)
        return [frames[0].bytes, *(f.buffer for f in frames[1:2])]

    def _send(self, result: pb.StepResult) -> None:
        with self._phase("send"):
            result.time.CopyFrom(take(self.clock, self.worker.runner.device_time))
            self.sock.send(pb.ExecutorMessage(result=result).SerializeToString())

    @contextlib.contextmanager
    def _phase(self, name: str) -> Iterator[None]:
        """Host time of one phase (step_clock.HOST_PHASES), also marked in a torch profile."""
        with self.clock.phase(name):
            if self.profiler is None:
                yield
            else:
                with self.profiler.phase(name):
                    yield

    def _finish(self, step_id: int, launched: Launched, start: float) -> pb.StepResult:
        try:
            with self._phase("finish"):
                req_ids, tokens = self.worker.runner.finish(launched)
        except Exception as e:
            return self._failed(step_id, e)
        result = self._result(step_id, req_ids, tokens, start, launched.graphed)
        if launched.proposals is not None:
            (result.draft_req_ids[:], result.num_draft_tokens[:],
             result.draft_token_ids[:]) = launched.proposals
        if (lp := launched.logprobs) is not None:
            result.logprob_rows[:], result.sampled_logprobs[:] = lp.rows, lp.sampled
            result.num_top_logprobs[:], result.top_logprob_token_ids[:] = lp.num_top, lp.top_ids
            result.top_logprobs[:] = lp.top_logprobs
        if launched.prompt is not None and launched.prompt_read is not None:
            rows = launched.prompt.rows
            result.prompt_logprob_req_ids[:], result.prompt_logprob_starts[:] = \
                rows.req_ids, rows.starts
            result.prompt_logprob_counts[:], result.prompt_logprob_ks[:] = rows.counts, rows.ks
            result.prompt_logprob_ints[:], result.prompt_logprob_floats[:] = launched.prompt_read
        return result

    @staticmethod
    def _failed(step_id: int, e: Exception) -> pb.StepResult:
        log.error("step %d failed:\n%s", step_id, traceback.format_exc())
        return pb.StepResult(step_id=step_id, error=f"{type(e).__name__}: {e}")

    def _result(self, step_id: int, req_ids: list[int], tokens: list[int], start: float,
                graphed: bool) -> pb.StepResult:
        used, total = self.worker.memory()
        return pb.StepResult(step_id=step_id, req_ids=req_ids, sampled_token_ids=tokens,
                             execute_seconds=time.perf_counter() - start,
                             device_memory_used_bytes=used, device_memory_total_bytes=total,
                             execution_mode=pb.EXECUTION_MODE_CUDA_GRAPH if graphed
                             else pb.EXECUTION_MODE_EAGER)


class Abandoned(Exception):
    """The scheduler will not send the bitmask a step waits for: drop the step unanswered."""


def _decode(data: bytes) -> pb.SchedulerMessage | None:
    try:
        return pb.SchedulerMessage.FromString(data)
    except Exception as e:  # the scheduler's socket is the only peer; never crash on it
        log.warning("dropped a malformed frame from the scheduler: %s", e)
        return None


def _link_keys(args: argparse.Namespace) -> tuple[KeyPair | None, bytes]:
    """This executor's key pair and the scheduler's public key, or none (then the scheduler's
    address must be on this host unless --insecure-executor-link)."""
    if bool(args.executor_key) != bool(args.scheduler_public_key):
        raise LinkSecurityError("give both --executor-key and --scheduler-public-key, or neither")
    check_exposure(args.scheduler_address, bool(args.executor_key), args.insecure_executor_link)
    if not args.executor_key:
        return None, b""
    return load_keypair(args.executor_key), load_public_key(args.scheduler_public_key)


def run(args: argparse.Namespace) -> None:
    try:
        keys = _link_keys(args)  # before the model loads: a key problem fails at once
    except LinkSecurityError as e:
        raise SystemExit(f"pagedserve executor: {e}") from None

    if args.tensor_parallel_size < 1:
        raise SystemExit(f"pagedserve executor: --tensor-parallel-size must be at least 1, got "
                         f"{args.tensor_parallel_size}")
    group = None
    if args.tensor_parallel_size > 1:  # followers start loading while this process does
        from pagedserve.executor.distributed import Group

        try:
            group = Group(args, args.tensor_parallel_size)
        except ValueError as e:
            raise SystemExit(f"pagedserve executor: {e}") from None
    try:
        worker = Worker(executor_config(args, 0, args.tensor_parallel_size,
                                        str(group.device) if group else args.device))
        if group is not None:
            group.lead(worker)
        worker.warm_up()
    except (MemoryBudgetError, DraftModelError, LoraError, UnsupportedModelError,
            QuantizationError, CheckpointFilesError) as e:
        # the same settings fail the same way: no restart
        print(f"pagedserve executor: {e}", file=sys.stderr, flush=True)
        sys.exit(EXIT_CONFIG)
    mark_ready()
    if worker.device.type == "cuda":
        JitWatch().install()
    profiler = (StepProfiler(args.torch_profile_dir, args.torch_profile_steps)
                if args.torch_profile_dir else None)
    server = ExecutorServer(worker, args.scheduler_address, profiler, *keys,
                            link_timeout_s=args.executor_link_timeout_s)

    def stop(*_: object) -> None:
        server.stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    log.info("executor %s connecting to %s", server.executor_id, args.scheduler_address)
    freeze_long_lived()  # torch, the model's modules, the warm-up's leftovers
    server.serve_forever()
    if group is not None:
        group.stop()


