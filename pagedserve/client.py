"""A small synchronous Python client for the pagedserve gRPC API.

    from pagedserve.client import Client
    with Client("localhost:50051") as c:
        for chunk in c.generate(chat=[("user", "What is the capital of France?")],
                                max_tokens=32, temperature=0):
            print(chunk.text, end="", flush=True)
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import grpc

from pagedserve.protos.v1 import generate_pb2 as api
from pagedserve.protos.v1 import generate_pb2_grpc


def build_request(
    text: str | None = None,
    *,
    chat: Sequence[tuple[str, str]] | None = None,
    token_ids: Sequence[int] | None = None,
    max_tokens: int | None = None,
    temperature: float | None = None,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int | None = None,
    stop: Sequence[str] = (),
    stop_token_ids: Sequence[int] = (),
    ignore_eos: bool = False,
    include_special_tokens: bool = False,
    priority: int = 0,
    request_id: str = "",
    presence_penalty: float | None = None,
    frequency_penalty: float | None = None,
    repetition_penalty: float | None = None,
    min_p: float | None = None,
    logit_bias: Mapping[int, float] | None = None,
    min_tokens: int = 0,
    logprobs: int | None = None,
    n: int | None = None,
    json_object: bool = False,
    json_schema: str | Mapping | None = None,
    regex: str | None = None,
    choice: Sequence[str] | None = None,
    grammar: str | None = None,
    lark_grammar: str | None = None,
    prompt_logprobs: int | None = None,
    adapter: str = "",
) -> api.GenerateRequest:
    req = api.GenerateRequest(request_id=request_id, priority=priority, adapter=adapter)
    if sum(x is not None for x in (text, chat, token_ids)) != 1:
        raise ValueError("give exactly one of text, chat or token_ids")
    if text is not None:
        req.text = text
    elif chat is not None:
        req.chat.messages.extend(api.ChatMessage(role=r, content=c) for r, c in chat)
    else:
        req.token_ids.ids.extend(token_ids)
    s = req.sampling
    for name, value in (("max_tokens", max_tokens), ("temperature", temperature),
                        ("top_k", top_k), ("top_p", top_p), ("seed", seed),
                        ("presence_penalty", presence_penalty),
                        ("frequency_penalty", frequency_penalty),
                        ("repetition_penalty", repetition_penalty), ("min_p", min_p),
                        ("logprobs", logprobs), ("n", n),
                        ("prompt_logprobs", prompt_logprobs)):
        if value is not None:
            setattr(s, name, value)
    s.stop.extend(stop)
    s.stop_token_ids.extend(stop_token_ids)
    s.ignore_eos = ignore_eos
    s.include_special_tokens = include_special_tokens
    s.logit_bias.update(logit_bias or {})
    s.min_tokens = min_tokens
    # structured outputs: at most one (SamplingParams.constraint)
    if json_object:
        s.json_object = True
    if json_schema is not None:
        s.json_schema = json_schema if isinstance(json_schema, str) else json.dumps(json_schema)
    for name, value in (("regex", regex), ("grammar", grammar), ("lark_grammar", lark_grammar)):
        if value is not None:
            setattr(s, name, value)
    if choice is not None:
        s.choice.choices.extend(choice)
    return req


def stop_reason(response: api.GenerateResponse) -> int | str | None:
    """What ended a FINISH_REASON_STOP request: the stop token's id (an int) or the stop string
    (a str); None on other responses."""
    kind = response.WhichOneof("stop")
    return None if kind is None else getattr(response, kind)


def channel(address: str, *, tls: bool = False, tls_ca: str | None = None,
            tls_cert: str | None = None, tls_key: str | None = None) -> grpc.Channel:
    """A channel to the server: plain, or TLS (tls, or any file given) verified against
    `tls_ca` (default: the system's roots), presenting `tls_cert`/`tls_key` for mutual TLS."""
    if not (tls or tls_ca or tls_cert or tls_key):
        return grpc.insecure_channel(address)

    def read(path: str | None) -> bytes | None:
        return Path(path).read_bytes() if path else None

    return grpc.secure_channel(address, grpc.ssl_channel_credentials(
        read(tls_ca), read(tls_key), read(tls_cert)))


class Client:
    def __init__(self, address: str = "localhost:50051", api_key: str | None = None, *,
                 tls: bool = False, tls_ca: str | None = None, tls_cert: str | None = None,
                 tls_key: str | None = None) -> None:
        """api_key: sent as 'authorization: Bearer <key>' (a server with --api-keys needs it);
        tls_*: see channel()."""
        self.channel = channel(address, tls=tls, tls_ca=tls_ca, tls_cert=tls_cert,
                               tls_key=tls_key)
        self.stub = generate_pb2_grpc.GenerationStub(self.channel)
        self.metadata = (("authorization", f"Bearer {api_key}"),) if api_key else ()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.channel.close()

    def wait_ready(self, timeout: float = 60.0) -> None:
        grpc.channel_ready_future(self.channel).result(timeout=timeout)

    def generate(self, text: str | None = None, *, timeout: float | None = None,
                 **kwargs) -> Iterator[api.GenerateResponse]:
        """Stream responses; breaking out of the loop cancels the request on the server."""
        call = self.stub.Generate(build_request(text, **kwargs), timeout=timeout,
                                  metadata=self.metadata)
        try:
            yield from call
        finally:
            call.cancel()

    def complete(
        self, text: str | None = None, **kwargs
    ) -> tuple[str, list[int], api.GenerateResponse]:
        """Run to the end; return (text, token ids, last response)."""
        parts, ids, last = [], [], None
        for last in self.generate(text, **kwargs):
            parts.append(last.text)
            ids.extend(last.token_ids)
        return "".join(parts), ids, last

    def tokenize(self, text: str) -> list[int]:
        return list(self.stub.Tokenize(api.TokenizeRequest(text=text),
                                       metadata=self.metadata).token_ids)

    def model_info(self) -> api.ModelInfo:
        return self.stub.GetModelInfo(api.GetModelInfoRequest(), metadata=self.metadata)
