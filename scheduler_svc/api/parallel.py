"""n > 1: one prompt, n completions, each its own Request (own tokens, blocks, seed and
finish), their chunks on one shared queue, told apart by Chunk.index.

The prompt is computed once: completions 1..n-1 wait in the queue (Scheduler._waits_for_first)
until completion 0's whole prompt has been scheduled, then find its blocks in the prefix cache,
shared by reference count, and compute only what is not in a full block (at most
block_size - 1 tokens each). Why not fork completion 0's block table instead: the prefix cache
already does reference-counted sharing, eviction and the accounting that preemption and abort
rely on; a fork would be a second path through all of that for the same saving. Without prefix
caching the completions do not wait and each computes the prompt.
"""

from __future__ import annotations

import asyncio
import dataclasses

from pagedserve.scheduler.api.streams import OutputProcessor, RequestStream
from pagedserve.scheduler.engine_io import EngineError, EngineRequest

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15  # odd: i -> seed + i * _GOLDEN is a bijection of 64-bit ints


def child_seed(seed: int, index: int) -> int:
    """Completion `index`'s seed: the request's seed itself for 0, distinct for each index
    (the sampler scrambles it with the position, so nearby seeds draw unrelated tokens)."""
    return (seed + index * _GOLDEN) & _MASK64


async def submit_parallel(outputs: OutputProcessor, request: EngineRequest
                          ) -> list[RequestStream]:
    """Queue request.params.n completions of one prompt; their streams share streams[0].queue.
    All or none: if one is refused (queue full), those already queued are aborted. Each is
    matched against the constraint on its own. The prompt counts once, as OpenAI's usage
    counts it: in the prompt-token metric, and in the tenant's tokens per minute (charged
    once by the servicer at admission, the n completions' tokens when the call ends)."""
    streams: list[RequestStream] = []
    queue: asyncio.Queue = asyncio.Queue()
    params = request.params
    try:
        for i in range(params.n):
            one = request if i == 0 else dataclasses.replace(
                request, sibling_of=streams[0].req_id,
                params=dataclasses.replace(  # completion 0 scores the prompt
                    params, prompt_logprobs=None,
                    seed=None if params.seed is None else child_seed(params.seed, i)))
            req_id = await outputs.client.submit(one)
            # nothing has run since submit queued it: the stream can still be opened
            name = streams[0].request_id if streams else request.request_id or f"req-{req_id}"
            stream = outputs.open(req_id, name, request.prompt, one.params)
            stream.queue, stream.index = queue, i
            streams.append(stream)
    except EngineError:
        for s in streams:
            outputs.abort(s)
        raise
    return streams
