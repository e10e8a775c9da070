"""http_metrics: each HTTP request counted once by route and status, and timed to its end,
through a real ASGI server (uvicorn) and client."""

from __future__ import annotations

import asyncio
import socket
import urllib.error
import urllib.request

import uvicorn
from prometheus_client import CollectorRegistry, Counter, Histogram
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from pagedserve.scheduler.api.http_metrics import HTTPMetrics


async def ok(request: Request) -> JSONResponse:
    return JSONResponse({"ok": True})


async def bad(request: Request) -> JSONResponse:
    return JSONResponse({"error": "no"}, status_code=400)


async def crash(request: Request) -> JSONResponse:
    raise RuntimeError("boom")


async def stream(request: Request) -> StreamingResponse:
    async def parts():
        for i in range(3):
            await asyncio.sleep(0.1)
            yield f"data: {i}\n\n".encode()
    return StreamingResponse(parts(), media_type="text/event-stream")


def test_requests_are_counted_by_route_and_status_and_timed_to_their_last_byte():
    registry = CollectorRegistry()
    requests = Counter("t_http_requests", "", ["model_name", "route", "status"],
                       registry=registry)
    duration = Histogram("t_http_duration", "", ["model_name", "route"], registry=registry)
    app = Starlette(routes=[Route("/v1/models", ok), Route("/v1/completions", bad,
                                                            methods=["POST"]),
                            Route("/v1/responses", crash, methods=["POST"]),
                            Route("/v1/chat/completions", stream, methods=["POST"])])
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]

    async def main() -> None:
        server = uvicorn.Server(uvicorn.Config(HTTPMetrics(app, requests, duration, "m"),
                                               lifespan="off", log_config=None))
        task = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started:
            await asyncio.sleep(0.01)
        def fetch(method: str, path: str) -> tuple[int, str]:
            req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", method=method)
            try:
                with urllib.request.urlopen(req, timeout=10) as r:
                    return r.status, r.read().decode()
            except urllib.error.HTTPError as e:
                return e.code, ""

        got = [await asyncio.to_thread(fetch, m, p) for m, p in [
            ("GET", "/v1/models"), ("POST", "/v1/completions"), ("POST", "/v1/responses"),
            ("GET", "/wp-login.php"), ("POST", "/v1/chat/completions")]]
        assert [status for status, _ in got] == [200, 400, 500, 404, 200]
        assert got[-1][1].count("data:") == 3
        # counted before the last byte left, so a scrape right after a response sees it
        assert registry.get_sample_value("t_http_requests_total", {
            "model_name": "m", "route": "/v1/models", "status": "200"}) == 1
        server.should_exit = True
        await task

    asyncio.run(main())

    def count(route: str, status: str) -> float | None:
        return registry.get_sample_value("t_http_requests_total",
                                         {"model_name": "m", "route": route, "status": status})

    assert [count("/v1/models", "200"), count("/v1/completions", "400"),
            count("/v1/responses", "500"), count("other", "404"),
            count("/v1/chat/completions", "200")] == [1, 1, 1, 1, 1]
    streamed = registry.get_sample_value("t_http_duration_sum",
                                         {"model_name": "m", "route": "/v1/chat/completions"})
    assert streamed >= 0.3  # three parts 0.1 s apart: the stream's end, not its first byte
