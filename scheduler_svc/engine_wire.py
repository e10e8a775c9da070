"""The one codec of the engine socket (protos/pagedserve/internal/v1/engine.proto): what
engine_io's types become on the wire between the engine core and the API processes, and the
checks that keep a frame from a stranger, or a broken one, from harming the engine. Each
decode answers (value, "") or (None, why); nothing here raises on hostile bytes."""

from __future__ import annotations

import math

from pagedserve.protos.internal.v1 import engine_pb2 as pb
from pagedserve.scheduler.engine_io import EngineError, EngineOutput, EngineRequest, ModelInfo
from pagedserve.scheduler.invalid import InvalidRequest
from pagedserve.scheduler.outputs import TokenLogprob
from pagedserve.scheduler.request import Constraint, GenerationParams

MAX_TOP = 20  # logprobs and prompt logprobs: vLLM's bound, as the API checks it


# ----------------------------------------------------------------- requests
def encode_params(p: GenerationParams) -> pb.Params:
    w = pb.Params(max_tokens=p.max_tokens, temperature=p.temperature, top_k=p.top_k,
                  top_p=p.top_p, stop_token_ids=p.stop_token_ids, ignore_eos=p.ignore_eos,
                  presence_penalty=p.presence_penalty, frequency_penalty=p.frequency_penalty,
                  repetition_penalty=p.repetition_penalty, min_p=p.min_p,
                  min_tokens=p.min_tokens, n=p.n)
    if p.seed is not None:
        w.seed = p.seed
    if p.logit_bias:
        w.logit_bias_ids[:], w.logit_bias_values[:] = zip(*p.logit_bias, strict=True)
    if p.logprobs is not None:
        w.logprobs = p.logprobs
    if p.prompt_logprobs is not None:
        w.prompt_logprobs = p.prompt_logprobs
    if p.constraint is not None:
        w.constraint.kind, w.constraint.spec = p.constraint.kind, p.constraint.spec
    return w


def decode_params(w: pb.Params) -> GenerationParams:
    """The engine's GenerationParams (stop strings are the API process's: none here)."""
    return GenerationParams(
        max_tokens=w.max_tokens, temperature=w.temperature, top_k=w.top_k, top_p=w.top_p,
        seed=w.seed if w.HasField("seed") else None, stop_token_ids=tuple(w.stop_token_ids),
        ignore_eos=w.ignore_eos, presence_penalty=w.presence_penalty,
        frequency_penalty=w.frequency_penalty, repetition_penalty=w.repetition_penalty,
        min_p=w.min_p, logit_bias=tuple(zip(w.logit_bias_ids, w.logit_bias_values,
                                            strict=True)),
        min_tokens=w.min_tokens, logprobs=w.logprobs if w.HasField("logprobs") else None,
        n=w.n, constraint=Constraint(w.constraint.kind, w.constraint.spec)
        if w.HasField("constraint") else None,
        prompt_logprobs=w.prompt_logprobs if w.HasField("prompt_logprobs") else None)


def encode_submit(local_id: int, r: EngineRequest, sibling_of: int | None = None,
                  resume_tokens: list[int] | None = None, timeout_s: float | None = None,
                  resubmitted: bool = False) -> bytes:
    """A request as the API process names it (local_id); sibling_of likewise; timeout_s: what
    is left of its deadline; resubmitted: to a new session, with its tokens so far."""
    s = pb.Submit(id=local_id, request_id=r.request_id, prompt=r.prompt,
                  params=encode_params(r.params), priority=r.priority, tenant=r.tenant,
                  resume_tokens=resume_tokens or (), resubmitted=resubmitted,
                  adapter=r.adapter)
    if timeout_s is not None:
        s.timeout_s = timeout_s
    if sibling_of is not None:
        s.sibling_of = sibling_of
    return pb.ApiMessage(submit=s).SerializeToString()


def check_submit(s: pb.Submit, info: ModelInfo | None) -> str:
    """Why a Submit cannot be run as it is (a peer that is not our API process, or one of
    another version), or "". The API processes validate every field for the client; this
    keeps out what would break the engine or the executor."""
    if info is None:
        return ""  # refused anyway (no executor yet)
    p, vocab = s.params, info.vocab_size
    n = len(s.prompt) + len(s.resume_tokens)
    tokens = [*s.prompt, *s.resume_tokens, *p.stop_token_ids, *p.logit_bias_ids]
    if not s.prompt:
        return "an empty prompt"
    if tokens and (min(tokens) < 0 or max(tokens) >= vocab):
        return "a token outside the vocabulary"
    if p.max_tokens < 1 or len(s.prompt) + p.max_tokens > info.max_model_len:
        return "max_tokens outside 1 .. max_model_len - prompt"
    if len(s.resume_tokens) >= p.max_tokens or n >= info.max_model_len:
        return "resume tokens that reach max_tokens"
    floats = (p.temperature, p.top_p, p.presence_penalty, p.frequency_penalty,
              p.repetition_penalty, p.min_p, *p.logit_bias_values)
    if not all(math.isfinite(v) for v in floats):
        return "a sampling parameter that is not finite"
    if p.temperature < 0 or not 0 < p.top_p <= 1 or p.top_k < 0 or p.repetition_penalty <= 0 \
            or not 0 <= p.min_p <= 1:
        return "a sampling parameter out of range"
    if len(p.logit_bias_ids) != len(p.logit_bias_values):
        return "logit bias ids and values that do not pair up"
    if not 0 <= p.min_tokens <= p.max_tokens or p.n < 1:
        return "min_tokens or n out of range"
    if (p.HasField("logprobs") and not 0 <= p.logprobs <= MAX_TOP) or \
            (p.HasField("prompt_logprobs") and not 0 <= p.prompt_logprobs <= MAX_TOP):
        return "logprobs out of range"
    if s.HasField("timeout_s") and not math.isfinite(s.timeout_s):
        return "a timeout that is not finite"
    return ""


def decode_submit(s: pb.Submit) -> EngineRequest:
    """The EngineRequest of a checked Submit (sibling_of: mapped by the engine's caller)."""
    return EngineRequest(s.request_id, list(s.prompt), decode_params(s.params), s.priority,
                         s.tenant, s.timeout_s if s.HasField("timeout_s") else None,
                         adapter=s.adapter)


# ----------------------------------------------------------------- errors, facts
def encode_error(e: EngineError | InvalidRequest) -> pb.Error:
    if isinstance(e, InvalidRequest):
        return pb.Error(code="INVALID_ARGUMENT", message=e.reason, field=e.field)
    w = pb.Error(code=e.code, message=str(e))
    if e.retry_after_s is not None:
        w.retry_after_s = e.retry_after_s
    return w


def decode_error(w: pb.Error) -> EngineError | InvalidRequest:
    if w.field:
        return InvalidRequest(w.field, w.message)
    return EngineError(w.code or "INTERNAL", w.message,
                       w.retry_after_s if w.HasField("retry_after_s") else None)


def encode_model_info(i: ModelInfo) -> pb.ModelInfo:
    return pb.ModelInfo(max_model_len=i.max_model_len, vocab_size=i.vocab_size,
                        eos_token_ids=i.eos_token_ids, block_size=i.block_size,
                        num_kv_blocks=i.num_kv_blocks, dtype=i.dtype, device=i.device,
                        attention_backend=i.attention_backend, kv_cache_dtype=i.kv_cache_dtype,
                        speculative_config=i.speculative_config)


def decode_model_info(w: pb.ModelInfo) -> ModelInfo:
    return ModelInfo(w.max_model_len, w.vocab_size, tuple(w.eos_token_ids), w.block_size,
                     w.num_kv_blocks, w.dtype, w.device, w.attention_backend, w.kv_cache_dtype,
                     w.speculative_config)


# ----------------------------------------------------------------- outputs
def encode_outputs(batch: list[EngineOutput], ids: list[int]) -> bytes:
    """One step's outputs for one API process; ids[i]: the API's name of batch[i]'s request."""
    o = pb.Outputs(ids=ids, num_tokens=[len(out.token_ids) for out in batch],
                   token_ids=[t for out in batch for t in out.token_ids])
    for row, out in enumerate(batch):
        if out.finish_reason:
            o.finish_rows.append(row)
            o.finish_reasons.append(out.finish_reason)
        if out.stop_reason is not None:
            o.stop_rows.append(row)
            o.stop_token_ids.append(out.stop_reason)
        if out.error is not None:
            o.error_rows.append(row)
            o.errors.append(encode_error(out.error))
        if out.cached_tokens:
            o.cached_rows.append(row)
            o.cached_tokens.append(out.cached_tokens)
        for lp in out.logprobs:
            o.logprob_rows.append(row)
            o.logprobs.append(lp.logprob)
            o.num_top.append(len(lp.top_ids))
            o.top_ids.extend(lp.top_ids)
            o.top_logprobs.extend(lp.top_logprobs)
        if out.prompt_logprobs is not None:
            o.prompt_rows.append(row)
            o.prompt_counts.append(len(out.prompt_logprobs))
            for e in out.prompt_logprobs:
                e = e or TokenLogprob(0.0)
                o.prompt_logprobs.append(e.logprob)
                o.prompt_ranks.append(e.rank)
                o.prompt_num_top.append(len(e.top_ids))
                o.prompt_top_ids.extend(e.top_ids)
                o.prompt_top_logprobs.extend(e.top_logprobs)
    return pb.EngineMessage(outputs=o).SerializeToString()


def decode_outputs(o: pb.Outputs) -> tuple[list[EngineOutput] | None, str]:
    """The outputs of an Outputs message (req_id: the API process's names), or (None, why)."""
    n = len(o.ids)
    if len(o.num_tokens) != n or min(o.num_tokens, default=0) < 0 \
            or sum(o.num_tokens) != len(o.token_ids):
        return None, "outputs whose tokens do not add up"
    pairs = ((o.finish_rows, o.finish_reasons), (o.stop_rows, o.stop_token_ids),
             (o.error_rows, o.errors), (o.cached_rows, o.cached_tokens),
             (o.prompt_rows, o.prompt_counts))
    if any(len(rows) != len(values) or (rows and not 0 <= min(rows) <= max(rows) < n)
           for rows, values in pairs):
        return None, "outputs whose parts name no output"
    if not (len(o.logprob_rows) == len(o.logprobs) == len(o.num_top)) \
            or sum(o.num_top) != len(o.top_ids) or len(o.top_ids) != len(o.top_logprobs) \
            or (o.logprob_rows and not 0 <= min(o.logprob_rows) <= max(o.logprob_rows) < n) \
            or min(o.num_top, default=0) < 0:
        return None, "outputs whose logprobs do not add up"
    entries = sum(o.prompt_counts)
    if min(o.prompt_counts, default=0) < 0 or not (
            entries == len(o.prompt_logprobs) == len(o.prompt_ranks) == len(o.prompt_num_top)) \
            or min(o.prompt_num_top, default=0) < 0 \
            or sum(o.prompt_num_top) != len(o.prompt_top_ids) \
            or len(o.prompt_top_ids) != len(o.prompt_top_logprobs):
        return None, "outputs whose prompt logprobs do not add up"
    outs, at = [], 0
    for i, k in zip(o.ids, o.num_tokens, strict=True):
        outs.append(EngineOutput(i, list(o.token_ids[at:at + k])))
        at += k
    for row, reason in zip(o.finish_rows, o.finish_reasons, strict=True):
        outs[row].finish_reason = reason
    for row, token in zip(o.stop_rows, o.stop_token_ids, strict=True):
        outs[row].stop_reason = token
    for row, err in zip(o.error_rows, o.errors, strict=True):
        e = decode_error(err)
        outs[row].error = e if isinstance(e, EngineError) else EngineError("INTERNAL", str(e))
    for row, cached in zip(o.cached_rows, o.cached_tokens, strict=True):
        outs[row].cached_tokens = cached
    at = 0
    for row, lp, k in zip(o.logprob_rows, o.logprobs, o.num_top, strict=True):
        outs[row].logprobs.append(TokenLogprob(lp, tuple(o.top_ids[at:at + k]),
                                               tuple(o.top_logprobs[at:at + k])))
        at += k
    at = top = 0
    for row, count in zip(o.prompt_rows, o.prompt_counts, strict=True):
        got: list[TokenLogprob | None] = []
        for j in range(at, at + count):
            k = o.prompt_num_top[j]
            got.append(None if o.prompt_ranks[j] == 0 else TokenLogprob(
                o.prompt_logprobs[j], tuple(o.prompt_top_ids[top:top + k]),
                tuple(o.prompt_top_logprobs[top:top + k]), o.prompt_ranks[j]))
            top += k
        at += count
        outs[row].prompt_logprobs = got
    return outs, ""


def decode(frames: list, message: type) -> tuple[object | None, str]:
    """One frame of `message` (pb.ApiMessage or pb.EngineMessage) with its kind set, or
    (None, why)."""
    if len(frames) != 1:
        return None, f"{len(frames)} frames, expected 1"
    try:
        msg = message.FromString(bytes(frames[0]))
    except Exception as e:  # DecodeError, and whatever else a hostile byte string provokes
        return None, f"not a {message.__name__}: {e}"
    if msg.WhichOneof("kind") is None:
        return None, "an empty message"
    return msg, ""
