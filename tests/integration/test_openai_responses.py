"""OpenAI's Responses API against a running `pagedserve serve`, called with the official `openai`
SDK: its create(), create(stream=True) and the stream() helper that checks the events' order."""

from __future__ import annotations

import json

import openai
import pytest

from tests.integration.conftest import MAX_TOKENS, PROMPTS
from tests.integration.test_openai_api import MODEL, sdk

CHATS = [i for i, (kind, _) in enumerate(PROMPTS) if kind == "chat"]
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "name": "get_weather", "description": "The weather in a city",
          "parameters": WEATHER}]
CHAT_TOOLS = [{"type": "function", "function": {"name": "get_weather",
                                                 "description": "The weather in a city",
                                                 "parameters": WEATHER}}]


@pytest.mark.parametrize("i", CHATS[:2])
def test_greedy_output_equals_hf_whole_and_streamed(service, hf_greedy, tokenizer, i):
    client = sdk(service)
    want = tokenizer.decode(hf_greedy[i], skip_special_tokens=True)
    kw = dict(model=MODEL, input=PROMPTS[i][1], max_output_tokens=MAX_TOKENS, temperature=0)
    out = client.responses.create(**kw)
    assert out.object == "response" and out.id.startswith("resp_") and out.model == MODEL
    assert out.output_text == want
    done = len(hf_greedy[i]) < MAX_TOKENS  # it stopped at the end of its answer
    assert [(o.type, o.role, o.status) for o in out.output] == [
        ("message", "assistant", "completed" if done else "incomplete")]
    assert out.status == ("completed" if done else "incomplete")
    assert out.incomplete_details is None if done else \
        out.incomplete_details.reason == "max_output_tokens"
    chat = client.chat.completions.create(model=MODEL, max_tokens=MAX_TOKENS, temperature=0,
                                          messages=[{"role": "user", "content": PROMPTS[i][1]}])
    assert (out.usage.input_tokens, out.usage.output_tokens, out.usage.total_tokens) == (
        chat.usage.prompt_tokens, len(hf_greedy[i]), chat.usage.total_tokens)

    events = list(client.responses.create(**kw, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done",
                          "response.completed" if done else "response.incomplete"]
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == want
    assert events[-1].response.output_text == want
    assert events[-1].response.usage.output_tokens == len(hf_greedy[i])
    with client.responses.stream(**kw) as stream:  # the SDK's helper tracks every event
        last = list(stream)[-1]  # (its final response is a response.completed event's only)
    assert last.type == kinds[-1] and last.response.output_text == want


def test_instructions_and_message_items_are_the_chat_messages(service):
    """instructions are the system message; message items with text parts are the turns."""
    client = sdk(service)
    out = client.responses.create(model=MODEL, instructions="Answer in one word.", input=[
        {"role": "user", "content": [{"type": "input_text", "text": "Capital of Italy?"}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "Rome."}]},
        {"type": "message", "role": "user", "content": "And of Spain?"}],
        max_output_tokens=12, temperature=0)
    chat = client.chat.completions.create(model=MODEL, max_tokens=12, temperature=0, messages=[
        {"role": "system", "content": "Answer in one word."},
        {"role": "user", "content": "Capital of Italy?"},
        {"role": "assistant", "content": "Rome."}, {"role": "user", "content": "And of Spain?"}])
    assert out.output_text == chat.choices[0].message.content
    assert out.usage.input_tokens == chat.usage.prompt_tokens


@pytest.mark.parametrize("stream", [False, True])
def test_a_forced_function_call_and_its_output_round_trip(service, stream):
    """tool_choice names the function: the output is its call, arguments valid for its
    schema; the call and its output sent back as input items answer as chat does with the
    same turns."""
    client = sdk(service)
    question = "What's the weather in Paris?"
    kw = dict(model=MODEL, input=question, tools=TOOLS, max_output_tokens=40, temperature=0,
              tool_choice={"type": "function", "name": "get_weather"})
    if stream:
        with client.responses.stream(**kw) as s:
            out = s.get_final_response()
    else:
        out = client.responses.create(**kw)
    assert [o.type for o in out.output] == ["function_call"]
    call = out.output[0]
    assert call.name == "get_weather" and call.call_id.startswith("call_")
    assert isinstance(json.loads(call.arguments)["city"], str)

    turns = [{"role": "user", "content": question},
             {"type": "function_call", "call_id": call.call_id, "name": call.name,
              "arguments": call.arguments},
             {"type": "function_call_output", "call_id": call.call_id, "output": "22 C, sunny"}]
    again = client.responses.create(model=MODEL, input=turns, tools=TOOLS, tool_choice="none",
                                    max_output_tokens=20, temperature=0)
    chat = client.chat.completions.create(
        model=MODEL, tools=CHAT_TOOLS, tool_choice="none", max_tokens=20, temperature=0,
        messages=[{"role": "user", "content": question},
                  {"role": "assistant", "content": None, "tool_calls": [
                      {"id": call.call_id, "type": "function",
                       "function": {"name": call.name, "arguments": call.arguments}}]},
                  {"role": "tool", "tool_call_id": call.call_id, "content": "22 C, sunny"}])
    assert again.output_text == chat.choices[0].message.content
    assert again.usage.input_tokens == chat.usage.prompt_tokens


def test_a_json_schema_format_constrains_the_text(service):
    schema = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 20}},
              "required": ["answer"], "additionalProperties": False}
    out = sdk(service).responses.create(
        model=MODEL, input="What is the capital of France? Reply in JSON.",
        text={"format": {"type": "json_schema", "name": "answer", "schema": schema,
                         "strict": True}}, max_output_tokens=40, temperature=0)
    assert out.status == "completed"
    assert isinstance(json.loads(out.output_text)["answer"], str)


BAD = [
    (dict(previous_response_id="resp_1"), "previous_response_id"),
    (dict(tools=[{"type": "web_search"}]), "tools[0].type"),
    (dict(input=[{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]),
     "input[0].content[0]"),
    (dict(input=[{"type": "function_call_output", "output": "x"}]), "input[0].call_id"),
    (dict(input=[{"type": "reasoning", "summary": []}]), "input[0].type"),
    (dict(max_output_tokens=10**7), "max_output_tokens"),
    (dict(max_output_tokens=0), "max_output_tokens"),
    (dict(text={"format": {"type": "yaml"}}), "text.format"),
    (dict(tool_choice="required"), "tool_choice"),
    (dict(text={"format": "text"}), "text.format"),
    (dict(tools=[{"type": "function", "name": "f", "parameters": "none"}]),
     "tools[0].parameters"),
    (dict(include=["message.output_text.logprobs"]), "include"),
    (dict(extra_body={"temperatur": 0}), "temperatur"),
]


@pytest.mark.parametrize("kwargs, param", BAD, ids=[p for _, p in BAD])
def test_bad_input_is_a_bad_request_naming_the_param(service, kwargs, param):
    with pytest.raises(openai.BadRequestError) as err:
        sdk(service).responses.create(**{"model": MODEL, "input": "hi",
                                         "max_output_tokens": 4, **kwargs})
    assert err.value.status_code == 400
    assert err.value.param == param
    assert err.value.body["message"].startswith(param + ":")
    assert service.client.complete(text="Hello", max_tokens=1)[1]  # still serving


def test_the_openai_agents_sdk_runs_a_tool_and_streams_an_answer(service, hf_greedy, tokenizer):
    """OpenAI's Agents SDK on its Responses model: a forced tool call runs the Python function
    with the arguments the model wrote; a plain agent's answer, streamed, is HF's greedy one."""
    import asyncio

    from agents import (
        Agent,
        ModelSettings,
        OpenAIResponsesModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )

    set_tracing_disabled(True)  # (it would upload traces to OpenAI)
    cities: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        cities.append(city)
        return f"22 C and sunny in {city}"

    def model() -> OpenAIResponsesModel:  # a client per event loop
        return OpenAIResponsesModel(model=MODEL, openai_client=openai.AsyncOpenAI(
            base_url=service.http_url + "/v1", api_key="none", max_retries=0))

    async def run() -> tuple[str, str, str]:
        agent = Agent(name="weather", instructions="You answer weather questions.",
                      model=model(), tools=[get_weather], tool_use_behavior="stop_on_first_tool",
                      model_settings=ModelSettings(tool_choice="get_weather", temperature=0,
                                                   max_tokens=40))
        called = await Runner.run(agent, "What's the weather in Paris?")
        plain = Agent(name="plain", model=model(),
                      model_settings=ModelSettings(temperature=0, max_tokens=MAX_TOKENS))
        streamed = Runner.run_streamed(plain, PROMPTS[CHATS[0]][1])
        deltas = [e.data.delta async for e in streamed.stream_events()
                  if e.type == "raw_response_event" and
                  e.data.type == "response.output_text.delta"]
        return called.final_output, "".join(deltas), streamed.final_output

    called, deltas, final = asyncio.run(run())
    assert len(cities) == 1 and called == f"22 C and sunny in {cities[0]}"
    want = tokenizer.decode(hf_greedy[CHATS[0]], skip_special_tokens=True)
    assert deltas == final == want
