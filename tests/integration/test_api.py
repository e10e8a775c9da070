"""The gRPC surface: errors, cancellation, tokenize, model info, health, reflection, CLI."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import grpc
import pytest
from google.protobuf import descriptor_pb2
from grpc_reflection.v1alpha import reflection_pb2

from pagedserve.client import build_request
from pagedserve.protos.v1 import generate_pb2 as api

INVALID = [  # (request kwargs, code, field named in the message)
    (dict(text=""), "INVALID_ARGUMENT", "text: the prompt is empty"),
    (dict(token_ids=[]), "INVALID_ARGUMENT", "token_ids: the prompt is empty"),
    (dict(chat=[]), "INVALID_ARGUMENT", "chat.messages"),
    (dict(token_ids=[1] * 9000), "INVALID_ARGUMENT", "input: the prompt has 9000 tokens"),
    (dict(token_ids=[1, 10**6]), "INVALID_ARGUMENT", "token_ids:"),
    (dict(text="hi", max_tokens=0), "INVALID_ARGUMENT", "sampling.max_tokens"),
    (dict(text="hi", max_tokens=-3), "INVALID_ARGUMENT", "sampling.max_tokens"),
    (dict(text="hi", max_tokens=10**9), "INVALID_ARGUMENT", "sampling.max_tokens"),
    (dict(text="hi", temperature=-1), "INVALID_ARGUMENT", "sampling.temperature"),
    (dict(text="hi", top_p=0), "INVALID_ARGUMENT", "sampling.top_p"),
    (dict(text="hi", top_p=1.01), "INVALID_ARGUMENT", "sampling.top_p"),
    (dict(text="hi", top_k=-2), "INVALID_ARGUMENT", "sampling.top_k"),
    (dict(text="hi", stop=[""]), "INVALID_ARGUMENT", "sampling.stop"),
    (dict(text="hi", stop_token_ids=[-1]), "INVALID_ARGUMENT", "sampling.stop_token_ids"),
]


@pytest.mark.parametrize("kwargs, code, message", INVALID,
                         ids=[m for _, _, m in INVALID])
def test_bad_input_gets_a_clear_status_and_the_server_keeps_serving(service, kwargs, code,
                                                                    message):
    with pytest.raises(grpc.RpcError) as err:
        list(service.client.stub.Generate(build_request(**kwargs), timeout=30))
    assert err.value.code().name == code
    assert message in err.value.details()
    _, ids, _ = service.client.complete(text="Hello", max_tokens=2, temperature=0)
    assert len(ids) == 2


def test_missing_input(service):
    with pytest.raises(grpc.RpcError) as err:
        list(service.client.stub.Generate(api.GenerateRequest(), timeout=30))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith("input:")


def _raw_generate_error(service, raw: bytes) -> grpc.RpcError:
    """The error a Generate call with these request bytes ends in (sent as they are)."""
    call = service.client.channel.unary_stream(
        "/pagedserve.v1.Generation/Generate", request_serializer=None,
        response_deserializer=api.GenerateResponse.FromString)
    with pytest.raises(grpc.RpcError) as err:
        list(call(raw, timeout=30))
    return err.value


def test_invalid_utf8_in_stop_string_names_the_field(service):
    raw = build_request(text="hi", stop=["ok", "XY"]).SerializeToString()
    err = _raw_generate_error(service, raw.replace(b"XY", b"\xff\xfe"))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.details() == "sampling.stop[1]: not valid UTF-8"
    assert service.client.complete(text="Hello", max_tokens=1)[1]


def _varint(n: int) -> bytes:
    n &= (1 << 64) - 1
    out = bytearray()
    while True:
        out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
        n >>= 7
        if not n:
            return bytes(out)


@pytest.mark.parametrize("field,extra", [
    ("priority", bytes([6 << 3]) + _varint(-(2**40))),  # GenerateRequest.priority = 6
    ("sampling.max_tokens", bytes([5 << 3 | 2, 6, 1 << 3]) + _varint(2**32 + 5)),
])
def test_a_number_too_wide_for_its_32_bit_field_is_refused_not_truncated(service, field, extra):
    err = _raw_generate_error(service, build_request(text="hi").SerializeToString() + extra)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.details().startswith(f"{field}: ")
    assert err.details().endswith("does not fit in 32 bits")


def test_a_huge_prompt_is_refused_before_tokenizing(service):
    text = "word " * 200_000  # 1 MB; the default model's limit is 32 bytes x 8192 tokens
    for call in (lambda: list(service.client.stub.Generate(build_request(text=text),
                                                          timeout=30)),
                 lambda: service.client.stub.Tokenize(api.TokenizeRequest(text=text),
                                                      timeout=30)):
        with pytest.raises(grpc.RpcError) as err:
            call()
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details() == "text: 1000000 bytes, more than the 262144 a prompt may have"
    assert service.client.complete(text="Hello", max_tokens=1)[1]


def test_cancel_frees_blocks_within_a_step(service):
    stream = service.client.stub.Generate(
        build_request(text="Count: 1, 2, 3,", max_tokens=500, ignore_eos=True, temperature=0),
        timeout=120)
    first = [next(stream) for _ in range(3)]
    assert all(c.token_ids for c in first)
    assert service.metrics()["pagedserve_num_requests_running"] == 1
    stream.cancel()
    m = service.wait_idle(timeout=5)
    assert m["pagedserve_num_requests_running"] == 0
    assert m["pagedserve_num_free_kv_blocks"] == m["pagedserve_num_kv_blocks"]


def test_tokenize_and_model_info(service, tokenizer):
    resp = service.client.stub.Tokenize(api.TokenizeRequest(text="Hello world"))
    assert list(resp.token_ids) == tokenizer.encode("Hello world")
    assert list(resp.tokens) == tokenizer.convert_ids_to_tokens(tokenizer.encode("Hello world"))
    info = service.client.model_info()
    assert (info.vocab_size, info.block_size, info.max_model_len) == (49152, 16, 8192)
    assert list(info.eos_token_ids) == [2]
    assert (info.dtype, info.device, info.attention_backend) == ("float32", "cpu", "torch")
    assert info.num_kv_blocks > 0


@pytest.mark.parametrize("version", ["v1", "v1alpha"])
def test_reflection_lists_the_services(service, version):
    # grpcio-reflection ships v1alpha's messages only; v1's are the same on the wire (the
    # package differs, not a field), so they call v1's method path as a v1 client does
    info = service.client.channel.stream_stream(
        f"/grpc.reflection.{version}.ServerReflection/ServerReflectionInfo",
        request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
        response_deserializer=reflection_pb2.ServerReflectionResponse.FromString)
    listed, own = info(iter([
        reflection_pb2.ServerReflectionRequest(list_services=""),
        reflection_pb2.ServerReflectionRequest(
            file_containing_symbol=f"grpc.reflection.{version}.ServerReflection")]), timeout=30)
    assert sorted(s.name for s in listed.list_services_response.service) == [
        "grpc.health.v1.Health", "grpc.reflection.v1.ServerReflection",
        "grpc.reflection.v1alpha.ServerReflection", "pagedserve.v1.Generation"]
    [file] = own.file_descriptor_response.file_descriptor_proto
    fdp = descriptor_pb2.FileDescriptorProto.FromString(file)
    assert (fdp.package, fdp.service[0].method[0].input_type) == (
        f"grpc.reflection.{version}", f".grpc.reflection.{version}.ServerReflectionRequest")


def test_stop_token_and_stop_string_are_told_apart(service):
    """The model's EOS is token 2; a stop string "2" must not read the same."""
    chat = [("user", "What is the capital of France?")]
    _, ids, eos = service.client.complete(chat=chat, temperature=0, max_tokens=24)
    text, _, digit = service.client.complete("Count from one to five: 1,", temperature=0,
                                             max_tokens=8, stop=["2"])  # " 2, 3, 4, "
    assert ids[-1] == 2 and eos.finish_reason == api.FINISH_REASON_STOP
    assert (eos.WhichOneof("stop"), eos.stop_token_id) == ("stop_token_id", 2)
    assert digit.finish_reason == api.FINISH_REASON_STOP and text == " "
    assert (digit.WhichOneof("stop"), digit.stop_string) == ("stop_string", "2")
    assert eos.stop_reason == digit.stop_reason == "2"  # the deprecated field, as before
    _, _, length = service.client.complete("Count: 1,", temperature=0, max_tokens=2)
    assert length.WhichOneof("stop") is None and length.stop_reason == ""


def test_cli_generate_prints_only_the_answer(service):
    cmd = [sys.executable, "-m", "pagedserve.cli", "generate", "--address", service.address,
           "--chat", "What is the capital of France?", "--temperature", "0"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout == "The capital of France is Paris.\n"
    out = subprocess.run([*cmd, "--json", "--max-tokens", "3"], capture_output=True, text=True,
                         timeout=120, check=True)
    chunks = [json.loads(line) for line in out.stdout.splitlines()]
    # one JSON line per streamed message; tokens that queued while the last message was being
    # written arrive merged in one (with async scheduling, two steps' tokens can)
    assert 1 <= len(chunks) <= 3 and all(c["tokenIds"] for c in chunks)
    assert [t for c in chunks for t in c["tokenIds"]] == [504, 3575, 282]  # "The capital of"
    assert "".join(c["text"] for c in chunks) == "The capital of"
    assert chunks[-1]["finishReason"] == "FINISH_REASON_LENGTH"
    assert chunks[-1]["usage"]["completionTokens"] == 3


def test_cli_generate_reports_errors(service):
    cmd = [sys.executable, "-m", "pagedserve.cli", "generate", "--address", service.address,
           "hi", "--top-p", "2"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 1
    assert "INVALID_ARGUMENT: sampling.top_p" in out.stderr


def test_executor_restart_recomputes_running_requests(service, hf_greedy):
    import psutil

    serve = psutil.Process(service.proc.pid)
    [executor] = [p for p in serve.children() if "executor" in p.cmdline()]
    stream = service.client.stub.Generate(
        build_request(chat=[("user", "What is the capital of France?")], temperature=0,
                      max_tokens=24), timeout=180)
    ids = list(next(stream).token_ids)
    executor.kill()
    for chunk in stream:
        ids.extend(chunk.token_ids)
    assert ids == hf_greedy[4]  # the new executor recomputed the request and went on
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not any(
            "executor" in p.cmdline() for p in serve.children()):
        time.sleep(0.2)
    assert service.client.complete(text="Hello", max_tokens=2, temperature=0)[1]
