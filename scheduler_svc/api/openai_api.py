"""The OpenAI-compatible HTTP API (Starlette on uvicorn), served by the scheduler process on the
gRPC server's asyncio loop: a request becomes the neutral GenerationInput (openai_protocol) and
goes through Frontend.start (frontend.py), the same path as a gRPC Generate call (tenants,
validation, admission, deadline), to the engine client.

    POST /v1/completions, POST /v1/chat/completions, POST /v1/responses   (stream: server-sent
    events)
    GET /v1/models, GET /health (readiness: 200 when an executor is joined, else 503)
    POST /tokenize, POST /detokenize (vLLM's)
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from pagedserve.core.lora import parse_module
from pagedserve.scheduler.api import openai_responses
from pagedserve.scheduler.api.frontend import CallBatch, Frontend
from pagedserve.scheduler.api.http_metrics import CLIENT_LEFT
from pagedserve.scheduler.api.openai_logprobs import (
    TokenText,
    chat_logprobs,
    completion_logprobs,
    prompt_logprobs,
)
from pagedserve.scheduler.api.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeBody,
    LoraAdapterBody,
    OpenAIError,
    TokenizeBody,
    completion_prompts,
    invalid,
    parse,
    scores_only,
    to_inputs,
    to_tokenize,
)
from pagedserve.scheduler.api.openai_tools import CallStream, ToolMode, read_calls, tool_mode
from pagedserve.scheduler.api.streams import Chunk
from pagedserve.scheduler.engine_io import EngineError
from pagedserve.scheduler.invalid import InvalidRequest
from pagedserve.scheduler.outputs import TokenLogprob

# JSON escapes at most double the UTF-8 bytes of a prompt (a non-ASCII character as \uXXXX); the
# MiB is for the request's other fields (a JSON schema, tools, logit_bias).
BODY_SLACK_BYTES = 1 << 20
LARGE_BODY_BYTES = 256 * 1024  # parsed on a worker thread; followed by a heap trim
LARGE_TOKENS = 4096  # token lists (de)tokenized or encoded on a worker thread
TIMEOUT_HEADER = "x-request-timeout"  # seconds the request may live, as a gRPC deadline
_DUMPS = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode


class OpenAIApp:
    def __init__(self, frontend: Frontend, model_name: str,
                 lora_updating: bool = False) -> None:
        """lora_updating: serve /v1/load_lora_adapter and /v1/unload_lora_adapter."""
        self.gen, self.client, self.model_name = frontend, frontend.client, model_name
        self.lora_updating = lora_updating
        self.created = int(time.time())
        self.token_text = TokenText(frontend.inputs.tok)
        self.app = Starlette(routes=[
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/v1/responses", self.responses, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/load_lora_adapter", self.load_lora_adapter, methods=["POST"]),
            Route("/v1/unload_lora_adapter", self.unload_lora_adapter, methods=["POST"]),
            Route("/tokenize", self.tokenize, methods=["POST"]),
            Route("/detokenize", self.detokenize, methods=["POST"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/health/ready", self.health, methods=["GET"]),
            Route("/health/live", self.live, methods=["GET"]),
        ], exception_handlers={HTTPException: _http_error, OpenAIError: _error})

    async def health(self, request: Request) -> Response:
        """Readiness (/health, /health/ready): 200 while a warmed-up executor is joined and
        the server is not shutting down."""
        if self.client.serving:
            return JSONResponse({"status": "ok"})
        why = "draining" if self.client.draining else "shutting down" if \
            self.client.leaving else "no executor has joined"
        return JSONResponse({"status": why}, status_code=503)

    async def live(self, request: Request) -> Response:
        """Liveness (/health/live): the process answers, with or without an executor (one
        restarting is not a reason to restart the scheduler)."""
        return JSONResponse({"status": "alive"})

    async def models(self, request: Request) -> Response:
        tenant = self._authenticate(request)
        card: dict[str, Any] = {"id": self.model_name, "object": "model",
                                "created": self.created, "owned_by": "pagedserve"}
        if (cap := self.client.model_info()) is not None:
            card["max_model_len"] = cap.max_model_len
            if cap.speculative_config:  # as vLLM's engine args spell it
                card["speculative_config"] = json.loads(cap.speculative_config)
        adapters = [{**card, "id": name, "root": path, "parent": self.model_name}
                    for name, path in self.gen.lora_modules  # vLLM's LoRA cards: the key's
                    if tenant is None or tenant.may_use(name)]  # tenant's only
        return JSONResponse({"object": "list", "data": [card, *adapters]})

    async def load_lora_adapter(self, request: Request) -> Response:
        """vLLM's: {"lora_name", "lora_path"} -> 200 and a line of text once the engine
        core has sent every API process the new list (a request naming it that comes to
        another one first waits for that list: Frontend.serves_adapter)."""
        return await self._lora_admin(request, load=True)

    async def unload_lora_adapter(self, request: Request) -> Response:
        return await self._lora_admin(request, load=False)

    async def _lora_admin(self, request: Request, load: bool) -> Response:
        """An admin's load or unload of a LoRA adapter."""
        tenant = self._authenticate(request)
        if not self.lora_updating:
            raise OpenAIError(404, "loading LoRA adapters at run time is off (start the server "
                              "with --allow-runtime-lora-updating)", code="not_found")
        if tenant is not None and not tenant.admin:
            raise OpenAIError(403, f"tenant {tenant.name} may not load or unload LoRA "
                              "adapters (admin: true in the API keys file)",
                              code="permission_denied")
        body = await self._parsed(request, LoraAdapterBody)
        name, path = body.lora_name, body.lora_path
        if load and path is None:
            raise OpenAIError(400, "lora_path: Field required", "lora_path")
        if name == self.model_name:
            raise OpenAIError(400, f"lora_name: {name!r} is the base model's name", "lora_name")
        if load:
            try:
                parse_module(f"{name}={path}")  # a name the flag would take
            except ValueError as e:
                raise OpenAIError(400, str(e).removeprefix("--lora-modules: "),
                                  "lora_name") from None
        try:
            await (self.client.load_lora(name, path) if load else self.client.unload_lora(name))
        except EngineError as e:
            raise OpenAIError.from_grpc(e.code, str(e), e.retry_after_s) from None
        done = "added" if load else "removed"
        return PlainTextResponse(f"Success: LoRA adapter '{name}' {done} successfully.")

    async def tokenize(self, request: Request) -> Response:
        """vLLM's /tokenize: {count, max_model_len, tokens, token_strs}."""
        self._authenticate(request)
        body = await self._parsed(request, TokenizeBody)
        if body.model is not None:
            await self._check_model(body.model)
        prompt, shaped = to_tokenize(body)
        try:
            out = await self.gen.tokenize(prompt)
        except InvalidRequest as e:
            raise invalid(e, shaped) from None
        cap = self.client.model_info()
        model_len = cap.max_model_len if cap else self.gen.inputs.model_len

        def answer() -> bytes:
            return _DUMPS({"count": len(out.ids), "max_model_len": model_len,
                           "tokens": out.ids,
                           "token_strs": list(out.strings) if body.return_token_strs else None
                           }).encode()

        return Response(await _off_loop_if(len(out.ids) >= LARGE_TOKENS, answer),
                        media_type="application/json")

    async def detokenize(self, request: Request) -> Response:
        """vLLM's /detokenize: {prompt}, the ids' text (special tokens kept)."""
        self._authenticate(request)
        body = await self._parsed(request, DetokenizeBody)
        if body.model is not None:
            await self._check_model(body.model)
        cap = self.client.model_info()
        vocab = cap.vocab_size if cap else len(self.gen.inputs.tok)
        tok = self.gen.inputs.tok

        def answer() -> bytes:
            bad = next((t for t in body.tokens if t >= vocab), None)
            if bad is not None:
                raise OpenAIError(400, f"tokens: token id {bad} is outside the vocabulary "
                                  f"(size {vocab})", "tokens")
            return _DUMPS({"prompt": tok.decode(body.tokens)}).encode()

        return Response(await _off_loop_if(len(body.tokens) >= LARGE_TOKENS, answer),
                        media_type="application/json")

    async def _parsed(self, request: Request, model: type) -> Any:
        """The body, read within the size limit and parsed (off the loop when large)."""
        body = await self._body(request)
        return await _off_loop_if(len(body) >= LARGE_BODY_BYTES, parse, model, body)

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, CompletionRequest)

    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, ChatCompletionRequest)

    async def responses(self, request: Request) -> Response:
        """OpenAI's Responses API, as a chat request (openai_responses.py)."""
        tenant = self._authenticate(request)
        body = await self._body(request)

        def read() -> tuple[Any, ChatCompletionRequest]:
            req = parse(openai_responses.ResponsesRequest, body)
            return req, openai_responses.to_chat(req)

        req, chat = await _off_loop_if(len(body) >= LARGE_BODY_BYTES, read)
        adapter = await self._check_model(req.model)
        rid = request.headers.get("x-request-id") or f"resp_{uuid.uuid4().hex}"
        try:
            tools = tool_mode(chat.tools, chat.tool_choice, chat.parallel_tool_calls)
            batch = await self._start(chat, rid, tools, tenant, _timeout(request), adapter)
        except OpenAIError as e:
            raise openai_responses.renamed(e) from None
        shape = openai_responses.ResponseShape(rid, req, req.model, tools)
        headers = {"x-request-id": rid}
        if req.stream:
            return _EventStream(openai_responses.events(shape, batch), batch,
                                media_type="text/event-stream",
                                headers={**headers, "cache-control": "no-cache"})
        try:
            wholes = await _gather(request, batch)
            if wholes is None:
                return Response(status_code=CLIENT_LEFT)
        finally:
            batch.close()
        return JSONResponse(openai_responses.whole(shape, batch, wholes[0]), headers=headers)

    async def _check_model(self, model: str) -> str:
        """The LoRA adapter a request's `model` names ("": the base model); 404 for a model
        this server does not serve (Frontend.serves_adapter)."""
        if model == self.model_name:
            return ""
        if await self.gen.serves_adapter(model):
            return model
        served = ", ".join(f"'{m}'" for m in (self.model_name, *self.gen.lora_adapters))
        raise OpenAIError(404, f"The model '{model}' does not exist; this server serves "
                          f"{served}", "model", "model_not_found")

    async def _body(self, request: Request) -> bytes:
        """The request body, read as it arrives and refused (413) as soon as it is known to be
        over the limit: from its Content-Length, else once that many bytes came; the rest is
        never held (uvicorn drops what follows a response)."""
        cap = self.client.model_info()
        most = body_limit(self.gen.inputs.byte_limit(cap.max_model_len if cap else None))
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > most:
            raise _too_large(f"{int(declared)} bytes", most)
        parts, n = [], 0
        try:
            async for part in request.stream():
                n += len(part)
                if n > most:
                    self.gen.trim.soon()
                    raise _too_large(f"more than {most} bytes", most)
                parts.append(part)
        except ClientDisconnect:  # gone while sending its body: nobody reads the answer
            raise OpenAIError(CLIENT_LEFT, "the client closed the connection") from None
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
        req = await self._parsed(request, model)
        adapter = await self._check_model(req.model)
        if req.stream_options is not None and not req.stream:
            raise OpenAIError(400, "stream_options: only allowed with stream: true",
                              "stream_options")
        chat = model is ChatCompletionRequest
        rid = request.headers.get("x-request-id") or \
            f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        tools = tool_mode(req.tools, req.tool_choice, req.parallel_tool_calls) if chat else None
        batch = await self._start(req, rid, tools, tenant, _timeout(request), adapter)
        usage = req.stream_options is not None and req.stream_options.include_usage
        first = batch.calls[0].stream.params
        shape = _Shape(rid, req.model, chat, usage, batch.n, len(batch.calls),
                       self.token_text if first.logprobs is not None else None,
                       self.token_text, tools)
        if not chat and req.echo:
            shape.echo_prompts(await self._prompt_texts(req, batch), batch.prompts,
                               req.logprobs, scores_only(req))
        if req.prompt_logprobs is not None:
            shape.prompt_k = req.prompt_logprobs
        headers = {"x-request-id": rid}
        if not req.stream:
            return await _complete(request, batch, shape, headers)
        return _EventStream(_events(batch, shape, usage), batch, media_type="text/event-stream",
                            headers={**headers, "cache-control": "no-cache"})

    async def _start(self, req: Any, rid: str, tools: ToolMode | None, tenant: Any,
                     timeout: float | None, adapter: str = "") -> CallBatch:
        """Start the request: a Call per prompt of a completions batch (in order; if one is
        refused, those started are closed and its error is the response's); adapter: the
        LoRA adapter its `model` names."""
        batch = CallBatch()
        gens = [dataclasses.replace(g, adapter=adapter)
                for g in to_inputs(req, rid, tools, timeout)]
        if tenant is not None and 0 < tenant.max_concurrent < len(gens):  # would never fit
            raise OpenAIError(400, f"prompt: a batch of {len(gens)} prompts, more than the "
                              f"{tenant.max_concurrent} requests this API key may run at once",
                              "prompt")
        try:
            for one in gens:
                batch.add(await self.gen.start(one, tenant))
        except InvalidRequest as e:
            batch.close()
            err = invalid(e, req)
            if len(gens) > 1:  # which prompt of the batch
                err.message = err.message.replace(": ", f": prompt {len(batch.calls)} of the "
                                                  f"batch: ", 1)
            raise err from None
        except EngineError as e:
            batch.close()
            raise OpenAIError.from_grpc(e.code, str(e), e.retry_after_s) from None
        except BaseException:
            batch.close()
            raise
        return batch

    async def _prompt_texts(self, req: CompletionRequest, batch: CallBatch) -> list[str]:
        """What echo sends back of each prompt: its text as given, or its token ids decoded
        (on a worker thread: work in proportion to the input stays off the event loop)."""
        prompts, tok = completion_prompts(req), self.gen.inputs.tok

        def texts() -> list[str]:
            return [p if isinstance(p, str) else tok.decode(p) for p in prompts]

        try:
            return await _off_loop_if(any(not isinstance(p, str) for p in prompts), texts)
        except BaseException:
            batch.close()
            raise


class _Shape:
    """The response objects of one request (its prompts' n choices each); a streamed chunk
    without logprobs has its JSON built around its text (json-encoding only that), since each
    token of every stream goes through here. logprobs: set when the request asked for them."""

    def __init__(self, rid: str, model: str, chat: bool, include_usage: bool, n: int,
                 prompts: int, logprobs: TokenText | None, text: TokenText,
                 tools: ToolMode | None) -> None:
        self.rid, self.model, self.chat, self.logprobs, self.text = rid, model, chat, \
            logprobs, text
        self.n = n  # choices per prompt
        choices = n * prompts
        self.tools = tools  # calls are read out of each choice's text
        self.calls = [CallStream(tools) for _ in range(choices)] if tools is not None else []
        self.created = int(time.time())
        self.kind = "chat.completion" if chat else "text_completion"
        self.offsets = [0] * choices  # completions' text_offset: characters each choice sent
        self.prompt_k: int | None = None  # the prompt_logprobs field's alternatives, if asked
        # echo (completions): each prompt's text and ids, put before its choices' first text
        self.echo: list[tuple[str, list[int]]] | None = None
        self.echo_k: int | None = None
        self.scores_only = False  # echo with max_tokens 0: the prompt alone, nothing generated
        self.echoed: set[int] = set()  # choices whose prompt went out
        self.prompt_lps: dict[int, list[TokenLogprob | None]] = {}  # by prompt, once known
        self._waiting: dict[int, list[Chunk]] = {}  # chunks held until their prompt's logprobs
        head = _DUMPS({"id": rid, "object": self.kind + (".chunk" if chat else ""),
                       "created": self.created, "model": model})[:-1]
        self._heads = [(f'data: {head},"choices":[{{"index":{i},' +
                        ('"delta":{"content":' if chat else '"text":')).encode()
                       for i in range(choices)]
        self._tail = (("}" if chat else "") + ',"logprobs":null,"finish_reason":null}]' +
                      (',"usage":null' if include_usage else "") + "}\n\n").encode()

    def echo_prompts(self, texts: list[str], ids: list[list[int]], k: int | None,
                     scores_only: bool) -> None:
        self.echo = list(zip(texts, ids, strict=True))
        self.echo_k, self.scores_only = k, scores_only

    def echoes_logprobs(self, chunk: Chunk) -> bool:
        """Whether the chunk is its choice's first with echo and logprobs: its prompt's
        logprobs go with it."""
        return self.echo is not None and self.logprobs is not None and \
            chunk.index not in self.echoed

    def plain(self, chunk: Chunk) -> bool:
        """Whether the chunk goes out as its text alone (delta())."""
        return not chunk.finish_reason and self.logprobs is None and self.tools is None and \
            (self.echo is None or chunk.index in self.echoed)

    def ready(self, chunk: Chunk) -> list[Chunk]:
        """The chunks that can go out now: with echo and logprobs, a choice's first chunk
        waits for its prompt's logprobs, which come on the prompt's completion 0's first."""
        if not self.echoes_logprobs(chunk):
            return [chunk]
        p, j = divmod(chunk.index, self.n)
        if p in self.prompt_lps:
            return [chunk]
        if j:
            self._waiting.setdefault(p, []).append(chunk)
            return []
        self.prompt_lps[p] = chunk.prompt_logprobs or []
        return [chunk, *self._waiting.pop(p, [])]

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
        chunk's tokens and, if finish, its finish reason (and the calls read from the text).
        With echo, the choice's first text is its prompt's, then the completion's."""
        reason = chunk.finish_reason if finish and chunk is not None else None
        stop_reason = chunk.stop_reason if finish and chunk is not None else None
        calls = None
        if self.tools is not None and final:
            text, calls, reason = read_calls(self.tools, text or "", reason or "")
        elif self.tools is not None:
            text = self.calls[index].feed(text or "") or None
            if finish:
                rest, calls, reason = self.calls[index].finish(reason or "")
                text = (text or "") + rest or None
        logprobs = None
        if self.logprobs is not None and chunk is not None:
            if self.chat:
                logprobs = chat_logprobs(self.text, chunk.token_ids, chunk.logprobs)
            else:
                logprobs = self._completion_logprobs(index, chunk)
        if self.scores_only:  # the one sampled token is not the client's
            text, reason, stop_reason = "", "length" if finish else None, None
        if self.echo is not None and index not in self.echoed:
            self.echoed.add(index)
            text = self.echo[index // self.n][0] + (text or "")
        if self.chat:
            body = {"message": {"role": "assistant", "content": text}} if final else \
                {"delta": {} if text is None else {"content": text}}
            if calls is not None:
                key = "message" if final else "delta"
                body[key]["tool_calls"] = calls if final else \
                    [{"index": i, **c} for i, c in enumerate(calls)]
        else:
            body = {"text": text or ""}
        return {"index": index, **body, "logprobs": logprobs, "finish_reason": reason,
                "stop_reason": stop_reason}  # vLLM's: what matched

    def _completion_logprobs(self, index: int, chunk: Chunk) -> dict:
        """The legacy completions' logprobs of the chunk's tokens, after its prompt's tokens
        on the choice's first chunk with echo."""
        into = None
        if self.echo is not None and index not in self.echoed:
            p = index // self.n
            into, self.offsets[index] = completion_logprobs(
                self.text, self.echo[p][1], self.prompt_lps[p], 0, self.echo_k)
            if self.scores_only:
                return into
        out, self.offsets[index] = completion_logprobs(
            self.text, chunk.token_ids, chunk.logprobs, self.offsets[index], into=into)
        return out

    def prompt_logprobs(self, prompt: list[int], whole: Chunk) -> dict:
        """vLLM's prompt_logprobs field, if the request asked."""
        if self.prompt_k is None or whole.prompt_logprobs is None:
            return {}
        return {"prompt_logprobs": prompt_logprobs(self.text, prompt, whole.prompt_logprobs,
                                                   self.prompt_k)}


def _usage(batch: CallBatch, completion_tokens: int) -> dict:
    """Each prompt counted once, however many completions (as OpenAI does)."""
    prompt = sum(c.stream.prompt_len for c in batch.calls)
    cached = sum(c.stream.cached_tokens for c in batch.calls)
    return {"prompt_tokens": prompt, "completion_tokens": completion_tokens,
            "total_tokens": prompt + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached}}


def _sse(obj: dict) -> bytes:
    return b"data: " + _DUMPS(obj).encode() + b"\n\n"


async def _events(batch: CallBatch, shape: _Shape, include_usage: bool
                  ) -> AsyncIterator[bytes]:
    """The server-sent events of a streamed request; an error after the response began goes
    out as an event with OpenAI's error object (the SDK raises it), then [DONE]."""
    extra = {"usage": None} if include_usage else {}  # OpenAI's: null but in the last
    completion_tokens = 0
    try:
        if shape.chat:  # each choice's first chunk carries the role, as OpenAI's do
            for i in range(len(batch.streams)):
                first = shape.choice(i, None, None, False, False)
                first["delta"] = {"role": "assistant", "content": ""}
                yield _sse(shape.obj([first], True, **extra))
        async for got in batch.chunks():
            for chunk in shape.ready(got):
                if shape.plain(chunk):
                    yield shape.delta(chunk.index, chunk.text)
                    continue
                finish = bool(chunk.finish_reason)
                text = chunk.text or None if finish else chunk.text
                args = (chunk.index, text, chunk, finish, False)
                choice = await _off_loop_if(shape.echoes_logprobs(chunk), shape.choice, *args)
                completion_tokens += 0 if shape.scores_only else chunk.completion_tokens
                if finish or choice.get("delta", True) or choice["logprobs"]:  # (a call's
                    yield _sse(shape.obj([choice], True, **extra))  # text is held)
        if include_usage:  # after every choice finished
            yield _sse(shape.obj([], True, usage=_usage(batch, completion_tokens)))
    except EngineError as e:
        yield _sse(OpenAIError.from_grpc(e.code, str(e)).body())
    yield b"data: [DONE]\n\n"


async def _complete(request: Request, batch: CallBatch, shape: _Shape,
                    headers: dict[str, str]) -> Response:
    """A non-streamed request, ended early (its blocks freed) if the client goes away."""

    try:
        wholes = await _gather(request, batch)
        if wholes is None:
            return Response(status_code=CLIENT_LEFT)  # nobody reads it
        n, prompts = shape.n, batch.prompts
        for w in wholes[::n]:  # each prompt's completion 0 scored it
            shape.prompt_lps[w.index // n] = w.prompt_logprobs or []
        def choices_of() -> list[dict]:
            return [shape.choice(w.index, w.text, w, True, True) for w in wholes]

        # an echoed prompt's logprobs are work in proportion to the input: off the event loop
        choices = await _off_loop_if(bool(shape.echo and shape.logprobs), choices_of)
        if not shape.chat:  # vLLM's places: on each completions choice, on the chat response
            choices = [c | shape.prompt_logprobs(prompts[i // n], wholes[i // n * n])
                       for i, c in enumerate(choices)]
        completion_tokens = 0 if shape.scores_only else sum(w.completion_tokens for w in wholes)
        body = shape.obj(choices, False, usage=_usage(batch, completion_tokens), **(
            {} if not shape.chat else shape.prompt_logprobs(prompts[0], wholes[0])))
        return JSONResponse(body, headers=headers)
    finally:
        batch.close()


async def _gather(request: Request, batch: CallBatch) -> list[Chunk] | None:
    """Each completion's chunks as one, by index; None if the client went away first (the
    caller closes the batch, which frees its blocks)."""

    async def collect() -> list[Chunk]:
        wholes: dict[int, Chunk] = {}
        async for chunk in batch.chunks():
            i = chunk.index
            wholes[i] = wholes[i].then(chunk) if i in wholes else chunk
        return [wholes[i] for i in sorted(wholes)]

    work = asyncio.ensure_future(collect())
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait((work, gone), return_when=asyncio.FIRST_COMPLETED)
        if not work.done():
            return None
        try:
            return work.result()
        except EngineError as e:
            raise OpenAIError.from_grpc(e.code, str(e), e.retry_after_s) from None
    finally:
        for task in (work, gone):
            task.cancel()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


class _EventStream(StreamingResponse):
    """A streamed response that closes its Calls however it ends: finished, failed, or the
    client gone (Starlette then cancels the stream, wherever it was waiting)."""

    def __init__(self, content: AsyncIterator[bytes], batch: CallBatch, **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self.batch = batch

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.batch.close()


async def _off_loop_if(large: bool, fn: Any, *args: Any) -> Any:
    """fn(*args), on a worker thread if large: work in proportion to the input stays off the
    event loop, which serves every stream."""
    return await asyncio.to_thread(fn, *args) if large else fn(*args)


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
