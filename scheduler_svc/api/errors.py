"""Maps exceptions to gRPC status codes in one place, including requests that fail to parse."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import DecodeError

from pagedserve.protos.v1 import generate_pb2
from pagedserve.scheduler.engine_io import EngineError
from pagedserve.scheduler.invalid import InvalidRequest


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """InvalidRequest -> INVALID_ARGUMENT, EngineError -> its code; a request that is not valid
    protobuf (e.g. a string field holding invalid UTF-8) or whose 32-bit field got a larger
    number (which protobuf would silently truncate) -> INVALID_ARGUMENT naming the field."""

    async def intercept_service(self, continuation: Callable, details: Any) -> Any:
        handler = await continuation(details)
        if handler is None:
            return None
        input_type = _input_type(details.method)
        if input_type is not None and handler.request_deserializer is not None:
            handler = handler._replace(
                request_deserializer=_lenient(handler.request_deserializer, input_type))
        if handler.unary_stream is not None:
            # A streaming handler is an async generator (ours) or a coroutine that writes with
            # context.write (grpc's health Watch): each keeps its own shape.
            stream = handler.unary_stream
            wrap = _wrap_stream if inspect.isasyncgenfunction(stream) else _wrap_unary
            return handler._replace(unary_stream=wrap(stream))
        if handler.unary_unary is not None:
            return handler._replace(unary_unary=_wrap_unary(handler.unary_unary))
        return handler


class _Unparsable:
    """A request the parser refused: the error to raise in the handler's place."""

    def __init__(self, error: InvalidRequest) -> None:
        self.error = error


async def _abort_for(exc: Exception, context: grpc.aio.ServicerContext) -> None:
    if isinstance(exc, InvalidRequest):
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
    if isinstance(exc, EngineError):
        if exc.retry_after_s is not None:
            context.set_trailing_metadata((("retry-after-ms", str(int(exc.retry_after_s * 1e3))),))
        await context.abort(getattr(grpc.StatusCode, exc.code), str(exc))
    raise exc


def _wrap_unary(fn: Callable) -> Callable:
    @functools.wraps(fn)
    async def wrapper(request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            if isinstance(request, _Unparsable):
                raise request.error
            return await fn(request, context)
        except (InvalidRequest, EngineError) as e:
            await _abort_for(e, context)

    return wrapper


def _wrap_stream(fn: Callable) -> Callable:
    @functools.wraps(fn)
    async def wrapper(request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            if isinstance(request, _Unparsable):
                raise request.error
            async for item in fn(request, context):
                yield item
        except (InvalidRequest, EngineError) as e:
            await _abort_for(e, context)

    return wrapper


def _input_type(method: str) -> Descriptor | None:
    service, _, name = method.lstrip("/").partition("/")
    for svc in generate_pb2.DESCRIPTOR.services_by_name.values():
        if svc.full_name == service and name in svc.methods_by_name:
            return svc.methods_by_name[name].input_type
    return None


def _lenient(deserialize: Callable, input_type: Descriptor) -> Callable:
    def parse(data: bytes) -> Any:
        try:
            msg = deserialize(data)
        except DecodeError as e:
            return _Unparsable(_explain(data, input_type)
                               or InvalidRequest("request", f"not valid protobuf: {e}"))
        truncated = _truncated_int(data, input_type, msg)
        return msg if truncated is None else _Unparsable(truncated)

    return parse


# the twins of generate.proto: string fields as bytes (to find invalid UTF-8 the strict parser
# rejects), 32-bit integers as 64-bit (to see the number a client sent before truncation)
_TWINS = {"bytes": {FieldDescriptor.TYPE_STRING: FieldDescriptor.TYPE_BYTES},
          "wide": {FieldDescriptor.TYPE_INT32: FieldDescriptor.TYPE_INT64,
                   FieldDescriptor.TYPE_UINT32: FieldDescriptor.TYPE_UINT64,
                   FieldDescriptor.TYPE_SINT32: FieldDescriptor.TYPE_SINT64}}


@functools.cache
def _twin(kind: str, full_name: str) -> type:
    fdp = descriptor_pb2.FileDescriptorProto()
    generate_pb2.DESCRIPTOR.CopyToProto(fdp)
    fdp.name = f"{kind}_twin/{fdp.name}"

    def relax(msg: descriptor_pb2.DescriptorProto) -> None:
        for f in msg.field:
            f.type = _TWINS[kind].get(f.type, f.type)
        for nested in msg.nested_type:
            relax(nested)

    for m in fdp.message_type:
        relax(m)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(fdp)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName(full_name))


def _explain(data: bytes, input_type: Descriptor) -> InvalidRequest | None:
    try:
        msg = _twin("bytes", input_type.full_name).FromString(data)
    except DecodeError:
        return None
    path = _bad_utf8_field(msg, "")
    return InvalidRequest(path, "not valid UTF-8") if path else None


def _truncated_int(data: bytes, input_type: Descriptor, strict: Any) -> InvalidRequest | None:
    """The first 32-bit field whose value the client sent wider (protobuf keeps its low bits)."""
    wide = _twin("wide", input_type.full_name).FromString(data)
    return _first_difference(wide, strict, "")


def _is_map(field: FieldDescriptor) -> bool:
    return field.type == FieldDescriptor.TYPE_MESSAGE and field.message_type.GetOptions().map_entry


def _has_key(strict_map: Any, key: int) -> bool:
    try:
        return key in strict_map
    except ValueError:  # outside the strict map's key type: the value it holds was truncated
        return False


def _first_difference(wide: Any, strict: Any, prefix: str) -> InvalidRequest | None:
    for field, value in wide.ListFields():
        name = prefix + field.name
        mine = getattr(strict, field.name)
        if _is_map(field):  # iterating a map gives its keys: integer keys are what may differ
            key = next((k for k in value if isinstance(k, int) and not _has_key(mine, k)), None)
            if key is not None:
                return InvalidRequest(name, f"key {key} does not fit in 32 bits")
        elif field.type == FieldDescriptor.TYPE_MESSAGE:
            pairs = zip(value, mine, strict=True) if field.is_repeated else [(value, mine)]
            for i, (w, s) in enumerate(pairs):
                where = f"{name}[{i}]." if field.is_repeated else name + "."
                if (found := _first_difference(w, s, where)) is not None:
                    return found
        elif field.type in (FieldDescriptor.TYPE_INT64, FieldDescriptor.TYPE_UINT64,
                            FieldDescriptor.TYPE_SINT64) and value != mine:
            if field.is_repeated:
                i = next(i for i, (a, b) in enumerate(zip(value, mine, strict=True)) if a != b)
                return InvalidRequest(f"{name}[{i}]", f"{value[i]} does not fit in 32 bits")
            return InvalidRequest(name, f"{value} does not fit in 32 bits")
    return None


def _bad_utf8_field(msg: Any, prefix: str) -> str | None:
    for field, value in msg.ListFields():
        name = prefix + field.name
        if _is_map(field):  # no map of this API has string keys or values
            continue
        repeated = field.is_repeated
        items = list(value) if repeated else [value]
        for i, item in enumerate(items):
            where = f"{name}[{i}]" if repeated else name
            if field.type == FieldDescriptor.TYPE_BYTES:
                try:
                    item.decode("utf-8")
                except UnicodeDecodeError:
                    return where
            elif field.type == FieldDescriptor.TYPE_MESSAGE:
                found = _bad_utf8_field(item, where + ".")
                if found:
                    return found
    return None
