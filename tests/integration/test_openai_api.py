"""The OpenAI-compatible HTTP API against a running `pagedserve serve`, called with the official
`openai` SDK (and once with plain HTTP, for the server-sent events' framing)."""

from __future__ import annotations

import json
import socket
import time
import urllib.error
import urllib.request

import grpc
import openai
import pytest

from pagedserve.client import Client, build_request
from pagedserve.protos.v1 import generate_pb2 as api
from tests.integration.conftest import MAX_TOKENS, PROMPTS, prompt_ids
from tests.integration.service import Service, Stack

MODEL = "default"


def sdk(svc, key: str = "none") -> openai.OpenAI:
    return openai.OpenAI(base_url=svc.http_url + "/v1", api_key=key, max_retries=0, timeout=120)


def post(svc, path: str, body: dict, headers: dict | None = None):
    """A raw POST: the response, or the HTTPError it raised (a response too)."""
    req = urllib.request.Request(svc.http_url + path, json.dumps(body).encode(),
                                 {"content-type": "application/json", **(headers or {})})
    try:
        return urllib.request.urlopen(req, timeout=120)
    except urllib.error.HTTPError as e:
        return e


@pytest.mark.parametrize("i", [i for i, (kind, _) in enumerate(PROMPTS) if kind == "text"])
def test_completions_greedy_equals_hf(service, hf_greedy, tokenizer, i):
    out = sdk(service).completions.create(model=MODEL, prompt=PROMPTS[i][1],
                                          max_tokens=MAX_TOKENS, temperature=0)
    assert out.object == "text_completion" and out.model == MODEL
    assert out.choices[0].text == tokenizer.decode(hf_greedy[i], skip_special_tokens=True)
    assert out.usage.completion_tokens == len(hf_greedy[i])
    assert out.usage.prompt_tokens == len(tokenizer.encode(PROMPTS[i][1]))
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens


@pytest.mark.parametrize("i", [i for i, (kind, _) in enumerate(PROMPTS) if kind == "chat"])
def test_chat_greedy_equals_hf_streamed_and_not(service, hf_greedy, tokenizer, i):
    client, messages = sdk(service), [{"role": "user", "content": PROMPTS[i][1]}]
    want = tokenizer.decode(hf_greedy[i], skip_special_tokens=True)
    whole = client.chat.completions.create(model=MODEL, messages=messages,
                                           max_completion_tokens=MAX_TOKENS, temperature=0)
    assert whole.object == "chat.completion"
    assert whole.choices[0].message.role == "assistant"
    assert whole.choices[0].message.content == want
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=MAX_TOKENS, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks[:-1]) == want
    finishes = [c.choices[0].finish_reason for c in chunks[:-1]]
    assert finishes[-1] == whole.choices[0].finish_reason and not any(finishes[:-1])
    assert all(c.usage is None for c in chunks[:-1])
    last = chunks[-1]  # include_usage: one more chunk, no choices, the usage
    assert last.choices == [] and last.usage.completion_tokens == len(hf_greedy[i])
    assert last.usage.prompt_tokens == whole.usage.prompt_tokens
    assert len({c.id for c in chunks}) == 1


def test_stop_string_ends_the_text_before_it(service, hf_greedy, tokenizer):
    want = tokenizer.decode(hf_greedy[0], skip_special_tokens=True)  # " Paris. ..."
    stop = want.split()[2]
    client = sdk(service)
    for stream in (False, True):
        out = client.completions.create(model=MODEL, prompt=PROMPTS[0][1], temperature=0,
                                        max_tokens=MAX_TOKENS, stop=["never here", stop],
                                        stream=stream)
        chunks = list(out) if stream else [out]
        assert "".join(c.choices[0].text for c in chunks) == want[:want.index(stop)]
        assert chunks[-1].choices[0].finish_reason == "stop"
        assert chunks[-1].choices[0].model_extra["stop_reason"] == stop


def test_usage_counts_cached_prompt_tokens_on_a_repeated_prompt(service):
    prompt = f"A prompt no other test sends ({time.time_ns()}): " + "tea and biscuits, " * 20
    block = service.client.stub.GetModelInfo(api.GetModelInfoRequest(), timeout=30).block_size
    client = sdk(service)
    first, second = (client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
                     for _ in range(2))
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    n = second.usage.prompt_tokens
    # whole blocks of the prompt, less its last token (which is always computed)
    assert second.usage.prompt_tokens_details.cached_tokens == (n - 1) // block * block > 0


BAD = [  # (endpoint, kwargs, param)
    ("completions", dict(temperature=-1), "temperature"),
    ("completions", dict(max_tokens=0), "max_tokens"),
    ("completions", dict(top_p=1.5), "top_p"),
    ("completions", dict(extra_body={"top_k": -3}), "top_k"),
    ("completions", dict(stop=[""]), "stop"),
    ("completions", dict(extra_body={"stop_token_ids": [10**6]}), "stop_token_ids"),
    ("completions", dict(prompt="x " * 20000), "prompt"),
    ("completions", dict(prompt=""), "prompt"),
    ("completions", dict(n=0), "n"),
    ("completions", dict(n=17), "n"),
    ("completions", dict(presence_penalty=2.5), "presence_penalty"),
    ("completions", dict(logprobs=21), "logprobs"),
    ("completions", dict(extra_body={"prompt_logprobs": 21}), "prompt_logprobs"),
    ("completions", dict(stream=True, extra_body={"prompt_logprobs": 1}), "prompt_logprobs"),
    ("completions", dict(best_of=2), "best_of"),
    ("completions", dict(prompt=["hi", ""]), "prompt"),  # one bad prompt of a batch
    ("completions", dict(prompt=[[1, 2], [10**7]]), "prompt"),
    ("completions", dict(extra_body={"max_tokenz": 3}), "max_tokenz"),
    ("chat", dict(max_completion_tokens=10**6), "max_completion_tokens"),
    ("chat", dict(messages=[{"role": "wizard", "content": "hi"}]), "messages[0].role"),
    ("chat", dict(messages=[]), "messages"),
    ("chat", dict(logprobs=True, top_logprobs=21), "top_logprobs"),
    ("chat", dict(logprobs=True, top_logprobs=-1), "top_logprobs"),
    ("chat", dict(top_logprobs=3), "top_logprobs"),
    ("chat", dict(n=0), "n"),
    ("chat", dict(extra_body={"prompt_logprobs": -1}), "prompt_logprobs"),
    ("chat", dict(frequency_penalty=-3.0), "frequency_penalty"),
    ("chat", dict(extra_body={"min_p": 1.5}), "min_p"),
    ("chat", dict(logit_bias={"42": 500}), "logit_bias"),
    ("chat", dict(logit_bias={"forty": 5}), "logit_bias"),
    ("chat", dict(tool_choice="required"), "tool_choice"),
    ("chat", dict(stream_options={"include_usage": True}), "stream_options"),
]


@pytest.mark.parametrize("endpoint, kwargs, param", BAD, ids=[f"{e}-{p}" for e, _, p in BAD])
def test_bad_input_is_a_bad_request_naming_the_param(service, endpoint, kwargs, param):
    client = sdk(service)
    with pytest.raises(openai.BadRequestError) as err:
        if endpoint == "chat":
            client.chat.completions.create(**{"model": MODEL, "max_tokens": 4, "messages": [
                {"role": "user", "content": "hi"}], **kwargs})
        else:
            client.completions.create(**{"model": MODEL, "prompt": "hi", "max_tokens": 4,
                                         **kwargs})
    assert err.value.status_code == 400
    assert err.value.param == param
    assert err.value.body["message"].startswith(param + ":")
    assert err.value.type == "invalid_request_error"


def test_what_sdks_send_by_default_is_accepted(service, tokenizer):
    """Nulls for the defaults, OpenAI's `developer` role (the template's system role), and
    parameters that mean nothing here (store, metadata) do not fail a request."""
    body = {"model": MODEL, "max_tokens": 3, "temperature": 0, "n": None, "logprobs": None,
            "presence_penalty": None, "stream": None, "store": False, "metadata": {"a": "b"},
            "response_format": {"type": "text"}, "tools": None, "parallel_tool_calls": None,
            "messages": [{"role": "developer", "content": "Answer briefly."},
                         {"role": "user", "content": [{"type": "text", "text": "Hi"}]}]}
    resp = post(service, "/v1/chat/completions", body)
    assert resp.status == 200, resp.read()
    out = json.loads(resp.read())
    system = tokenizer.apply_chat_template(
        [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Hi"}],
        add_generation_prompt=True, tokenize=True)
    system = system if isinstance(system, list) else system["input_ids"]
    assert out["usage"]["prompt_tokens"] == len(system)
    assert resp.headers["x-request-id"] == out["id"]


def test_an_unknown_model_is_not_found_and_models_lists_the_served_one(service):
    client = sdk(service)
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="gpt-4o", prompt="hi", max_tokens=2)
    assert (err.value.param, err.value.code) == ("model", "model_not_found")
    assert [m.id for m in client.models.list()] == [MODEL]
    health = urllib.request.urlopen(service.http_url + "/health", timeout=10)
    assert health.status == 200


def test_sse_framing_over_plain_http(service):
    resp = post(service, "/v1/completions", {"model": MODEL, "prompt": PROMPTS[0][1],
                                             "max_tokens": 5, "temperature": 0,
                                             "stream": True})
    assert resp.status == 200
    assert resp.headers["content-type"].startswith("text/event-stream")
    raw = resp.read().decode()
    events = raw.split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]  # every event ends in a blank line
    assert all(e.startswith("data: ") and "\n" not in e for e in events[:-1])
    chunks = [json.loads(e[len("data: "):]) for e in events[:-2]]
    assert [c["object"] for c in chunks] == ["text_completion"] * len(chunks)
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "length"
    assert "usage" not in chunks[-1]  # only with stream_options.include_usage


def test_a_deadline_header_ends_a_long_request(service):
    resp = post(service, "/v1/completions", {"model": MODEL, "prompt": "Count:",
                                             "max_tokens": 4000, "ignore_eos": True},
                {"x-request-timeout": "1"})
    assert resp.status == 504
    assert json.loads(resp.read())["error"]["code"] == "deadline_exceeded"
    assert service.wait_idle(30)["pagedserve_num_requests_running"] == 0


LONG_RUNS = {  # requests that would run for minutes on a CPU
    "completions": {"prompt": "Count:", "max_tokens": 4000, "ignore_eos": True},
    "batch": {"prompt": ["Count:", "Letters:"], "max_tokens": 4000, "ignore_eos": True},
    "responses": {"input": "Count.", "max_output_tokens": 4000, "text": {"format": {  # no EOS
        "type": "json_schema", "name": "count", "schema": {
            "type": "array", "items": {"type": "integer"}, "minItems": 2000}}}},
}


@pytest.mark.parametrize("kind", sorted(LONG_RUNS))
@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_drops_frees_the_blocks(service, stream, kind):
    body = json.dumps({"model": MODEL, **LONG_RUNS[kind], "stream": stream}).encode()
    path = b"/v1/responses" if kind == "responses" else b"/v1/completions"
    sock = socket.create_connection(("127.0.0.1", service.http_port), timeout=60)
    sock.sendall(b"POST %s HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                 b"content-length: %d\r\n\r\n%s" % (path, len(body), body))
    deadline = time.monotonic() + 60
    while service.metrics()["pagedserve_num_requests_running"] < (2 if kind == "batch" else 1):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    if stream:
        assert sock.recv(4096).startswith(b"HTTP/1.1 200")  # tokens are flowing
    sock.close()
    start = time.monotonic()
    m = service.wait_idle(10)
    assert m["pagedserve_num_requests_running"] == 0
    assert m["pagedserve_num_free_kv_blocks"] == m["pagedserve_num_kv_blocks"]
    assert time.monotonic() - start < 5  # 4000 tokens would take minutes on a CPU


KEYS = """
tenants:
  paying: {priority: [-2, 0], max_concurrent: 1}
  metered: {tokens_per_minute: 60}
keys:
  - {key: sk-paying, tenant: paying}
  - {key: sk-metered, tenant: metered}
"""


@pytest.fixture(scope="module")
def keyed(tmp_path_factory, model_dir):
    tmp = tmp_path_factory.mktemp("openai_keys")
    (tmp / "keys.yaml").write_text(KEYS)
    svc = Service(tmp / "serve.log", "--api-keys", str(tmp / "keys.yaml"))
    svc.wait_serving()
    yield svc
    svc.stop()


def test_api_keys_are_the_grpc_tenants(keyed):
    for key in ("none", "sk-wrong"):
        with pytest.raises(openai.AuthenticationError) as err:
            sdk(keyed, key).completions.create(model=MODEL, prompt="hi", max_tokens=2)
        assert err.value.code == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            sdk(keyed, key).models.list()
    paying = sdk(keyed, "sk-paying")
    assert paying.completions.create(model=MODEL, prompt="hi", max_tokens=2).choices[0].text
    with pytest.raises(openai.PermissionDeniedError):  # outside the tenant's priority range
        paying.completions.create(model=MODEL, prompt="hi", max_tokens=2,
                                  extra_body={"priority": 5})
    # max_concurrent 1, counted across both APIs: an HTTP stream holds the tenant's one slot
    stream = paying.completions.create(model=MODEL, prompt="Count:", max_tokens=4000,
                                       stream=True, extra_body={"ignore_eos": True})
    next(iter(stream))
    with pytest.raises(openai.RateLimitError) as err:
        paying.completions.create(model=MODEL, prompt="hi", max_tokens=2)
    assert err.value.response.headers["retry-after"] == "1"
    with Client(keyed.address, api_key="sk-paying") as grpc_client, \
            pytest.raises(grpc.RpcError) as grpc_err:
        list(grpc_client.stub.Generate(build_request(text="hi", max_tokens=2),
                                       metadata=(("authorization", "Bearer sk-paying"),),
                                       timeout=30))
    assert grpc_err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    stream.close()  # the slot is free again
    deadline = time.monotonic() + 10
    while True:
        try:
            assert paying.completions.create(model=MODEL, prompt="hi", max_tokens=2).usage
            break
        except openai.RateLimitError:
            assert time.monotonic() < deadline
            time.sleep(0.2)


def test_without_an_executor_health_and_requests_are_503(tmp_path):
    stack = Stack(tmp_path, executor=False)
    try:
        svc = type("S", (), {"http_url": f"http://127.0.0.1:{stack.http_port}"})
        deadline = time.monotonic() + 120
        while True:  # the scheduler loads its tokenizer before it listens
            try:
                urllib.request.urlopen(svc.http_url + "/health", timeout=5)
                raise AssertionError("healthy without an executor")
            except urllib.error.HTTPError as e:
                assert e.code == 503
                break
            except urllib.error.URLError:
                assert time.monotonic() < deadline, stack.logs()
                time.sleep(0.5)
        with pytest.raises(openai.InternalServerError) as err:
            sdk(svc).chat.completions.create(model=MODEL, max_tokens=2,
                                             messages=[{"role": "user", "content": "hi"}])
        assert err.value.status_code == 503
        assert "no executor has joined" in err.value.message
    finally:
        stack.stop()


def test_penalties_min_tokens_and_logit_bias_give_what_grpc_gives(service):
    """The HTTP API hands them to the same engine: greedy output equals the gRPC call's."""
    kw = dict(presence_penalty=0.8, frequency_penalty=0.5, logit_bias={"42": 3.0})
    extra = dict(repetition_penalty=1.3, min_p=0.05, min_tokens=12)
    out = sdk(service).completions.create(model=MODEL, prompt=PROMPTS[0][1], max_tokens=16,
                                          temperature=0, **kw, extra_body=extra)
    text, ids, _ = service.client.complete(
        text=PROMPTS[0][1], max_tokens=16, temperature=0, logit_bias={42: 3.0},
        **{k: v for k, v in kw.items() if k != "logit_bias"}, **extra)
    plain = sdk(service).completions.create(model=MODEL, prompt=PROMPTS[0][1], max_tokens=16,
                                            temperature=0)
    assert out.choices[0].text == text != plain.choices[0].text
    assert out.usage.completion_tokens == len(ids) >= 12


def choices_by_index(chunks):
    """{index: (text, finish reasons)} of a streamed response's chunks."""
    out: dict[int, tuple[str, list]] = {}
    for c in chunks:
        for ch in c.choices:
            text, finishes = out.get(ch.index, ("", []))
            delta = ch.delta.content if hasattr(ch, "delta") else ch.text
            out[ch.index] = (text + (delta or ""), finishes + [ch.finish_reason])
    return out


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_n_with_a_seed_gives_n_reproducible_choices_and_counts_the_prompt_once(service,
                                                                              endpoint):
    client = sdk(service)

    def call(**kw):
        if endpoint == "chat":
            return client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "Tell me about cats."}],
                max_tokens=12, temperature=1.0, seed=1234, **kw)
        return client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=12,
                                          temperature=1.0, seed=1234, **kw)

    def texts(out):
        return [c.message.content if endpoint == "chat" else c.text for c in out.choices]

    first, again, alone = call(n=3), call(n=3), call()
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert texts(first) == texts(again) and len(set(texts(first))) == 3
    assert texts(first)[0] == texts(alone)[0]  # choice 0 samples with the seed itself
    # the gRPC call with the same parameters: the same completions, each with its usage
    source = dict(chat=[("user", "Tell me about cats.")]) if endpoint == "chat" else \
        dict(text="Once upon a time")
    grpc_texts, finals = {}, []
    for r in service.client.generate(**source, n=3, max_tokens=12, temperature=1.0,
                                     seed=1234, timeout=300):
        grpc_texts[r.index] = grpc_texts.get(r.index, "") + r.text
        if r.finish_reason:
            finals.append(r)
    assert texts(first) == [grpc_texts[i] for i in range(3)]
    assert [c.finish_reason for c in first.choices] == [
        {1: "stop", 2: "length"}[r.finish_reason] for r in sorted(finals, key=lambda r: r.index)]
    assert first.usage.prompt_tokens == alone.usage.prompt_tokens == finals[0].usage.prompt_tokens
    assert first.usage.completion_tokens == sum(r.usage.completion_tokens for r in finals)
    assert first.usage.total_tokens == first.usage.prompt_tokens + first.usage.completion_tokens


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_streamed_n_tells_choices_apart_and_each_ends_with_its_finish(service, endpoint):
    client = sdk(service)
    kw = dict(model=MODEL, max_tokens=10, temperature=1.0, seed=99, n=2)
    if endpoint == "chat":
        create = client.chat.completions.create
        kw["messages"] = [{"role": "user", "content": "Name a colour."}]
    else:
        create, kw["prompt"] = client.completions.create, "My favourite colour is"
    whole = create(**kw)
    chunks = list(create(**kw, stream=True, stream_options={"include_usage": True}))
    got = choices_by_index(chunks[:-1])
    assert sorted(got) == [0, 1]
    for c in whole.choices:
        text, finishes = got[c.index]
        assert text == (c.message.content if endpoint == "chat" else c.text)
        assert finishes[-1] == c.finish_reason and not any(finishes[:-1])
    last = chunks[-1]  # the prompt once, every choice's tokens (the cache is warmer now)
    assert last.choices == [] and (last.usage.prompt_tokens, last.usage.completion_tokens,
                                   last.usage.total_tokens) == (
        whole.usage.prompt_tokens, whole.usage.completion_tokens, whole.usage.total_tokens)
    assert all(len(c.choices) == 1 for c in chunks[:-1])  # one choice per chunk, as OpenAI


def hf_log_softmax(model, ids):
    """HF's fp32 log_softmax at every position of ids: [len(ids), V] (row p scores p + 1)."""
    import torch

    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)


def test_chat_logprobs_equal_hf_log_softmax_streamed_and_not(service, tokenizer, hf_model):
    messages = [{"role": "user", "content": PROMPTS[4][1]}]
    client = sdk(service)
    kw = dict(model=MODEL, messages=messages, max_tokens=10, temperature=0, logprobs=True,
              top_logprobs=5)
    whole = client.chat.completions.create(**kw)
    _, ids, _ = service.client.complete(chat=[("user", PROMPTS[4][1])], max_tokens=10,
                                        temperature=0, timeout=300)
    prompt = prompt_ids(tokenizer, "chat", PROMPTS[4][1])
    ref = hf_log_softmax(hf_model, prompt + ids)[len(prompt) - 1:-1]
    content = whole.choices[0].logprobs.content
    assert [e.token for e in content] == [tokenizer.decode([t]) for t in ids]
    for i, (e, t) in enumerate(zip(content, ids, strict=True)):
        assert abs(e.logprob - ref[i, t].item()) < 1e-4
        assert bytes(e.bytes) == tokenizer.decode([t]).encode()
        top = ref[i].topk(5)
        assert [a.token for a in e.top_logprobs] == [tokenizer.decode([a]) for a in
                                                     top.indices.tolist()]
        assert max(abs(a.logprob - b) for a, b in zip(e.top_logprobs, top.values.tolist(),
                                                      strict=True)) < 1e-4
    streamed = [e for c in client.chat.completions.create(**kw, stream=True) if c.choices
                and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    # the same tokens; logprobs within 1e-4 (the prompt now comes from the prefix cache)
    assert [(e.token, e.bytes, [a.token for a in e.top_logprobs]) for e in streamed] == [
        (e.token, e.bytes, [a.token for a in e.top_logprobs]) for e in content]
    assert max(abs(a.logprob - b.logprob) for a, b in zip(streamed, content, strict=True)) < 1e-4
    plain = client.chat.completions.create(**{**kw, "logprobs": None, "top_logprobs": None})
    assert plain.choices[0].logprobs is None


def test_completions_logprobs_format(service, tokenizer, hf_model):
    out = sdk(service).completions.create(model=MODEL, prompt=PROMPTS[0][1], max_tokens=8,
                                          temperature=0, logprobs=3)
    lp, text = out.choices[0].logprobs, out.choices[0].text
    _, ids, _ = service.client.complete(text=PROMPTS[0][1], max_tokens=8, temperature=0,
                                        timeout=300)
    prompt = tokenizer.encode(PROMPTS[0][1])
    ref = hf_log_softmax(hf_model, prompt + ids)[len(prompt) - 1:-1]
    assert lp.tokens == [tokenizer.decode([t]) for t in ids] and "".join(lp.tokens) == text
    assert lp.text_offset == [len("".join(lp.tokens[:i])) for i in range(len(ids))]
    for i, t in enumerate(ids):
        assert abs(lp.token_logprobs[i] - ref[i, t].item()) < 1e-4
        top = ref[i].topk(3)
        want = {tokenizer.decode([a]): b for a, b in zip(top.indices.tolist(),
                                                          top.values.tolist(), strict=True)}
        want.setdefault(lp.tokens[i], lp.token_logprobs[i])  # the sampled one is always there
        assert lp.top_logprobs[i].keys() == want.keys()
        assert max(abs(lp.top_logprobs[i][k] - v) for k, v in want.items()) < 1e-4
    (text_s, entries, finish), = streamed_completions(sdk(service).completions.create(
        model=MODEL, prompt=PROMPTS[0][1], max_tokens=8, temperature=0, logprobs=3,
        stream=True)).values()
    assert text_s == text and finish == out.choices[0].finish_reason
    assert [(e[0], e[3], e[2].keys()) for e in entries] == [
        (t, o, top.keys()) for t, o, top in zip(lp.tokens, lp.text_offset, lp.top_logprobs,
                                                strict=True)]
    assert max(abs(e[1] - b) for e, b in zip(entries, lp.token_logprobs, strict=True)) < 1e-4


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_prompt_logprobs_as_vllm_returns_them(service, tokenizer, hf_model, endpoint):
    client = sdk(service)
    if endpoint == "chat":
        out = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi there"}], max_tokens=2,
            extra_body={"prompt_logprobs": 2})
        got, prompt = out.model_extra["prompt_logprobs"], prompt_ids(tokenizer, "chat",
                                                                     "Hi there")
    else:
        out = client.completions.create(model=MODEL, prompt="The capital of France is",
                                        max_tokens=2, extra_body={"prompt_logprobs": 2})
        got, prompt = out.choices[0].model_extra["prompt_logprobs"], tokenizer.encode(
            "The capital of France is")
    ref = hf_log_softmax(hf_model, prompt)
    assert len(got) == len(prompt) == out.usage.prompt_tokens and got[0] is None
    for p in range(1, len(prompt)):
        row, t = ref[p - 1], prompt[p]
        top = row.topk(2)
        want_ids = [t] + [a for a in top.indices.tolist() if a != t]
        assert list(got[p]) == [str(a) for a in want_ids]  # the prompt token first
        for a in want_ids:
            entry = got[p][str(a)]
            assert abs(entry["logprob"] - row[a].item()) < 1e-4
            assert entry["rank"] == int((row >= row[a]).sum())
            assert entry["decoded_token"] == tokenizer.decode([a])


def test_a_batch_larger_than_the_tenants_concurrency_is_a_bad_request(keyed):
    """It could never be admitted whole: a 429 would have a client retry forever."""
    with pytest.raises(openai.BadRequestError) as err:
        sdk(keyed, "sk-paying").completions.create(model=MODEL, prompt=["a", "b"],
                                                   max_tokens=2)
    assert err.value.param == "prompt" and "more than the 1 requests" in str(err.value)
    out = sdk(keyed, "sk-paying").completions.create(model=MODEL, prompt=["a"], max_tokens=2)
    assert len(out.choices) == 1


def test_n_completions_charge_the_tenant_the_prompt_once(keyed):
    """tokens_per_minute 60 (a token a second): a 10-token prompt with n = 3 and 4 tokens each
    charges 10 + 12, leaving about 38, enough for a 30-token prompt; the prompt charged three
    times (42 in all) would leave about 18 and the 30-token request would be refused."""
    metered = sdk(keyed, "sk-metered")
    before = keyed.metrics()["pagedserve_prompt_tokens_total"]
    out = metered.completions.create(model=MODEL, prompt=list(range(100, 110)), n=3,
                                     max_tokens=4, extra_body={"ignore_eos": True})
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (10, 12)
    assert keyed.metrics()["pagedserve_prompt_tokens_total"] - before == 10
    assert metered.completions.create(model=MODEL, prompt=list(range(200, 230)),
                                      max_tokens=1).usage.prompt_tokens == 30
    with pytest.raises(openai.RateLimitError):  # the bucket is spent now: it does meter
        metered.completions.create(model=MODEL, prompt=list(range(300, 330)), max_tokens=1)


def test_a_full_queue_is_a_rate_limit_with_retry_after(queue_service):
    """One sequence runs and one waits (queue_service's bounds): a third request is refused at
    once with 429, OpenAI's error object and a Retry-After header, and the service keeps
    serving when the two streams end."""
    client = sdk(queue_service)
    long = {"ignore_eos": True}
    running = client.completions.create(model=MODEL, prompt="Count:", max_tokens=4000,
                                        stream=True, extra_body=long)
    next(iter(running))  # it runs: the next request waits
    waiting = client.completions.create(model=MODEL, prompt="Count:", max_tokens=4000,
                                        stream=True, extra_body=long)
    try:
        started = time.monotonic()
        with pytest.raises(openai.RateLimitError) as err:
            client.completions.create(model=MODEL, prompt="hi", max_tokens=2)
        assert time.monotonic() - started < 10
        assert err.value.status_code == 429
        assert err.value.type == "rate_limit_error"
        assert "server busy" in err.value.message
        assert int(err.value.response.headers["retry-after"]) >= 1
    finally:
        waiting.close()
        running.close()
    queue_service.wait_idle(timeout=60)
    assert client.completions.create(model=MODEL, prompt="hi", max_tokens=2).usage


def streamed_completions(chunks):
    """{index: (text, token logprobs entries, finish reason)} of a streamed completions
    response, its chunks' texts and logprobs joined."""
    out: dict[int, tuple[str, list, str | None]] = {}
    for c in chunks:
        for ch in c.choices:
            text, lps, _ = out.get(ch.index, ("", [], None))
            lp = ch.logprobs
            if lp is not None:
                lps = lps + list(zip(lp.tokens, lp.token_logprobs, lp.top_logprobs,
                                     lp.text_offset, strict=True))
            out[ch.index] = (text + ch.text, lps, ch.finish_reason)
    return out


def test_a_batch_of_prompts_gives_each_its_greedy_output_in_order(service, hf_greedy,
                                                                  tokenizer):
    """A batch of texts, then the same as token id lists."""
    texts = [i for i, (kind, _) in enumerate(PROMPTS) if kind == "text"][:3]
    client = sdk(service)
    for prompt in ([PROMPTS[i][1] for i in texts],
                   [tokenizer.encode(PROMPTS[i][1]) for i in texts]):
        out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS,
                                        temperature=0)
        assert [c.index for c in out.choices] == [0, 1, 2]
        assert [c.text for c in out.choices] == [
            tokenizer.decode(hf_greedy[i], skip_special_tokens=True) for i in texts]
        assert out.usage.prompt_tokens == sum(len(tokenizer.encode(PROMPTS[i][1]))
                                              for i in texts)
        assert out.usage.completion_tokens == sum(len(hf_greedy[i]) for i in texts)
        streamed = streamed_completions(client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, stream=True))
        assert {i: (t, f) for i, (t, _, f) in streamed.items()} == {
            c.index: (c.text, c.finish_reason) for c in out.choices}
    assert service.wait_idle(30)["pagedserve_num_requests_running"] == 0


def test_a_batch_with_n_is_prompt_major_and_each_prompt_samples_as_alone(service):
    """Choice p * n + j is prompt p's completion j, sampled as a request of that prompt alone
    with the same seed would sample it."""
    client = sdk(service)
    prompts = ["Once upon a time", "My favourite colour is"]
    kw = dict(model=MODEL, max_tokens=8, temperature=1.0, seed=7, n=2)
    batch = client.completions.create(prompt=prompts, **kw)
    alone = [client.completions.create(prompt=p, **kw) for p in prompts]
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    assert [c.text for c in batch.choices] == [c.text for a in alone for c in a.choices]
    assert batch.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert batch.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)
    chunks = list(client.completions.create(prompt=prompts, **kw, stream=True,
                                            stream_options={"include_usage": True}))
    streamed = streamed_completions(chunks[:-1])
    assert [streamed[i][0] for i in range(4)] == [c.text for c in batch.choices]
    assert chunks[-1].usage.prompt_tokens == batch.usage.prompt_tokens


def test_a_refused_prompt_of_a_batch_refuses_all_and_frees_what_started(service):
    client = sdk(service)
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt=["Count:", "x " * 20000],
                                  max_tokens=4000, extra_body={"ignore_eos": True})
    assert err.value.param == "prompt"
    assert err.value.body["message"].startswith("prompt: prompt 1 of the batch: ")
    m = service.wait_idle(10)
    assert m["pagedserve_num_requests_running"] == 0
    assert m["pagedserve_num_free_kv_blocks"] == m["pagedserve_num_kv_blocks"]


def echo_reference(tokenizer, hf_model, service, prompt: str, max_tokens: int):
    """The prompt's ids, the greedy completion's ids and HF's log_softmax over both."""
    _, ids, _ = service.client.complete(text=prompt, max_tokens=max_tokens, temperature=0,
                                        timeout=300)
    prompt_ids_ = tokenizer.encode(prompt)
    return prompt_ids_, ids, hf_log_softmax(hf_model, prompt_ids_ + ids)


@pytest.mark.parametrize("stream", [False, True])
def test_echo_with_logprobs_scores_the_prompt_and_the_completion_as_hf(service, tokenizer,
                                                                       hf_model, stream):
    """What lm-evaluation-harness's loglikelihood requests send (echo, logprobs, a batch of
    token id prompts), n=2 so that a second choice takes its prompt's scores from the first."""
    prompt, k = PROMPTS[2][1], 2
    pids, ids, ref = echo_reference(tokenizer, hf_model, service, prompt, 4)
    out = sdk(service).completions.create(model=MODEL, prompt=[pids, pids[:3]], echo=True,
                                          logprobs=k, max_tokens=4, temperature=0, n=2,
                                          stream=stream)
    if stream:
        got = streamed_completions(out)
    else:
        got = {c.index: (c.text, list(zip(c.logprobs.tokens, c.logprobs.token_logprobs,
                                          c.logprobs.top_logprobs, c.logprobs.text_offset,
                                          strict=True)), c.finish_reason) for c in out.choices}
    assert sorted(got) == [0, 1, 2, 3]
    for i in (0, 1):  # the first prompt's two greedy choices
        text, entries, finish = got[i]
        assert text == tokenizer.decode(pids) + tokenizer.decode(ids, skip_special_tokens=True)
        assert finish == "length"
        whole = pids + ids
        assert [e[0] for e in entries] == [tokenizer.decode([t]) for t in whole]
        assert [e[3] for e in entries] == [len("".join(e[0] for e in entries[:j]))
                                           for j in range(len(whole))]
        assert entries[0][1] is None and entries[0][2] is None  # nothing scores the first
        for p in range(1, len(whole)):
            row, t = ref[p - 1], whole[p]
            assert abs(entries[p][1] - row[t].item()) < 1e-4
            want = {tokenizer.decode([a]) for a in row.topk(k).indices.tolist()}
            assert set(entries[p][2]) == want | {entries[p][0]}
    assert got[2][0] == got[3][0] and got[2][0].startswith(tokenizer.decode(pids[:3]))
    assert [e[0] for e in got[2][1][:3]] == [tokenizer.decode([t]) for t in pids[:3]]


def test_echo_with_max_tokens_0_returns_the_scored_prompt_alone(service, tokenizer, hf_model):
    prompt = "The capital of France is"
    pids = tokenizer.encode(prompt)
    ref = hf_log_softmax(hf_model, pids)
    client = sdk(service)
    out = client.completions.create(model=MODEL, prompt=prompt, echo=True, max_tokens=0,
                                    logprobs=0)
    c = out.choices[0]
    assert c.text == prompt and c.finish_reason == "length"
    assert c.logprobs.tokens == [tokenizer.decode([t]) for t in pids]
    assert c.logprobs.token_logprobs[0] is None
    assert max(abs(c.logprobs.token_logprobs[p] - ref[p - 1, pids[p]].item())
               for p in range(1, len(pids))) < 1e-4
    assert all(d.keys() == {tok} for d, tok in zip(c.logprobs.top_logprobs[1:],
                                                  c.logprobs.tokens[1:], strict=True))
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(pids), 0)
    plain = client.completions.create(model=MODEL, prompt=prompt, echo=True, max_tokens=3,
                                      temperature=0)
    assert plain.choices[0].text.startswith(prompt) and plain.choices[0].logprobs is None
    streamed = streamed_completions(client.completions.create(
        model=MODEL, prompt=prompt, echo=True, max_tokens=0, stream=True))
    assert streamed == {0: (prompt, [], "length")}


def test_lm_evaluation_harness_loglikelihoods_equal_hf(service, model_dir, tokenizer, hf_model):
    """lm-evaluation-harness's own API client (local-completions: batches of token id
    prompts, echo, logprobs 1, max_tokens 1), as an evaluation run calls it."""
    from lm_eval.api.instance import Instance
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    lm = LocalCompletionsAPI(base_url=service.http_url + "/v1/completions", model=MODEL,
                             tokenizer=str(model_dir), tokenizer_backend="huggingface",
                             batch_size=4, max_retries=1)
    pairs = [("The capital of France is", " Paris"), ("The capital of France is", " London"),
             ("Water boils at 100 degrees", " Celsius"), ("1, 2, 3,", " 4, 5")]
    got = lm.loglikelihood([Instance("loglikelihood", {}, p, i) for i, p in enumerate(pairs)])
    for (context, continuation), (ll, greedy) in zip(pairs, got, strict=True):
        whole = tokenizer.encode(context + continuation)
        start = len(tokenizer.encode(context))
        ref = hf_log_softmax(hf_model, whole)
        assert abs(ll - sum(ref[p - 1, whole[p]].item() for p in range(start, len(whole)))) \
            < 1e-4
        assert greedy == all(ref[p - 1].argmax().item() == whole[p]
                             for p in range(start, len(whole)))


def test_tokenize_and_detokenize_as_vllm_serves_them(service, tokenizer):
    text = PROMPTS[0][1]
    r = post(service, "/tokenize", {"model": MODEL, "prompt": text, "return_token_strs": True})
    assert r.status == 200
    got = json.load(r)
    ids = tokenizer.encode(text)
    assert got == {"count": len(ids), "max_model_len": 8192, "tokens": ids,
                   "token_strs": tokenizer.convert_ids_to_tokens(ids)}
    chat = json.load(post(service, "/tokenize", {"messages": [{"role": "user",
                                                               "content": PROMPTS[4][1]}]}))
    assert chat["tokens"] == prompt_ids(tokenizer, "chat", PROMPTS[4][1])
    assert chat["token_strs"] is None
    back = json.load(post(service, "/detokenize", {"model": MODEL, "tokens": chat["tokens"]}))
    assert back == {"prompt": tokenizer.decode(chat["tokens"])}
    for path, body, status, param in [
            ("/detokenize", {"tokens": [10**7]}, 400, "tokens"),
            ("/detokenize", {"tokens": [-1]}, 400, "tokens[0]"),
            ("/tokenize", {"model": MODEL}, 400, "prompt"),
            ("/tokenize", {"prompt": ""}, 400, "prompt"),
            ("/tokenize", {"messages": [{"role": "wizard", "content": "hi"}]}, 400,
             "messages[0].role"),
            ("/tokenize", {"model": "gpt-4", "prompt": "hi"}, 404, "model"),
            ("/tokenize", {"prompt": "hi", "add_special_tokens": False}, 400,
             "add_special_tokens"),
            ("/tokenize", {"messages": [{"role": "user", "content": "hi"}],
                           "add_special_tokens": True}, 400, "add_special_tokens")]:
        r = post(service, path, body)
        assert (r.status, json.load(r)["error"]["param"]) == (status, param), (path, body)


def test_http_requests_are_counted_by_route_and_status_a_dropped_upload_as_499(service):
    key = 'pagedserve_http_requests_total{{route="{}",status="{}"}}'

    def count(route: str, status: int) -> float:
        return service.metrics().get(key.format(route, status), 0.0)

    before = [count("/v1/completions", 499), count("/v1/models", 200), count("other", 404)]
    with socket.create_connection(("127.0.0.1", service.http_port), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: "
                     b"application/json\r\ncontent-length: 1000\r\n\r\n{\"model\": ")
    sdk(service).models.list()
    assert post(service, "/v2/everything", {}).status == 404
    deadline = time.monotonic() + 10
    while [count("/v1/completions", 499), count("/v1/models", 200),
           count("other", 404)] != [b + 1 for b in before]:
        assert time.monotonic() < deadline, before
        time.sleep(0.1)
    assert service.metrics()[
        'pagedserve_http_request_duration_seconds_count{route="/v1/models"}'] >= 1
