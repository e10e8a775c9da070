"""The one engine client the API front ends share: submit(EngineRequest), abort(id), the
stream of EngineOutput batches, and model_info() (the model's limits and the cache's size, from
the newest executor's capacity). gRPC and OpenAI HTTP sit side by side on it; neither builds
the other's request types.

This one is in-process: the engine runs in the front ends' process, on their asyncio loop (the
one-process scheduler, `serve` by default). A step's batch is handed to the subscriber (the
front ends' output processor) synchronously, inside the step loop, after the next step was
sent, so a stop string it matches aborts the request before the step after is planned. With
the engine core in a process of its own (`serve --api-server-count N`), the API processes use
engine_remote.RemoteEngineClient, with the same verbs over the engine socket.
"""

from __future__ import annotations

from collections.abc import Callable

from pagedserve.scheduler.engine import Engine
from pagedserve.scheduler.engine_io import EngineError, EngineOutput, EngineRequest, ModelInfo
from pagedserve.scheduler.metrics import Metrics
from pagedserve.scheduler.request import Constraint

Subscriber = Callable[[list[EngineOutput]], None]


class EngineClient:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._subscriber: Subscriber | None = None
        engine.streams.emit = self._deliver

    def subscribe(self, subscriber: Subscriber) -> None:
        """Where every output batch goes from now on (one subscriber: the output processor
        that routes each output to its request's stream)."""
        self._subscriber = subscriber

    def _deliver(self, batch: list[EngineOutput]) -> None:
        if self._subscriber is not None:
            self._subscriber(batch)

    async def submit(self, request: EngineRequest) -> int:
        """Queue a request (its structured-output constraint compiled first, off the step
        loop); its engine id, which its outputs carry. Raises EngineError (UNAVAILABLE while
        draining, RESOURCE_EXHAUSTED with a retry hint when the queue is full) or
        InvalidRequest (a constraint that does not compile). Nothing awaits after the request
        is queued: the caller registers its stream before any output can come."""
        if self.engine.draining:
            raise EngineError("UNAVAILABLE", "server is draining")
        c = request.params.constraint
        grammar = None if c is None else await self.engine.compile(c)
        return self.engine.submit(request, grammar)

    async def compile(self, constraint: Constraint) -> None:
        """Compile a constraint ahead of submit (cached: submit then finds it), to know early
        whether it is valid; InvalidRequest naming the field if not."""
        await self.engine.compile(constraint)

    def abort(self, req_id: int, reason: str = "abort") -> None:
        """End a request (client gone, stop string matched: "stop", deadline passed:
        "deadline_exceeded"); its blocks are free before the next step. No output follows."""
        self.engine.abort(req_id, reason)

    def model_info(self) -> ModelInfo | None:
        """The model's limits and facts; None before an executor has joined."""
        return self.engine.model_info()

    def lora_modules(self) -> list[tuple[str, str]]:
        """The LoRA adapters served now, (name, path) each."""
        return self.engine.lora.registry.modules()

    async def sync_state(self) -> None:
        """(The engine runs in this process: what it serves, this process serves.)"""

    async def load_lora(self, name: str, path: str) -> None:
        """Serve a LoRA adapter from now on (EngineError naming why not)."""
        await self.engine.lora.load(name, path)

    async def unload_lora(self, name: str) -> None:
        await self.engine.lora.unload(name)

    @property
    def serving(self) -> bool:
        return self.engine.serving

    @property
    def draining(self) -> bool:
        return self.engine.draining

    @property
    def leaving(self) -> bool:
        """Shutting down after a delay: not ready, still admitting (Engine.leave_soon)."""
        return self.engine.leaving

    @property
    def metrics(self) -> Metrics:
        """The one set of metrics (the front ends count RPCs, HTTP and tenants there too)."""
        return self.engine.metrics
