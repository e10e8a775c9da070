"""One typed client error: the field path travels with it, and the OpenAI API names the field
as its own parameter from that path (not from the message)."""

import pytest

from pagedserve.scheduler.api.chat import ChatError
from pagedserve.scheduler.api.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    invalid,
)
from pagedserve.scheduler.api.tools import ToolError
from pagedserve.scheduler.invalid import InvalidRequest

CHAT = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}],
                             max_completion_tokens=4)
JSON_CHAT = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}],
                                  response_format={"type": "json_object"})
COMPLETION = CompletionRequest(model="m", prompt="hi")


def test_str_is_the_grpc_message_and_every_kind_is_one_type():
    e = InvalidRequest("sampling.top_p", "must be in (0, 1], got 1.5")
    assert str(e) == "sampling.top_p: must be in (0, 1], got 1.5"
    assert isinstance(ChatError("chat.messages", "x"), InvalidRequest)
    assert isinstance(ToolError("chat.tools", "x"), InvalidRequest)


@pytest.mark.parametrize(("field", "req", "param"), [
    ("sampling.top_p", COMPLETION, "top_p"),
    ("sampling.max_tokens", COMPLETION, "max_tokens"),
    ("sampling.max_tokens", CHAT, "max_completion_tokens"),
    ("sampling.json_object", JSON_CHAT, "response_format"),
    ("chat.messages", CHAT, "messages"),
    ("chat.messages[2].role", CHAT, "messages[2].role"),
    ("chat.tools", CHAT, "tools"),
    ("chat.tools[1].parameters", CHAT, "tools[1].function.parameters"),
    ("chat.messages[0].tool_calls[3].arguments", CHAT,
     "messages[0].tool_calls[3].function.arguments"),
    ("token_ids", COMPLETION, "prompt"),
    ("input", CHAT, "messages"),
])
def test_the_openai_parameter_comes_from_the_field(field, req, param):
    err = invalid(InvalidRequest(field, "why: with a colon"), req)
    assert (err.status, err.param, err.message) == (400, param, f"{param}: why: with a colon")


def test_a_field_with_no_openai_name_keeps_the_grpc_message():
    err = invalid(InvalidRequest("request_id", "too long"), COMPLETION)
    assert (err.param, err.message) == (None, "request_id: too long")
