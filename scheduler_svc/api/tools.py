"""Tools in chat (both APIs): the offered functions and the calls in assistant messages, checked
and put into the shapes chat templates take (transformers' `tools=` and messages' `tool_calls`).

A template without a place for tools (SmolLM2's renders role and content only) gets the Hermes
format, as vLLM's and TGI's tool prompts do for such models: a system block listing the tools
and asking for `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, the assistant's past
calls written in that format, and a tool's result as the "tool" message's content. The HTTP API
parses the same format out of the model's answer (openai_tools.py).
"""

from __future__ import annotations

import json
import re
from typing import Any

from pagedserve.scheduler.api.generation_input import Tool, ToolCall
from pagedserve.scheduler.invalid import InvalidRequest

MAX_TOOLS = 128  # OpenAI's bound
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_CPP_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")  # xgrammar's "[time] file.cc:123: "
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
NO_PARAMETERS = {"type": "object", "properties": {}}

FALLBACK_PROMPT = (
    "You may call one or more functions to assist with the user query. The functions, each "
    "with a JSON Schema of its parameters, are within <tools></tools>:\n<tools>\n{tools}\n"
    "</tools>\nTo call a function, reply with a JSON object with its name and arguments "
    "within <tool_call></tool_call> tags, one per call:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)


class ToolError(InvalidRequest):
    """A client's tool or tool call that cannot be used."""


def tool_dicts(tools: list[Tool]) -> list[dict[str, Any]]:
    """The offered tools as OpenAI's (and transformers') dicts; ToolError if one is bad."""
    if len(tools) > MAX_TOOLS:
        raise ToolError("chat.tools", f"at most {MAX_TOOLS} tools")
    out, seen = [], set()
    for i, t in enumerate(tools):
        if not _NAME.fullmatch(t.name):
            raise ToolError(f"chat.tools[{i}].name", f"1 to 64 letters, digits, _ or -, got "
                            f"{t.name!r}")
        if t.name in seen:
            raise ToolError(f"chat.tools[{i}].name", f"{t.name!r} is offered twice")
        seen.add(t.name)
        params = json_object(t.parameters, f"chat.tools[{i}].parameters") if t.parameters \
            else NO_PARAMETERS
        check_schema(params, f"chat.tools[{i}].parameters")
        fn = {"name": t.name, "description": t.description, "parameters": params}
        out.append({"type": "function", "function": fn})
    return out


def json_object(text: str, field: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError as e:
        raise ToolError(field, f"not JSON ({e})") from None
    if not isinstance(value, dict):
        raise ToolError(field, "must be a JSON object")
    return value


def check_schema(schema: dict[str, Any], field: str) -> None:
    """A schema xgrammar can turn into a grammar (the engine that would constrain calls to
    it): the same message as a json_schema constraint would get, before anything is queued."""
    import xgrammar as xgr

    try:
        xgr.Grammar.from_json_schema(json.dumps(schema), strict_mode=True)
    except (RuntimeError, ValueError) as e:
        raise ToolError(field, _CPP_PREFIX.sub("", str(e).strip()).strip()) from None


def call_dicts(calls: list[ToolCall], field: str) -> list[dict[str, Any]]:
    """An assistant message's calls as templates take them: arguments as a dict."""
    return [{"id": c.id, "type": "function",
             "function": {"name": c.name,
                          "arguments": json_object(c.arguments or "{}",
                                                   f"{field}[{j}].arguments")}}
            for j, c in enumerate(calls)]


def fallback_system(tools: list[dict[str, Any]]) -> str:
    return FALLBACK_PROMPT.format(tools="\n".join(json.dumps(t, ensure_ascii=False)
                                                 for t in tools))


def calls_text(calls: list[dict[str, Any]]) -> str:
    """Past calls in the format the fallback block asks for."""
    return "\n".join(f"{CALL_OPEN}\n" + json.dumps(
        {"name": c["function"]["name"], "arguments": c["function"]["arguments"]},
        ensure_ascii=False) + f"\n{CALL_CLOSE}" for c in calls)
