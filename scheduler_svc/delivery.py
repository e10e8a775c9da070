"""The open streams, keyed by request id: where sampled tokens become chunks on their queues,
and the one way a request leaves (finished, aborted, failed or expired)."""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable, Iterable, Iterator

from pagedserve.scheduler.outputs import Sampled
from pagedserve.scheduler.request import RequestStatus
from pagedserve.scheduler.streams import EngineError, RequestStream
from pagedserve.scheduler.telemetry import Telemetry


class StreamTable:
    def __init__(self, telemetry: Telemetry, finish: Callable[[int], object],
                 stream_interval: int = 1) -> None:
        """`finish(req_id)` takes a request out of the scheduler (its blocks freed at once)."""
        if stream_interval < 1:
            raise ValueError(f"stream_interval must be >= 1, got {stream_interval}")
        self.telemetry, self.finish, self.stream_interval = telemetry, finish, stream_interval
        self._open: dict[int, RequestStream] = {}
        # (deadline, req_id) of the streams that have one, soonest first: the step loop checks
        # deadlines every iteration, and a scan of every open stream grew with the running
        self._deadlines: list[tuple[float, int]] = []

    def __len__(self) -> int:
        return len(self._open)

    def __iter__(self) -> Iterator[RequestStream]:
        return iter(list(self._open.values()))  # a copy: ending a stream removes it

    def add(self, stream: RequestStream) -> None:
        self._open[stream.req.req_id] = stream
        if stream.deadline != float("inf"):
            heapq.heappush(self._deadlines, (stream.deadline, stream.req.req_id))

    def get(self, req_id: int) -> RequestStream | None:
        return self._open.get(req_id)

    def deliver(self, sampled: list[Sampled]) -> None:
        """Queue each token's text for its stream; a stream that ended meanwhile (aborted,
        failed) gets nothing."""
        now = time.monotonic()
        for s in sampled:
            stream = self._open.get(s.req.req_id)
            if stream is None:
                continue
            self.telemetry.token(stream, now)
            chunk = stream.push(s.token, s.finish_reason, s.stop_reason, self.stream_interval,
                                s.logprob)
            if chunk is None:
                continue
            if chunk.finish_reason:
                self.leave(stream, chunk.finish_reason, now)
            stream.queue.put_nowait(chunk)
        self.telemetry.flush()

    def fail(self, streams: Iterable[RequestStream | None], code: str, message: str) -> None:
        """End each stream with an error (code: a grpc.StatusCode name)."""
        for stream in streams:
            if stream is not None and not stream.finished:
                self.leave(stream, code.lower())
                stream.queue.put_nowait(EngineError(code, message))

    def expire(self) -> None:
        now, due = time.monotonic(), []
        while self._deadlines and self._deadlines[0][0] < now:
            due.append(self._open.get(heapq.heappop(self._deadlines)[1]))  # None: it ended
        self.fail(due, "DEADLINE_EXCEEDED", "the request's deadline passed")

    def leave(self, stream: RequestStream, reason: str, now: float | None = None) -> None:
        """The one way a request leaves: logged, and out of the scheduler unless the scheduler
        ended it itself."""
        stream.finished = True
        self.telemetry.finished(stream, reason, time.monotonic() if now is None else now)
        if stream.req.status != RequestStatus.FINISHED:
            self.finish(stream.req.req_id)
        self._open.pop(stream.req.req_id, None)
