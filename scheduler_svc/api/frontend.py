"""The path both API front ends share, on the one engine client: API keys, the model's limits,
tokenizing off the event loop, validation, tenant admission and submission; the Call (or the
CallBatch of a completions batch) each gets back, read as chunks and closed however it ends.
Each front end hands it a GenerationInput built from its own wire format."""

from __future__ import annotations

import asyncio
import dataclasses
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

from pagedserve.core.memory import TrimAfterBurst
from pagedserve.scheduler.api.generation_input import GenerationInput, Prompt, Tokens
from pagedserve.scheduler.api.inputs import InputProcessor, Limits, validate
from pagedserve.scheduler.api.parallel import submit_parallel
from pagedserve.scheduler.api.sampling_defaults import SamplingDefaults
from pagedserve.scheduler.api.streams import Chunk, OutputProcessor, RequestStream
from pagedserve.scheduler.api.tenants import Admission, Tenant, Tenants
from pagedserve.scheduler.engine_io import EngineError, EngineRequest
from pagedserve.scheduler.invalid import InvalidRequest

NO_EXECUTOR = ("no executor has joined the scheduler yet (readiness, health service "
               "'pagedserve.v1.Generation', turns SERVING when one does)")
# Inputs from this size on are tokenized on one thread of their own, so that a burst of them
# takes one core from the running streams rather than all, and are followed by a heap trim.
LARGE_INPUT_BYTES = 64 * 1024
_Out = TypeVar("_Out")
Metadata = Iterable[tuple[str, str | bytes]] | None  # gRPC metadata, or the HTTP headers


@dataclass(eq=False, slots=True)
class Call:
    """An admitted request, as the APIs see it: its chunks (of its n completions, told apart
    by Chunk.index), and close() when it ends."""

    outputs: OutputProcessor
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
            self.outputs.abort(stream, reason)
        if self.admission is not None:
            n = sum(s.num_tokens for s in self.streams)
            self.admission.release(n)
            self.outputs.client.metrics.tenant_generation_tokens[
                self.admission.tenant.name].inc(n)


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
                stream.index += base
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
        return [c.stream.prompt for c in self.calls]

    async def chunks(self) -> AsyncIterator[Chunk]:
        async for chunk in merged_chunks(self.calls[0].stream.queue, len(self.streams)):
            yield chunk

    def close(self, reason: str = "abort") -> None:
        for call in self.calls:
            call.close(reason)


class Frontend:
    def __init__(self, outputs: OutputProcessor, inputs: InputProcessor,
                 tenants: Tenants | None = None,
                 defaults: SamplingDefaults = SamplingDefaults()) -> None:
        """tenants: API keys and what each tenant may ask for; None: open to everyone.
        defaults: the model's sampling defaults (--generation-config)."""
        self.outputs, self.client = outputs, outputs.client
        self.defaults = defaults
        self.inputs = inputs
        self.tenants = tenants
        self.trim = TrimAfterBurst()
        self._large = ThreadPoolExecutor(1, thread_name_prefix="tokenize-large")

    @property
    def lora_modules(self) -> list[tuple[str, str]]:
        """The LoRA adapters a request may name now, (name, path) each (the engine's: those
        of --lora-modules and those loaded at run time)."""
        return self.client.lora_modules()

    @property
    def lora_adapters(self) -> list[str]:
        return [name for name, _ in self.client.lora_modules()]

    def authenticate(self, metadata: Metadata) -> Tenant | None:
        """The tenant of the request's API key (None when the service runs without keys)."""
        if self.tenants is None:
            return None
        try:
            return self.tenants.authenticate(metadata)
        except EngineError:
            self.client.metrics.refused["unauthenticated"].inc()
            raise

    async def serves_adapter(self, adapter: str) -> bool:
        """Whether this server serves the adapter; one this process does not know yet is
        looked for again once it has the engine core's newest list (loaded at run time
        through another API process)."""
        if adapter not in self.lora_adapters:
            await self.client.sync_state()
        return adapter in self.lora_adapters

    async def check_adapter(self, adapter: str, tenant: Tenant | None) -> None:
        """An adapter this server serves (InvalidRequest) and the tenant may use
        (PERMISSION_DENIED)."""
        if not await self.serves_adapter(adapter):
            served = ", ".join(self.lora_adapters) or "none"
            raise InvalidRequest("adapter", f"unknown LoRA adapter {adapter!r} (this server "
                                 f"serves: {served})")
        if tenant is not None:
            tenant.check_adapter(adapter)

    def _admit(self, tenant: Tenant | None, priority: int, prompt_len: int) -> Admission | None:
        if tenant is None:
            return None
        outcomes = self.client.metrics.tenant_requests[tenant.name]
        try:
            admission = self.tenants.admit(tenant, priority, prompt_len)
        except EngineError as e:
            outcomes["denied" if e.code == "PERMISSION_DENIED" else "throttled"].inc()
            raise
        outcomes["admitted"].inc()
        return admission

    def limits(self) -> Limits:
        """The model's limits, known once an executor has joined. Before that the call fails
        at once, as it would against a server still loading its model (vLLM and TGI open their
        port only then): UNAVAILABLE is the code clients retry and gRPC retry policies name.
        After an executor is lost the limits stay known and new requests queue for the next."""
        info = self.client.model_info()
        if info is None:
            raise EngineError("UNAVAILABLE", NO_EXECUTOR)
        return Limits(max_model_len=info.max_model_len, vocab_size=info.vocab_size,
                      defaults=self.defaults)

    async def tokenized(self, work: Callable[[Prompt], _Out], prompt: Prompt,
                        max_model_len: int | None) -> _Out:
        """work(prompt), tokenizing, on a worker thread once the input passed the size check
        (work in proportion to the input never runs on the event loop, which serves every
        stream)."""
        n = self.inputs.input_bytes(prompt)
        try:
            self.inputs.check_size(prompt, n, max_model_len)
            pool = self._large if n >= LARGE_INPUT_BYTES else None
            return await asyncio.get_running_loop().run_in_executor(pool, work, prompt)
        finally:
            if n >= LARGE_INPUT_BYTES:
                self.trim.soon()

    async def start(self, request: GenerationInput, tenant: Tenant | None) -> Call:
        """Tokenize and validate a request (either API's, as the neutral input), then
        submit() it. The caller must close() the Call it gets, however the request ends."""
        if self.client.draining:
            raise EngineError("UNAVAILABLE", "server is draining")
        limits = self.limits()
        prompt = await self.tokenized(self.inputs.prompt_ids, request.prompt,
                                      limits.max_model_len)
        params = validate(request, prompt, limits)
        if request.adapter:
            await self.check_adapter(request.adapter, tenant)
        return await self.submit(EngineRequest(request.request_id, prompt, params,
                                               request.priority, timeout=request.timeout,
                                               adapter=request.adapter), tenant)

    async def submit(self, request: EngineRequest, tenant: Tenant | None) -> Call:
        """Admit a validated request for an authenticated tenant (which bounds its priority
        and quota) and queue its completions on the engine client: the one admission path of
        both APIs. The caller must close() the Call it gets, however the request ends."""
        if (c := request.params.constraint) is not None:  # a schema that does not compile is
            await self.client.compile(c)  # the client's error: it takes no tenant admission
        admission = self._admit(tenant, request.priority, len(request.prompt))
        if admission is not None or tenant is not None:
            request = dataclasses.replace(
                request, priority=admission.priority if admission else request.priority,
                tenant=tenant.name if tenant else "")
        try:
            streams = await submit_parallel(self.outputs, request)
        except BaseException:
            if admission is not None:
                admission.release(0)
            raise
        return Call(self.outputs, streams, admission)

    async def tokenize(self, prompt: Prompt) -> Tokens:
        """An authenticated Tokenize (gRPC's, and the HTTP API's /tokenize)."""
        info = self.client.model_info()  # none yet: the model config's length bounds it
        return await self.tokenized(self.inputs.tokenize, prompt,
                                    info.max_model_len if info else None)


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
