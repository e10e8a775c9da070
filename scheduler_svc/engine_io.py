"""What crosses between the engine core and its clients (the API front ends): a request in,
output batches out, the model's facts, and the one error type of a request the engine ended.
Token ids only: text, stop strings and each API's shapes belong to the front ends."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedserve.scheduler.outputs import TokenLogprob
from pagedserve.scheduler.request import GenerationParams


class EngineError(Exception):
    """A request failed inside the engine (or was refused by it); `code` is a grpc.StatusCode
    name, which each front end names in its own convention."""

    def __init__(self, code: str, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.retry_after_s = retry_after_s


@dataclass(frozen=True, slots=True)
class EngineRequest:
    """One completion to generate, validated by a front end. params.constraint is its
    structured-output spec (compiled by the engine client); params.stop its stop strings,
    which the front end matches (the engine decides EOS, stop_token_ids and max_tokens)."""

    request_id: str  # the client's ("" : the engine names it req-<id>)
    prompt: list[int]  # token ids
    params: GenerationParams
    priority: int = 0  # lower is served first; already bounded by the tenant
    tenant: str = ""  # for the request log ("" when the service runs without API keys)
    timeout: float | None = None  # seconds it may live (the client's deadline)
    # n > 1: the engine id of completion 0 of the same prompt; this one waits for its prompt
    # (to take it from the prefix cache), does not count the prompt again, and logs under its
    # request id
    sibling_of: int | None = None
    # a resubmission to a new engine core: the output tokens it had produced (max_tokens and
    # the penalties count them; its outputs continue after them; its prompt is not counted)
    resume_tokens: tuple[int, ...] = ()
    resubmitted: bool = False  # admitted before, by an engine core now gone: past the queue
    # bounds (it was queued already), its prompt not counted again
    adapter: str = ""  # a LoRA adapter's name (--lora-modules); "": the base model


@dataclass(slots=True)
class EngineOutput:
    """What one step brought one request: its new tokens, and how it ended if it did. A
    request's last output has finish_reason or error set; an aborted one gets none."""

    req_id: int  # the engine's id (EngineClient.submit's answer)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)  # per token, if asked for
    finish_reason: str | None = None  # "stop" (EOS or a stop token) | "length" (max_tokens)
    stop_reason: int | None = None  # the stop token's id
    error: EngineError | None = None
    # on the first output: prompt tokens found in the prefix cache, and (if asked) each prompt
    # token's logprob (None for the first)
    cached_tokens: int = 0
    prompt_logprobs: list[TokenLogprob | None] | None = None


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """The served model and cache as the newest executor reported them."""

    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    block_size: int
    num_kv_blocks: int
    dtype: str
    device: str
    attention_backend: str
    kv_cache_dtype: str
    speculative_config: str = ""  # --speculative-config as JSON ("": off)
