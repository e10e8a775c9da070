"""The executor link over a real ZeroMQ socket, with the test playing the executor's DEALER."""

from __future__ import annotations

import asyncio

import zmq
import zmq.asyncio

from pagedserve.protos.internal.v1 import executor_pb2 as pb
from pagedserve.scheduler.executor_link import ExecutorLink, LinkConfig, LinkDown
from pagedserve.scheduler.outputs import ScheduledRequest, SchedulerOutput
from pagedserve.scheduler.request import GenerationParams, Request

CAP = pb.Capacity(num_kv_blocks=8, block_size=4, max_model_len=32, vocab_size=100)


class Executor:
    """The far end: a DEALER that says hello and answers plans."""

    def __init__(self, address: str, executor_id: str) -> None:
        self.sock = zmq.asyncio.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)
        self.executor_id = executor_id

    async def hello(self) -> pb.SchedulerMessage:
        hello = pb.Hello(capacity=CAP, executor_id=self.executor_id)
        await self.sock.send(pb.ExecutorMessage(hello=hello).SerializeToString())
        return await self.recv()

    async def recv(self) -> pb.SchedulerMessage:
        return pb.SchedulerMessage.FromString(await asyncio.wait_for(self.sock.recv(), 5))

    async def answer(self, step_id: int, req_ids: list[int], tokens: list[int]) -> None:
        result = pb.StepResult(step_id=step_id, req_ids=req_ids, sampled_token_ids=tokens)
        await self.sock.send(pb.ExecutorMessage(result=result).SerializeToString())


def one_request_step(req: Request, start: int, n: int, blocks: list[int],
                     new: bool) -> SchedulerOutput:
    s = ScheduledRequest(req, n, start, blocks)
    return SchedulerOutput(new=[s]) if new else SchedulerOutput(cached=[s])


async def until(condition, timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.01)


def test_handshake_plans_results_and_a_silent_executor(tmp_path):
    async def main():
        address = f"ipc://{tmp_path}/link"
        link = ExecutorLink(address, LinkConfig(step_timeout_s=5, heartbeat_timeout_s=0.5))
        joined, lost = [], []
        link.attach(joined.append, lost.append)
        await link.start()
        ex = Executor(address, "exec-a")
        assert (await ex.hello()).welcome.executor_id == "exec-a"
        assert joined == [CAP] and link.connected.is_set() and link.capacity == CAP

        req = Request(7, "r", 3, [11, 12, 13], GenerationParams(max_tokens=4, temperature=0.5,
                                                                 seed=9))
        await link.send(1, one_request_step(req, 0, 3, [2], new=True))
        plan = (await ex.recv()).plan
        new = plan.new_requests[0]
        assert (plan.step_id, new.req_id, list(new.token_ids), new.num_computed_tokens,
                list(new.block_ids), list(plan.new_num_scheduled_tokens)) == \
            (1, 7, [11, 12, 13], 0, [2], [3])
        assert (new.sampling.temperature, new.sampling.has_seed, new.sampling.seed) == \
            (0.5, True, 9)

        # a result that arrives before the next step is sent stays queued for the engine
        await ex.answer(1, [7], [42])
        await until(lambda: link.results.qsize() == 1)
        req.token_ids.append(42)
        await link.send(2, one_request_step(req, 3, 1, [3], new=False))
        plan = (await ex.recv()).plan
        assert (list(plan.cached_req_ids), list(plan.cached_num_computed_tokens),
                list(plan.cached_num_scheduled_tokens), list(plan.cached_new_block_ids)) == \
            ([7], [3], [1], [3])
        first = link.results.get_nowait()
        assert (first.step_id, list(first.sampled_token_ids)) == (1, [42])
        await ex.answer(2, [7], [43])
        assert (await asyncio.wait_for(link.results.get(), 5)).step_id == 2

        # silence while idle: lost after heartbeat_timeout_s; a new executor is adopted
        await until(lambda: bool(lost))
        assert not link.connected.is_set() and "no heartbeat" in lost[0]
        down = link.results.get_nowait()
        assert isinstance(down, LinkDown) and down.generation == 1
        again = Executor(address, "exec-b")
        assert (await again.hello()).welcome.executor_id == "exec-b"
        assert link.connected.is_set() and link.generation == 3
        ex.sock.close()
        again.sock.close()
        await link.close()

    asyncio.run(main())


def test_a_step_left_unanswered_loses_the_executor_naming_the_step(tmp_path):
    async def main():
        address = f"ipc://{tmp_path}/link"
        link = ExecutorLink(address, LinkConfig(step_timeout_s=0.3, heartbeat_timeout_s=60))
        lost = []
        link.attach(lambda cap: None, lost.append)
        await link.start()
        ex = Executor(address, "exec-a")
        await ex.hello()
        req = Request(1, "r", 2, [5, 6], GenerationParams(max_tokens=4))
        await link.send(1, one_request_step(req, 0, 2, [0], new=True))
        down = await asyncio.wait_for(link.results.get(), 5)
        assert (down.timed_out_step, down.generation) == (1, 1)
        assert lost == ["step 1 took longer than 0.3 s"] and not link.connected.is_set()
        await ex.answer(1, [1], [9])  # too late: a lost executor's results are not taken
        await asyncio.sleep(0.1)
        assert link.results.empty()
        ex.sock.close()
        await link.close()

    asyncio.run(main())


def test_malformed_frames_are_dropped_and_the_adopted_executor_sending_one_is_lost(tmp_path):
    async def main():
        address = f"ipc://{tmp_path}/link"
        link = ExecutorLink(address, LinkConfig(step_timeout_s=5, heartbeat_timeout_s=60))
        lost = []
        link.attach(lambda cap: None, lost.append)
        tasks = await link.start()
        stranger = zmq.asyncio.Context.instance().socket(zmq.DEALER)
        stranger.setsockopt(zmq.LINGER, 0)
        stranger.connect(address)
        for frames in ([b"\x0a\xff\xff\xff\xff\x0f garbage"], [b"a", b"b"], [b""],
                       [pb.ExecutorMessage(hello=pb.Hello(executor_id="x")).SerializeToString()]):
            await stranger.send_multipart(frames)
        ex = Executor(address, "exec-a")
        assert (await ex.hello()).welcome.executor_id == "exec-a"  # the link still serves
        assert not any(t.done() for t in tasks) and lost == []
        req = Request(1, "r", 2, [5, 6], GenerationParams(max_tokens=4))
        await link.send(1, one_request_step(req, 0, 2, [0], new=True))
        await ex.recv()
        await ex.answer(1, [1, 2], [9])  # ids and tokens do not pair up
        down = await asyncio.wait_for(link.results.get(), 5)
        assert isinstance(down, LinkDown) and "malformed frame" in lost[0]
        assert not any(t.done() for t in tasks)
        stranger.close()
        ex.sock.close()
        await link.close()

    asyncio.run(main())


def test_results_from_any_peer_but_the_adopted_executor_are_ignored(tmp_path):
    async def main():
        address = f"ipc://{tmp_path}/link"
        link = ExecutorLink(address, LinkConfig(step_timeout_s=5, heartbeat_timeout_s=60))
        link.attach(lambda cap: None, lambda why: None)
        await link.start()
        stale, current = Executor(address, "before-restart"), Executor(address, "current")
        await stale.hello()
        link._lose("restarted")  # as a lost executor: the next hello is adopted
        link.results.get_nowait()  # its LinkDown
        assert (await current.hello()).welcome.executor_id == "current"
        req = Request(1, "r", 2, [5, 6], GenerationParams(max_tokens=4))
        await link.send(1, one_request_step(req, 0, 2, [0], new=True))
        await current.recv()
        await stale.answer(1, [1], [66])  # the old executor answers the step: dropped
        await asyncio.sleep(0.2)
        assert link.results.empty()
        await current.answer(1, [1], [7])
        got = await asyncio.wait_for(link.results.get(), 5)
        assert list(got.sampled_token_ids) == [7]
        stale.sock.close()
        current.sock.close()
        await link.close()

    asyncio.run(main())


PAUSABLE_EXECUTOR = """
import sys, time, zmq
from pagedserve.core.link_liveness import keep_alive
from pagedserve.protos.internal.v1 import executor_pb2 as pb
address, link_timeout, step_s = sys.argv[1], float(sys.argv[2]), float(sys.argv[3])
sock = zmq.Context.instance().socket(zmq.DEALER)
sock.setsockopt(zmq.LINGER, 0)
keep_alive(sock, link_timeout)
sock.connect(address)
cap = pb.Capacity(num_kv_blocks=8, block_size=4, max_model_len=32, vocab_size=100)
hello = pb.ExecutorMessage(hello=pb.Hello(capacity=cap, executor_id="exec-a"))
sock.send(hello.SerializeToString())
sock.recv()  # welcome
step = pb.SchedulerMessage.FromString(sock.recv()).plan.step_id
print("step", step, flush=True)
start = time.monotonic()
while time.monotonic() - start < step_s:  # a long step that holds the GIL throughout
    pass
result = pb.StepResult(step_id=step, req_ids=[1], sampled_token_ids=[9])
sock.send(pb.ExecutorMessage(result=result).SerializeToString())
while True:  # then idle, saying hello as the real executor does
    sock.send(hello.SerializeToString())
    if sock.poll(200):
        sock.recv()
"""


def test_heartbeats_keep_a_busy_executor_and_drop_a_stopped_one_within_the_link_timeout(
        tmp_path, caplog):
    """A real process: its Python thread busy in a step for 3 link timeouts is not lost
    (libzmq answers the heartbeats); SIGSTOPped, it is lost within 1.25 link timeouts
    although a step is in flight and the step and idle timeouts are a minute; after SIGCONT
    its late result is dropped and its next hello adopts it afresh."""
    import signal
    import subprocess
    import sys
    import time

    timeout = 0.4

    async def main():
        address = f"ipc://{tmp_path}/link"
        link = ExecutorLink(address, LinkConfig(step_timeout_s=60, heartbeat_timeout_s=60,
                                                link_timeout_s=timeout))
        joined, lost = [], []
        link.attach(joined.append, lost.append)
        await link.start()
        peer = subprocess.Popen([sys.executable, "-c", PAUSABLE_EXECUTOR, address,
                                 str(timeout), "3.0"], stdout=subprocess.PIPE, text=True)
        try:
            await until(lambda: link.connected.is_set(), 30)
            req = Request(1, "r", 2, [5, 6], GenerationParams(max_tokens=4))
            await link.send(1, one_request_step(req, 0, 2, [0], new=True))
            assert await asyncio.to_thread(peer.stdout.readline) == "step 1\n"
            await asyncio.sleep(3 * timeout)
            assert link.connected.is_set() and lost == []  # busy, but heartbeats answered

            peer.send_signal(signal.SIGSTOP)
            stopped = time.monotonic()
            await until(lambda: bool(lost), 10)
            noticed = time.monotonic() - stopped
            assert noticed < 1.25 * timeout + 0.25, noticed
            assert lost == [f"its connection closed (the process died, or sent nothing, not "
                            f"even a heartbeat, for {timeout:g} s)"]
            assert isinstance(link.results.get_nowait(), LinkDown)

            await asyncio.sleep(3.0 - 6 * timeout)  # its step is over when it resumes
            peer.send_signal(signal.SIGCONT)
            await until(lambda: len(joined) == 2, 10)  # its hello after the late result
            assert link.connected.is_set() and link.results.empty()
            assert "dropped the result of step 1 from a peer that is not the adopted " \
                   "executor" in caplog.text
        finally:
            peer.send_signal(signal.SIGCONT)
            peer.kill()
            peer.wait()
        await link.close()

    asyncio.run(main())


def test_a_result_whose_logprobs_do_not_fit_together_is_refused():
    from zmq import Frame

    from pagedserve.scheduler.executor_link import decode_executor_message

    cap = pb.Capacity(vocab_size=100)

    def why(**fields):
        result = pb.StepResult(step_id=1, req_ids=[1, 2], sampled_token_ids=[5, 6], **fields)
        frame = Frame(pb.ExecutorMessage(result=result).SerializeToString())
        return decode_executor_message([frame], cap)[1]

    good = dict(logprob_rows=[0, 1], sampled_logprobs=[-0.1, -2.0], num_top_logprobs=[2, 0],
                top_logprob_token_ids=[5, 7], top_logprobs=[-0.1, -3.0])
    assert why(**good) == ""
    assert why(**{**good, "logprob_rows": [0]}) == "a result whose logprob rows do not pair up"
    assert why(**{**good, "logprob_rows": [0, 2]}).startswith("a result with logprob rows outside")
    assert why(**{**good, "logprob_rows": [1, 0]}).startswith("a result with logprob rows outside")
    assert why(**{**good, "num_top_logprobs": [3, 0]}) == ("a result whose top logprobs do not "
                                                           "add up")
    assert why(**{**good, "top_logprob_token_ids": [5, 100]}) == ("a result with a logprob token "
                                                                  "outside the vocabulary")


def test_a_result_whose_draft_proposals_do_not_fit_together_is_refused():
    from zmq import Frame

    from pagedserve.scheduler.executor_link import decode_executor_message

    def why(**fields):
        result = pb.StepResult(step_id=1, req_ids=[1], sampled_token_ids=[5], **fields)
        frame = Frame(pb.ExecutorMessage(result=result).SerializeToString())
        return decode_executor_message([frame], pb.Capacity(vocab_size=100))[1]

    good = dict(draft_req_ids=[1, 2], num_draft_tokens=[2, 1], draft_token_ids=[5, 6, 7])
    assert why(**good) == "" and why() == ""
    bad = "a result whose draft proposals do not add up"
    for fields in (dict(draft_token_ids=[3]), dict(num_draft_tokens=[1]),
                   {**good, "num_draft_tokens": [2, 2]}, {**good, "draft_req_ids": [1, 1]},
                   {**good, "num_draft_tokens": [4, -1]}):
        assert why(**fields) == bad, fields
    assert why(**{**good, "draft_token_ids": [5, 6, 100]}) == ("a result with a draft token "
                                                               "outside the vocabulary")


def test_a_result_whose_prompt_logprobs_do_not_fit_together_is_refused():
    from zmq import Frame

    from pagedserve.scheduler.executor_link import decode_executor_message
    from pagedserve.scheduler.outputs import TokenLogprob, prompt_logprobs_of

    cap = pb.Capacity(vocab_size=100)

    def result(**fields):
        return pb.StepResult(step_id=1, **fields)

    def why(**fields):
        frame = Frame(pb.ExecutorMessage(result=result(**fields)).SerializeToString())
        return decode_executor_message([frame], cap)[1]

    # request 7: tokens 1 and 2 with 1 alternative each; request 9: token 5, none
    good = dict(prompt_logprob_req_ids=[7, 9], prompt_logprob_starts=[1, 5],
                prompt_logprob_counts=[2, 1], prompt_logprob_ks=[1, 0],
                prompt_logprob_ints=[3, 40, 1, 41, 100], prompt_logprob_floats=[
                    -2.0, -0.5, -0.25, -0.25, -9.0])
    assert why(**good) == ""
    assert prompt_logprobs_of(result(**good)) == [
        (7, 1, [TokenLogprob(-2.0, (40,), (-0.5,), 3), TokenLogprob(-0.25, (41,), (-0.25,), 1)]),
        (9, 5, [TokenLogprob(-9.0, (), (), 100)])]
    assert why(**{**good, "prompt_logprob_ks": [1]}) == ("a result whose prompt logprob "
                                                         "requests do not pair up")
    assert why(**{**good, "prompt_logprob_starts": [0, 5]}).startswith(
        "a result with prompt logprobs before the second token")
    assert why(**{**good, "prompt_logprob_counts": [3, 1]}) == ("a result whose prompt "
                                                                "logprobs do not add up")
    assert why(**{**good, "prompt_logprob_ints": [3, 40, 1, 141, 100]}) == (
        "a result with a prompt logprob token outside the vocabulary")
