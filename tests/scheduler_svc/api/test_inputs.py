import pytest

from pagedserve.protos.v1 import generate_pb2 as api
from pagedserve.scheduler.api.inputs import InputProcessor, InvalidRequest, Limits
from pagedserve.scheduler.api.inputs import validate as validate_input
from pagedserve.scheduler.api.sampling_defaults import SamplingDefaults
from pagedserve.scheduler.api.servicer import generation_input, prompt_of

LIMITS = Limits(max_model_len=100, vocab_size=1000)


def validate(req, prompt, limits):
    """inputs.validate of a GenerateRequest, as the servicer hands it over."""
    return validate_input(generation_input(req), prompt, limits)


def request(**sampling):
    r = api.GenerateRequest(token_ids=api.TokenIds(ids=[1, 2, 3]))
    for k, v in sampling.items():
        if isinstance(v, list):
            getattr(r.sampling, k).extend(v)
        else:
            setattr(r.sampling, k, v)
    return r


def test_defaults():
    p = validate(request(), [1, 2, 3], LIMITS)
    assert (p.max_tokens, p.temperature, p.top_k, p.top_p, p.seed) == (97, 1.0, 0, 1.0, None)
    assert p.skip_special_tokens and not p.ignore_eos


def test_the_models_defaults_fill_what_a_request_leaves_unset():
    """--generation-config's values (a request's own win, 0 and 1.0 included); max_tokens
    from max_new_tokens, bounded by the room the prompt leaves."""
    model = Limits(max_model_len=100, vocab_size=1000, defaults=SamplingDefaults(
        temperature=0.6, top_p=0.9, top_k=20, min_p=0.05, repetition_penalty=1.1,
        max_tokens=7))
    p = validate(request(), [1, 2, 3], model)
    assert (p.max_tokens, p.temperature, p.top_k, p.top_p, p.min_p, p.repetition_penalty) == (
        7, pytest.approx(0.6), 20, pytest.approx(0.9), pytest.approx(0.05),
        pytest.approx(1.1))
    p = validate(request(max_tokens=50, temperature=0.0, top_k=0, top_p=1.0, min_p=0.0,
                         repetition_penalty=1.0), [1, 2, 3], model)
    assert (p.max_tokens, p.temperature, p.top_k, p.top_p, p.min_p, p.repetition_penalty) == (
        50, 0.0, 0, 1.0, 0.0, 1.0)
    roomy = Limits(max_model_len=100, vocab_size=1000, defaults=SamplingDefaults(max_tokens=500))
    assert validate(request(), [1, 2, 3], roomy).max_tokens == 97


@pytest.mark.parametrize("sampling, field", [
    ({"max_tokens": 0}, "sampling.max_tokens"),
    ({"max_tokens": -5}, "sampling.max_tokens"),
    ({"max_tokens": 98}, "sampling.max_tokens"),  # 3 + 98 > 100
    ({"temperature": -0.1}, "sampling.temperature"),
    ({"temperature": float("nan")}, "sampling.temperature"),
    ({"top_p": 0.0}, "sampling.top_p"),
    ({"top_p": 1.5}, "sampling.top_p"),
    ({"top_k": -1}, "sampling.top_k"),
    ({"stop": [""]}, "sampling.stop"),
    ({"stop_token_ids": [5000]}, "sampling.stop_token_ids"),
])
def test_bad_sampling_names_the_field(sampling, field):
    with pytest.raises(InvalidRequest, match=f"^{field}"):
        validate(request(**sampling), [1, 2, 3], LIMITS)


def test_prompt_limits():
    with pytest.raises(InvalidRequest, match="^input: the prompt has 100 tokens"):
        validate(request(), list(range(100)), LIMITS)
    with pytest.raises(InvalidRequest, match="^token_ids: 1000 is outside"):
        validate(request(), [1, 1000], LIMITS)
    with pytest.raises(InvalidRequest, match="^input: the prompt has 100 tokens"):  # no scan
        validate(request(), [1000] * 100, LIMITS)


def test_prompt_sources(tokenizer):
    ip = InputProcessor(tokenizer)
    assert ip.prompt_ids(prompt_of(api.GenerateRequest(text="Hello"))) == \
        tokenizer.encode("Hello")
    chat = api.GenerateRequest(chat=api.ChatMessages(
        messages=[api.ChatMessage(role="user", content="Hi")]))
    ids = ip.prompt_ids(prompt_of(chat))
    assert tokenizer.decode(ids).endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    for empty, field in ((api.GenerateRequest(text=""), "^text"),
                         (api.GenerateRequest(), "^input"),
                         (api.GenerateRequest(token_ids=api.TokenIds()), "^token_ids"),
                         (api.GenerateRequest(chat=api.ChatMessages()), "^chat.messages")):
        with pytest.raises(InvalidRequest, match=field):
            ip.prompt_ids(prompt_of(empty))


def test_input_too_large_is_refused_before_tokenizing(tokenizer):
    class Untouchable:  # a tokenizer that must not be asked
        chat_template, added_tokens_decoder = "", {}

        def encode(self, text):
            raise AssertionError("tokenized")

    inputs = InputProcessor(Untouchable(), model_len=50)

    def check(req, max_model_len):
        prompt = prompt_of(req)
        inputs.check_size(prompt, inputs.input_bytes(prompt), max_model_len)

    big = api.GenerateRequest(text="x" * 3201)  # 32 bytes per token of max_model_len 100
    with pytest.raises(InvalidRequest, match=r"^text: 3201 bytes, more than the 3200"):
        check(big, 100)
    chat = api.GenerateRequest(chat=api.ChatMessages(
        messages=[api.ChatMessage(role="user", content="y" * 3200)]))
    with pytest.raises(InvalidRequest, match=r"^chat: 3204 bytes"):
        check(chat, 100)
    check(api.GenerateRequest(token_ids=api.TokenIds(ids=[1] * 101)), 100)  # cheap
    check(api.GenerateRequest(text="x" * 3200), 100)  # at the limit: fine
    # no executor yet: the model config's length (50) bounds Tokenize
    with pytest.raises(InvalidRequest, match=r"^text: 1601 bytes, more than the 1600 a"):
        check(api.TokenizeRequest(text="x" * 1601), None)
    assert InputProcessor(Untouchable(), max_input_bytes=10).byte_limit(100) == 10
    assert InputProcessor(Untouchable(), max_input_bytes=10, model_len=50).byte_limit(None) == 10


@pytest.mark.parametrize("sampling, message", [
    ({"presence_penalty": 2.5}, "sampling.presence_penalty: must be in [-2, 2], got 2.5"),
    ({"presence_penalty": float("nan")}, "sampling.presence_penalty: must be in [-2, 2]"),
    ({"frequency_penalty": -2.5}, "sampling.frequency_penalty: must be in [-2, 2], got -2.5"),
    ({"repetition_penalty": 0.0}, "sampling.repetition_penalty: must be > 0, got 0.0"),
    ({"repetition_penalty": float("inf")}, "sampling.repetition_penalty: must be > 0"),
    ({"min_p": 1.5}, "sampling.min_p: must be in [0, 1], got 1.5"),
    ({"min_p": -0.25}, "sampling.min_p: must be in [0, 1], got -0.25"),
    ({"logit_bias": {1000: 1.0}}, "sampling.logit_bias: token 1000 is outside the vocabulary "
                                  "[0, 1000)"),
    ({"logit_bias": {-1: 1.0}}, "sampling.logit_bias: token -1 is outside the vocabulary"),
    ({"logit_bias": {5: 101.0}}, "sampling.logit_bias: the bias of token 5 must be in "
                                 "[-100, 100], got 101.0"),
    ({"min_tokens": -1}, "sampling.min_tokens: must be in [0, max_tokens = 97], got -1"),
    ({"min_tokens": 11, "max_tokens": 10},
     "sampling.min_tokens: must be in [0, max_tokens = 10], got 11"),
    ({"logprobs": 21}, "sampling.logprobs: must be in [0, 20], got 21"),
    ({"logprobs": -1}, "sampling.logprobs: must be in [0, 20], got -1"),
    ({"n": 0}, "sampling.n: must be in [1, 16], got 0"),
    ({"n": 17}, "sampling.n: must be in [1, 16], got 17"),
])
def test_bad_sampling_extras_are_refused_with_the_field_and_range(sampling, message):
    r = request(**{k: v for k, v in sampling.items() if k != "logit_bias"})
    r.sampling.logit_bias.update(sampling.get("logit_bias", {}))
    with pytest.raises(InvalidRequest) as e:
        validate(r, [1, 2, 3], LIMITS)
    assert str(e.value).startswith(message)


def test_sampling_extras_defaults_and_values():
    p = validate(request(), [1, 2, 3], LIMITS)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty, p.min_p,
            p.logit_bias, p.min_tokens, p.logprobs, p.n) == (0.0, 0.0, 1.0, 0.0, (), 0, None, 1)
    r = request(presence_penalty=-2.0, frequency_penalty=2.0, repetition_penalty=1.5, min_p=1.0,
                min_tokens=97, logprobs=0, n=16)
    r.sampling.logit_bias.update({999: -100.0, 0: 100.0})
    p = validate(r, [1, 2, 3], LIMITS)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty, p.min_p,
            p.logit_bias, p.min_tokens, p.logprobs, p.n) == (
        -2.0, 2.0, 1.5, 1.0, ((0, 100.0), (999, -100.0)), 97, 0, 16)


def test_a_logit_bias_map_parses_and_a_key_wider_than_32_bits_is_named():
    """The lenient parser walks every field for 32-bit values sent wider; a map's entries are
    walked by key (iterating it as a list of messages raised AttributeError: UNKNOWN)."""
    from pagedserve.scheduler.api.errors import _lenient, _twin

    parse = _lenient(api.GenerateRequest.FromString, api.GenerateRequest.DESCRIPTOR)
    ok = request()
    ok.sampling.logit_bias.update({5: -100.0, 7: 2.5})
    assert parse(ok.SerializeToString()) == ok
    wide = _twin("wide", "pagedserve.v1.GenerateRequest")()
    wide.token_ids.ids.append(1)
    wide.sampling.logit_bias[2**33 + 5] = 1.0
    error = parse(wide.SerializeToString()).error
    assert (error.field, str(error)) == (
        "sampling.logit_bias", f"sampling.logit_bias: key {2**33 + 5} does not fit in 32 bits")
