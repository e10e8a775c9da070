"""The LoRA adapters requests may name, owned by the engine core: those of --lora-modules (ids
1..N, which the executor reads at start) and those loaded at run time (ids after them, never
reused: a name unloaded and loaded again gets a new id, so its prefix-cache keys and its slot
never meet the old adapter's)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from pagedserve.protos.internal.v1 import executor_pb2 as pb
from pagedserve.scheduler.engine_io import EngineError

if TYPE_CHECKING:
    from pagedserve.scheduler.executor_link import ExecutorLink
    from pagedserve.scheduler.scheduler import Scheduler

log = logging.getLogger(__name__)


class LoraRegistry:
    def __init__(self, modules: tuple[tuple[str, str], ...] = ()) -> None:
        self._by_name = {name: (i + 1, path) for i, (name, path) in enumerate(modules)}
        self.names: dict[int, str] = {i + 1: name for i, (name, _) in enumerate(modules)}
        self.num_static = len(modules)
        self._next = len(modules) + 1
        self.pending: set[str] = set()  # names being loaded (their executor has not answered)

    def id_of(self, name: str) -> int | None:
        entry = self._by_name.get(name)
        return None if entry is None else entry[0]

    def modules(self) -> list[tuple[str, str]]:
        """(name, path) of every adapter served now, in the order they came."""
        return [(name, path) for name, (_, path) in
                sorted(self._by_name.items(), key=lambda kv: kv[1][0])]

    def added(self) -> list[tuple[int, str, str]]:
        """(id, name, path) of those loaded at run time: what a new executor must be given."""
        return [(i, name, path) for name, (i, path) in self._by_name.items()
                if i > self.num_static]

    def reserve(self) -> int:
        """A new id (used or not, it is never handed out again)."""
        self._next += 1
        return self._next - 1

    def add(self, adapter_id: int, name: str, path: str) -> None:
        self._by_name[name] = (adapter_id, path)
        self.names[adapter_id] = name

    def remove(self, name: str) -> int:
        adapter_id, _ = self._by_name.pop(name)
        del self.names[adapter_id]
        return adapter_id


LOAD_TIMEOUT_S = 120.0  # an adapter's read by the executor (a large one from a slow disk)


class LoraAdmin:
    """Loading and unloading adapters at run time: the registry, the executor's answers, and
    the running requests an unload must not pull an adapter from."""

    def __init__(self, registry: LoraRegistry, link: ExecutorLink,
                 scheduler: Callable[[], Scheduler | None]) -> None:
        self.registry, self.link, self._scheduler = registry, link, scheduler
        self.on_change: Callable[[], None] = lambda: None  # the engine host tells the APIs
        self._waiters: dict[int, asyncio.Future] = {}
        link.on_lora_updated = self._on_updated

    async def load(self, name: str, path: str) -> None:
        """Read a new adapter on the executor; EngineError naming the problem otherwise."""
        reg = self.registry
        if reg.id_of(name) is not None or name in reg.pending:
            raise EngineError("ALREADY_EXISTS", f"LoRA adapter {name!r} is already loaded")
        if not self.link.connected.is_set():
            raise EngineError("UNAVAILABLE", "no executor is joined; retry", retry_after_s=1.0)
        adapter_id = reg.reserve()
        reg.pending.add(name)
        fut = self._waiters[adapter_id] = asyncio.get_running_loop().create_future()
        try:
            await self.link.send_lora_update(pb.LoraUpdate(adapter_id=adapter_id, name=name,
                                                           path=path))
            error = await asyncio.wait_for(fut, LOAD_TIMEOUT_S)
        except (TimeoutError, ConnectionError) as e:
            raise EngineError("UNAVAILABLE", f"the executor did not load LoRA adapter {name!r} "
                              f"({e or 'no answer'}); retry", retry_after_s=1.0) from None
        finally:
            reg.pending.discard(name)
            self._waiters.pop(adapter_id, None)
        if error:
            raise EngineError("INVALID_ARGUMENT", error)
        reg.add(adapter_id, name, path)
        log.info("LoRA adapter %r loaded (id %d) from %s", name, adapter_id, path)
        self.on_change()

    async def unload(self, name: str) -> None:
        """Stop serving an adapter that no request waits for or runs on."""
        adapter_id = self.registry.id_of(name)
        if adapter_id is None:
            raise EngineError("NOT_FOUND", f"LoRA adapter {name!r} is not loaded")
        sched = self._scheduler()
        users = 0 if sched is None else sum(
            1 for r in sched.requests.values() if r.lora_id == adapter_id)
        if users:
            raise EngineError("FAILED_PRECONDITION", f"{users} requests of LoRA adapter "
                              f"{name!r} are queued or running; unload it once they end")
        self.registry.remove(name)
        if sched is not None and sched.lora is not None:
            sched.lora.forget(adapter_id)
        log.info("LoRA adapter %r unloaded (id %d)", name, adapter_id)
        self.on_change()
        if self.link.connected.is_set():  # its host memory back (no answer awaited)
            with contextlib.suppress(ConnectionError):
                await self.link.send_lora_update(pb.LoraUpdate(adapter_id=adapter_id,
                                                               name=name, remove=True))

    def rejoin(self) -> None:
        """A new executor holds only --lora-modules: it is given those loaded at run time
        right after its Welcome, before any plan. One that fails there is logged (requests of
        it then fail their steps)."""
        self.link.after_welcome = [
            pb.SchedulerMessage(lora_update=pb.LoraUpdate(adapter_id=i, name=name, path=path))
            for i, name, path in self.registry.added()]

    def fail_pending(self, why: str) -> None:
        """The executor is gone: the loads it was reading get no answer."""
        for fut in self._waiters.values():
            if not fut.done():
                fut.set_exception(ConnectionError(f"the executor was lost: {why}"))

    def _on_updated(self, u: pb.LoraUpdated) -> None:
        fut = self._waiters.pop(u.adapter_id, None)
        if fut is not None and not fut.done():
            fut.set_result(u.error)
        elif u.error:  # a new executor could not read an adapter loaded at run time
            name = self.registry.names.get(u.adapter_id)
            log.error("LoRA adapter %r (id %d) is no longer served: the executor that joined "
                      "could not read it: %s", name, u.adapter_id, u.error)
            if name is not None and self.registry.id_of(name) == u.adapter_id:
                sched = self._scheduler()
                if sched is None or not any(r.lora_id == u.adapter_id
                                            for r in sched.requests.values()):
                    self.registry.remove(name)
                    self.on_change()
