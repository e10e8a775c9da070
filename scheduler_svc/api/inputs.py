"""Turns a GenerationInput (generation_input.py: what either API's request asks for) into
prompt token ids and validated GenerationParams.

Every problem raises InvalidRequest naming the offending field; each front end names it in its
own convention. Nothing a client sends should reach the scheduler unchecked.
"""

from __future__ import annotations

import ctypes
import json
import math
from dataclasses import dataclass
from typing import Any

from pagedserve.scheduler.api.chat import ChatRenderer
from pagedserve.scheduler.api.generation_input import (
    Chat,
    GenerationInput,
    Prompt,
    Sampling,
    StructuredOutput,
    Tokens,
    prompt_field,
)
from pagedserve.scheduler.api.sampling_defaults import SamplingDefaults
from pagedserve.scheduler.api.tools import call_dicts, tool_dicts
from pagedserve.scheduler.invalid import InvalidRequest
from pagedserve.scheduler.request import Constraint, GenerationParams

MAX_STOP_STRINGS = 16
MAX_STOP_STRING_LEN = 256
MAX_REQUEST_ID_LEN = 256
MAX_TOP_LOGPROBS = 20  # OpenAI's top_logprobs bound
MAX_LOGIT_BIAS = 1024  # entries: each costs a little work on every step of the request
MAX_N = 16  # completions per request
MAX_CHOICES = 1024  # strings of a choice constraint


@dataclass(frozen=True, slots=True)
class Limits:
    max_model_len: int
    vocab_size: int
    defaults: SamplingDefaults = SamplingDefaults()  # the model's, for what a request leaves


BYTES_PER_TOKEN_BOUND = 32  # no tokenizer here averages more bytes per token than this


class InputProcessor:
    def __init__(self, tokenizer: Any, max_input_bytes: int = 0, model_len: int = 0) -> None:
        """max_input_bytes: the most UTF-8 bytes of text (or chat text) tokenized for one
        request; 0: BYTES_PER_TOKEN_BOUND per token of max_model_len (the joined executor's,
        or model_len, the model config's, before one has joined)."""
        self.tok = tokenizer
        self.chat = ChatRenderer(tokenizer)
        self.max_input_bytes = max_input_bytes
        self.model_len = model_len

    def byte_limit(self, max_model_len: int | None) -> int:
        return self.max_input_bytes or BYTES_PER_TOKEN_BOUND * (max_model_len or self.model_len)

    def encode_text(self, text: str) -> list[int]:
        return list(self.tok.encode(text))

    def encode_chat(self, chat: Chat) -> list[int]:
        """Raises InvalidRequest (ChatError, ToolError) naming the field."""
        tools = tool_dicts(list(chat.tools))
        messages = []
        for i, m in enumerate(chat.messages):
            msg: dict[str, Any] = {"role": m.role, "content": m.content}
            if m.tool_calls:
                msg["tool_calls"] = call_dicts(list(m.tool_calls),
                                               f"chat.messages[{i}].tool_calls")
            if m.tool_call_id:
                msg["tool_call_id"] = m.tool_call_id
            messages.append(msg)
        return self.chat.encode(messages, tools)

    @staticmethod
    def input_bytes(prompt: Prompt) -> int:
        """The UTF-8 bytes of text or chat input that tokenizing would read (0 for token ids:
        they need no work, and validate() bounds them)."""
        if isinstance(prompt, str):
            return len(prompt.encode())
        if isinstance(prompt, Chat):
            return sum(len(t.encode()) for t in _chat_texts(prompt))
        return 0

    def check_size(self, prompt: Prompt, n: int, max_model_len: int | None) -> None:
        """Refuse input too large to be a prompt (n: its input_bytes) before any tokenizing
        work is spent on it; max_model_len None: no executor has joined yet."""
        if n > (most := self.byte_limit(max_model_len)):
            raise InvalidRequest(prompt_field(prompt), f"{n} bytes, more than the {most} a "
                                 "prompt may have")

    def tokenize(self, prompt: Prompt) -> Tokens:
        """The prompt's ids and their token strings, both in proportion to the input (called
        off the event loop)."""
        ids = self.prompt_ids(prompt)
        return Tokens(ids, self.tok.convert_ids_to_tokens(ids))

    def prompt_ids(self, prompt: Prompt) -> list[int]:
        if prompt is None:
            raise InvalidRequest("input", "one of text, token_ids or chat is required")
        if isinstance(prompt, str):
            ids = self.encode_text(prompt) if prompt else []
        elif isinstance(prompt, Chat):
            ids = self.encode_chat(prompt)
        else:
            ids = list(prompt)
        if not ids:
            raise InvalidRequest(prompt_field(prompt), "the prompt is empty")
        return ids


def _chat_texts(chat: Chat) -> list[str]:
    """What rendering a chat tokenizes, roughly: its messages, calls and tools."""
    out = [m.role + m.content + m.tool_call_id for m in chat.messages]
    out += [c.name + c.arguments for m in chat.messages for c in m.tool_calls]
    return out + [t.name + t.description + t.parameters for t in chat.tools]


def _f32(x: float) -> float:
    """x as the engine's sampler holds it (float32; both APIs' values are rounded alike)."""
    return ctypes.c_float(x).value


def validate(request: GenerationInput, prompt: list[int], limits: Limits) -> GenerationParams:
    """The request's GenerationParams for its prompt's token ids."""
    if len(request.request_id) > MAX_REQUEST_ID_LEN:
        raise InvalidRequest("request_id", f"longer than {MAX_REQUEST_ID_LEN} characters")
    room = limits.max_model_len - len(prompt)
    if room < 1:  # before the scan below: a prompt far too long is refused without one
        raise InvalidRequest("input", f"the prompt has {len(prompt)} tokens; max_model_len is "
                             f"{limits.max_model_len}, so it must be at most "
                             f"{limits.max_model_len - 1}")
    bad = next((t for t in prompt if not 0 <= t < limits.vocab_size), None)
    if bad is not None:
        raise InvalidRequest("token_ids",
                             f"{bad} is outside the vocabulary [0, {limits.vocab_size})")
    s = request.sampling
    d = limits.defaults
    max_tokens = room if d.max_tokens is None or s.max_tokens is not None else min(
        d.max_tokens, room)
    if s.max_tokens is not None:
        if s.max_tokens < 1:
            raise InvalidRequest("sampling.max_tokens", f"must be >= 1, got {s.max_tokens}")
        if s.max_tokens > room:
            raise InvalidRequest("sampling.max_tokens",
                                 f"{s.max_tokens} with a {len(prompt)}-token prompt exceeds "
                                 f"max_model_len {limits.max_model_len}; at most {room} allowed")
        max_tokens = s.max_tokens
    temperature = _f32(_first(s.temperature, d.temperature, 1.0))
    if not (math.isfinite(temperature) and temperature >= 0):
        raise InvalidRequest("sampling.temperature", f"must be >= 0, got {temperature}")
    top_p = _f32(_first(s.top_p, d.top_p, 1.0))
    if not (0 < top_p <= 1):
        raise InvalidRequest("sampling.top_p", f"must be in (0, 1], got {top_p}")
    top_k = _first(s.top_k, d.top_k, 0)
    if top_k < 0:
        raise InvalidRequest("sampling.top_k", f"must be >= 0 (0 disables), got {top_k}")
    if len(s.stop) > MAX_STOP_STRINGS:
        raise InvalidRequest("sampling.stop", f"at most {MAX_STOP_STRINGS} stop strings")
    for stop in s.stop:
        if not stop or len(stop) > MAX_STOP_STRING_LEN:
            raise InvalidRequest("sampling.stop", f"each must have 1..{MAX_STOP_STRING_LEN} chars")
    for t in s.stop_token_ids:
        if not 0 <= t < limits.vocab_size:
            raise InvalidRequest("sampling.stop_token_ids", f"{t} is outside the vocabulary")
    return GenerationParams(
        max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
        seed=s.seed, stop=tuple(s.stop), stop_token_ids=tuple(s.stop_token_ids),
        ignore_eos=s.ignore_eos, skip_special_tokens=not s.include_special_tokens,
        **_extras(s, max_tokens, limits),
    )


def _first(*values: Any) -> Any:
    """The first value that is not None (the request's, the model's default, the API's),
    else None."""
    return next((v for v in values if v is not None), None)


def _extras(s: Sampling, max_tokens: int, limits: Limits) -> dict[str, Any]:
    """The penalties, filters, logprobs and n, checked with vLLM's ranges."""
    extras: dict[str, Any] = {}
    for name in ("presence_penalty", "frequency_penalty"):
        if (v := getattr(s, name)) is not None:
            v = _f32(v)
            if not -2.0 <= v <= 2.0:
                raise InvalidRequest(f"sampling.{name}", f"must be in [-2, 2], got {v}")
            extras[name] = v
    if (r := _first(s.repetition_penalty, limits.defaults.repetition_penalty, None)) is not None:
        v = _f32(r)
        if not (math.isfinite(v) and v > 0):
            raise InvalidRequest("sampling.repetition_penalty", f"must be > 0, got {v}")
        extras["repetition_penalty"] = v
    if (m := _first(s.min_p, limits.defaults.min_p, None)) is not None:
        v = _f32(m)
        if not 0.0 <= v <= 1.0:
            raise InvalidRequest("sampling.min_p", f"must be in [0, 1], got {v}")
        extras["min_p"] = v
    extras["logit_bias"] = _logit_bias(s.logit_bias, limits)
    if not 0 <= s.min_tokens <= max_tokens:
        raise InvalidRequest("sampling.min_tokens", f"must be in [0, max_tokens = {max_tokens}], "
                             f"got {s.min_tokens}")
    extras["min_tokens"] = s.min_tokens
    for name in ("logprobs", "prompt_logprobs"):
        if (k := getattr(s, name)) is not None:
            if not 0 <= k <= MAX_TOP_LOGPROBS:
                raise InvalidRequest(f"sampling.{name}", f"must be in [0, {MAX_TOP_LOGPROBS}], "
                                     f"got {k}")
            extras[name] = k
    if s.n is not None:
        if not 1 <= s.n <= MAX_N:
            raise InvalidRequest("sampling.n", f"must be in [1, {MAX_N}], got {s.n}")
        extras["n"] = s.n
    if s.structured is not None:
        if s.min_tokens:
            raise InvalidRequest("sampling.min_tokens", f"cannot be combined with "
                                 f"{s.structured.kind} (the constraint decides where the "
                                 f"output ends)")
        extras["constraint"] = _constraint(s.structured)
    return extras


def _logit_bias(bias: tuple[tuple[int, float], ...], limits: Limits
                ) -> tuple[tuple[int, float], ...]:
    if len(bias) > MAX_LOGIT_BIAS:
        raise InvalidRequest("sampling.logit_bias", f"at most {MAX_LOGIT_BIAS} entries, got "
                             f"{len(bias)}")
    out = []
    for t, v in bias:
        v = _f32(v)
        if not 0 <= t < limits.vocab_size:
            raise InvalidRequest("sampling.logit_bias", f"token {t} is outside the vocabulary "
                                 f"[0, {limits.vocab_size})")
        if not -100.0 <= v <= 100.0:
            raise InvalidRequest("sampling.logit_bias", f"the bias of token {t} must be in "
                                 f"[-100, 100], got {v}")
        out.append((t, v))
    return tuple(sorted(out))


def _constraint(spec: StructuredOutput) -> Constraint:
    """The structured-output constraint; its text is checked by compiling it (grammar.py)."""
    kind, value = spec.kind, spec.value
    if kind == "json_object":
        if value is not True:
            raise InvalidRequest("sampling.json_object", "set it to true, or leave it unset")
        return Constraint(kind)
    if kind == "choice":
        choices = list(value) if isinstance(value, tuple) else []
        if not 1 <= len(choices) <= MAX_CHOICES or not all(choices):
            empty = "" if all(choices) else " with an empty one"
            raise InvalidRequest("sampling.choice", f"1..{MAX_CHOICES} non-empty strings needed, "
                                 f"got {len(choices)}{empty}")
        return Constraint(kind, json.dumps(choices, ensure_ascii=False))
    if not isinstance(value, str) or not value.strip():
        raise InvalidRequest(f"sampling.{kind}", "empty")
    return Constraint(kind, value)
