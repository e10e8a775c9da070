"""Counts every RPC the server completes by method and status code, as go-grpc-prometheus's
grpc_server_handled_total does: the only place that sees requests rejected before they reach
the engine (INVALID_ARGUMENT, UNAUTHENTICATED, RESOURCE_EXHAUSTED, ...), including those that do
not parse. The outermost interceptor, so that it reads the code the error interceptor set."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable
from typing import Any

import grpc
from prometheus_client import Counter


class RpcMetrics(grpc.aio.ServerInterceptor):
    def __init__(self, handled: Counter, model_name: str) -> None:
        """handled: labelled (model_name, grpc_service, grpc_method, grpc_code)."""
        self.handled, self.model_name = handled, model_name

    async def intercept_service(self, continuation: Callable, details: Any) -> Any:
        handler = await continuation(details)
        if handler is None:
            return None
        service, _, method = details.method.lstrip("/").rpartition("/")

        def count(code: str) -> None:
            self.handled.labels(self.model_name, service, method, code).inc()

        if handler.unary_stream is not None:
            return handler._replace(unary_stream=_counted(handler.unary_stream, count))
        if handler.unary_unary is not None:
            return handler._replace(unary_unary=_counted(handler.unary_unary, count))
        return handler


def _counted(fn: Callable, count: Callable[[str], None]) -> Callable:
    # A server-streaming handler is an async generator or a coroutine writing with
    # context.write (the health service's Watch); each keeps its kind.
    if inspect.isasyncgenfunction(fn):
        async def stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
            code = "UNKNOWN"
            try:
                async for item in fn(request, context):
                    yield item
                code = _code(context, "OK")
            except (asyncio.CancelledError, GeneratorExit):
                # grpc cancels the task serving the call; when that task is awaiting the write
                # rather than the generator, the generator only learns at its finalizer
                # (GeneratorExit at the yield), which is the same cancellation
                code = _cancelled(context)
                raise
            except BaseException:
                code = _code(context, "UNKNOWN")
                raise
            finally:
                count(code)

        return stream

    async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
        code = "UNKNOWN"
        try:
            result = await fn(request, context)
            code = _code(context, "OK")
            return result
        except asyncio.CancelledError:
            code = _cancelled(context)
            raise
        except BaseException:  # context.abort raises after setting the code
            code = _code(context, "UNKNOWN")
            raise
        finally:
            count(code)

    return call


def _code(context: grpc.aio.ServicerContext, default: str) -> str:
    code = context.code()
    if isinstance(code, grpc.StatusCode):
        return code.name
    if isinstance(code, int):  # some versions hand back the raw number
        return next((c.name for c in grpc.StatusCode if c.value[0] == code), default)
    return default


def _cancelled(context: grpc.aio.ServicerContext) -> str:
    """gRPC cancels the handler when the client cancels or when the deadline passes."""
    return "DEADLINE_EXCEEDED" if past_deadline(context) else "CANCELLED"


# The client's deadline timer and the server's (the grpc-timeout header counted from its
# arrival) fire together, so a client's cancellation at its deadline may arrive a little before
# the server's own deadline: one within this margin is taken for the deadline.
DEADLINE_MARGIN_S = 0.05


def past_deadline(context: grpc.aio.ServicerContext) -> bool:
    """Whether the call ends because its deadline passed (as near as the server can tell)."""
    remaining = context.time_remaining()  # None: no deadline
    return remaining is not None and remaining <= DEADLINE_MARGIN_S
