"""The OpenAI API's request bodies and their one translation into the front ends' neutral
GenerationInput (generation_input.py), which inputs.validate checks for both APIs; the field
paths of its errors are named back as OpenAI parameters here (openai_param). OpenAIError lives
in openai_errors.

Fields OpenAI (or vLLM) defines that the engine cannot honour yet are accepted in the models and
refused by `unsupported()` when a request sets them to anything but their default.
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from pagedserve.scheduler.api.generation_input import (
    Chat,
    GenerationInput,
    Message,
    Prompt,
    Sampling,
    StructuredOutput,
)
from pagedserve.scheduler.api.inputs import MAX_TOP_LOGPROBS
from pagedserve.scheduler.api.openai_errors import OpenAIError
from pagedserve.scheduler.api.openai_tools import (
    ToolCallIn,
    ToolDef,
    ToolMode,
    forced_schema,
    message_calls,
    offer,
)
from pagedserve.scheduler.invalid import InvalidRequest

Int32 = Annotated[int, Field(ge=-(2**31), le=2**31 - 1)]
Count = Annotated[int, Field(ge=0, le=2**31 - 1)]
class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class _Request(BaseModel):
    """What completions and chat completions share. Unknown fields are refused, as OpenAI
    does: a misspelt parameter should not be silently ignored."""

    model_config = ConfigDict(extra="forbid")

    model: str
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(None, allow_inf_nan=False)
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    user: str | None = None
    # OpenAI's cache-routing and abuse-tracking keys: accepted; a proxy routes on the
    # x-session-id header instead (docs/scaling.md), as it cannot hash a body
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    # vLLM's extensions
    top_k: Int32 | None = None
    stop_token_ids: list[Count] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    priority: Int32 = 0
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None  # vLLM's
    logit_bias: dict[str, float] | None = None
    min_p: float | None = None  # vLLM's
    min_tokens: int | None = None  # vLLM's
    # structured outputs, vLLM's: `structured_outputs` (0.12 on) and the guided_* before it
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    response_format: dict[str, Any] | None = None  # OpenAI's (chat), vLLM's for both
    n: int | None = 1
    prompt_logprobs: int | None = None  # vLLM's; not with stream


class CompletionRequest(_Request):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for completions
    logprobs: int | None = None
    echo: bool | None = False
    best_of: int | None = None
    suffix: str | None = None


class ContentPart(BaseModel):
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None  # an assistant's
    tool_call_id: str | None = None  # a tool's result answers this call


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list[ToolDef] | None = None  # openai_tools.py
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None  # false: one call at most
    # accepted, with no effect on a server that has no storage or tiers
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None


_UNSUPPORTED_DEFAULTS = {  # field -> its default (null is too); others refused until supported
    "best_of": 1, "suffix": None,
}


class LoraAdapterBody(BaseModel):
    """vLLM's POST /v1/load_lora_adapter (lora_path given) and /v1/unload_lora_adapter
    bodies; fields of vLLM's these do not use (load_inplace) are ignored."""

    lora_name: str = Field(min_length=1)
    lora_path: str | None = Field(default=None, min_length=1)


class TokenizeBody(BaseModel):
    """vLLM's POST /tokenize: a prompt (its special tokens added, as a completion's prompt), or
    chat messages (rendered with the template and a generation prompt, as a chat request's;
    the template holds its special tokens, so none are added)."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # vLLM's defaults: true for a prompt, false for chat
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    tokens: list[Count]


def to_tokenize(body: TokenizeBody) -> tuple[Prompt, _Request]:
    """The prompt to tokenize, and the request it tokenizes as (for naming errors'
    parameters)."""
    if (body.prompt is None) == (body.messages is None):
        raise OpenAIError(400, "prompt: give a prompt or messages (one of them)", "prompt")
    chat = body.messages is not None
    if body.add_special_tokens not in (None, not chat):
        raise OpenAIError(400, f"add_special_tokens: only {str(not chat).lower()} is supported "
                          f"with {'messages' if chat else 'a prompt'}", "add_special_tokens",
                          "unsupported_parameter")
    if not body.add_generation_prompt:
        raise OpenAIError(400, "add_generation_prompt: only true is supported",
                          "add_generation_prompt", "unsupported_parameter")
    if body.prompt is not None:
        return body.prompt, CompletionRequest(model=body.model or "", prompt=body.prompt)
    shaped = ChatCompletionRequest(model=body.model or "", messages=body.messages or [])
    return _chat(shaped, None), shaped


def unsupported(req: _Request) -> str | None:
    """The first field the request sets that the engine does not support yet."""
    for name, default in _UNSUPPORTED_DEFAULTS.items():
        if name not in type(req).model_fields:
            continue
        if getattr(req, name) not in (None, default):
            return name
    return None


def parse(model: type[_Request], body: bytes) -> _Request:
    try:
        return model.model_validate_json(body)
    except ValidationError as e:
        err = e.errors(include_url=False)[0]
        param = param_of(err["loc"])
        where = f"{param}: " if param else ""
        raise OpenAIError(400, f"{where}{err['msg']}", param,
                          "invalid_json" if err["type"] == "json_invalid" else None) from None


_TYPE_NAMES = {"str", "int", "float", "bool", "list", "dict", "none", "function-after"}


def param_of(loc: tuple) -> str | None:
    """pydantic's error location as OpenAI names a parameter: messages[0].content."""
    out = ""
    for p in loc:
        if isinstance(p, str) and (p in _TYPE_NAMES or "[" in p or p[:1].isupper()):
            continue  # a union's member, named by its type (str, list[int], ContentPart)
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else p)
    return out or None


def to_inputs(req: _Request, request_id: str, tools: ToolMode | None = None,
              timeout: float | None = None) -> list[GenerationInput]:
    """The one translation from an OpenAI request to what the engine is asked (validated by
    inputs.validate like a gRPC request): one input per prompt of a completions request's
    batch (request_id-i for prompt i of several, as vLLM names them), else one. tools: the
    chat request's tool_mode(); timeout: the request's deadline, seconds."""
    name = unsupported(req)
    if name is not None:
        raise OpenAIError(400, f"{name}: not supported yet", name, "unsupported_parameter")
    base = GenerationInput(None, _sampling(req, tools), request_id, req.priority, timeout)
    if isinstance(req, ChatCompletionRequest):
        return [dataclasses.replace(base, prompt=_chat(req, tools))]
    assert isinstance(req, CompletionRequest)
    prompts = completion_prompts(req)
    return [dataclasses.replace(base, prompt=_completion_prompt(prompt), request_id=(
                f"{request_id}-{i}" if len(prompts) > 1 else request_id))
            for i, prompt in enumerate(prompts)]


def scores_only(req: _Request) -> bool:
    """A completions request with echo and max_tokens 0: the prompt comes back (with its
    logprobs, if asked), nothing is generated. The engine samples one token, dropped here."""
    return isinstance(req, CompletionRequest) and bool(req.echo) and req.max_tokens == 0


def _sampling(req: _Request, tools: ToolMode | None) -> Sampling:
    kw: dict[str, Any] = {}
    limit = 1 if scores_only(req) else _max_tokens(req)
    if limit is not None:
        if not 1 <= limit < 2**31:
            echo = " (0 with echo)" if isinstance(req, CompletionRequest) else ""
            raise OpenAIError(400, f"{_max_tokens_name(req)}: must be >= 1{echo}, got {limit}",
                              _max_tokens_name(req))
        kw["max_tokens"] = limit
    if req.top_k is not None:
        kw["top_k"] = max(0, req.top_k) if req.top_k >= -1 else req.top_k  # vLLM's -1: all
    if req.seed is not None:
        kw["seed"] = req.seed % 2**64  # OpenAI's seed is any integer; the engine's unsigned
    stops = [req.stop] if isinstance(req.stop, str) else (req.stop or [])
    kw.update(  # unset (None): validation's defaults
        temperature=req.temperature, top_p=req.top_p, stop=tuple(stops),
        stop_token_ids=tuple(req.stop_token_ids or ()), ignore_eos=req.ignore_eos,
        include_special_tokens=not req.skip_special_tokens,
        presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
        repetition_penalty=req.repetition_penalty, min_p=req.min_p,
        min_tokens=req.min_tokens or 0, n=req.n)  # n: checked by validation, as gRPC's
    kw.update(_logprobs(req))
    kw["logit_bias"] = _logit_bias(req)
    kw["structured"] = _constrain(req, tools)
    return Sampling(**kw)


def _logit_bias(req: _Request) -> tuple[tuple[int, float], ...]:
    bias: dict[int, float] = {}
    for token, value in (req.logit_bias or {}).items():
        try:  # OpenAI's keys are token ids as strings
            t = int(token)
        except (ValueError, OverflowError):
            t = None
        if t is None or not -(2**31) <= t < 2**31:
            raise OpenAIError(400, f"logit_bias: key {token!r} is not a token id",
                              "logit_bias") from None
        bias[t] = value
    return tuple(bias.items())


# (OpenAI's or vLLM's parameter, its key, the SamplingParams constraint field)
_CONSTRAINTS = (
    ("guided_json", None, "json_schema"), ("guided_regex", None, "regex"),
    ("guided_choice", None, "choice"), ("guided_grammar", None, "grammar"),
    ("structured_outputs", "json", "json_schema"), ("structured_outputs", "regex", "regex"),
    ("structured_outputs", "choice", "choice"), ("structured_outputs", "grammar", "grammar"),
    ("structured_outputs", "json_object", "json_object"),
)


def constraint_param(req: _Request) -> str | None:
    """The parameter that set the request's constraint (for errors about it)."""
    if isinstance(req, ChatCompletionRequest) and req.tools and (
            req.tool_choice == "required" or isinstance(req.tool_choice, dict)):
        return "tools"
    rf = req.response_format
    if rf is not None and rf.get("type") in ("json_object", "json_schema"):
        return "response_format"
    return next((p for p, key, _ in _CONSTRAINTS if _value(req, p, key) is not None), None)


def _value(req: _Request, param: str, key: str | None) -> Any:
    value = getattr(req, param)
    return value if key is None or value is None else value.get(key)


def _constrain(req: _Request, tools: ToolMode | None) -> StructuredOutput | None:
    """response_format, structured_outputs, guided_* or a forced tool call: the structured
    output the request asks for."""
    found = [(p, key, field, v) for p, key, field in _CONSTRAINTS
             if (v := _value(req, p, key)) not in (None, False)]
    if tools is not None and tools.constrained:
        assert isinstance(req, ChatCompletionRequest) and req.tools
        found.insert(0, ("tool_choice", None, "json_schema", forced_schema(req.tools, tools)))
    rf = req.response_format
    kind = None if rf is None else rf.get("type")
    if kind == "json_object":
        found.append(("response_format", None, "json_object", True))
    elif kind == "json_schema":
        schema = (rf.get("json_schema") or {}).get("schema")
        if not isinstance(schema, dict):
            raise OpenAIError(400, "response_format: json_schema.schema must be a JSON Schema "
                              "object", "response_format")
        found.append(("response_format", None, "json_schema", schema))
    elif kind not in (None, "text"):
        raise OpenAIError(400, f"response_format: type must be text, json_object or "
                          f"json_schema, got {kind!r}", "response_format")
    if len(found) > 1:
        raise OpenAIError(400, f"{found[1][0]}: only one constraint per request",
                          found[1][0])
    if not found:
        return None
    param, _, field, value = found[0]
    if field == "json_object":
        return StructuredOutput(field, True)
    if field == "choice":
        if not isinstance(value, list) or not all(isinstance(c, str) for c in value):
            raise OpenAIError(400, f"{param}: a list of strings", param)
        return StructuredOutput(field, tuple(value))
    if not isinstance(value, str) and field == "json_schema":
        return StructuredOutput(field, json.dumps(value))
    if isinstance(value, str):
        return StructuredOutput(field, value)
    raise OpenAIError(400, f"{param}: a string", param)


def _logprobs(req: _Request) -> dict[str, int]:
    """Chat's logprobs + top_logprobs, or completions' logprobs: k alternatives per token,
    0..MAX_TOP_LOGPROBS (the completions API's too: vLLM's bound, where OpenAI's is 5)."""
    if isinstance(req, ChatCompletionRequest):
        if req.top_logprobs is not None and not req.logprobs:
            raise OpenAIError(400, "top_logprobs: only allowed with logprobs: true",
                              "top_logprobs")
        k, name = (req.top_logprobs or 0) if req.logprobs else None, "top_logprobs"
    else:
        k, name = req.logprobs, "logprobs"
    for value, param in ((k, name), (req.prompt_logprobs, "prompt_logprobs")):
        if value is not None and not 0 <= value <= MAX_TOP_LOGPROBS:
            raise OpenAIError(400, f"{param}: must be in [0, {MAX_TOP_LOGPROBS}], got {value}",
                              param)
    out = {} if k is None else {"logprobs": k}
    if req.prompt_logprobs is not None:
        if req.stream:  # vLLM's rule too: they would precede every token of every stream
            raise OpenAIError(400, "prompt_logprobs: not supported with stream: true",
                              "prompt_logprobs")
        out["prompt_logprobs"] = req.prompt_logprobs
    if isinstance(req, CompletionRequest) and req.echo and k is not None:
        # the echoed prompt's tokens carry logprobs as the completion's do; the response's
        # prompt_logprobs field, if asked too, shows its own number of alternatives
        out["prompt_logprobs"] = max(k, req.prompt_logprobs or 0)
    return out


def _max_tokens(req: _Request) -> int | None:
    if isinstance(req, ChatCompletionRequest) and req.max_completion_tokens is not None:
        return req.max_completion_tokens
    return req.max_tokens


def _max_tokens_name(req: _Request) -> str:
    chat = isinstance(req, ChatCompletionRequest) and req.max_completion_tokens is not None
    return "max_completion_tokens" if chat else "max_tokens"


def completion_prompts(req: CompletionRequest) -> list[str | list[int]]:
    """The request's prompts: a batch (a list of strings, or of token id lists), else one."""
    prompt = req.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        return list(prompt)
    if isinstance(prompt, list) and not prompt:
        return [[]]  # no token ids (refused by validation, as an empty text is)
    return [prompt]


def _completion_prompt(prompt: str | list[int]) -> str | list[int]:
    if isinstance(prompt, str):
        return prompt
    for t in prompt:
        if not 0 <= t < 2**31:
            raise OpenAIError(400, f"prompt: token id {t} is outside the vocabulary", "prompt")
    return list(prompt)  # [] is refused by validation, as an empty text is


def _chat(req: ChatCompletionRequest, tools: ToolMode | None) -> Chat:
    offered = offer(req.tools) if tools is not None and req.tools else ()
    messages = []
    for i, m in enumerate(req.messages):
        content = m.content
        if isinstance(content, list):
            if any(p.type != "text" or p.text is None for p in content):
                raise OpenAIError(400, f"messages[{i}].content: only text parts are supported",
                                  f"messages[{i}].content")
            content = "".join(p.text for p in content)
        role = "system" if m.role == "developer" else m.role  # OpenAI's newer name for it
        messages.append(Message(role, content or "", message_calls(m.tool_calls or [], i),
                                m.tool_call_id or ""))
    return Chat(tuple(messages), offered)


_CONSTRAINT_FIELDS = {"json_object", "json_schema", "regex", "choice", "grammar", "lark_grammar"}
# a tool's or a tool call's field path (generation_input.py) -> the OpenAI parameter's path
_TOOL_FIELD = re.compile(r"^chat\.(tools\[\d+\]\.|messages\[\d+\]\.tool_calls\[\d+\]\.)"
                         r"(name|parameters|arguments)$")
_MESSAGES = re.compile(r"^chat\.messages(\[\d+\]\.\w+)?$")


def openai_param(field: str, req: _Request) -> str | None:
    """The OpenAI parameter of a field path (InvalidRequest.field, generation_input.py)."""
    if field == "chat.tools":
        return "tools"
    if (t := _TOOL_FIELD.match(field)) is not None:
        return f"{t.group(1)}function.{t.group(2)}"
    if field.startswith("sampling."):
        name = field.removeprefix("sampling.")
        if name in _CONSTRAINT_FIELDS:
            return constraint_param(req) or name
        return _max_tokens_name(req) if name == "max_tokens" else name
    if (m := _MESSAGES.match(field)) is not None:
        return "messages" + (m.group(1) or "")
    if field in ("text", "token_ids", "input"):
        return "messages" if isinstance(req, ChatCompletionRequest) else "prompt"
    return None


def invalid(e: InvalidRequest, req: _Request) -> OpenAIError:
    """An inputs.InvalidRequest, its field named as the OpenAI parameter."""
    param = openai_param(e.field, req)
    if param is None:
        return OpenAIError(400, str(e))
    return OpenAIError(400, f"{param}: {e.reason}", param)

