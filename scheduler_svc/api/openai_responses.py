"""OpenAI's Responses API (POST /v1/responses), stateless. A request's instructions and input
items become a chat request (openai_protocol's ChatCompletionRequest: the two share validation,
tools and structured outputs); the chat answer becomes the response's output items (a message,
function calls) and, streamed, the API's semantic events (response.created ..
response.output_text.delta .. response.completed).

Nothing is stored: `store` is accepted, but `previous_response_id` is refused (send the whole
conversation as input, function_call and function_call_output items included) and no GET
/v1/responses/{id} is served, as vLLM's default is.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from pagedserve.scheduler.api.frontend import CallBatch
from pagedserve.scheduler.api.openai_errors import OpenAIError
from pagedserve.scheduler.api.openai_protocol import ChatCompletionRequest, param_of
from pagedserve.scheduler.api.openai_tools import CallStream, ToolMode, read_calls
from pagedserve.scheduler.api.streams import Chunk
from pagedserve.scheduler.engine_io import EngineError

_DUMPS = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode


class ResponsesRequest(BaseModel):
    """The request body; unknown fields are refused, as OpenAI does."""

    model_config = ConfigDict(extra="forbid")

    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = Field(None, allow_inf_nan=False)
    top_p: float | None = None
    stream: bool | None = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None  # {"format": {"type": "text" | "json_object" | ...}}
    previous_response_id: str | None = None
    background: bool | None = None
    # accepted, with no effect on a server that stores nothing and has no tiers or reasoning
    store: bool | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    service_tier: str | None = None
    truncation: str | None = None
    include: list[str] | None = None
    reasoning: dict[str, Any] | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None


def _bad(param: str, message: str, code: str | None = None) -> OpenAIError:
    return OpenAIError(400, f"{param}: {message}", param, code)


def to_chat(req: ResponsesRequest) -> ChatCompletionRequest:
    """The chat request that asks the same of the model."""
    if req.previous_response_id is not None:
        raise _bad("previous_response_id", "not supported: this server stores no responses; "
                   "send the whole conversation as input", "unsupported_parameter")
    if req.background:
        raise _bad("background", "not supported", "unsupported_parameter")
    if "message.output_text.logprobs" in (req.include or []):
        raise _bad("include", "message.output_text.logprobs is not supported yet",
                   "unsupported_parameter")
    messages = [{"role": "system", "content": req.instructions}] if req.instructions else []
    messages += _messages(req.input)
    chat: dict[str, Any] = {"model": req.model, "messages": messages, "stream": req.stream}
    for name in ("temperature", "top_p", "parallel_tool_calls", "user"):
        if getattr(req, name) is not None:
            chat[name] = getattr(req, name)
    if req.max_output_tokens is not None:
        chat["max_completion_tokens"] = req.max_output_tokens
    if req.tools:
        chat["tools"] = [_tool(t, i) for i, t in enumerate(req.tools)]
    if req.tool_choice is not None:
        chat["tool_choice"] = _tool_choice(req.tool_choice)
    fmt = (req.text or {}).get("format")
    if fmt is not None:
        chat["response_format"] = _format(fmt)
    try:
        return ChatCompletionRequest.model_validate(chat)
    except ValidationError as e:
        err = e.errors(include_url=False)[0]
        param = param_of(err["loc"]) or "input"
        raise renamed(OpenAIError(400, f"{param}: {err['msg']}", param)) from None


def _messages(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Input items as chat messages: a function_call joins the assistant message before it
    (a message item and its calls are one chat turn), a function_call_output is a tool
    message."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        if kind == "message":
            out.append({"role": _str(item, "role", i), "content": _text(item.get("content"), i)})
        elif kind == "function_call":
            call = {"id": _str(item, "call_id", i), "type": "function",
                    "function": {"name": _str(item, "name", i),
                                 "arguments": _str(item, "arguments", i)}}
            if out and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            out.append({"role": "tool", "tool_call_id": _str(item, "call_id", i),
                        "content": output if isinstance(output, str) else
                        _text(output, i, "output")})
        else:
            raise _bad(f"input[{i}].type", "message, function_call or function_call_output, "
                       f"got {kind!r}")
    return out


def _str(item: dict[str, Any], key: str, i: int) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise _bad(f"input[{i}].{key}", "a string is required")
    return value


def _text(content: Any, i: int, key: str = "content") -> str:
    """A message's content: a string, or text parts (input_text, output_text)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(f"input[{i}].{key}", "a string or a list of text parts")
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text") \
                or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else None
            raise _bad(f"input[{i}].{key}[{j}]", f"only text parts are supported, got {kind!r}")
        texts.append(part["text"])
    return "".join(texts)


def _tool(tool: dict[str, Any], i: int) -> dict[str, Any]:
    """A Responses function tool (flat) as chat's ({"function": {...}})."""
    if tool.get("type") != "function":
        raise _bad(f"tools[{i}].type", f"only 'function' tools are served, got "
                   f"{tool.get('type')!r}")
    if not isinstance(tool.get("name"), str):
        raise _bad(f"tools[{i}].name", "a string is required")
    return {"type": "function", "function": {k: tool[k] for k in (
        "name", "description", "parameters", "strict") if tool.get(k) is not None}}


def _tool_choice(choice: str | dict[str, Any]) -> str | dict[str, Any]:
    if isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise _bad("tool_choice", "'none', 'auto', 'required' or {\"type\": \"function\", "
               "\"name\": ...}")


def _format(fmt: Any) -> dict[str, Any]:
    if not isinstance(fmt, dict):
        raise _bad("text.format", "an object: {\"type\": \"text\" | \"json_object\" | "
                   "\"json_schema\", ...}")
    kind = fmt.get("type")
    if kind in ("text", "json_object"):
        return {"type": kind}
    if kind == "json_schema":
        return {"type": "json_schema", "json_schema": {
            "name": fmt.get("name", "output"), "schema": fmt.get("schema"),
            "strict": fmt.get("strict")}}
    raise _bad("text.format", f"type must be text, json_object or json_schema, got {kind!r}")


_PARAMS = {"max_completion_tokens": "max_output_tokens", "response_format": "text.format",
           "messages": "input"}


_TOOL = re.compile(r"^tools\[\d+\]\.function(?=\.)")


def renamed(err: OpenAIError) -> OpenAIError:
    """An error of the chat request, naming the Responses parameter instead (a tool's fields
    are the tool's own there: tools[0].name, not tools[0].function.name)."""
    param = err.param or ""
    head = param.split("[")[0].split(".")[0]
    if head in _PARAMS:
        new = _PARAMS[head]
    elif _TOOL.match(param):
        new = param.replace(".function", "", 1)
    else:
        return err
    message = err.message[len(param):] if err.message.startswith(param) else ": " + err.message
    return OpenAIError(err.status, new + message, new, err.code, err.retry_after_s)


class ResponseShape:
    """The response object of one request, whole or as its stream of events."""

    def __init__(self, rid: str, req: ResponsesRequest, model: str, tools: ToolMode | None
                 ) -> None:
        self.id, self.req, self.model, self.tools = rid, req, model, tools
        self.created = int(time.time())
        self.seq = 0

    def response(self, status: str, output: list[dict], usage: dict | None = None,
                 incomplete: str | None = None) -> dict[str, Any]:
        r = self.req
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status,
            "error": None,
            "incomplete_details": {"reason": incomplete} if incomplete else None,
            "instructions": r.instructions, "max_output_tokens": r.max_output_tokens,
            "model": self.model, "output": output,
            "parallel_tool_calls": r.parallel_tool_calls is not False,
            "previous_response_id": None, "reasoning": {"effort": None, "summary": None},
            "store": False, "temperature": r.temperature, "top_p": r.top_p,
            "text": r.text or {"format": {"type": "text"}},
            "tool_choice": r.tool_choice or ("auto" if r.tools else "none"),
            "tools": r.tools or [], "truncation": r.truncation or "disabled",
            "usage": usage, "user": r.user, "metadata": r.metadata or {},
        }

    def output(self, text: str, finish: str) -> tuple[list[dict], str | None]:
        """The whole answer's output items, and why it is incomplete (None: completed)."""
        content, calls, finish = read_calls(self.tools, text, finish) if self.tools \
            else (text, None, finish)
        cut = finish == "length"
        items = [message(content, "incomplete" if cut else "completed")] if content else []
        items += [function_call(c) for c in calls or []]
        return items, "max_output_tokens" if cut else None

    def event(self, kind: str, **fields: Any) -> bytes:
        self.seq += 1
        body = _DUMPS({"type": kind, "sequence_number": self.seq - 1, **fields})
        return f"event: {kind}\ndata: {body}\n\n".encode()


def message(text: str, status: str = "completed") -> dict[str, Any]:
    """An assistant message item: in_progress (opened, no content yet), completed, or
    incomplete (max_output_tokens cut it)."""
    return {"type": "message", "id": f"msg_{uuid.uuid4().hex}", "status": status,
            "role": "assistant", "content": [] if status == "in_progress" else [_part(text)]}


def _part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def function_call(call: dict[str, Any]) -> dict[str, Any]:
    """A chat tool call as a Responses function_call item."""
    return {"type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "call_id": call["id"],
            "name": call["function"]["name"], "arguments": call["function"]["arguments"],
            "status": "completed"}


def usage(batch: CallBatch, output_tokens: int) -> dict[str, Any]:
    stream = batch.calls[0].stream
    prompt = stream.prompt_len
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens":
                                                             stream.cached_tokens},
            "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt + output_tokens}


def whole(shape: ResponseShape, batch: CallBatch, answer: Chunk) -> dict[str, Any]:
    items, incomplete = shape.output(answer.text, answer.finish_reason or "stop")
    return shape.response("incomplete" if incomplete else "completed", items,
                          usage(batch, answer.completion_tokens), incomplete)


async def events(shape: ResponseShape, batch: CallBatch) -> AsyncIterator[bytes]:
    """The streamed response: its text as output_text deltas of a message item, opened at
    the first text; function calls, read when the answer ends, as whole items after it."""
    ev = shape.event
    yield ev("response.created", response=shape.response("in_progress", []))
    yield ev("response.in_progress", response=shape.response("in_progress", []))
    calls = CallStream(shape.tools) if shape.tools is not None else None
    item: dict[str, Any] | None = None
    text, output = "", []

    def delta(piece: str) -> list[bytes]:
        nonlocal item, text
        out = []
        if item is None:
            item = message("", "in_progress")
            out += [ev("response.output_item.added", output_index=0, item=item),
                    ev("response.content_part.added", item_id=item["id"], output_index=0,
                       content_index=0, part=_part(""))]
        text += piece
        out.append(ev("response.output_text.delta", item_id=item["id"], output_index=0,
                      content_index=0, delta=piece, logprobs=[]))
        return out

    try:
        async for chunk in batch.chunks():
            piece = chunk.text if calls is None else calls.feed(chunk.text)
            found: list[dict] = []
            finish = chunk.finish_reason
            if finish and calls is not None:
                rest, got, finish = calls.finish(finish)
                piece, found = piece + rest, got or []
            for b in delta(piece) if piece else []:
                yield b
            if not chunk.finish_reason:
                continue
            if item is not None:
                done = {**item, "status": "incomplete" if finish == "length" else "completed",
                        "content": [_part(text)]}
                yield ev("response.output_text.done", item_id=item["id"], output_index=0,
                         content_index=0, text=text, logprobs=[])
                yield ev("response.content_part.done", item_id=item["id"], output_index=0,
                         content_index=0, part=_part(text))
                yield ev("response.output_item.done", output_index=0, item=done)
                output.append(done)
            for call in found:
                fc = function_call(call)
                i = len(output)
                yield ev("response.output_item.added", output_index=i,
                         item={**fc, "arguments": "", "status": "in_progress"})
                yield ev("response.function_call_arguments.delta", item_id=fc["id"],
                         output_index=i, delta=fc["arguments"])
                yield ev("response.function_call_arguments.done", item_id=fc["id"],
                         output_index=i, arguments=fc["arguments"])
                yield ev("response.output_item.done", output_index=i, item=fc)
                output.append(fc)
            incomplete = "max_output_tokens" if finish == "length" else None
            yield ev("response.incomplete" if incomplete else "response.completed",
                     response=shape.response("incomplete" if incomplete else "completed",
                                             output, usage(batch, chunk.completion_tokens),
                                             incomplete))
    except EngineError as e:  # OpenAI's: an error event, then the response failed
        err = OpenAIError.from_grpc(e.code, str(e))
        yield ev("error", code=err.code, message=err.message, param=None)
        failed = shape.response("failed", output)
        failed["error"] = {"code": err.code, "message": err.message}
        yield ev("response.failed", response=failed)
