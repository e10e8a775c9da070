"""What one streamed gRPC message costs the serving process, with nothing else to do.

A grpc.aio server in this process streams `--messages` GenerateResponse messages on each of
`--streams` concurrent Generate calls from a client in another process. Each step wakes every
stream's handler through an asyncio.Queue, as the scheduler's delivery does, and waits until
all have written. The record keeps the server's wall and CPU time per message: at interval 1
the scheduler pays about this per token per stream on its one thread, beside planning and
delivery.

    python -m benchmarks.grpc_stream [--streams 256] [--messages 200]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import time

import grpc

from benchmarks.common import write_records
from pagedserve.protos.v1 import generate_pb2 as api
from pagedserve.protos.v1 import generate_pb2_grpc as rpc


class _Servicer(rpc.GenerationServicer):
    def __init__(self, messages: int) -> None:
        self.messages = messages
        self.queues: list[asyncio.Queue] = []

    async def Generate(self, request, context):  # noqa: N802
        queue: asyncio.Queue = asyncio.Queue()
        self.queues.append(queue)
        for i in range(self.messages):
            await queue.get()
            yield api.GenerateResponse(request_id=request.request_id, text=" word",
                                       token_ids=[i], index=0)


def _client(port: int, streams: int) -> None:
    async def one(stub: rpc.GenerationStub, i: int) -> None:
        async for _ in stub.Generate(api.GenerateRequest(request_id=f"r{i}")):
            pass

    async def main() -> None:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = rpc.GenerationStub(channel)
            await asyncio.gather(*(one(stub, i) for i in range(streams)))

    asyncio.run(main())


async def measure(streams: int, messages: int) -> dict:
    servicer = _Servicer(messages)
    server = grpc.aio.server()
    rpc.add_GenerationServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    client = mp.get_context("spawn").Process(target=_client, args=(port, streams))
    client.start()
    deadline = time.monotonic() + 120
    while len(servicer.queues) < streams:
        if not client.is_alive() or time.monotonic() > deadline:
            raise SystemExit(f"the client opened {len(servicer.queues)} of {streams} streams")
        await asyncio.sleep(0.01)
    wall0, cpu0 = time.perf_counter(), time.process_time()
    for _ in range(messages):
        for q in servicer.queues:
            q.put_nowait(None)
        while any(q.qsize() for q in servicer.queues):  # every handler has taken its item
            await asyncio.sleep(0)
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    client.join(timeout=60)
    await server.stop(1)
    n = streams * messages
    return {"kind": "grpc_stream", "streams": streams, "messages": messages,
            "server_wall_us_per_message": wall / n * 1e6,
            "server_cpu_us_per_message": cpu / n * 1e6}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--streams", type=int, default=256)
    p.add_argument("--messages", type=int, default=200)
    args = p.parse_args()
    r = asyncio.run(measure(args.streams, args.messages))
    print(f"{r['streams']} streams: server {r['server_wall_us_per_message']:.1f} us wall, "
          f"{r['server_cpu_us_per_message']:.1f} us CPU per message")
    print("appended to", write_records("step_overhead", [r]))


if __name__ == "__main__":
    main()
