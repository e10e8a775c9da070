"""A request as the scheduler keeps it: the full token list outlives any executor."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from pagedserve.core.wire import PENDING_TOKEN


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # queued, never run or preempted (then recomputed from scratch)
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(frozen=True, slots=True)
class Constraint:
    """What a request's output must match (structured outputs; scheduler_svc/grammar.py): kind
    is a SamplingParams.constraint field's name; spec the schema (JSON text), regex or grammar,
    a JSON list of strings for "choice", "" for "json_object". Hashable: the grammar cache's
    key."""

    kind: str
    spec: str = ""


@dataclass(frozen=True, slots=True)
class GenerationParams:
    """A request's validated sampling, stopping and detokenizing parameters (from the public
    API's SamplingParams; the executor gets the sampling part as the wire's Sampling)."""

    max_tokens: int
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    # OpenAI's, over the output tokens: logit -= frequency * count + presence * (count > 0)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # HF's and vLLM's, over prompt and output tokens: a seen token's logit is divided by it if
    # positive, multiplied if negative
    repetition_penalty: float = 1.0
    min_p: float = 0.0  # keep tokens with p >= min_p * max p (after temperature)
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    # until this many output tokens: EOS (unless ignore_eos) and stop_token_ids are masked,
    # and nothing ends the request but max_tokens
    min_tokens: int = 0
    # None: no logprobs; 0: the sampled token's logprob; k (<= 20): also the k most likely
    logprobs: int | None = None
    n: int = 1  # completions of the prompt (each a Request; see scheduler_svc/api/parallel.py)
    constraint: Constraint | None = None  # structured output; None: free text
    # None: no prompt logprobs; k (<= 20): each prompt token's logprob, rank and k alternatives
    prompt_logprobs: int | None = None


@dataclass(eq=False, slots=True)
class Request:
    req_id: int  # internal handle, also used on the wire to the executor
    external_id: str  # the client's request_id
    prompt_len: int
    token_ids: list[int]  # prompt followed by generated tokens
    params: GenerationParams
    priority: int = 0  # lower is served first
    arrival_seq: int = 0  # admission order among equal priorities
    num_computed_tokens: int = 0  # tokens whose KV is (or will be, after this step) cached
    status: RequestStatus = RequestStatus.WAITING
    on_executor: bool = False  # the executor holds this request's state
    num_preemptions: int = 0
    num_step_timeouts: int = 0  # unanswered steps it was in (the second fails it)
    sort_key: tuple[int, int] = field(init=False)  # (priority, arrival): running order
    effective_priority: int = 0  # priority improved by aging while waiting
    queued_at_step: int = 0  # scheduler step at which it (re)entered the waiting queue
    swapped_blocks: list[int] = field(default_factory=list)  # host blocks while swapped out
    # Async scheduling: the last num_pending entries of token_ids are PENDING_TOKENs for tokens
    # that steps in flight will sample; each result fills the oldest.
    num_pending: int = 0
    # what the executor masks until min_tokens: EOS ids (unless ignore_eos), stop_token_ids
    min_tokens_masked_ids: tuple[int, ...] = ()
    # n > 1: completion 0, whose prompt the others wait for (to take it from the prefix cache)
    first_sibling: Request | None = None
    # structured outputs: its xgrammar GrammarMatcher, advanced by every token received
    matcher: Any = None
    # prompt tokens not scored yet (params.prompt_logprobs): while so, the request reads no
    # prefix cache and the executor scores the positions it computes
    needs_prompt_logprobs: bool = False
    # speculative decoding: the drafts of the step in flight (scheduled after its last token,
    # never in token_ids); cleared when its result comes
    spec_token_ids: list[int] = field(default_factory=list)
    # a draft model's proposals (StepResult.draft_*), good while num_tokens is proposed_at
    proposed: list[int] = field(default_factory=list)
    proposed_at: int = -1
    # LoRA: its adapter (1-based, --lora-modules; 0: the base model) and, while it is on the
    # executor, the device slot holding it (scheduler_svc/lora_slots.py)
    lora_id: int = 0
    lora_slot: int = 0

    def __post_init__(self) -> None:
        self.sort_key = (self.priority, self.arrival_seq)
        self.effective_priority = self.priority

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        """Output tokens, counting those still pending."""
        return len(self.token_ids) - self.prompt_len

    @property
    def num_known_output_tokens(self) -> int:
        """Output tokens sampled and received (not counting pending ones)."""
        return len(self.token_ids) - self.num_pending - self.prompt_len

    def fills_max_tokens(self, num_output_tokens: int) -> bool:
        """The max_tokens rule: whether a request with this many output tokens is done."""
        return num_output_tokens >= self.params.max_tokens

    def add_pending(self) -> None:
        self.token_ids.append(PENDING_TOKEN)
        self.num_pending += 1

    def add_token(self, token: int) -> None:
        """A sampled token: it fills the oldest pending entry, else it is appended."""
        if self.num_pending:
            self.token_ids[len(self.token_ids) - self.num_pending] = token
            self.num_pending -= 1
        else:
            self.token_ids.append(token)

    def drop_pending(self) -> None:
        if self.num_pending:
            del self.token_ids[-self.num_pending:]
            self.num_pending = 0
