"""What the scheduler hands out: the plan of one step, the tokens a result brought, its stats."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedserve.protos.internal.v1 import executor_pb2 as pb
from pagedserve.scheduler.request import Request


@dataclass(slots=True)
class ScheduledRequest:
    """One request's part of a step:

        token_ids:  [ computed ......... | this step's num_tokens | rest ]
                    0                  start               start + num_tokens
    """

    req: Request
    num_tokens: int  # tokens this step computes
    start: int  # num_computed_tokens before the step: the mirrors on both sides must agree
    block_ids: list[int]  # a new request's whole block table; a cached one's gained blocks
    # speculative drafts, the last len(spec_token_ids) of num_tokens (a cached request's)
    spec_token_ids: list[int] = field(default_factory=list)


@dataclass(slots=True)
class SchedulerOutput:
    new: list[ScheduledRequest] = field(default_factory=list)  # the executor has no state
    cached: list[ScheduledRequest] = field(default_factory=list)  # the executor holds them
    finished_req_ids: list[int] = field(default_factory=list)
    preempted_req_ids: list[int] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device block, host block)
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host block, device block)
    num_batched_tokens: int = 0
    # structured outputs: a StepBitmask for this step follows the plan (some constrained
    # request samples in it)
    bitmask_follows: bool = False
    # planned after the loop waited for work (StepPlan.after_idle)
    after_idle: bool = False
    # speculative decoding by a draft model: drafts the executor proposes after this step
    # (StepPlan.num_lookahead_tokens)
    num_lookahead_tokens: int = 0
    # LoRA: (slot, adapter id) to load before this step runs (StepPlan.lora_loads)
    lora_loads: list[tuple[int, int]] = field(default_factory=list)
    # what the decoders' prefill share (prefill_share.py) learns from this step: it has
    # decode rows, a partial prefill's chunk the share covers, and how many it held back
    decoding: bool = False
    chunked: bool = False
    held_chunks: int = 0

    @property
    def is_empty(self) -> bool:
        return not (self.new or self.cached or self.finished_req_ids or self.preempted_req_ids
                    or self.lora_loads)

    def scheduled(self) -> list[ScheduledRequest]:
        return self.new + self.cached


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """A sampled token's logprob and its most likely alternatives (GenerationParams.logprobs of
    them, most likely first), from the model's raw distribution."""

    logprob: float
    top_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()
    rank: int = 0  # of a prompt token (1: the most likely); 0 for a sampled one


def prompt_logprobs_of(result: pb.StepResult) -> list[tuple[int, int, list[TokenLogprob]]]:
    """A result's prompt logprobs: (req_id, position of the first, one per scored token)."""
    out, at = [], 0
    ints, floats = result.prompt_logprob_ints, result.prompt_logprob_floats
    for rid, start, count, k in zip(result.prompt_logprob_req_ids, result.prompt_logprob_starts,
                                    result.prompt_logprob_counts, result.prompt_logprob_ks,
                                    strict=True):
        entries = []
        for _ in range(count):
            entries.append(TokenLogprob(floats[at], tuple(ints[at + 1:at + 1 + k]),
                                        tuple(floats[at + 1:at + 1 + k]), ints[at]))
            at += 1 + k
        out.append((rid, start, entries))
    return out


def proposals_of(result: pb.StepResult) -> dict[int, list[int]]:
    """A draft model's proposals in a result, by request id; checked on arrival by the link."""
    out, at = {}, 0
    for rid, n in zip(result.draft_req_ids, result.num_draft_tokens, strict=True):
        out[rid] = list(result.draft_token_ids[at:at + n])
        at += n
    return out


def logprobs_of(result: pb.StepResult) -> dict[int, TokenLogprob]:
    """A result's logprobs by row (index in its req_ids); checked on arrival by the link."""
    out, at = {}, 0
    for row, lp, k in zip(result.logprob_rows, result.sampled_logprobs, result.num_top_logprobs,
                          strict=True):
        out[row] = TokenLogprob(lp, tuple(result.top_logprob_token_ids[at:at + k]),
                                tuple(result.top_logprobs[at:at + k]))
        at += k
    return out


@dataclass(slots=True)
class Sampled:
    """A token a step sampled for a request, and whether it ended the request."""

    req: Request
    token: int
    finish_reason: str | None = None  # "stop" (EOS or a stop token) | "length" (max_tokens)
    stop_reason: int | None = None  # the stop token's id
    logprob: TokenLogprob | None = None  # if the request asked for logprobs


@dataclass(frozen=True, slots=True)
class SchedulerStats:
    running: int
    waiting: int
    swapped: int  # waiting requests whose KV sits in host memory
    num_blocks: int
    free_blocks: int
    block_size: int
    kv_tokens_held: int  # KV tokens in the blocks in use; a shared block's counted once
    preemptions: int
    swap_preemptions: int  # of preemptions, those swapped rather than recomputed
    priority_preemptions: int
    prefix_queried_tokens: int
    prefix_hit_tokens: int
    held_chunks: int = 0  # partial prefills' chunks held for the decoders (prefill_share.py)
    spec_drafts: int = 0  # speculative decoding: drafted requests, over all steps
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_accepted_per_pos: tuple[int, ...] = ()  # drafts accepted at each position
    max_loras: int = 0  # LoRA: device slots (0: LoRA off), the adapters of the running and of
    running_lora: tuple[str, ...] = ()  # the waiting requests, by name
    waiting_lora: tuple[str, ...] = ()
