"""openai_responses: Responses input items as chat messages, and errors renamed."""

from __future__ import annotations

import pytest

from pagedserve.scheduler.api.openai_errors import OpenAIError
from pagedserve.scheduler.api.openai_responses import ResponsesRequest, renamed, to_chat


def chat_of(**body):
    return to_chat(ResponsesRequest.model_validate({"model": "m", **body}))


def test_calls_join_the_assistant_turn_before_them_and_outputs_are_tool_messages():
    chat = chat_of(instructions="Be brief.", input=[
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"type": "message", "role": "assistant",
         "content": [{"type": "output_text", "text": "Checking."}]},
        {"type": "function_call", "call_id": "c1", "name": "w", "arguments": '{"city":"Paris"}'},
        {"type": "function_call", "call_id": "c2", "name": "w", "arguments": '{"city":"Rome"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {"type": "function_call_output", "call_id": "c2",
         "output": [{"type": "input_text", "text": "rain"}]},
        {"type": "function_call", "call_id": "c3", "name": "w", "arguments": "{}"}],
        max_output_tokens=7, tools=[{"type": "function", "name": "w", "parameters": {}}],
        tool_choice={"type": "function", "name": "w"},
        text={"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}}})
    got = [(m.role, m.content, [c.id for c in m.tool_calls or []], m.tool_call_id)
           for m in chat.messages]
    assert got == [("system", "Be brief.", [], None),
                   ("user", "Weather in Paris and Rome?", [], None),
                   ("assistant", "Checking.", ["c1", "c2"], None),
                   ("tool", "sunny", [], "c1"), ("tool", "rain", [], "c2"),
                   ("assistant", None, ["c3"], None)]
    assert chat.max_completion_tokens == 7 and chat.tools[0].function.name == "w"
    assert chat.tool_choice == {"type": "function", "function": {"name": "w"}}
    assert chat.response_format == {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object"}, "strict": None}}


@pytest.mark.parametrize("body, param", [
    ({"input": [{"type": "function_call", "name": "w", "arguments": "{}"}]},
     "input[0].call_id"),
    ({"input": [{"role": "user", "content": [{"type": "input_file"}]}]}, "input[0].content[0]"),
    ({"input": "x", "tools": [{"type": "file_search"}]}, "tools[0].type"),
    ({"input": "x", "tool_choice": {"type": "mcp"}}, "tool_choice"),
    ({"input": "x", "background": True}, "background"),
])
def test_what_cannot_be_served_is_a_400_naming_it(body, param):
    with pytest.raises(OpenAIError) as err:
        chat_of(**body)
    assert (err.value.status, err.value.param) == (400, param)
    assert err.value.message.startswith(param + ": ")


def test_chat_errors_name_the_responses_parameter():
    err = renamed(OpenAIError(400, "max_completion_tokens: too many", "max_completion_tokens"))
    assert (err.param, err.message) == ("max_output_tokens", "max_output_tokens: too many")
    err = renamed(OpenAIError(400, "messages[2].content: bad", "messages[2].content"))
    assert (err.param, err.message) == ("input", "input: bad")
    same = OpenAIError(400, "top_p: bad", "top_p")
    assert renamed(same) is same
