"""Tool calls in chat completions, through the official `openai` SDK against `pagedserve serve`
on the default model: forced calls validate against their tool's schema, past calls and tool
results render into the prompt, `auto` reads <tool_call> blocks, bad tools are 400s."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from pagedserve.scheduler.api.tools import fallback_system

MODEL = "default"
WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 20},
    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"$ref": "#/$defs/zone"}},
        "required": ["zone"], "$defs": {"zone": {"type": "string", "enum": ["UTC", "CET"]}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description":
                                           "The weather in a city", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def sdk(svc) -> openai.OpenAI:
    return openai.OpenAI(base_url=svc.http_url + "/v1", api_key="none", max_retries=0,
                         timeout=120)


def ask(svc, stream: bool, **kwargs):
    """(content, tool_calls as dicts, finish_reason), streamed or not."""
    kwargs = {"model": MODEL, "messages": ASK, "tools": TOOLS, "max_tokens": 40, **kwargs}
    out = sdk(svc).chat.completions.create(stream=stream, **kwargs)
    if not stream:
        msg = out.choices[0].message
        calls = [c.model_dump() for c in msg.tool_calls or []]
        return msg.content, calls, out.choices[0].finish_reason
    content, calls, finishes = "", {}, []
    for chunk in out:
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for c in delta.tool_calls or []:  # each call whole, in one delta
            assert c.index not in calls and c.id.startswith("call_") and c.type == "function"
            calls[c.index] = {"id": c.id, "type": c.type, "function": c.function.model_dump()}
        finishes.append(chunk.choices[0].finish_reason)
    assert not any(finishes[:-1])
    return content or None, [calls[i] for i in sorted(calls)], finishes[-1]


def valid(call: dict) -> dict:
    args = json.loads(call["function"]["arguments"])
    jsonschema.validate(args, SCHEMAS[call["function"]["name"]])
    return args


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_named_function_is_called_with_valid_arguments(service, stream, temperature):
    content, calls, finish = ask(service, stream, tool_choice=NAMED, temperature=temperature,
                                 seed=7)
    assert content is None and finish == "stop"  # OpenAI's finish for a forced function
    assert [c["function"]["name"] for c in calls] == ["get_weather"]
    assert calls[0]["id"].startswith("call_") and calls[0]["type"] == "function"
    valid(calls[0])


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_required_gives_one_call_of_an_offered_tool(service, stream, temperature):
    content, calls, finish = ask(service, stream, tool_choice="required",
                                 parallel_tool_calls=False, temperature=temperature, seed=3)
    assert content is None and finish == "tool_calls" and len(calls) == 1
    valid(calls[0])


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_required_parallel_calls_cut_by_max_tokens_keep_the_whole_ones(service, stream):
    # greedy SmolLM2 lists get_weather calls until max_tokens: in 60 tokens one whole call
    # (returned) and the start of a second (dropped)
    content, calls, finish = ask(service, stream, tool_choice="required", temperature=0,
                                 max_tokens=60)
    assert content is None and finish == "length" and len(calls) == 1
    assert all(valid(c)["city"] == "Paris" for c in calls)
    assert len({c["id"] for c in calls}) == len(calls)


def test_a_conversation_with_a_tool_result_renders_it(service, tokenizer):
    call = {"id": "call_abc", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": '
                                                            '"celsius"}'}}
    turns = ASK + [{"role": "assistant", "content": None, "tool_calls": [call]},
                   {"role": "tool", "tool_call_id": "call_abc", "content": "22 degrees"}]
    out = sdk(service).chat.completions.create(model=MODEL, messages=turns, tools=TOOLS,
                                               tool_choice="none", max_tokens=8,
                                               temperature=0)
    assert out.choices[0].message.tool_calls is None
    assert isinstance(out.choices[0].message.content, str)
    # tool_choice none: the tools are not offered; the past call and its result are there
    want = tokenizer.apply_chat_template(ASK + [
        {"role": "assistant", "content": '<tool_call>\n{"name": "get_weather", "arguments": '
                                         '{"city": "Paris", "unit": "celsius"}}\n</tool_call>'},
        {"role": "tool", "content": "22 degrees"}], add_generation_prompt=True, tokenize=True)
    want = want if isinstance(want, list) else want["input_ids"]
    assert out.usage.prompt_tokens == len(want)
    offered = sdk(service).chat.completions.create(model=MODEL, messages=turns, tools=TOOLS,
                                                   tool_choice=NAMED, max_tokens=40)
    tools = [{"type": "function", "function": {"name": t["function"]["name"], "description":
                                               t["function"].get("description", ""),
                                               "parameters": t["function"]["parameters"]}}
             for t in TOOLS]  # as the server passes them on
    want = tokenizer.apply_chat_template(
        [{"role": "system", "content": fallback_system(tools)}] + turns[:1] + [
            {"role": "assistant", "content": '<tool_call>\n{"name": "get_weather", "arguments": '
                                             '{"city": "Paris", "unit": "celsius"}}\n</tool_call>'},
            {"role": "tool", "content": "22 degrees"}], add_generation_prompt=True,
        tokenize=True)
    want = want if isinstance(want, list) else want["input_ids"]
    assert offered.usage.prompt_tokens == len(want)
    valid(offered.choices[0].message.tool_calls[0].model_dump())


# `auto` on a model that writes a <tool_call> block: SmolLM2-135M never does by itself, so the
# server is made to write one by a regex (a real generation, parsed as auto parses any)
BLOCK = ('Checking.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", '
         '"unit": "celsius"}}\n</tool_call>')


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_auto_reads_a_tool_call_block(service, stream):
    regex = BLOCK.replace(".", r"\.").replace("{", r"\{").replace("}", r"\}")
    content, calls, finish = ask(service, stream, tool_choice="auto", temperature=0,
                                 max_tokens=80, extra_body={"guided_regex": regex})
    assert (content, finish) == ("Checking.", "tool_calls")
    assert [(c["function"]["name"], valid(c)) for c in calls] == [
        ("get_weather", {"city": "Rome", "unit": "celsius"})]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_auto_without_a_call_is_content(service, stream):
    content, calls, finish = ask(service, stream, temperature=0, max_tokens=12)
    plain = sdk(service).chat.completions.create(model=MODEL, messages=ASK, max_tokens=12,
                                                 temperature=0)
    assert calls == [] and finish == "length" and content
    assert plain.choices[0].message.content != content  # the tools were in the prompt


BAD = [
    (dict(tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice"),
    (dict(tool_choice="sometimes"), "tool_choice"),
    (dict(tools=None, tool_choice="required"), "tool_choice"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}]),
     "tools[0].function.parameters"),
    (dict(tools=[{"type": "retrieval", "function": {"name": "f"}}]), "tools[0].type"),
    (dict(tools=[{"type": "function", "function": {"name": "a b"}}]), "tools[0].function.name"),
    (dict(tools=TOOLS + TOOLS[:1]), "tools[2].function.name"),
    (dict(tool_choice="required", response_format={"type": "json_object"}), "response_format"),
    (dict(messages=ASK + [{"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "get_weather",
                                                     "arguments": "{not json"}}]}]),
     "messages[1].tool_calls[0].function.arguments"),
]


@pytest.mark.parametrize("kwargs, param", BAD, ids=[f"{i}-{p}" for i, (_, p) in enumerate(BAD)])
def test_bad_tools_are_400_naming_the_param(service, kwargs, param):
    kwargs = {"model": MODEL, "messages": ASK, "tools": TOOLS, "max_tokens": 4, **kwargs}
    if kwargs["tools"] is None:
        del kwargs["tools"]
    with pytest.raises(openai.BadRequestError) as err:
        sdk(service).chat.completions.create(**kwargs)
    assert err.value.param == param
    assert err.value.body["message"].startswith(param + ":")
