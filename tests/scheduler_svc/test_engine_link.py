"""The engine socket end to end in one event loop: EngineHost (the engine core's ROUTER) over a
stand-in engine, and RemoteEngineClient (an API process's DEALER), over a real ipc:// socket.
Outputs reach the subscriber in order even when they come before submit() has returned;
aborts reach the engine with their reason; an API process gone has its requests aborted; a new
engine core gets every accepted request again with its tokens so far; an abort during a
grammar's compile keeps the request out of the engine."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from pagedserve.scheduler.engine_host import EngineBindError, EngineHost
from pagedserve.scheduler.engine_io import EngineError, EngineOutput, EngineRequest, ModelInfo
from pagedserve.scheduler.engine_remote import SYNC_HELLO_S, RemoteEngineClient
from pagedserve.scheduler.lora_registry import LoraRegistry
from pagedserve.scheduler.metrics import Metrics
from pagedserve.scheduler.request import Constraint, GenerationParams

INFO = ModelInfo(64, 100, (2,), 4, 32, "float32", "cpu", "torch", "float32")


class StandInLora:
    """The engine's LoraAdmin as the host uses it: a registry, load and unload."""

    def __init__(self) -> None:
        self.registry = LoraRegistry((("a", "/a"),))

    async def load(self, name: str, path: str) -> None:
        if path == "/bad":
            raise EngineError("INVALID_ARGUMENT", "no adapter_config.json")
        self.registry.add(self.registry.reserve(), name, path)

    async def unload(self, name: str) -> None:
        self.registry.remove(name)


class StandInEngine:
    """What EngineHost uses of the Engine: submit answers ids and may emit at once."""

    def __init__(self) -> None:
        self.streams = SimpleNamespace(emit=lambda batch: None)
        self.scheduler, self.grammars = object(), object()
        self.serving, self.draining, self.leaving = True, False, False
        self.submitted: list[EngineRequest] = []
        self.aborted: list[tuple[int, str]] = []
        self.compiling = asyncio.Event()
        self.compile_gate: asyncio.Event | None = None
        self.emit_on_submit: list[int] = []  # tokens of an output emitted right after submit
        self.lora = StandInLora()

    def model_info(self) -> ModelInfo:
        return INFO

    def submit(self, request: EngineRequest, grammar=None) -> int:
        self.submitted.append(request)
        rid = len(self.submitted)
        if self.emit_on_submit:  # the next step's output, right behind the reply
            asyncio.get_running_loop().call_soon(
                self.streams.emit, [EngineOutput(rid, list(self.emit_on_submit))])
        return rid

    def abort(self, rid: int, reason: str) -> None:
        self.aborted.append((rid, reason))

    async def compile(self, constraint: Constraint) -> object:
        self.compiling.set()
        if self.compile_gate is not None:
            await self.compile_gate.wait()
        return object()


def request(**params) -> EngineRequest:
    return EngineRequest("", [1, 2, 3], GenerationParams(max_tokens=8, **params))


async def until(condition, timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.01)


async def start(address: str, engine: StandInEngine | None = None):
    engine = engine or StandInEngine()
    host = EngineHost(engine, address, hello_timeout_s=5.0)
    await host.start()
    return engine, host


async def connected_clients(address: str, n: int, hello_s: float) -> list[RemoteEngineClient]:
    """n API processes' engine clients, started and connected to the host at address."""
    clients = [RemoteEngineClient(address, Metrics(), hello_s=hello_s) for _ in range(n)]
    for c in clients:
        await c.start()
        await c.wait_connected(5)
    return clients


def run(test) -> None:
    asyncio.run(asyncio.wait_for(test(), 30))


@pytest.fixture
def address(tmp_path):
    return f"ipc://{tmp_path}/engine.sock"


def test_outputs_before_submit_returns_reach_the_stream_in_order(address):
    async def main():
        engine, host = await start(address)
        engine.emit_on_submit = [7]
        client = RemoteEngineClient(address, Metrics(), hello_s=0.05)
        got: list[tuple[int, list[int]]] = []
        client.subscribe(lambda batch: got.extend((o.req_id, o.token_ids) for o in batch))
        await client.start()
        assert await client.wait_connected(5)
        assert client.model_info() == INFO and client.serving
        opened = []

        async def submit_and_open():  # as submit_parallel does: open right after submit
            rid = await client.submit(request())
            opened.append((rid, list(got)))  # nothing delivered before the stream opened
            host._emit([EngineOutput(1, [8]), EngineOutput(1, [9], finish_reason="stop")])
            return rid

        rid = await submit_and_open()
        await until(lambda: len(got) == 3)
        assert opened == [(rid, [])]
        assert got == [(rid, [7]), (rid, [8]), (rid, [9])]
        assert len(client) == 0  # finished: nothing left to resubmit
        client.abort(rid, "stop")  # after the end: nothing is sent
        await asyncio.sleep(0.1)
        assert engine.aborted == []
        await client.close()
        await host.close()

    run(main)


def test_aborts_carry_their_reason_and_a_process_gone_loses_its_requests(address):
    async def main():
        engine, host = await start(address)
        client = RemoteEngineClient(address, Metrics(), hello_s=0.05)
        await client.start()
        await client.wait_connected(5)
        a = await client.submit(request())
        await client.submit(request())
        client.abort(a, "stop")  # a stop string matched in the front end
        await until(lambda: engine.aborted == [(1, "stop")])
        await client.close()  # the API process is gone: its other request ends too
        await until(lambda: engine.aborted == [(1, "stop"), (2, "abort")])
        assert host.peers == {}
        await host.close()

    run(main)


def test_a_new_engine_core_gets_the_accepted_requests_with_their_tokens(address):
    async def main():
        engine, host = await start(address)
        client = RemoteEngineClient(address, Metrics(), hello_s=0.05, state_timeout_s=0.5)
        got = []
        client.subscribe(lambda batch: got.extend(o.token_ids for o in batch))
        await client.start()
        await client.wait_connected(5)
        rid = await client.submit(request(seed=5))
        host._emit([EngineOutput(1, [11]), EngineOutput(1, [12])])
        await until(lambda: got == [[11], [12]])
        await host.close()  # the engine core dies
        await until(lambda: not client.connected)
        assert not client.serving
        with pytest.raises(EngineError) as e:  # new requests: retried elsewhere
            await client.submit(request())
        assert (e.value.code, e.value.retry_after_s) == ("UNAVAILABLE", 1.0)
        engine2, host2 = await start(address)
        await until(lambda: len(engine2.submitted) == 1)
        again = engine2.submitted[0]
        assert (again.resume_tokens, again.resubmitted, again.params.seed) == ((11, 12), True, 5)
        host2._emit([EngineOutput(1, [13], finish_reason="length")])
        await until(lambda: got == [[11], [12], [13]])
        assert rid == 1 and client.serving
        await client.close()
        await host2.close()

    run(main)


def test_an_abort_during_the_grammars_compile_keeps_the_request_out(address):
    async def main():
        engine, host = await start(address)
        engine.compile_gate = asyncio.Event()
        client = RemoteEngineClient(address, Metrics(), hello_s=0.05)
        await client.start()
        await client.wait_connected(5)
        task = asyncio.create_task(client.submit(request(constraint=Constraint("regex", "a+"))))
        await engine.compiling.wait()
        task.cancel()  # the client left while its schema compiled
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(0.1)  # the abort arrives before the compile ends
        engine.compile_gate.set()
        await asyncio.sleep(0.1)
        assert engine.submitted == []
        await client.close()
        await host.close()

    run(main)


def test_the_engine_socket_stays_on_this_host():
    async def main():
        host = EngineHost(StandInEngine(), "tcp://0.0.0.0:5999")
        with pytest.raises(EngineBindError) as e:
            await host.start()
        assert str(e.value).startswith("--engine-address tcp://0.0.0.0:5999: the engine socket "
                                       "is for this host only")
        await host.close()

    run(main)


def test_a_keyed_engine_socket_serves_other_hosts_api_processes_with_allowed_keys(tmp_path):
    """With CURVE keys the engine socket may bind every interface: an API process with an
    allowed key pair and the engine core's public key is served; one whose key is not in
    the allow-list never gets an answer; keys without an allow-list are one line."""
    from pagedserve.core.link_security import (
        LinkSecurityError,
        create_keypair,
        load_keypair,
        load_public_key,
    )
    from tests.integration.service import free_port

    engine_pub, engine_key = create_keypair(tmp_path / "engine", "engine")
    allowed = tmp_path / "allowed"
    api_pub, api_key = create_keypair(tmp_path / "api", "api")
    allowed.mkdir()
    (allowed / "api.key").write_bytes(api_pub.read_bytes())
    _, stranger_key = create_keypair(tmp_path / "stranger", "stranger")
    port = free_port()

    async def main():
        engine = StandInEngine()
        host = EngineHost(engine, f"tcp://0.0.0.0:{port}", key_file=str(engine_key),
                          allowed_keys_dir=str(allowed))
        await host.start()
        at = f"tcp://127.0.0.1:{port}"
        stranger = RemoteEngineClient(at, Metrics(), hello_s=0.05,
                                      key=load_keypair(stranger_key),
                                      engine_public_key=load_public_key(engine_pub))
        await stranger.start()
        client = RemoteEngineClient(at, Metrics(), hello_s=0.05, key=load_keypair(api_key),
                                    engine_public_key=load_public_key(engine_pub))
        await client.start()
        assert await client.wait_connected(5)
        rid = await client.submit(request())
        assert rid == 1 and len(engine.submitted) == 1
        assert not await stranger.wait_connected(1)
        assert len(host.peers) == 1
        for c in (client, stranger):
            await c.close()
        await host.close()
        bare = EngineHost(StandInEngine(), f"tcp://0.0.0.0:{port}", key_file=str(engine_key))
        with pytest.raises(LinkSecurityError, match=r"no allow-list of API process keys "
                                                    r"\(--engine-allowed-keys\)"):
            await bare.start()
        await bare.close()

    run(main)


def test_adapters_loaded_through_one_api_process_are_served_by_every_one(address):
    """A load or unload answered to one API process is in every API process's list by then
    (the host sends its state to all before the answer); a refused one changes nothing."""
    async def main():
        engine, host = await start(address)
        clients = await connected_clients(address, 2, hello_s=0.05)
        assert [c.lora_modules() for c in clients] == [[("a", "/a")]] * 2
        await clients[0].load_lora("b", "/b")
        await until(lambda: clients[1].lora_modules() == [("a", "/a"), ("b", "/b")])
        assert clients[0].lora_modules() == [("a", "/a"), ("b", "/b")]
        with pytest.raises(EngineError, match="no adapter_config.json"):
            await clients[1].load_lora("c", "/bad")
        await clients[1].unload_lora("a")
        await until(lambda: clients[0].lora_modules() == [("b", "/b")])
        for c in clients:
            await c.close()
        await host.close()

    run(main)


def test_a_request_naming_an_adapter_just_loaded_elsewhere_waits_for_the_next_state(address):
    """sync_state returns once a state newer than the call has arrived: right after another
    API process's load returns, the adapter is in this process's list, with no waiting in
    the test; each call sends at most one hello a SYNC_HELLO_S."""
    async def main():
        engine, host = await start(address)
        clients = await connected_clients(address, 2, hello_s=60.0)
        await clients[0].load_lora("b", "/b")
        seen = clients[1]._states
        await clients[1].sync_state()
        assert clients[1]._states > seen
        assert clients[1].lora_modules() == [("a", "/a"), ("b", "/b")]
        await asyncio.sleep(SYNC_HELLO_S)
        seen = clients[1]._states  # (the periodic hellos are a minute apart here)
        await asyncio.gather(*(clients[1].sync_state() for _ in range(20)))
        assert clients[1]._states == seen + 1  # twenty calls at once: one hello, one state
        for c in clients:
            await c.close()
        await host.close()

    run(main)
