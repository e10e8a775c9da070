"""Structured outputs through the running service (the default model): what it generates under
a JSON schema validates with `jsonschema`, greedy and sampled; regex, choice and grammar outputs
match; bad constraints are INVALID_ARGUMENT (gRPC) and 400 naming the parameter (HTTP);
unconstrained requests sharing a batch with constrained ones get the tokens they get alone;
async scheduling, preemption (recompute and swap) and n > 1 keep outputs valid."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import grpc
import jsonschema
import openai
import pytest

from pagedserve.protos.v1 import generate_pb2 as api
from tests.integration.conftest import _serving

MAX_TOKENS = 160
LEAVES = {  # bounded strings and arrays: a small model may otherwise run to max_tokens
    "str": {"type": "string", "maxLength": 12},
    "int": {"type": "integer", "minimum": -5, "maximum": 100},
    "num": {"type": "number", "minimum": 0, "maximum": 1},
    "bool": {"type": "boolean"},
    "enum": {"enum": ["red", "green", "blue"]},
    "pattern": {"type": "string", "pattern": "^[a-z]{2,6}$"},
    "const": {"const": "fixed"},
    "null": {"type": "null"},
    "ints": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
             "minItems": 1, "maxItems": 4},
    "any_of": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 10},
                         {"type": "string", "maxLength": 5}]},
}


def _obj(props: dict, required: list[str] | None = None) -> dict:
    return {"type": "object", "properties": props,
            "required": list(props) if required is None else required}


def schemas() -> dict[str, dict]:
    """52 schemas: each leaf in five shapes (flat, optional field, nested, array of objects,
    $ref), and two of their own."""
    out = {}
    for name, leaf in LEAVES.items():
        out[f"flat-{name}"] = _obj({"value": leaf})
        out[f"optional-{name}"] = _obj({"id": LEAVES["int"], "extra": leaf}, ["id"])
        out[f"nested-{name}"] = _obj({"outer": _obj({"inner": leaf, "tag": LEAVES["enum"]})})
        out[f"array-{name}"] = _obj({"items": {"type": "array", "items": _obj({"v": leaf}),
                                               "minItems": 1, "maxItems": 3}})
        out[f"ref-{name}"] = {"$defs": {"item": _obj({"v": leaf})}, **_obj({
            "a": {"$ref": "#/$defs/item"},
            "b": {"type": "array", "items": {"$ref": "#/$defs/item"}, "maxItems": 2}})}
    out["person"] = _obj({"name": LEAVES["str"], "age": {"type": "integer", "minimum": 0,
                                                         "maximum": 120},
                          "email": {"type": "string", "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.com$"},
                          "address": _obj({"city": LEAVES["str"], "zip": {
                              "type": "string", "pattern": "^[0-9]{5}$"}})}, ["name", "age"])
    out["top-array"] = {"type": "array", "items": LEAVES["enum"], "minItems": 2, "maxItems": 5}
    return out


SCHEMAS = schemas()
PROMPT = "Answer with a JSON document about {}."


def generate(svc, **kwargs) -> tuple[str, list[int], api.GenerateResponse]:
    return svc.client.complete(chat=[("user", kwargs.pop("prompt", "Answer in JSON."))],
                               max_tokens=kwargs.pop("max_tokens", MAX_TOKENS), **kwargs)


def run_all(svc, jobs: list[dict]) -> list[tuple[str, list[int], api.GenerateResponse]]:
    """The requests at once: they share steps, as production traffic would."""
    with ThreadPoolExecutor(len(jobs)) as pool:
        return list(pool.map(lambda kw: generate(svc, **kw), jobs))


@pytest.fixture(scope="module")
def wide(tmp_path_factory, model_dir):
    """Room for the 104 schema requests in one batch of 64; without async scheduling (on by
    default): the reference the async runs (service, tight_service, swap_service) must equal."""
    yield from _serving(tmp_path_factory, "structured", "--no-async-scheduling",
                        "--max-num-seqs", "64",
                        "--max-num-batched-tokens", "2048")


def test_fifty_schemas_validate_greedy_and_sampled(wide):
    assert len(SCHEMAS) >= 50
    jobs = [dict(prompt=PROMPT.format(name), json_schema=schema, temperature=t, seed=i)
            for i, (name, schema) in enumerate(SCHEMAS.items()) for t in (0.0, 1.0)]
    before = wide.metrics()
    results = run_all(wide, jobs)
    for job, (text, _, last), name in zip(jobs, results,
                                            [n for n in SCHEMAS for _ in (0, 1)], strict=True):
        assert last.finish_reason == api.FINISH_REASON_STOP, (name, text)
        jsonschema.validate(json.loads(text), job["json_schema"])  # raises if not
    # each step that sampled a constrained token advanced the grammars once, timed (at least
    # as many steps as the longest answer has tokens)
    after = wide.wait_idle()
    steps = {key: after[f"pagedserve_grammar_{key}_seconds_count"]
             - before[f"pagedserve_grammar_{key}_seconds_count"] for key in ("accept", "bitmask")}
    assert steps["accept"] >= max(len(tokens) for _, tokens, _ in results)
    assert after["pagedserve_grammar_accept_seconds_sum"] > \
        before["pagedserve_grammar_accept_seconds_sum"]
    assert steps["bitmask"] >= steps["accept"] - 1


def test_regex_choice_and_grammars_match(wide):
    jobs = [dict(regex=r"[0-9]{3}-[0-9]{4}", temperature=1.0, seed=1),
            dict(regex=r"(yes|no), because [a-z ]{1,20}\.", temperature=0.0),
            dict(choice=["Paris", "London", 'say "hi"'], temperature=1.0, seed=2),
            dict(choice=["Paris", "London"], temperature=0.0,
                 prompt="What is the capital of France?"),
            dict(grammar='root ::= "(" [0-9]+ ("+" [0-9]+)* ")"', temperature=1.0, seed=3,
                 max_tokens=60),
            dict(lark_grammar='start: "ok" | "ko" NUM\nNUM: /[0-9]{1,3}/', temperature=1.0,
                 seed=4),
            dict(json_object=True, temperature=0.0)]
    r = run_all(wide, jobs)
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", r[0][0])
    assert re.fullmatch(r"(yes|no), because [a-z ]{1,20}\.", r[1][0])
    assert r[2][0] in ("Paris", "London", 'say "hi"')
    assert r[3][0] in ("Paris", "London")
    assert re.fullmatch(r"\([0-9]+(\+[0-9]+)*\)", r[4][0]), r[4][0]
    assert re.fullmatch(r"ok|ko[0-9]{1,3}", r[5][0])
    assert isinstance(json.loads(r[6][0]), dict)
    assert all(last.finish_reason == api.FINISH_REASON_STOP for _, _, last in r)
    eos = set(wide.client.model_info().eos_token_ids)
    assert all(ids[-1] in eos for _, ids, _ in r)  # each ended on EOS once its match was whole


@pytest.mark.parametrize("fixture", ["wide", "service"])  # sync, async scheduling
def test_unconstrained_requests_get_their_tokens_alone_in_a_mixed_batch(request, fixture):
    svc = request.getfixturevalue(fixture)
    plain = [dict(prompt=p, temperature=0.0, max_tokens=24)
             for p in ("What is the capital of France?", "Count to ten.", "Say hi.")]
    alone = [generate(svc, **dict(kw))[1] for kw in plain]
    constrained = [dict(prompt=PROMPT.format(n), json_schema=s, temperature=1.0, seed=7)
                   for n, s in list(SCHEMAS.items())[:12]]
    mixed = run_all(svc, [*constrained[:6], *plain, *constrained[6:]])
    assert [ids for _, ids, _ in mixed[6:9]] == alone
    for job, (text, _, last) in zip(constrained, mixed[:6] + mixed[9:], strict=True):
        assert last.finish_reason == api.FINISH_REASON_STOP, text
        jsonschema.validate(json.loads(text), job["json_schema"])


def test_n_completions_each_follow_the_schema(wide):
    schema = SCHEMAS["person"]
    call = wide.client.generate(chat=[("user", "A person as JSON")], max_tokens=MAX_TOKENS,
                                temperature=1.0, seed=11, n=3, json_schema=schema)
    texts = ["", "", ""]
    for resp in call:
        texts[resp.index] += resp.text
    for t in texts:
        jsonschema.validate(json.loads(t), schema)
    assert len(set(texts)) > 1  # each its own matcher and seed


BAD_GRPC = [
    (dict(json_schema='{"type": 5}'), "sampling.json_schema: "),
    (dict(json_schema="{not json"), "sampling.json_schema: "),
    (dict(regex="(["), "sampling.regex: "),
    (dict(grammar="root ::= "), "sampling.grammar: "),
    (dict(lark_grammar="start: undefined_rule"), "sampling.lark_grammar: "),
    (dict(choice=[]), "sampling.choice: "),
    (dict(json_object=True, min_tokens=3), "sampling.min_tokens: "),
]


@pytest.mark.parametrize("kwargs, prefix", BAD_GRPC, ids=[p for _, p in BAD_GRPC])
def test_bad_constraints_are_invalid_argument_naming_the_field(wide, kwargs, prefix):
    with pytest.raises(grpc.RpcError) as err:
        generate(wide, max_tokens=4, **kwargs)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith(prefix)
    assert len(err.value.details()) > len(prefix)  # the parser's message follows


def test_regex_error_carries_the_parsers_message(wide):
    with pytest.raises(grpc.RpcError) as err:
        generate(wide, max_tokens=4, regex="([")
    assert err.value.details() == ("sampling.regex: Regex parsing error at position 3: "
                                   "Unclosed '['")


def test_async_scheduling_gives_the_same_constrained_tokens(wide, service):
    jobs = [dict(prompt=PROMPT.format(n), json_schema=SCHEMAS[n], temperature=0.0)
            for n in ("person", "nested-enum", "array-int", "ref-str")]
    sync = [ids for _, ids, _ in run_all(wide, jobs)]
    assert [ids for _, ids, _ in run_all(service, jobs)] == sync  # async: the default


PREEMPTED = [dict(prompt=PROMPT.format(n), json_schema=SCHEMAS[n], temperature=0.0,
                  max_tokens=96)
             for n in ["person", "array-str", "ref-any_of", "nested-str", "flat-ints",
                       "ref-ints", "array-pattern", "optional-str"]]


@pytest.fixture(scope="module")
def unpreempted(wide):
    """PREEMPTED's token ids on the wide service, where nothing is preempted."""
    return [ids for _, ids, _ in run_all(wide, PREEMPTED)]


@pytest.mark.parametrize("fixture, mode", [("tight_service", "recompute"),
                                           ("swap_service", "swap")])
def test_preempted_constrained_requests_stay_valid(request, unpreempted, fixture, mode):
    """The 8 constrained prompts at once on 10 KV blocks give their unpreempted tokens (the
    matcher carries on where it was), round after round until one has preempted (whether one
    does depends on how the concurrent requests happen to arrive, as in test_generation)."""
    svc = request.getfixturevalue(fixture)
    key = f'pagedserve_num_preemptions_total{{mode="{mode}"}}'
    before = svc.metrics().get(key, 0.0)
    for _ in range(3):
        assert [ids for _, ids, _ in run_all(svc, PREEMPTED)] == unpreempted
        if svc.wait_idle().get(key, 0.0) > before:
            return
    raise AssertionError(f"no {mode} preemption in 3 rounds of 8 concurrent prompts")


# ----------------------------------------------------------------- HTTP (OpenAI's SDK)
def sdk(svc) -> openai.OpenAI:
    return openai.OpenAI(base_url=svc.http_url + "/v1", api_key="none", max_retries=0,
                         timeout=120)


def test_openai_response_format_json_schema(wide):
    schema = SCHEMAS["person"]
    out = sdk(wide).chat.completions.create(
        model="default", messages=[{"role": "user", "content": "A person as JSON"}],
        max_tokens=MAX_TOKENS, temperature=0, response_format={
            "type": "json_schema", "json_schema": {"name": "person", "schema": schema,
                                                   "strict": True}})
    assert out.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(out.choices[0].message.content), schema)


def test_vllm_fields_constrain_completions_and_chat(wide):
    client = sdk(wide)
    chat = client.chat.completions.create(
        model="default", messages=[{"role": "user", "content": "Capital of France?"}],
        max_tokens=10, temperature=0, extra_body={"guided_choice": ["Paris", "Rome"]})
    assert chat.choices[0].message.content in ("Paris", "Rome")
    comp = client.completions.create(model="default", prompt="Phone: ", max_tokens=20,
                                     extra_body={"structured_outputs": {"regex": "[0-9]{4}"}})
    assert re.fullmatch("[0-9]{4}", comp.choices[0].text)
    obj = client.chat.completions.create(
        model="default", messages=[{"role": "user", "content": "JSON please"}], max_tokens=60,
        temperature=0, response_format={"type": "json_object"})
    assert isinstance(json.loads(obj.choices[0].message.content), dict)


BAD_HTTP = [
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x",
                                                                  "schema": {"type": 5}}}),
     "response_format"),
    (dict(response_format={"type": "xml"}), "response_format"),
    (dict(extra_body={"guided_regex": "(["}), "guided_regex"),
    (dict(extra_body={"structured_outputs": {"grammar": "root ::= "}}), "structured_outputs"),
    (dict(extra_body={"guided_regex": "a", "guided_choice": ["a"]}), "guided_choice"),
]


@pytest.mark.parametrize("kwargs, param", BAD_HTTP, ids=[p for _, p in BAD_HTTP])
def test_bad_constraints_are_400_naming_the_param(wide, kwargs, param):
    with pytest.raises(openai.BadRequestError) as err:
        sdk(wide).chat.completions.create(
            model="default", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
            **kwargs)
    assert err.value.status_code == 400
    assert err.value.param == param
    assert err.value.body["message"].startswith(param + ":")
