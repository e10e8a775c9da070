"""The OpenAI-compatible HTTP API (Starlette on uvicorn), served by the scheduler process on the
gRPC server's asyncio loop: a request goes through GenerationServicer.start, the same path as a
gRPC Generate call (tenants, validation, admission, deadline), then straight to the engine.

    POST /v1/completions, POST /v1/chat/completions   (stream: server-sent events)
    GET /v1/models, GET /health (readiness: 200 when an executor is joined, else 503)
"""

from __future__ import annotations

import asyncio
import json
import math
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from pagedserve.scheduler.inputs import InvalidRequest
from pagedserve.scheduler.openai_logprobs import (
    TokenText,
    chat_logprobs,
    completion_logprobs,
    prompt_logprobs,
)
from pagedserve.scheduler.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    OpenAIError,
    invalid,
    parse,
    to_generate,
)
from pagedserve.scheduler.openai_tools import CallStream, ToolMode, read_calls, tool_mode
from pagedserve.scheduler.servicer import Call, GenerationServicer
from pagedserve.scheduler.streams import Chunk, EngineError

# JSON escapes at most double the UTF-8 bytes of a prompt (a non-ASCII character as \uXXXX); the
# MiB is for the request's other fields (a JSON schema, tools, logit_bias).
BODY_SLACK_BYTES = 1 << 20
LARGE_BODY_BYTES = 256 * 1024  # parsed on a worker thread; followed by a heap trim
TIMEOUT_HEADER = "x-request-timeout"  # seconds the request may live, as a gRPC deadline
_DUMPS = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode


class OpenAIApp:
    def __init__(self, servicer: GenerationServicer, model_name: str) -> None:
        self.gen, self.engine, self.model_name = servicer, servicer.engine, model_name
        self.created = int(time.time())
        self.token_text = TokenText(servicer.inputs.tok)
        self.app = Starlette(routes=[
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
        ], exception_handlers={HTTPException: _http_error, OpenAIError: _error})

    async def health(self, request: Request) -> Response:
        if self.engine.serving:
            return JSONResponse({"status": "ok"})
        why = "draining" if self.engine.draining else "no executor has joined"
        return JSONResponse({"status": why}, status_code=503)

    async def models(self, request: Request) -> Response:
        self._authenticate(request)
        card: dict[str, Any] = {"id": self.model_name, "object": "model",
                                "created": self.created, "owned_by": "pagedserve"}
        if (cap := self.engine.link.capacity) is not None:
            card["max_model_len"] = cap.max_model_len
        return JSONResponse({"object": "list", "data": [card]})

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, CompletionRequest)

    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, ChatCompletionRequest)

    async def _body(self, request: Request) -> bytes:
        """The request body, read as it arrives and refused (413) as soon as it is known to be
        over the limit: from its Content-Length, else once that many bytes came; the rest is
        never held (uvicorn drops what follows a response)."""
        cap = self.engine.link.capacity
        most = body_limit(self.gen.inputs.byte_limit(cap.max_model_len if cap else None))
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > most:
            raise _too_large(f"{int(declared)} bytes", most)
        parts, n = [], 0
        async for part in request.stream():
            n += len(part)
            if n > most:
                self.gen.trim.soon()
                raise _too_large(f"more than {most} bytes", most)
            parts.append(part)
        if n >= LARGE_BODY_BYTES:
            self.gen.trim.soon()
        return b"".join(parts)

    def _authenticate(self, request: Request) -> Any:
        try:
            return self.gen.authenticate([("authorization", request.headers.get(
                "authorization", ""))])
        except EngineError as e:
            raise OpenAIError(401, str(e), code="invalid_api_key") from None

    async def _generate(self, request: Request, model: type) -> Response:
        tenant = self._authenticate(request)
        body = await self._body(request)
        req = parse(model, body) if len(body) < LARGE_BODY_BYTES else \
            await asyncio.to_thread(parse, model, body)
        if req.model != self.model_name:
            raise OpenAIError(404, f"The model '{req.model}' does not exist; this server "
                              f"serves '{self.model_name}'", "model", "model_not_found")
        if req.stream_options is not None and not req.stream:
            raise OpenAIError(400, "stream_options: only allowed with stream: true",
                              "stream_options")
        chat = model is ChatCompletionRequest
        rid = request.headers.get("x-request-id") or \
            f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        tools = tool_mode(req.tools, req.tool_choice, req.parallel_tool_calls) if chat else None
        try:
            call = await self.gen.start(to_generate(req, rid, tools), tenant, _timeout(request))
        except InvalidRequest as e:
            raise invalid(str(e), req) from None
        except EngineError as e:
            raise OpenAIError.from_grpc(e.code, str(e), e.retry_after_s) from None
        usage = req.stream_options is not None and req.stream_options.include_usage
        shape = _Shape(rid, self.model_name, chat, usage, len(call.streams),
                       self.token_text if call.stream.req.params.logprobs is not None else None,
                       self.token_text, tools)
        headers = {"x-request-id": rid}
        if not req.stream:
            return await _complete(request, call, shape, headers)
        return _EventStream(_events(call, shape, usage), call, media_type="text/event-stream",
                            headers={**headers, "cache-control": "no-cache"})


class _Shape:
    """The response objects of one request (its n choices); a streamed chunk without logprobs
    has its JSON built around its text (json-encoding only that), since each token of every
    stream goes through here. logprobs: set when the request asked for them."""

    def __init__(self, rid: str, model: str, chat: bool, include_usage: bool, n: int,
                 logprobs: TokenText | None, text: TokenText, tools: ToolMode | None) -> None:
        self.rid, self.model, self.chat, self.logprobs, self.text = rid, model, chat, \
            logprobs, text
        self.tools = tools  # calls are read out of each choice's text
        self.calls = [CallStream(tools) for _ in range(n)] if tools is not None else []
        self.created = int(time.time())
        self.kind = "chat.completion" if chat else "text_completion"
        self.offsets = [0] * n  # completions' text_offset: characters each choice sent
        head = _DUMPS({"id": rid, "object": self.kind + (".chunk" if chat else ""),
                       "created": self.created, "model": model})[:-1]
        self._heads = [(f'data: {head},"choices":[{{"index":{i},' +
                        ('"delta":{"content":' if chat else '"text":')).encode()
                       for i in range(n)]
        self._tail = (("}" if chat else "") + ',"logprobs":null,"finish_reason":null}]' +
                      (',"usage":null' if include_usage else "") + "}\n\n").encode()

    def delta(self, index: int, text: str) -> bytes:
        return self._heads[index] + _DUMPS(text).encode() + self._tail

    def obj(self, choices: list[dict], streamed: bool, **fields: Any) -> dict:
        """A response object (a streamed chunk, or the whole answer) with more fields (usage)."""
        kind = self.kind + (".chunk" if self.chat and streamed else "")
        return {"id": self.rid, "object": kind, "created": self.created, "model": self.model,
                "choices": choices, **fields}

    def choice(self, index: int, text: str | None, chunk: Chunk | None, finish: bool,
               final: bool) -> dict:
        """A choice: the whole message (final) or a streamed delta, with the logprobs of the
        chunk's tokens and, if finish, its finish reason (and the calls read from the text)."""
        reason = chunk.finish_reason if finish and chunk is not None else None
        calls = None
        if self.tools is not None and final:
            text, calls, reason = read_calls(self.tools, text or "", reason or "")
        elif self.tools is not None:
            text = self.calls[index].feed(text or "") or None
            if finish:
                rest, calls, reason = self.calls[index].finish(reason or "")
                text = (text or "") + rest or None
        if self.chat:
            body = {"message": {"role": "assistant", "content": text}} if final else \
                {"delta": {} if text is None else {"content": text}}
            if calls is not None:
                key = "message" if final else "delta"
                body[key]["tool_calls"] = calls if final else \
                    [{"index": i, **c} for i, c in enumerate(calls)]
        else:
            body = {"text": text or ""}
        logprobs = None
        if self.logprobs is not None and chunk is not None:
            if self.chat:
                logprobs = chat_logprobs(self.text, chunk.token_ids, chunk.logprobs)
            else:
                logprobs, self.offsets[index] = completion_logprobs(
                    self.text, chunk.token_ids, chunk.logprobs, self.offsets[index])
        end = chunk if finish else None
        out = {"index": index, **body, "logprobs": logprobs, "finish_reason": reason,
               "stop_reason": end.stop_reason if end else None}  # vLLM's: what matched
        return out

    def prompt_logprobs(self, call: Call, whole: Chunk) -> dict:
        """vLLM's prompt_logprobs field, if the request asked."""
        if whole.prompt_logprobs is None:
            return {}
        req = call.stream.req
        return {"prompt_logprobs": prompt_logprobs(self.text, req.token_ids[:req.prompt_len],
                                                   whole.prompt_logprobs)}


def _usage(call: Call, completion_tokens: int) -> dict:
    """The prompt counted once, however many completions (as OpenAI does)."""
    prompt = call.stream.req.prompt_len
    return {"prompt_tokens": prompt, "completion_tokens": completion_tokens,
            "total_tokens": prompt + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": call.stream.cached_tokens}}


def _sse(obj: dict) -> bytes:
    return b"data: " + _DUMPS(obj).encode() + b"\n\n"


async def _events(call: Call, shape: _Shape, include_usage: bool) -> AsyncIterator[bytes]:
    """The server-sent events of a streamed request; an error after the response began goes
    out as an event with OpenAI's error object (the SDK raises it), then [DONE]."""
    extra = {"usage": None} if include_usage else {}  # OpenAI's: null but in the last
    completion_tokens = 0
    try:
        if shape.chat:  # each choice's first chunk carries the role, as OpenAI's do
            for i in range(len(call.streams)):
                first = shape.choice(i, None, None, False, False)
                first["delta"] = {"role": "assistant", "content": ""}
                yield _sse(shape.obj([first], True, **extra))
        async for chunk in call.chunks():
            if not chunk.finish_reason and shape.logprobs is None and shape.tools is None:
                yield shape.delta(chunk.index, chunk.text)
                continue
            finish = bool(chunk.finish_reason)
            text = chunk.text or None if finish else chunk.text
            choice = shape.choice(chunk.index, text, chunk, finish, False)
            completion_tokens += chunk.completion_tokens
            if finish or choice["delta"] or choice["logprobs"]:  # (a call's text is held)
                yield _sse(shape.obj([choice], True, **extra))
        if include_usage:  # after every choice finished
            yield _sse(shape.obj([], True, usage=_usage(call, completion_tokens)))
    except EngineError as e:
        yield _sse(OpenAIError.from_grpc(e.code, str(e)).body())
    yield b"data: [DONE]\n\n"


async def _complete(request: Request, call: Call, shape: _Shape,
                    headers: dict[str, str]) -> Response:
    """A non-streamed request, ended early (its blocks freed) if the client goes away."""

    async def collect() -> list[Chunk]:
        """Each completion's chunks as one, by index."""
        wholes: dict[int, Chunk] = {}
        async for chunk in call.chunks():
            i = chunk.index
            wholes[i] = wholes[i].then(chunk) if i in wholes else chunk
        return [wholes[i] for i in sorted(wholes)]

    work = asyncio.ensure_future(collect())
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait((work, gone), return_when=asyncio.FIRST_COMPLETED)
        if not work.done():
            return Response(status_code=499)  # nobody reads it; nginx's "client closed"
        try:
            wholes = work.result()
        except EngineError as e:
            raise OpenAIError.from_grpc(e.code, str(e), e.retry_after_s) from None
        choices = [shape.choice(w.index, w.text, w, True, True) for w in wholes]
        prompt = shape.prompt_logprobs(call, wholes[0])
        if not shape.chat:  # vLLM's places: on each completions choice, on the chat response
            choices = [c | prompt for c in choices]
        body = shape.obj(choices, False, usage=_usage(call, sum(
            w.completion_tokens for w in wholes)), **({} if not shape.chat else prompt))
        return JSONResponse(body, headers=headers)
    finally:
        for task in (work, gone):
            task.cancel()
        call.close()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


class _EventStream(StreamingResponse):
    """A streamed response that closes its Call however it ends: finished, failed, or the
    client gone (Starlette then cancels the stream, wherever it was waiting)."""

    def __init__(self, content: AsyncIterator[bytes], call: Call, **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self.call = call

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.call.close()


def body_limit(input_limit: int) -> int:
    """The most bytes a request body may have, given --max-input-bytes' limit on its text."""
    return 2 * input_limit + BODY_SLACK_BYTES


def _too_large(size: str, most: int) -> OpenAIError:
    return OpenAIError(413, f"request body: {size}, more than the {most} a request may have "
                       f"(twice the input limit, --max-input-bytes, plus 1 MiB)",
                       code="request_too_large")


def _timeout(request: Request) -> float | None:
    value = request.headers.get(TIMEOUT_HEADER)
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        seconds = math.nan
    if not (math.isfinite(seconds) and seconds > 0):
        raise OpenAIError(400, f"the {TIMEOUT_HEADER} header must be a positive number of "
                          f"seconds, got {value!r}")
    return seconds


async def _error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, OpenAIError)
    headers = {}
    if exc.retry_after_s is not None:  # whole seconds, rounded up, as HTTP's Retry-After is
        headers["retry-after"] = str(math.ceil(exc.retry_after_s))
    return JSONResponse(exc.body(), status_code=exc.status, headers=headers)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    return await _error(request, OpenAIError(exc.status_code, f"{request.method} "
                                             f"{request.url.path}: {exc.detail}"))
