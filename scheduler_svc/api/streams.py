"""A request's output side in the front end: the engine's outputs (token ids) become
UTF-8-safe text, stop strings are matched (a match aborts the request in the engine), and
chunks are queued for the servicer that streams them to the client. OutputProcessor routes
each batch the engine client hands out to the streams it concerns."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pagedserve.scheduler.api.detokenizer import (
    IncrementalDetokenizer,
    StopStringMatcher,
    decoder_of,
)
from pagedserve.scheduler.engine_client import EngineClient
from pagedserve.scheduler.engine_io import EngineError, EngineOutput
from pagedserve.scheduler.outputs import TokenLogprob
from pagedserve.scheduler.request import GenerationParams


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


@dataclass(eq=False, slots=True)
class RequestStream:
    """One completion's output as its front end sees it."""

    req_id: int  # the engine's id
    request_id: str  # the client's (or the one the front end made up)
    prompt: list[int]  # its token ids
    params: GenerationParams
    detok: IncrementalDetokenizer
    matcher: StopStringMatcher
    index: int = 0  # which of its API request's completions (Chunk.index)
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)  # Chunk | EngineError
    finished: bool = False
    num_tokens: int = 0  # output tokens pushed
    cached_tokens: int = 0  # prompt tokens found in the prefix cache (from the first output)
    held: Chunk | None = None  # tokens not yet queued (stream_interval)
    # held tokens of a request without stop strings, not decoded yet: nothing needs their
    # text before their chunk goes out, and one decode of them all then costs what one token's
    # does
    unsent: list[int] = field(default_factory=list)
    unsent_logprobs: list[TokenLogprob] = field(default_factory=list)

    @classmethod
    def open(cls, req_id: int, request_id: str, prompt: list[int], params: GenerationParams,
             tokenizer: Any, decode: Callable | None = None) -> RequestStream:
        return cls(req_id, request_id, prompt, params,
                   IncrementalDetokenizer(tokenizer, params.skip_special_tokens, decode),
                   StopStringMatcher(params.stop))

    @property
    def prompt_len(self) -> int:
        return len(self.prompt)

    def push(self, token: int, finish: str | None, stop_reason: int | str | None,
             interval: int, logprob: TokenLogprob | None = None,
             prompt_logprobs: list[TokenLogprob | None] | None = None) -> Chunk | None:
        """One sampled token (and the engine's finish decision): the chunk to queue now, or
        None while it is held back. The first token goes out at once (with the prompt's
        logprobs, if asked), then every `interval` tokens; a matched stop string ends the
        request here (finish_reason "stop"; the caller aborts it in the engine), but not
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
        if self.num_tokens < self.params.min_tokens:
            text, matched = delta, None
        else:
            text, matched = self.matcher.feed(delta, final=finish is not None)
        if matched is not None:
            finish, stop_reason = "stop", matched
        chunk = Chunk(text, tokens, logprobs=logprobs, index=self.index)
        if self.num_tokens == 1:
            chunk.prompt_logprobs = prompt_logprobs
        if finish:
            chunk.finish_reason, chunk.stop_reason = finish, stop_reason
            chunk.prompt_tokens, chunk.completion_tokens = self.prompt_len, self.num_tokens
        if self.held is not None:
            chunk = self.held.then(chunk)
            self.held = None
        if not finish and self.num_tokens > 1 and self.num_tokens % interval:
            self.held = chunk
            return None
        return chunk


class OutputProcessor:
    """The front ends' end of the engine client: the open streams by engine id, each output
    batch turned into their chunks. A stream whose stop string matched is aborted in the
    engine (reason "stop") before its last chunk is queued."""

    def __init__(self, client: EngineClient, tokenizer: Any, stream_interval: int = 1) -> None:
        if stream_interval < 1:
            raise ValueError(f"stream_interval must be >= 1, got {stream_interval}")
        self.client, self.tokenizer, self.stream_interval = client, tokenizer, stream_interval
        self._decode = decoder_of(tokenizer)
        self._open: dict[int, RequestStream] = {}
        client.subscribe(self.deliver)

    def __len__(self) -> int:
        return len(self._open)

    def open(self, req_id: int, request_id: str, prompt: list[int],
             params: GenerationParams) -> RequestStream:
        """The stream of a request just submitted (before anything awaits: no output of it
        can have come yet)."""
        stream = RequestStream.open(req_id, request_id, prompt, params, self.tokenizer,
                                    self._decode)
        self._open[req_id] = stream
        return stream

    def abort(self, stream: RequestStream, reason: str = "abort") -> None:
        """Stop a stream that has not ended (client gone): out of the engine, no more chunks."""
        if not stream.finished:
            self._close(stream)
            self.client.abort(stream.req_id, reason)

    def deliver(self, batch: list[EngineOutput]) -> None:
        interval = self.stream_interval
        for out in batch:
            stream = self._open.get(out.req_id)
            if stream is None:
                continue
            if out.error is not None:
                self._close(stream)
                stream.queue.put_nowait(out.error)
                continue
            if not stream.num_tokens:
                stream.cached_tokens = out.cached_tokens
            chunk, last = None, len(out.token_ids) - 1
            for i, token in enumerate(out.token_ids):
                chunk = stream.push(token, out.finish_reason if i == last else None,
                                    out.stop_reason, interval,
                                    out.logprobs[i] if out.logprobs else None,
                                    out.prompt_logprobs)
                if chunk is not None and chunk.finish_reason:
                    break
            if chunk is None:
                continue
            if chunk.finish_reason:
                self._close(stream)
                if not out.finish_reason:  # a stop string: the engine did not end it
                    self.client.abort(stream.req_id, chunk.finish_reason)
            stream.queue.put_nowait(chunk)

    def fail_all(self, code: str, message: str) -> int:
        """End every open stream with an error (the drain's timeout), out of the engine too;
        how many there were."""
        streams = list(self._open.values())
        for stream in streams:
            self._close(stream)
            self.client.abort(stream.req_id, code.lower())
            stream.queue.put_nowait(EngineError(code, message))
        return len(streams)

    def _close(self, stream: RequestStream) -> None:
        stream.finished = True
        self._open.pop(stream.req_id, None)
