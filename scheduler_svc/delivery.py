"""The engine's open requests, keyed by request id: where a step's sampled tokens become one
batch of EngineOutputs for the engine's client, and the one way a request leaves (finished,
aborted, failed or expired)."""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable, Iterable, Iterator

from pagedserve.scheduler.engine_io import EngineError, EngineOutput
from pagedserve.scheduler.outputs import Sampled
from pagedserve.scheduler.request import RequestStatus
from pagedserve.scheduler.telemetry import Telemetry
from pagedserve.scheduler.tracked import Tracked

Emit = Callable[[list[EngineOutput]], None]


class StreamTable:
    def __init__(self, telemetry: Telemetry, finish: Callable[[int], object],
                 emit: Emit | None = None) -> None:
        """`finish(req_id)` takes a request out of the scheduler (its blocks freed at once);
        `emit(batch)` hands the client a step's outputs (None: nobody listens)."""
        self.telemetry, self.finish = telemetry, finish
        self.emit: Emit = emit or (lambda batch: None)
        self._open: dict[int, Tracked] = {}
        # (deadline, req_id) of the requests that have one, soonest first: the step loop
        # checks deadlines every iteration, and a scan of every open one grew with the running
        self._deadlines: list[tuple[float, int]] = []

    def __len__(self) -> int:
        return len(self._open)

    def __iter__(self) -> Iterator[Tracked]:
        return iter(list(self._open.values()))  # a copy: ending a request removes it

    def add(self, t: Tracked) -> None:
        self._open[t.req.req_id] = t
        if t.deadline != float("inf"):
            heapq.heappush(self._deadlines, (t.deadline, t.req.req_id))

    def get(self, req_id: int) -> Tracked | None:
        return self._open.get(req_id)

    def deliver(self, sampled: list[Sampled]) -> None:
        """One output per sampled token, as one batch; a request that ended meanwhile
        (aborted, failed) gets nothing."""
        now, batch = time.monotonic(), []
        for s in sampled:
            t = self._open.get(s.req.req_id)
            if t is None:
                continue
            self.telemetry.token(t, now)
            out = EngineOutput(s.req.req_id, [s.token],
                               [] if s.logprob is None else [s.logprob],
                               s.finish_reason, s.stop_reason)
            if not t.sent_first:
                t.sent_first = True
                out.cached_tokens, out.prompt_logprobs = t.cached_tokens, t.prompt_logprobs
            if s.finish_reason:
                self.leave(t, s.finish_reason, now)
            batch.append(out)
        self.telemetry.flush()
        if batch:
            self.emit(batch)

    def fail(self, tracked: Iterable[Tracked | None], code: str, message: str) -> None:
        """End each request with an error (code: a grpc.StatusCode name)."""
        batch = []
        for t in tracked:
            if t is not None and not t.finished:
                self.leave(t, code.lower())
                batch.append(EngineOutput(t.req.req_id, error=EngineError(code, message)))
        if batch:
            self.emit(batch)

    def expire(self) -> None:
        now, due = time.monotonic(), []
        while self._deadlines and self._deadlines[0][0] < now:
            due.append(self._open.get(heapq.heappop(self._deadlines)[1]))  # None: it ended
        self.fail(due, "DEADLINE_EXCEEDED", "the request's deadline passed")

    def leave(self, t: Tracked, reason: str, now: float | None = None) -> None:
        """The one way a request leaves: logged, and out of the scheduler unless the scheduler
        ended it itself."""
        t.finished = True
        self.telemetry.finished(t, reason, time.monotonic() if now is None else now)
        if t.req.status != RequestStatus.FINISHED:
            self.finish(t.req.req_id)
        self._open.pop(t.req.req_id, None)
