"""Reading tool calls out of generated text (exact strings: the default model never writes a
<tool_call> block by itself) and the schemas that force a call."""

import json

import jsonschema

from pagedserve.scheduler.api.openai_tools import (
    CallStream,
    Function,
    ToolDef,
    ToolMode,
    forced_schema,
    read_calls,
)

AUTO = ToolMode("auto", frozenset({"add", "now"}))
ADD = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
NOW = '<tool_call>{"name": "now", "parameters": {}}</tool_call>'


def functions(calls):
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def test_auto_reads_every_block_and_keeps_the_text_around_them():
    content, calls, finish = read_calls(AUTO, f"Let me add.\n{ADD}\n{NOW}", "stop")
    assert (content, finish) == ("Let me add.", "tool_calls")
    assert functions(calls) == [("add", {"a": 1, "b": 2}), ("now", {})]
    assert all(c["id"].startswith("call_") and len(c["id"]) == 29 for c in calls)
    assert read_calls(AUTO, ADD, "stop")[0] is None  # only a call: content null
    unclosed = read_calls(AUTO, ADD.removesuffix("</tool_call>"), "stop")  # EOS before the tag
    assert functions(unclosed[1]) == [("add", {"a": 1, "b": 2})]
    one = ToolMode("auto", AUTO.names, parallel=False)
    assert functions(read_calls(one, ADD + NOW, "stop")[1]) == [("add", {"a": 1, "b": 2})]


def test_text_that_is_not_a_call_of_an_offered_tool_stays_content():
    for text in ("no calls here", ADD.replace('"add"', '"sub"'), ADD.replace("}}", "}"),
                 '<tool_call>{"name": "add", "arguments": [1]}</tool_call>', ADD + "<tool_call>{"):
        assert read_calls(AUTO, text, "stop") == (text, None, "stop")


def test_a_stream_holds_what_may_be_a_call_and_releases_the_rest():
    s = CallStream(AUTO)
    pieces = ["Sure", ". <tool", "_call>\n{\"name\": \"add\", ", '"arguments": {"a": 1, "b": 2}}',
              "\n</tool_call>"]
    assert [s.feed(p) for p in pieces] == ["Sure", ". ", "", "", ""]
    rest, calls, finish = s.finish("stop")
    assert (rest, finish, functions(calls)) == ("", "tool_calls", [("add", {"a": 1, "b": 2})])
    s = CallStream(AUTO)
    assert [s.feed(p) for p in ("a <to", "ol box")] == ["a ", "<tool box"]
    assert s.finish("length") == ("", None, "length")


def test_forced_schemas_are_vllms_and_accept_only_offered_calls():
    p = {"type": "object", "properties": {"x": {"$ref": "#/$defs/x"}}, "required": ["x"],
         "$defs": {"x": {"type": "integer"}}}
    tools = [ToolDef(type="function", function=Function(name="f", parameters=p)),
             ToolDef(type="function", function=Function(name="g"))]
    named = forced_schema(tools, ToolMode("named", frozenset("fg"), "f"))
    assert named == p
    required = forced_schema(tools, ToolMode("required", frozenset("fg")))
    assert required["minItems"] == 1 and required["$defs"] == p["$defs"]
    jsonschema.validate([{"name": "f", "parameters": {"x": 3}},
                         {"name": "g", "parameters": {}}], required)
    for bad in ([], [{"name": "h", "parameters": {}}], [{"name": "f", "parameters": {"x": "3"}}]):
        assert not jsonschema.Draft202012Validator(required).is_valid(bad)
    single = forced_schema(tools, ToolMode("required", frozenset("fg"), parallel=False))
    assert single["maxItems"] == 1
    assert forced_schema(tools, AUTO) is None
    assert p["$defs"] == {"x": {"type": "integer"}}  # the request's schema is left whole
