"""The public gRPC servicer: a thin conversion layer between protobuf and the shared front-end
path (frontend.py), which talks to the engine client: a GenerateRequest becomes the neutral
GenerationInput (generation_input.py), whose field paths are the request's own."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import grpc

from pagedserve.protos.v1 import generate_pb2 as api
from pagedserve.protos.v1 import generate_pb2_grpc
from pagedserve.scheduler.api.frontend import Frontend
from pagedserve.scheduler.api.generation_input import (
    Chat,
    GenerationInput,
    Message,
    Prompt,
    Sampling,
    StructuredOutput,
    Tool,
    ToolCall,
)
from pagedserve.scheduler.api.rpc_metrics import past_deadline
from pagedserve.scheduler.api.streams import Chunk

_FINISH = {"stop": api.FINISH_REASON_STOP, "length": api.FINISH_REASON_LENGTH}


class GenerationServicer(generate_pb2_grpc.GenerationServicer):
    def __init__(self, frontend: Frontend, model_name: str) -> None:
        self.frontend = frontend
        self.model_name = model_name

    async def Generate(  # noqa: N802 (gRPC method name)
        self, request: api.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[api.GenerateResponse]:
        tenant = self.frontend.authenticate(context.invocation_metadata())
        call = await self.frontend.start(generation_input(request, context.time_remaining()),
                                         tenant)
        rid = call.stream.request_id
        try:
            async for chunk in call.chunks():
                yield _response(rid, chunk, call.stream.prompt)
        finally:  # the client left or its deadline passed (gRPC cancels us), or the stream
            # ended: free the requests' blocks now
            call.close("deadline_exceeded" if past_deadline(context) else "abort")

    async def Tokenize(  # noqa: N802
        self, request: api.TokenizeRequest, context: grpc.aio.ServicerContext
    ) -> api.TokenizeResponse:
        self.frontend.authenticate(context.invocation_metadata())
        out = await self.frontend.tokenize(prompt_of(request))
        return api.TokenizeResponse(token_ids=out.ids, tokens=out.strings)

    async def GetModelInfo(  # noqa: N802
        self, request: api.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> api.ModelInfo:
        tenant = self.frontend.authenticate(context.invocation_metadata())
        self.frontend.limits()  # UNAVAILABLE before an executor joined
        info = self.frontend.client.model_info()
        return api.ModelInfo(
            model=self.model_name, max_model_len=info.max_model_len, vocab_size=info.vocab_size,
            block_size=info.block_size, num_kv_blocks=info.num_kv_blocks,
            eos_token_ids=info.eos_token_ids, dtype=info.dtype, device=info.device,
            attention_backend=info.attention_backend, kv_cache_dtype=info.kv_cache_dtype,
            speculative_config=info.speculative_config,
            lora_adapters=[a for a in self.frontend.lora_adapters  # the key's tenant's only
                           if tenant is None or tenant.may_use(a)],
        )


def generation_input(request: api.GenerateRequest, timeout: float | None = None
                     ) -> GenerationInput:
    """The request as the front ends' neutral input; timeout: the call's deadline, seconds."""
    return GenerationInput(prompt_of(request), _sampling(request.sampling),
                           request.request_id, request.priority, timeout, request.adapter)


def prompt_of(request: api.GenerateRequest | api.TokenizeRequest) -> Prompt:
    kind = request.WhichOneof("input")
    if kind == "text":
        return request.text
    if kind == "token_ids":
        return list(request.token_ids.ids)
    if kind == "chat":
        chat = request.chat
        return Chat(tuple(Message(m.role, m.content, tuple(
                        ToolCall(c.id, c.name, c.arguments) for c in m.tool_calls),
                        m.tool_call_id) for m in chat.messages),
                    tuple(Tool(t.name, t.description, t.parameters) for t in chat.tools))
    return None


def _sampling(s: api.SamplingParams) -> Sampling:
    def opt(name: str) -> Any:
        return getattr(s, name) if s.HasField(name) else None

    return Sampling(
        max_tokens=opt("max_tokens"), temperature=opt("temperature"), top_k=opt("top_k"),
        top_p=opt("top_p"), seed=opt("seed"), stop=tuple(s.stop),
        stop_token_ids=tuple(s.stop_token_ids), ignore_eos=s.ignore_eos,
        include_special_tokens=s.include_special_tokens,
        presence_penalty=opt("presence_penalty"), frequency_penalty=opt("frequency_penalty"),
        repetition_penalty=opt("repetition_penalty"), min_p=opt("min_p"),
        logit_bias=tuple(s.logit_bias.items()), min_tokens=s.min_tokens,
        logprobs=opt("logprobs"), prompt_logprobs=opt("prompt_logprobs"), n=opt("n"),
        structured=_structured(s))


def _structured(s: api.SamplingParams) -> StructuredOutput | None:
    kind = s.WhichOneof("constraint")
    if kind is None:
        return None
    if kind == "choice":
        return StructuredOutput(kind, tuple(s.choice.choices))
    return StructuredOutput(kind, getattr(s, kind))


def _response(request_id: str, chunk: Chunk, prompt: list[int]) -> api.GenerateResponse:
    """prompt: the request's token ids."""
    resp = api.GenerateResponse(request_id=request_id, text=chunk.text, token_ids=chunk.token_ids,
                                index=chunk.index)
    for tok, lp in zip(chunk.token_ids, chunk.logprobs, strict=False):
        resp.logprobs.add(token_id=tok, logprob=lp.logprob, top_token_ids=lp.top_ids,
                          top_logprobs=lp.top_logprobs)
    if chunk.prompt_logprobs is not None:
        for tok, lp in zip(prompt, chunk.prompt_logprobs, strict=False):
            if lp is not None:  # the first prompt token has none: not sent
                resp.prompt_logprobs.add(token_id=tok, logprob=lp.logprob, rank=lp.rank,
                                         top_token_ids=lp.top_ids, top_logprobs=lp.top_logprobs)
    if chunk.finish_reason:
        resp.finish_reason = _FINISH[chunk.finish_reason]
        if isinstance(chunk.stop_reason, str):
            resp.stop_string = chunk.stop_reason
        elif chunk.stop_reason is not None:
            resp.stop_token_id = chunk.stop_reason
        if chunk.stop_reason is not None:  # for clients built before the oneof
            resp.stop_reason = str(chunk.stop_reason)
        resp.usage.prompt_tokens = chunk.prompt_tokens
        resp.usage.completion_tokens = chunk.completion_tokens
    return resp
