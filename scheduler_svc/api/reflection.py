"""gRPC server reflection under both names clients ask for: grpc.reflection.v1 (grpcurl and
the current clients try it first) and grpc.reflection.v1alpha (older clients).

grpcio-reflection (1.85) implements v1alpha only. The v1 proto is v1alpha's with the package
renamed: same messages, same field numbers, so its bytes on the wire are the same. v1 is
therefore v1alpha's servicer mounted on v1's method path, plus v1's file descriptor in the
default pool so that a client can also ask for the v1 service's own schema.
"""

from __future__ import annotations

from collections.abc import Iterable

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_reflection.v1alpha import reflection, reflection_pb2

V1_PACKAGE = "grpc.reflection.v1"
V1_SERVICE_NAME = f"{V1_PACKAGE}.ServerReflection"
V1ALPHA_SERVICE_NAME = reflection.SERVICE_NAME


def enable(service_names: Iterable[str], server: grpc.aio.Server) -> None:
    """Serve reflection v1 and v1alpha, listing service_names and both reflection services."""
    _add_v1_descriptor()
    names = (*service_names, V1_SERVICE_NAME, V1ALPHA_SERVICE_NAME)
    servicer = reflection.aio.ReflectionServicer(names)
    reflection.enable_server_reflection(names, server)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(V1_SERVICE_NAME, {
        "ServerReflectionInfo": grpc.stream_stream_rpc_method_handler(
            servicer.ServerReflectionInfo,
            request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
            response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString)}),))


def _add_v1_descriptor() -> None:
    pool = descriptor_pool.Default()
    name = f"{V1_PACKAGE.replace('.', '/')}/reflection.proto"
    try:
        pool.FindFileByName(name)
        return  # a second server in this process
    except KeyError:
        pass
    fdp = descriptor_pb2.FileDescriptorProto()
    reflection_pb2.DESCRIPTOR.CopyToProto(fdp)
    old, new = f".{fdp.package}.", f".{V1_PACKAGE}."
    fdp.name, fdp.package = name, V1_PACKAGE
    fdp.options.Clear()  # v1alpha's: deprecated, and its Java/Go package names
    fdp.options.go_package = "google.golang.org/grpc/reflection/grpc_reflection_v1"
    for field in (f for msg in fdp.message_type for f in msg.field if f.type_name):
        field.type_name = field.type_name.replace(old, new)
    for method in (m for service in fdp.service for m in service.method):
        method.input_type = method.input_type.replace(old, new)
        method.output_type = method.output_type.replace(old, new)
    pool.AddSerializedFile(fdp.SerializeToString())
