"""The public gRPC servicer: a thin conversion layer between protobuf and the engine."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

import grpc

from pagedserve.core.memory import TrimAfterBurst
from pagedserve.protos.v1 import generate_pb2 as api
from pagedserve.protos.v1 import generate_pb2_grpc
from pagedserve.scheduler.api.inputs import InputProcessor, Limits, validate
from pagedserve.scheduler.api.rpc_metrics import past_deadline
from pagedserve.scheduler.api.tenants import Admission, Tenant, Tenants
from pagedserve.scheduler.engine import Engine
from pagedserve.scheduler.parallel import submit_parallel
from pagedserve.scheduler.streams import Chunk, EngineError, RequestStream

_FINISH = {"stop": api.FINISH_REASON_STOP, "length": api.FINISH_REASON_LENGTH}
NO_EXECUTOR = ("no executor has joined the scheduler yet (readiness, health service "
               "'pagedserve.v1.Generation', turns SERVING when one does)")
# Inputs from this size on are tokenized on one thread of their own, so that a burst of them
# takes one core from the running streams rather than all, and are followed by a heap trim.
LARGE_INPUT_BYTES = 64 * 1024
_In = TypeVar("_In", api.GenerateRequest, api.TokenizeRequest)
_Out = TypeVar("_Out")
Metadata = Iterable[tuple[str, str | bytes]] | None  # gRPC metadata, or the HTTP headers


@dataclass(eq=False, slots=True)
class Call:
    """An admitted request, as the APIs see it: its chunks (of its n completions, told apart
    by Chunk.index), and close() when it ends."""

    engine: Engine
    streams: list[RequestStream]  # one per completion; they share streams[0].queue (a
    # CallBatch re-points a later prompt's to its first Call's queue: read the batch's chunks)
    admission: Admission | None
    closed: bool = False

    @property
    def stream(self) -> RequestStream:
        """The first completion's stream (its request id, prompt and cached tokens)."""
        return self.streams[0]

    async def chunks(self) -> AsyncIterator[Chunk]:
        """The output until every completion finished; an engine error is raised after the
        chunks queued before it."""
        async for chunk in merged_chunks(self.stream.queue, len(self.streams)):
            yield chunk

    def close(self, reason: str = "abort") -> None:
        """Free the requests' blocks now (client gone, or the streams ended; reason is what the
        request log and metrics say of one not finished) and settle the tenant's accounts;
        only the first call counts."""
        if self.closed:
            return
        self.closed = True
        for stream in self.streams:
            self.engine.abort(stream, reason)
        if self.admission is not None:
            n = sum(s.num_tokens for s in self.streams)
            self.admission.release(n)
            self.engine.metrics.tenant_generation_tokens[self.admission.tenant.name].inc(n)


class CallBatch:
    """The Calls of one API request as one: a completions request's batch of prompts, one Call
    each (admitted, validated and charged as separate requests), or a single Call. Their
    streams share the first Call's queue; prompt p's completion j is Chunk.index p * n + j,
    the order of OpenAI's choices."""

    def __init__(self) -> None:
        self.calls: list[Call] = []

    def add(self, call: Call) -> None:
        """The next prompt's Call, added before anything awaits after its start (so nothing
        is on its queue yet and its streams can be re-pointed)."""
        if self.calls:
            base = len(self.calls) * len(call.streams)
            for stream in call.streams:
                assert stream.queue.empty()
                stream.queue = self.calls[0].stream.queue
                stream.req.index += base
        self.calls.append(call)

    @property
    def n(self) -> int:
        """Completions per prompt."""
        return len(self.calls[0].streams)

    @property
    def streams(self) -> list[RequestStream]:
        return [s for c in self.calls for s in c.streams]

    @property
    def prompts(self) -> list[list[int]]:
        """Each prompt's token ids."""
        return [c.stream.req.token_ids[:c.stream.req.prompt_len] for c in self.calls]

    async def chunks(self) -> AsyncIterator[Chunk]:
        async for chunk in merged_chunks(self.calls[0].stream.queue, len(self.streams)):
            yield chunk

    def close(self, reason: str = "abort") -> None:
        for call in self.calls:
            call.close(reason)


class GenerationServicer(generate_pb2_grpc.GenerationServicer):
    def __init__(self, engine: Engine, inputs: InputProcessor, model_name: str,
                 tenants: Tenants | None = None) -> None:
        """tenants: API keys and what each tenant may ask for; None: open to everyone."""
        self.engine = engine
        self.inputs = inputs
        self.model_name = model_name
        self.tenants = tenants
        self.trim = TrimAfterBurst()
        self._large = ThreadPoolExecutor(1, thread_name_prefix="tokenize-large")

    def authenticate(self, metadata: Metadata) -> Tenant | None:
        """The tenant of the request's API key (None when the service runs without keys)."""
        if self.tenants is None:
            return None
        try:
            return self.tenants.authenticate(metadata)
        except EngineError:
            self.engine.metrics.refused["unauthenticated"].inc()
            raise

    def _admit(self, tenant: Tenant | None, priority: int, prompt_len: int) -> Admission | None:
        if tenant is None:
            return None
        outcomes = self.engine.metrics.tenant_requests[tenant.name]
        try:
            admission = self.tenants.admit(tenant, priority, prompt_len)
        except EngineError as e:
            outcomes["denied" if e.code == "PERMISSION_DENIED" else "throttled"].inc()
            raise
        outcomes["admitted"].inc()
        return admission

    def _limits(self) -> Limits:
        """The model's limits, known once an executor has joined. Before that the call fails
        at once, as it would against a server still loading its model (vLLM and TGI open their
        port only then): UNAVAILABLE is the code clients retry and gRPC retry policies name.
        After an executor is lost the limits stay known and new requests queue for the next."""
        cap = self.engine.capacity()
        if cap is None:
            raise EngineError("UNAVAILABLE", NO_EXECUTOR)
        return Limits(max_model_len=cap.max_model_len, vocab_size=cap.vocab_size)

    async def _tokenized(self, work: Callable[[_In], _Out], request: _In,
                         max_model_len: int | None) -> _Out:
        """work(request), tokenizing, on a worker thread once the input passed the size check
        (work in proportion to the input never runs on the event loop, which serves every
        stream)."""
        n = self.inputs.input_bytes(request)
        try:
            self.inputs.check_size(request, n, max_model_len)
            pool = self._large if n >= LARGE_INPUT_BYTES else None
            return await asyncio.get_running_loop().run_in_executor(pool, work, request)
        finally:
            if n >= LARGE_INPUT_BYTES:
                self.trim.soon()

    async def start(self, request: api.GenerateRequest, tenant: Tenant | None,
                    timeout: float | None) -> Call:
        """Validate and admit an authenticated request, and queue it; the HTTP API calls this
        too, so that both APIs share validation, tenants, admission control and deadlines.
        The caller must close() the Call it gets, however the request ends."""
        if self.engine.draining:
            raise EngineError("UNAVAILABLE", "server is draining")
        limits = self._limits()
        prompt = await self._tokenized(self.inputs.prompt_ids, request, limits.max_model_len)
        params = validate(request, prompt, limits)
        grammar = None if params.constraint is None else \
            await self.engine.compile(params.constraint)
        admission = self._admit(tenant, request.priority, len(prompt))
        try:
            streams = submit_parallel(self.engine, request.request_id, prompt, params,
                                      admission.priority if admission else request.priority,
                                      timeout=timeout, grammar=grammar)
        except EngineError:
            if admission is not None:
                admission.release(0)
            raise
        for stream in streams:
            stream.tenant = tenant.name if tenant else ""
        return Call(self.engine, streams, admission)

    async def Generate(  # noqa: N802 (gRPC method name)
        self, request: api.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[api.GenerateResponse]:
        tenant = self.authenticate(context.invocation_metadata())
        call = await self.start(request, tenant, context.time_remaining())
        rid = call.stream.req.external_id
        try:
            async for chunk in call.chunks():
                yield _response(rid, chunk, call.stream.req.token_ids)
        finally:  # the client left or its deadline passed (gRPC cancels us), or the stream
            # ended: free the requests' blocks now
            call.close("deadline_exceeded" if past_deadline(context) else "abort")

    async def Tokenize(  # noqa: N802
        self, request: api.TokenizeRequest, context: grpc.aio.ServicerContext
    ) -> api.TokenizeResponse:
        self.authenticate(context.invocation_metadata())
        return await self.tokenize(request)

    async def tokenize(self, request: api.TokenizeRequest) -> api.TokenizeResponse:
        """An authenticated Tokenize (the HTTP API's /tokenize too)."""
        cap = self.engine.capacity()  # none yet: the model config's length bounds it
        return await self._tokenized(self.inputs.tokenize, request,
                                     cap.max_model_len if cap else None)

    async def GetModelInfo(  # noqa: N802
        self, request: api.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> api.ModelInfo:
        self.authenticate(context.invocation_metadata())
        self._limits()
        cap = self.engine.capacity()
        return api.ModelInfo(
            model=self.model_name, max_model_len=cap.max_model_len, vocab_size=cap.vocab_size,
            block_size=cap.block_size, num_kv_blocks=cap.num_kv_blocks,
            eos_token_ids=sorted(self.engine.eos_token_ids), dtype=cap.dtype, device=cap.device,
            attention_backend=cap.attention_backend, kv_cache_dtype=cap.kv_cache_dtype,
        )


async def merged_chunks(queue: asyncio.Queue, n: int) -> AsyncIterator[Chunk]:
    """The chunks of n completions sharing a queue, until each has finished; an EngineError
    on the queue is raised. Chunks of one completion that queued while the last write was on
    its way go out as one message: a slow client or a busy server sends fewer, larger
    messages, not a backlog."""
    held: deque = deque()  # taken off the queue, not sent yet (another completion's, an error)
    while n:
        item = held.popleft() if held else await queue.get()
        if isinstance(item, EngineError):
            raise item
        while not item.finish_reason and (held or not queue.empty()):
            nxt = held.popleft() if held else queue.get_nowait()
            if isinstance(nxt, EngineError) or nxt.index != item.index:
                held.appendleft(nxt)
                break
            item = item.then(nxt)
        yield item
        if item.finish_reason:
            n -= 1


def _response(request_id: str, chunk: Chunk, token_ids: list[int]) -> api.GenerateResponse:
    """token_ids: the request's, its prompt first."""
    resp = api.GenerateResponse(request_id=request_id, text=chunk.text, token_ids=chunk.token_ids,
                                index=chunk.index)
    for tok, lp in zip(chunk.token_ids, chunk.logprobs, strict=False):
        resp.logprobs.add(token_id=tok, logprob=lp.logprob, top_token_ids=lp.top_ids,
                          top_logprobs=lp.top_logprobs)
    if chunk.prompt_logprobs is not None:
        for tok, lp in zip(token_ids, chunk.prompt_logprobs, strict=False):
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
