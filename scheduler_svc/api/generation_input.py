"""What a client asks the engine to generate, in neither API's shape: each front end builds a
GenerationInput from its own wire format (the gRPC servicer from a GenerateRequest, the OpenAI
API from a JSON body), and tokenizing, chat templates, tools and validation (inputs.py) work on
it alone, so that neither API builds the other's request types.

Its attribute paths are the field paths validation names in InvalidRequest: `sampling.top_p`,
`chat.messages[0].role`, `chat.tools[1].parameters`, `sampling.<kind>` for the structured
output, and `text`, `token_ids` or `chat` for the prompt (`input` when there is none). The
gRPC API sends them as they are (they are its GenerateRequest's paths too); the OpenAI API maps
them onto its parameters (openai_protocol.openai_param). None means unset: validation supplies
the default.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeAlias


@dataclass(frozen=True, slots=True)
class Tool:
    """A function the chat offers the model."""

    name: str
    description: str = ""
    parameters: str = ""  # a JSON Schema of its arguments, as JSON text ("": none)


@dataclass(frozen=True, slots=True)
class ToolCall:
    """A call of a tool, in an assistant message."""

    id: str
    name: str
    arguments: str  # a JSON object, as JSON text


@dataclass(frozen=True, slots=True)
class Message:
    role: str
    content: str = ""
    tool_calls: tuple[ToolCall, ...] = ()  # an assistant's
    tool_call_id: str = ""  # a "tool" message: the call whose result it holds


@dataclass(frozen=True, slots=True)
class Chat:
    """Chat messages, rendered with the model's chat template and a generation prompt."""

    messages: tuple[Message, ...] = ()
    tools: tuple[Tool, ...] = ()


# The prompt: text (tokenized, its special tokens added), token ids (used as they are), or chat
# messages; None: none was given.
Prompt: TypeAlias = str | list[int] | Chat | None


def prompt_field(prompt: Prompt) -> str:
    """The prompt's field path: which kind of input it is."""
    if prompt is None:
        return "input"
    if isinstance(prompt, str):
        return "text"
    return "chat" if isinstance(prompt, Chat) else "token_ids"


@dataclass(frozen=True, slots=True)
class StructuredOutput:
    """A constraint on the generated text (sampling.<kind> in errors). value: True for
    json_object, the strings for choice, the spec's text for json_schema, regex, grammar
    (GBNF) and lark_grammar."""

    kind: str
    value: bool | str | tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Sampling:
    """How tokens are chosen, when generation ends, and what comes back with them."""

    max_tokens: int | None = None  # None: up to max_model_len
    temperature: float | None = None
    top_k: int | None = None  # 0: off; None: the model's default (sampling_defaults.py), else off
    top_p: float | None = None
    seed: int | None = None  # unsigned 64-bit
    stop: tuple[str, ...] = ()  # stop strings, matched by the front end
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    include_special_tokens: bool = False  # in the returned text
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_p: float | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias), each id once
    min_tokens: int = 0
    logprobs: int | None = None  # alternatives per generated token; None: no logprobs
    prompt_logprobs: int | None = None  # alternatives per prompt token; None: none
    n: int | None = None  # completions of the prompt
    structured: StructuredOutput | None = None


@dataclass(frozen=True, slots=True)
class GenerationInput:
    """One prompt to complete, as a client asked for it (not validated yet)."""

    prompt: Prompt
    sampling: Sampling = Sampling()
    request_id: str = ""  # the client's ("": the engine names it)
    priority: int = 0  # lower is served first; the tenant bounds it
    timeout: float | None = None  # seconds the request may live (the client's deadline)
    adapter: str = ""  # a LoRA adapter's name; "": the base model


@dataclass(frozen=True, slots=True)
class Tokens:
    """A tokenized prompt: its ids and each one's token string."""

    ids: list[int]
    strings: list[str]
