"""OpenAI's `tools` and `tool_choice` in chat completions: which tools the prompt offers, the
constraint that forces a call, and the calls read back out of the generated text.

    tool_choice   prompt offers   output constrained to (json_schema)       calls from
    none          no tools        -                                         - (all content)
    auto          the tools       -                                         <tool_call> blocks
    required      the tools       [{"name": one of them, "parameters": {..}}, ...] (vLLM's)
    {function}    the tools       that function's parameters (vLLM's)       the whole text

`auto` reads the Hermes format the fallback prompt asks for (tools.py), which is also what
Qwen's and Hermes' own templates ask for: `<tool_call>{"name": ..., "arguments": {...}}
</tool_call>`; text that does not parse into calls of offered tools stays content. A named
function's call ends with finish_reason "stop", as OpenAI's and vLLM's do; `required` and
`auto` calls with "tool_calls".
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict

from pagedserve.scheduler.api.generation_input import Tool, ToolCall
from pagedserve.scheduler.api.openai_errors import OpenAIError
from pagedserve.scheduler.api.tools import CALL_CLOSE, CALL_OPEN, NO_PARAMETERS


class Function(BaseModel):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # accepted: calls are always constrained when forced


class ToolDef(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: str
    function: Function


class CalledFunction(BaseModel):
    name: str
    arguments: str  # JSON text, as OpenAI returns and takes it back


class ToolCallIn(BaseModel):
    id: str
    type: str = "function"
    function: CalledFunction


@dataclass(frozen=True, slots=True)
class ToolMode:
    """What a request's tool_choice makes of its output. name: the forced function's."""
    kind: str  # "auto", "required" or "named"
    names: frozenset[str]
    name: str | None = None
    parallel: bool = True

    @property
    def constrained(self) -> bool:
        return self.kind != "auto"


def _error(message: str, param: str) -> OpenAIError:
    return OpenAIError(400, f"{param}: {message}", param)


def tool_mode(tools: list[ToolDef] | None, choice: Any, parallel: bool | None
              ) -> ToolMode | None:
    """The request's mode (None: tools play no part), or a 400 naming the parameter."""
    tools = tools or []
    for i, t in enumerate(tools):
        if t.type != "function":
            raise _error(f"type must be 'function', got {t.type!r}", f"tools[{i}].type")
    names = frozenset(t.function.name for t in tools)
    if choice is None:
        choice = "auto" if tools else "none"
    if choice == "none":
        return None
    if not tools:
        raise _error("only allowed when tools are given", "tool_choice")
    if choice in ("auto", "required"):
        return ToolMode(choice, names, parallel=parallel is not False)
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
    if not (isinstance(choice, dict) and choice.get("type") == "function" and
            isinstance(name, str)):
        raise _error("'none', 'auto', 'required' or {\"type\": \"function\", \"function\": "
                     "{\"name\": ...}}", "tool_choice")
    if name not in names:
        raise _error(f"function {name!r} is not among the tools "
                     f"({', '.join(sorted(names))})", "tool_choice")
    return ToolMode("named", names, name, parallel is not False)


def offer(tools: list[ToolDef]) -> tuple[Tool, ...]:
    """The tools the prompt offers, as the chat's (checked there: tools.tool_dicts)."""
    return tuple(Tool(t.function.name, t.function.description or "",
                      json.dumps(t.function.parameters or NO_PARAMETERS)) for t in tools)


def forced_schema(tools: list[ToolDef], mode: ToolMode) -> dict[str, Any] | None:
    """The JSON Schema a call is constrained to (vLLM's shapes), None for auto."""
    if mode.kind == "named":
        return next(t.function.parameters or NO_PARAMETERS for t in tools
                    if t.function.name == mode.name)
    if mode.kind != "required":
        return None
    defs: dict[str, Any] = {}
    options = []
    for t in tools:
        params = dict(t.function.parameters or NO_PARAMETERS)
        defs.update(params.pop("$defs", {}))  # refs are to the root: hoist them there
        options.append({"properties": {"name": {"type": "string", "enum": [t.function.name]},
                                       "parameters": params},
                        "required": ["name", "parameters"]})
    schema: dict[str, Any] = {"type": "array", "minItems": 1,
                              "items": {"type": "object", "anyOf": options}}
    if not mode.parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def message_calls(calls: list[ToolCallIn], i: int) -> tuple[ToolCall, ...]:
    for j, c in enumerate(calls):
        if c.type != "function":
            raise _error(f"type must be 'function', got {c.type!r}",
                         f"messages[{i}].tool_calls[{j}].type")
    return tuple(ToolCall(c.id, c.function.name, c.function.arguments) for c in calls)


# ------------------------------------------------------------------ reading calls back
def new_call(name: str, arguments: str) -> dict[str, Any]:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


_BLOCK = re.compile(re.escape(CALL_OPEN) + r"(.*?)(?:" + re.escape(CALL_CLOSE) + r"|\Z)",
                    re.DOTALL)


def parse_hermes(text: str, names: frozenset[str]) -> tuple[str | None, list[dict]] | None:
    """(content outside the blocks or None, calls) if the text holds <tool_call> blocks that
    all parse into calls of offered functions; None otherwise (the text is content)."""
    calls = []
    for m in _BLOCK.finditer(text):
        try:
            call = json.loads(m.group(1))
        except ValueError:
            return None
        args = call.get("arguments", call.get("parameters")) if isinstance(call, dict) else None
        if not isinstance(args, dict) or call.get("name") not in names:
            return None
        calls.append(new_call(call["name"], json.dumps(args, ensure_ascii=False)))
    if not calls:
        return None
    content = _BLOCK.sub("", text).strip()
    return content or None, calls


def read_calls(mode: ToolMode, text: str, finish: str
               ) -> tuple[str | None, list[dict] | None, str]:
    """A whole answer as (content, tool_calls, finish_reason)."""
    if mode.kind == "named":  # the text is the arguments (cut short if finish is "length")
        return None, [new_call(mode.name or "", text)], finish
    if mode.kind == "required":
        items = _whole_items(text)
        if not items:
            return text, None, finish
        calls = [new_call(c["name"], json.dumps(c["parameters"], ensure_ascii=False))
                 for c in items]
        return None, calls, "tool_calls" if finish == "stop" else finish
    parsed = parse_hermes(text, mode.names)
    if parsed is None:
        return text, None, finish
    content, calls = parsed
    if not mode.parallel:
        calls = calls[:1]
    return content, calls, "tool_calls" if finish == "stop" else finish


def _whole_items(text: str) -> list[Any]:
    """The complete items of a JSON array, which is cut short when the answer reached
    max_tokens (a small model can list calls until then): the calls made so far."""
    dec, i, items = json.JSONDecoder(), 1, []
    while text.startswith("["):
        while i < len(text) and text[i] in " \n\t,":
            i += 1
        try:
            item, i = dec.raw_decode(text, i)
        except ValueError:
            break
        items.append(item)
    return items


class CallStream:
    """One streamed choice: content goes out as it comes until a call may be starting, the
    rest is held and read as calls when the choice finishes (constrained modes hold all)."""

    def __init__(self, mode: ToolMode) -> None:
        self.mode, self.held, self.sent = mode, "", ""

    def feed(self, text: str) -> str:
        """The content that can go out now."""
        self.held += text
        if self.mode.constrained or CALL_OPEN in self.held:
            return ""
        keep = next((k for k in range(len(CALL_OPEN) - 1, 0, -1)
                     if self.held.endswith(CALL_OPEN[:k])), 0)  # a tag may be starting
        out, self.held = self.held[:len(self.held) - keep], self.held[len(self.held) - keep:]
        self.sent += out
        return out

    def finish(self, finish: str) -> tuple[str, list[dict] | None, str]:
        """(the content still to send, calls, finish_reason)."""
        _, calls, reason = read_calls(self.mode, self.sent + self.held, finish)
        if calls is None:
            return self.held, None, reason
        if self.mode.constrained:
            return "", calls, reason
        rest = _BLOCK.sub("", self.held)  # (the text before the first block went out)
        return rest if rest.strip() else "", calls, reason
