"""The executor process's message loop against a real ZeroMQ ROUTER (the test is the
scheduler): token bitmasks that follow their plan (structured outputs), including one that
never comes, a malformed one and a plan that overtakes one."""

from __future__ import annotations

import contextlib
import threading

import numpy as np
import pytest
import zmq

from pagedserve.executor.server import HELLO_INTERVAL_S, ExecutorServer
from pagedserve.executor.worker import ExecutorConfig, Worker
from pagedserve.protos.internal.v1 import executor_pb2 as pb
from tests.executor_svc.test_model_gpu import save_random_llama

WORDS = 4096 // 32  # the d64 model's vocabulary


class Scheduler:
    """The scheduler's end: a ROUTER the executor under test connects to."""

    def __init__(self) -> None:
        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.ident = b""

    def recv(self, timeout_s: float = 30.0) -> pb.ExecutorMessage | None:
        if not self.sock.poll(int(timeout_s * 1000)):
            return None
        self.ident, data = self.sock.recv_multipart()
        return pb.ExecutorMessage.FromString(data)

    def result(self, timeout_s: float = 30.0) -> pb.StepResult | None:
        """The next result, skipping hellos."""
        while (msg := self.recv(timeout_s)) is not None:
            if msg.WhichOneof("kind") == "result":
                return msg.result
        return None

    def send(self, msg: pb.SchedulerMessage | bytes) -> None:
        data = msg if isinstance(msg, bytes) else msg.SerializeToString()
        self.sock.send_multipart([self.ident, data])

    def send_mask_frame(self, mask: pb.SchedulerMessage) -> None:
        """As the scheduler's link sends a mask: its rows as a frame after the message."""
        bits = mask.bitmask.token_bitmask
        mask.bitmask.token_bitmask = b""
        self.sock.send_multipart([self.ident, mask.SerializeToString(), bits])

    def welcome(self) -> None:
        while (msg := self.recv()).WhichOneof("kind") != "hello":
            pass
        self.send(pb.SchedulerMessage(welcome=pb.Welcome(executor_id=msg.hello.executor_id)))


@contextlib.contextmanager
def serving(worker):
    """The worker's ExecutorServer on a thread, joined to a test Scheduler (welcomed), stopped
    at the end."""
    sched = Scheduler()
    server = ExecutorServer(worker, f"tcp://127.0.0.1:{sched.port}")
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        sched.welcome()
        yield sched
    finally:
        server.stopping = True
        thread.join(10)
        sched.sock.close()


@pytest.fixture(scope="module")
def link(tmp_path_factory):
    path = tmp_path_factory.mktemp("d64")
    save_random_llama(path, "d64")
    with serving(Worker(ExecutorConfig(model=str(path), device="cpu",
                                       num_kv_blocks=16))) as sched:
        yield sched


def new(step_id: int, req_id: int, blocks: list[int], bitmask_follows: bool) -> pb.StepPlan:
    plan = pb.StepPlan(step_id=step_id, bitmask_follows=bitmask_follows)
    plan.new_requests.add(req_id=req_id, token_ids=[5, 6, 7], block_ids=blocks,
                          sampling=pb.Sampling(temperature=0.0, top_p=1.0))
    plan.new_num_scheduled_tokens.append(3)
    return pb.SchedulerMessage(plan=plan)


def decode(step_id: int, req_id: int, computed: int) -> pb.SchedulerMessage:
    return pb.SchedulerMessage(plan=pb.StepPlan(
        step_id=step_id, cached_req_ids=[req_id], cached_num_computed_tokens=[computed],
        cached_num_scheduled_tokens=[1], cached_num_new_blocks=[0], bitmask_follows=True))


def only(step_id: int, req_id: int, token: int) -> pb.SchedulerMessage:
    """A bitmask allowing one token."""
    bits = np.zeros(WORDS, np.int32)
    bits[token // 32] = np.int32(np.uint32(1 << token % 32).view(np.int32))
    return pb.SchedulerMessage(bitmask=pb.StepBitmask(step_id=step_id, req_ids=[req_id],
                                                      token_bitmask=bits.tobytes()))


def test_the_mask_is_awaited_after_the_previous_result_goes_out(link):
    link.send(new(1, 1, [0], bitmask_follows=False))
    link.send(decode(2, 1, 3))  # async scheduling: planned before step 1's token is back
    first = link.result()
    assert (first.step_id, list(first.req_ids), first.error) == (1, [1], "")
    assert link.result(timeout_s=0.3) is None  # step 2 waits for its mask
    link.send_mask_frame(only(1, 1, 99))  # a stale one (of a step not awaited) is dropped
    link.send_mask_frame(only(2, 1, 4000))  # bit 31 of its word: the sign bit
    second = link.result()
    assert (second.step_id, list(second.sampled_token_ids), second.error) == (2, [4000], "")
    link.send(pb.SchedulerMessage(plan=pb.StepPlan(step_id=3, finished_req_ids=[1])))
    assert link.result().step_id == 3  # (nothing to run: answered at once)


def test_a_mask_that_never_comes_keeps_the_executor_saying_hello_until_welcomed(link):
    link.send(new(10, 2, [1], bitmask_follows=True))
    hello = link.recv(timeout_s=3 * HELLO_INTERVAL_S)
    assert hello is not None and hello.WhichOneof("kind") == "hello"
    link.send(pb.SchedulerMessage(welcome=pb.Welcome(executor_id=hello.hello.executor_id)))
    # the step is dropped unanswered, its state with it: the same request is new again
    link.send(new(11, 2, [1], bitmask_follows=True))
    link.send(only(11, 2, 17))
    got = link.result()
    assert (got.step_id, list(got.sampled_token_ids), got.error) == (11, [17], "")
    link.send(pb.SchedulerMessage(plan=pb.StepPlan(step_id=12, finished_req_ids=[2])))
    assert link.result().step_id == 12  # (nothing to run: answered at once)


def test_a_malformed_mask_fails_its_step(link):
    link.send(new(20, 3, [2], bitmask_follows=True))
    link.send(b"\xff\xff\xff")  # not a message at all: dropped, still waiting
    bad = only(20, 3, 1)
    bad.bitmask.token_bitmask = bad.bitmask.token_bitmask[:-2]  # not whole words
    link.send(bad)
    got = link.result()
    assert (got.step_id, list(got.req_ids)) == (20, [])
    assert got.error == f"ValueError: token_bitmask: {4 * WORDS - 2} bytes for 1 rows of " \
                        f"1 to {WORDS} words"
    link.send(new(21, 3, [2], bitmask_follows=True))  # the same, the rows as a frame
    bad = only(21, 3, 1)
    bad.bitmask.token_bitmask = bad.bitmask.token_bitmask + b"\0" * 4  # wider than the vocab
    link.send_mask_frame(bad)
    got = link.result()
    assert got.error == f"ValueError: token_bitmask: {4 * WORDS + 4} bytes for 1 rows of " \
                        f"1 to {WORDS} words"


def test_a_plan_before_the_awaited_mask_fails_that_step_and_then_runs(link):
    link.send(new(30, 4, [3], bitmask_follows=True))
    link.send(new(31, 5, [4], bitmask_follows=False))
    failed = link.result()
    assert (failed.step_id, failed.error) == (
        30, "ValueError: step 31's plan arrived before step 30's token bitmask")
    ran = link.result()
    assert (ran.step_id, list(ran.req_ids), ran.error) == (31, [5], "")


class DeviceStep:
    """A launched step's completion event, under the test's control (a CUDA event's part)."""

    def __init__(self) -> None:
        self.done = False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.done = True


def test_a_plan_that_comes_while_the_device_runs_is_launched_before_the_tokens_are_read(
        tmp_path):
    """Async scheduling on a device: while step 1 still runs, the executor waits for the next
    plan or step 1's end, whichever first. Plan 2 comes first, so it is launched behind step 1
    (the device need not idle while the host builds it) and only then is step 1's result read
    and sent; step 2's result waits for its own end."""
    save_random_llama(tmp_path, "d64")
    worker = Worker(ExecutorConfig(model=str(tmp_path), device="cpu", num_kv_blocks=16))
    runner, order, steps = worker.runner, [], {}
    launch, finish = runner.launch, runner.finish

    def launching(plan, *args):
        launched = launch(plan, *args)
        launched.host_tokens, launched.ready = launched.tokens, DeviceStep()
        steps[plan.step_id] = launched.ready
        order.append(("launch", plan.step_id))
        return launched

    def finishing(launched):
        order.append(("read", next(s for s, e in steps.items() if e is launched.ready)))
        return finish(launched)

    runner.launch, runner.finish = launching, finishing
    with serving(worker) as sched:
        sched.send(new(1, 1, [0], bitmask_follows=False))
        assert sched.result(timeout_s=0.5) is None  # step 1 runs and no plan came: it waits
        plan2 = decode(2, 1, 3)
        plan2.plan.bitmask_follows = False
        sched.send(plan2)
        first = sched.result()
        assert first.step_id == 1 and len(first.sampled_token_ids) == 1
        assert order == [("launch", 1), ("launch", 2), ("read", 1)]
        assert sched.result(timeout_s=0.5) is None  # step 2 still runs
        steps[2].done = True
        second = sched.result()
        assert second.step_id == 2 and order[-1] == ("read", 2)


def test_an_adapter_added_at_run_time_is_read_while_steps_go_on(tmp_path):
    """The read of a LoRA adapter added at run time (held here until released) does not hold
    up the steps planned meanwhile; a plan that loads the adapter into a slot waits for it,
    and the scheduler hears it is added before that step's result."""
    from pagedserve.core.lora import LoraConfig
    from tests.executor_svc.test_lora_adapters import write_adapter

    hf = save_random_llama(tmp_path / "d64", "d64")
    one = write_adapter(tmp_path / "one", hf, 1, 8, ["q_proj", "down_proj"], 16)
    worker = Worker(ExecutorConfig(model=str(tmp_path / "d64"), device="cpu", num_kv_blocks=16,
                                   lora=LoraConfig((), 1, 8)))
    lora, release = worker.runner.lora, threading.Event()
    read = lora.read
    lora.read = lambda name, path: release.wait(30) and read(name, path)
    with serving(worker) as sched:
        try:
            sched.send(pb.SchedulerMessage(lora_update=pb.LoraUpdate(adapter_id=1, name="one",
                                                                     path=str(one))))
            sched.send(new(1, 1, [0], bitmask_follows=False))
            assert sched.result().req_ids == [1]  # stepped while the read is held
            plan = new(2, 2, [1], bitmask_follows=False)
            plan.plan.lora_loads.add(slot=1, adapter_id=1)
            plan.plan.new_requests[0].lora_slot, plan.plan.new_requests[0].lora_adapter = 1, 1
            sched.send(plan)
            early = sched.recv(0.5)  # the step waits for the read: a hello at most
            assert early is None or early.WhichOneof("kind") == "hello"
            release.set()
            kinds = []
            while len(kinds) < 2:
                msg = sched.recv()
                if msg.WhichOneof("kind") != "hello":
                    kinds.append(msg.WhichOneof("kind"))
                    if kinds[-1] == "lora_updated":
                        assert (msg.lora_updated.adapter_id, msg.lora_updated.error) == (1, "")
                    else:
                        assert list(msg.result.req_ids) == [2] and not msg.result.error
            assert kinds == ["lora_updated", "result"]
            assert lora.slots.holds[1] == 1
        finally:
            release.set()  # before the server stops: its loop may wait for the read
