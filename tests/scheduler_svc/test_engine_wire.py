"""engine_wire: what crosses the engine socket comes back as it went, and frames from a
stranger or a broken peer decode to (None, why) or fail check_submit, never an exception."""

from __future__ import annotations

import dataclasses
import random

from pagedserve.protos.internal.v1 import engine_pb2 as pb
from pagedserve.scheduler import engine_wire as wire
from pagedserve.scheduler.engine_io import EngineError, EngineOutput, EngineRequest, ModelInfo
from pagedserve.scheduler.invalid import InvalidRequest
from pagedserve.scheduler.outputs import TokenLogprob
from pagedserve.scheduler.request import Constraint, GenerationParams

INFO = ModelInfo(64, 100, (2,), 4, 32, "float32", "cpu", "torch", "float32")


def test_a_request_crosses_with_every_engine_parameter():
    params = GenerationParams(
        max_tokens=9, temperature=0.7, top_k=5, top_p=0.875, seed=2**64 - 3,
        stop=("never sent",), stop_token_ids=(7, 8), ignore_eos=True,
        skip_special_tokens=False, presence_penalty=0.5, frequency_penalty=-0.25,
        repetition_penalty=1.125, min_p=0.0625, logit_bias=((3, -1.5), (4, 2.0)), min_tokens=2,
        logprobs=0, n=3, constraint=Constraint("regex", "[ab]+"), prompt_logprobs=4)
    request = EngineRequest("client-id", [1, 5, 9], params, priority=-2, tenant="acme",
                            timeout=3.5)
    msg = pb.ApiMessage.FromString(wire.encode_submit(41, request, sibling_of=40,
                                                      resume_tokens=[6], timeout_s=2.5))
    s = msg.submit
    assert (s.id, s.sibling_of, list(s.resume_tokens), s.timeout_s) == (41, 40, [6], 2.5)
    assert wire.check_submit(s, INFO) == ""
    got = wire.decode_submit(s)
    # stop strings and skip_special_tokens are the API process's: they do not travel
    assert got == EngineRequest("client-id", [1, 5, 9], dataclasses.replace(
        params, stop=(), skip_special_tokens=True), -2, "acme", 2.5)
    plain = wire.decode_submit(pb.ApiMessage.FromString(wire.encode_submit(
        1, EngineRequest("", [1], GenerationParams(max_tokens=1)))).submit)
    assert plain == EngineRequest("", [1], GenerationParams(max_tokens=1))


def test_a_steps_outputs_cross_with_logprobs_errors_and_finishes():
    batch = [
        EngineOutput(11, [5], [TokenLogprob(-0.5, (5, 6), (-0.5, -1.25))], cached_tokens=16,
                     prompt_logprobs=[None, TokenLogprob(-2.0, (9,), (-0.125,), 3)]),
        EngineOutput(12, [7, 8], finish_reason="stop", stop_reason=8),
        EngineOutput(13, error=EngineError("DEADLINE_EXCEEDED", "late", retry_after_s=2.0)),
        EngineOutput(14, [1], finish_reason="length"),
    ]
    msg = pb.EngineMessage.FromString(wire.encode_outputs(batch, [1, 2, 3, 4]))
    got, why = wire.decode_outputs(msg.outputs)
    assert why == ""
    assert [o.req_id for o in got] == [1, 2, 3, 4]
    for a, b in zip(got, batch, strict=True):
        assert (a.token_ids, a.logprobs, a.finish_reason, a.stop_reason, a.cached_tokens,
                a.prompt_logprobs) == (b.token_ids, b.logprobs, b.finish_reason, b.stop_reason,
                                       b.cached_tokens, b.prompt_logprobs)
    e = got[2].error
    assert (e.code, str(e), e.retry_after_s) == ("DEADLINE_EXCEEDED", "late", 2.0)


def test_an_invalid_request_keeps_its_field_across():
    err = wire.decode_error(wire.encode_error(InvalidRequest("sampling.regex", "bad")))
    assert isinstance(err, InvalidRequest) and (err.field, err.reason) == ("sampling.regex",
                                                                         "bad")


def _submit(**changes) -> pb.Submit:
    s = pb.Submit(id=1, prompt=[1, 2], params=wire.encode_params(GenerationParams(max_tokens=4)))
    for name, value in changes.items():
        target = s if name in ("prompt", "resume_tokens") else s.params
        if isinstance(value, list):
            getattr(target, name)[:] = value
        else:
            setattr(target, name, value)
    return s


def test_check_submit_keeps_out_what_would_break_the_engine():
    assert wire.check_submit(_submit(), INFO) == ""
    bad = {"prompt": [], "resume_tokens": [100], "stop_token_ids": [-1], "max_tokens": 0,
           "temperature": float("nan"), "top_p": 0.0, "top_k": -1, "min_tokens": 5,
           "logprobs": 21, "prompt_logprobs": -1, "n": 0, "repetition_penalty": 0.0}
    for name, value in bad.items():
        assert wire.check_submit(_submit(**{name: value}), INFO) != "", name
    assert wire.check_submit(_submit(max_tokens=63), INFO) != ""  # 2 + 63 > max_model_len
    assert wire.check_submit(_submit(resume_tokens=[3, 3, 3, 3]), INFO) != ""  # all produced
    s = _submit()
    s.params.logit_bias_ids.append(3)  # without its value
    assert wire.check_submit(s, INFO) != ""


def test_garbage_frames_decode_to_a_reason_not_an_exception():
    rng = random.Random(0)
    good_outputs = wire.encode_outputs([EngineOutput(1, [3], finish_reason="stop")], [1])
    for _ in range(300):
        junk = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 40)))
        for message in (pb.ApiMessage, pb.EngineMessage):
            msg, why = wire.decode([junk], message)
            assert (msg is None) == bool(why)
        # a valid message bit-flipped: if it still parses, its outputs are checked
        flipped = bytearray(good_outputs)
        flipped[rng.randrange(len(flipped))] ^= 1 << rng.randrange(8)
        msg, _ = wire.decode([bytes(flipped)], pb.EngineMessage)
        if msg is not None and msg.WhichOneof("kind") == "outputs":
            wire.decode_outputs(msg.outputs)
    assert wire.decode([b"a", b"b"], pb.ApiMessage)[1] == "2 frames, expected 1"
    broken = pb.Outputs(ids=[1], num_tokens=[2], token_ids=[5])
    assert wire.decode_outputs(broken) == (None, "outputs whose tokens do not add up")
    broken = pb.Outputs(ids=[1], num_tokens=[1], token_ids=[5], finish_rows=[3],
                        finish_reasons=["stop"])
    assert wire.decode_outputs(broken) == (None, "outputs whose parts name no output")
