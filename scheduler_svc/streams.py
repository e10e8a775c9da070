"""A request's output side: tokens become UTF-8-safe text, stop strings are matched, and chunks
are queued for the servicer that streams them to the client."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pagedserve.scheduler.detokenizer import IncrementalDetokenizer, StopStringMatcher
from pagedserve.scheduler.metrics import priority_class
from pagedserve.scheduler.outputs import TokenLogprob
from pagedserve.scheduler.request import Request


@dataclass(slots=True)
class Chunk:
    """What one or more steps produced for one request (see GenerateResponse)."""

    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length"
    stop_reason: int | str | None = None  # the stop token's id, or the stop string matched
    prompt_tokens: int = 0
    completion_tokens: int = 0
    logprobs: list[TokenLogprob] = field(default_factory=list)  # per token, if asked for
    index: int = 0  # which of the request's n completions
    # on a completion's first chunk, if asked: each prompt token's (None for the first)
    prompt_logprobs: list[TokenLogprob | None] | None = None

    def then(self, later: Chunk) -> Chunk:
        """This chunk followed by a later one of the same completion, as one (the later one's
        finish and usage win)."""
        return Chunk(self.text + later.text, self.token_ids + later.token_ids,
                     later.finish_reason, later.stop_reason, later.prompt_tokens,
                     later.completion_tokens, self.logprobs + later.logprobs, self.index,
                     self.prompt_logprobs if self.prompt_logprobs is not None
                     else later.prompt_logprobs)


class EngineError(Exception):
    """A request failed inside the engine; `code` is a grpc.StatusCode name."""

    def __init__(self, code: str, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.retry_after_s = retry_after_s


@dataclass(eq=False, slots=True)
class RequestStream:
    req: Request
    detok: IncrementalDetokenizer
    matcher: StopStringMatcher
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)  # Chunk | EngineError
    finished: bool = False
    arrival: float = field(default_factory=time.monotonic)
    scheduled_at: float = 0.0  # first scheduled (0: not yet)
    first_token_at: float = 0.0
    last_token_at: float = 0.0
    deadline: float = float("inf")
    priority_class: str = "0"  # the metrics' priority label
    num_tokens: int = 0  # output tokens pushed
    cached_tokens: int = 0  # prompt tokens found in the prefix cache when first scheduled
    tenant: str = ""  # the API key's tenant ("" when the service runs without keys)
    held: Chunk | None = None  # tokens not yet queued (stream_interval)
    # params.prompt_logprobs: by prompt position, filled as the executor scores them
    prompt_logprobs: list[TokenLogprob | None] | None = None
    prompt_logprobs_missing: int = 0
    # held tokens of a request without stop strings, not decoded yet: nothing needs their
    # text before their chunk goes out, and one decode of them all then costs what one token's
    # does
    unsent: list[int] = field(default_factory=list)
    unsent_logprobs: list[TokenLogprob] = field(default_factory=list)

    @classmethod
    def open(cls, req: Request, tokenizer: Any, decode: Callable,
             timeout: float | None = None) -> RequestStream:
        """`timeout`: seconds the request may live (the client's gRPC deadline)."""
        stream = cls(req, IncrementalDetokenizer(tokenizer, req.params.skip_special_tokens,
                                                 decode), StopStringMatcher(req.params.stop))
        if timeout is not None:
            stream.deadline = stream.arrival + timeout
        stream.priority_class = priority_class(req.priority)
        if req.params.prompt_logprobs is not None:
            stream.prompt_logprobs = [None] * req.prompt_len
            stream.prompt_logprobs_missing = req.prompt_len - 1
            req.needs_prompt_logprobs = req.prompt_len > 1
        return stream

    def record_prompt_logprobs(self, start: int, entries: list[TokenLogprob]) -> None:
        """Prompt tokens start.. scored by a step (again, after a preemption: same values)."""
        if self.prompt_logprobs is None or start + len(entries) > self.req.prompt_len:
            return
        for i, e in enumerate(entries, start):
            self.prompt_logprobs_missing -= self.prompt_logprobs[i] is None
            self.prompt_logprobs[i] = e
        if not self.prompt_logprobs_missing:
            self.req.needs_prompt_logprobs = False

    def push(self, token: int, finish: str | None, stop_reason: int | str | None,
             interval: int, logprob: TokenLogprob | None = None) -> Chunk | None:
        """One sampled token (and the scheduler's finish decision): the chunk to queue now, or
        None while it is held back. The first token goes out at once, then every `interval`
        tokens; a matched stop string ends the request here (finish_reason "stop"), but not
        before min_tokens output tokens (vLLM's rule: text before that is not searched)."""
        n = self.num_tokens = self.num_tokens + 1
        if n % interval and n > 1 and not (finish or self.matcher.stops):
            self.unsent.append(token)
            if logprob is not None:
                self.unsent_logprobs.append(logprob)
            return None
        if self.unsent:
            tokens, self.unsent = self.unsent + [token], []
            delta = self.detok.push_many(tokens)
        else:
            tokens = [token]
            delta = self.detok.push(token)
        logprobs: list[TokenLogprob] = []
        if self.unsent_logprobs:
            logprobs, self.unsent_logprobs = self.unsent_logprobs, []
        if logprob is not None:
            logprobs.append(logprob)
        if finish:
            delta += self.detok.flush()
        if self.num_tokens < self.req.params.min_tokens:
            text, matched = delta, None
        else:
            text, matched = self.matcher.feed(delta, final=finish is not None)
        if matched is not None:
            finish, stop_reason = "stop", matched
        chunk = Chunk(text, tokens, logprobs=logprobs, index=self.req.index)
        if self.num_tokens == 1:
            chunk.prompt_logprobs = self.prompt_logprobs
        if finish:
            chunk.finish_reason, chunk.stop_reason = finish, stop_reason
            chunk.prompt_tokens, chunk.completion_tokens = self.req.prompt_len, self.num_tokens
        if self.held is not None:
            chunk = self.held.then(chunk)
            self.held = None
        if not finish and self.num_tokens > 1 and self.num_tokens % interval:
            self.held = chunk
            return None
        return chunk
