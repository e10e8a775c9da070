"""Counts every HTTP API request by route and status code, and times it to its response's last
byte, as rpc_metrics counts every RPC: the only view of HTTP requests refused before they reach
the engine (400, 401, 404, 413, 429, 503). A plain ASGI middleware, so that a streamed response
is timed to its end and nothing is buffered."""

from __future__ import annotations

import time
from typing import Any

from prometheus_client import Counter, Histogram

# the routes served; any other path is counted as "other" (a scanner must not grow the series)
ROUTES = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/models",
                    "/health", "/tokenize", "/detokenize"})
CLIENT_LEFT = 499  # nginx's code: the client went away before the response began


class HTTPMetrics:
    def __init__(self, app: Any, requests: Counter, duration: Histogram,
                 model_name: str) -> None:
        """requests: labelled (model_name, route, status); duration: (model_name, route)."""
        self.app, self.requests, self.duration, self.model_name = app, requests, duration, \
            model_name
        for route in ROUTES:  # from the start: a rate() needs a sample from before the first
            duration.labels(model_name, route)

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        route = scope["path"] if scope["path"] in ROUTES else "other"
        status, start, counted = 0, time.monotonic(), False

        def count() -> None:
            nonlocal counted
            if not counted:
                counted = True
                self.requests.labels(self.model_name, route, str(status or CLIENT_LEFT)).inc()
                self.duration.labels(self.model_name, route).observe(time.monotonic() - start)

        async def sending(message: dict) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body" and not message.get("more_body"):
                count()  # before the last byte leaves: a client that has it sees it counted
            await send(message)

        try:
            await self.app(scope, receive, sending)
        except BaseException:
            status = status or 500  # (Starlette answers 500 itself before re-raising)
            raise
        finally:
            count()
