"""The neutral GenerationInput both front ends build: the gRPC servicer from a GenerateRequest,
the OpenAI API from its body; the same ask gives the same input and the same validated
parameters either way."""

import pytest

from pagedserve.protos.v1 import generate_pb2 as api
from pagedserve.scheduler.api.generation_input import (
    Chat,
    GenerationInput,
    Message,
    Sampling,
    StructuredOutput,
    Tool,
    ToolCall,
    prompt_field,
)
from pagedserve.scheduler.api.inputs import Limits, validate
from pagedserve.scheduler.api.openai_errors import OpenAIError
from pagedserve.scheduler.api.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    to_inputs,
)
from pagedserve.scheduler.api.openai_tools import tool_mode
from pagedserve.scheduler.api.servicer import generation_input, prompt_of
from pagedserve.scheduler.invalid import InvalidRequest

LIMITS = Limits(max_model_len=100, vocab_size=1000)


def test_the_prompt_field_names_its_kind():
    assert [prompt_field(p) for p in ("hi", [1, 2], Chat(), None)] == [
        "text", "token_ids", "chat", "input"]


def test_both_apis_give_the_same_input_and_parameters():
    grpc = api.GenerateRequest(request_id="r", priority=3, token_ids=api.TokenIds(ids=[1, 2]))
    s = grpc.sampling
    s.max_tokens, s.temperature, s.top_p, s.seed = 5, 0.7, 0.9, 7
    s.stop.append("END")
    s.presence_penalty, s.logprobs, s.n = 0.3, 2, 2
    s.logit_bias[42] = 1.5
    s.regex = "[ab]+"
    body = CompletionRequest(model="m", prompt=[1, 2], max_tokens=5, temperature=0.7,
                             top_p=0.9, seed=7, stop="END", presence_penalty=0.3, logprobs=2,
                             n=2, logit_bias={"42": 1.5}, guided_regex="[ab]+", priority=3)
    [http] = to_inputs(body, "r", timeout=2.5)
    mine = generation_input(grpc, 2.5)
    assert (http.prompt, http.request_id, http.priority, http.timeout) == (
        mine.prompt, mine.request_id, mine.priority, mine.timeout) == ([1, 2], "r", 3, 2.5)
    assert http.sampling.structured == mine.sampling.structured == StructuredOutput(
        "regex", "[ab]+")
    # the proto's floats are float32; validation rounds the HTTP API's alike
    assert validate(http, [1, 2], LIMITS) == validate(mine, [1, 2], LIMITS)


def test_a_chat_with_tools_and_calls_becomes_the_neutral_chat():
    body = ChatCompletionRequest(model="m", messages=[
        {"role": "developer", "content": "Be brief."},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "function": {"name": "add", "arguments": "{\"a\": 1}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "2"}]}],
        tools=[{"type": "function", "function": {"name": "add", "description": "Adds."}}])
    [inp] = to_inputs(body, "r", tool_mode(body.tools, body.tool_choice, None))
    assert inp.prompt == Chat(
        (Message("system", "Be brief."),
         Message("assistant", "", (ToolCall("c1", "add", "{\"a\": 1}"),)),
         Message("tool", "2", tool_call_id="c1")),
        (Tool("add", "Adds.", '{"type": "object", "properties": {}}'),))
    grpc = api.GenerateRequest(chat=api.ChatMessages(
        messages=[api.ChatMessage(role="system", content="Be brief."),
                  api.ChatMessage(role="assistant", tool_calls=[
                      api.ToolCall(id="c1", name="add", arguments="{\"a\": 1}")]),
                  api.ChatMessage(role="tool", content="2", tool_call_id="c1")],
        tools=[api.Tool(name="add", description="Adds.",
                        parameters='{"type": "object", "properties": {}}')]))
    assert prompt_of(grpc) == inp.prompt


def test_a_completions_batch_is_one_input_per_prompt():
    body = CompletionRequest(model="m", prompt=["a", "b"], max_tokens=3)
    inputs = to_inputs(body, "cmpl-x")
    assert [(i.request_id, i.prompt) for i in inputs] == [("cmpl-x-0", "a"), ("cmpl-x-1", "b")]
    assert inputs[0].sampling == inputs[1].sampling == Sampling(max_tokens=3, n=1)


def test_an_openai_seed_wraps_and_a_logit_bias_key_must_be_a_32_bit_id():
    [inp] = to_inputs(CompletionRequest(model="m", prompt="a", seed=-1), "r")
    assert inp.sampling.seed == 2**64 - 1
    with pytest.raises(OpenAIError, match="^logit_bias: key '4294967296' is not a token id"):
        to_inputs(CompletionRequest(model="m", prompt="a", logit_bias={str(2**32): 1.0}), "r")


def test_validation_of_a_neutral_input_names_its_field_paths():
    with pytest.raises(InvalidRequest, match=r"^sampling\.choice: 1\.\.1024 non-empty"):
        validate(GenerationInput([1], Sampling(structured=StructuredOutput("choice", ()))),
                 [1], LIMITS)
    with pytest.raises(InvalidRequest, match=r"^sampling\.n: must be in \[1, 16\], got 99"):
        validate(GenerationInput([1], Sampling(n=99)), [1], LIMITS)


def test_openai_cache_and_safety_keys_are_accepted():
    """The OpenAI SDK sends prompt_cache_key and safety_identifier; refusing them (unknown
    fields are refused) would fail those clients."""
    for cls, extra in ((CompletionRequest, {"prompt": "hi"}),
                       (ChatCompletionRequest, {"messages": [{"role": "user", "content": "hi"}]})):
        body = cls(model="m", prompt_cache_key="conversation-7", safety_identifier="u1", **extra)
        assert body.prompt_cache_key == "conversation-7"
        with pytest.raises(ValueError):
            cls(model="m", prompt_cache_kee="x", **extra)
