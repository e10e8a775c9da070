"""Plans each step under a token budget: there is no prefill phase and no decode phase.

Every request has num_computed_tokens and num_tokens; a step gives each request up to
num_tokens - num_computed_tokens tokens, running requests first (in priority order), then
waiting ones, within max_num_batched_tokens and max_num_seqs. Long prompts are therefore
prefilled in chunks (at most long_prefill_token_threshold tokens per step each, so short
requests behind them keep getting their turn), decodes and prefill chunks share a step, and a
preempted request simply starts again from num_computed_tokens = 0 (recompute).

Priorities (lower value first):
- the waiting queue is ordered by (effective priority, arrival); a waiting request's effective
  priority improves by one level for every `priority_aging_steps` steps it has waited, so low
  priority work cannot starve;
- when blocks run out during a step, the least important running request (highest (priority,
  arrival)) is preempted;
- when the head of the queue outranks the least important running request (its effective
  priority is strictly lower) and there is no room for it (sequence slots or blocks), running
  requests are preempted, least important first, until it fits.

Preemption mode, per victim: recompute (drop its KV; it restarts from its token list, reusing
whatever prefix is still cached) or swap (its computed blocks are copied to host memory and
copied back on resume, so nothing is recomputed). With preemption_mode "auto", a victim is
swapped when it has at least swap_min_tokens computed tokens and the host pool has room: long
contexts are expensive to recompute (quadratic attention, a prefill per token) and cheap to copy,
short ones the reverse.

Speculative decoding (cfg.speculative; scheduler_svc/speculative.py): a running request at its
last token gets up to k drafts, scheduled with it as 1 + k tokens in the step's budget and its
blocks; when the result comes, num_computed_tokens goes back by the drafts rejected (their KV
slots are written over later). Drafts are never in token_ids, so prefix-cache hashes cover only
accepted tokens. A step planned ahead of a result (async scheduling) drafts nothing. The
drafts come from the n-gram proposer here, or from a draft model in the executor: then each
result carries the next step's proposals (update(proposals=...)), and a speculating request
gets k lookahead slots past its step's tokens for the draft's KV (StepPlan.num_lookahead_tokens).
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass

from pagedserve.core.speculative import SpeculativeConfig
from pagedserve.scheduler.block_manager import (
    BlockManager,
    CachedPrefix,
    HostBlockPool,
    prefix_root,
)
from pagedserve.scheduler.grammar import Grammars
from pagedserve.scheduler.lora_slots import LoraSlots
from pagedserve.scheduler.outputs import (
    Sampled,
    ScheduledRequest,
    SchedulerOutput,
    SchedulerStats,
    TokenLogprob,
)
from pagedserve.scheduler.prefill_share import PrefillShare
from pagedserve.scheduler.request import Request, RequestStatus
from pagedserve.scheduler.speculative import NgramProposer
from pagedserve.scheduler.waiting_queue import WaitingQueue

log = logging.getLogger("pagedserve.scheduler")


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    # Cap on one request's prefill chunk per step (0: only the budget caps it).
    long_prefill_token_threshold: int = 0
    enable_prefix_caching: bool = True
    # A waiting request gains one priority level per this many steps waited (0: no aging).
    priority_aging_steps: int = 500
    # Bounds of the waiting queue; past them a request is refused at once (0: unbounded).
    max_waiting_requests: int = 1024
    max_waiting_prompt_tokens: int = 0
    preemption_mode: str = "auto"  # "auto", "recompute" or "swap" (see the module doc)
    max_loras: int = 0  # LoRA device slots (--max-loras with --enable-lora); 0: no LoRA
    # the adapters of --lora-modules, (name, path) each: adapter id i + 1 is lora_modules[i]
    lora_modules: tuple[tuple[str, str], ...] = ()
    swap_min_tokens: int = 256
    speculative: SpeculativeConfig | None = None  # None: one token per request per step
    # while requests decode, the time a partial prefill's chunks may add to theirs, as a
    # share of it (prefill_share.py; 0: chunks are never held)
    long_prefill_decode_share: float = 0.0


INTEGRITY_CHECK_S = 10.0  # least time between two full block-accounting checks when idle


def _by_priority(r: Request) -> tuple[int, int]:
    return r.sort_key


class Scheduler:
    def __init__(self, cfg: SchedulerConfig, blocks: BlockManager,
                 host_blocks: HostBlockPool | None = None,
                 eos_token_ids: Iterable[int] = ()) -> None:
        if cfg.preemption_mode not in ("auto", "recompute", "swap"):
            raise ValueError(f"preemption_mode must be auto, recompute or swap, "
                             f"got {cfg.preemption_mode!r}")
        self.cfg = cfg
        self.eos_token_ids = frozenset(eos_token_ids)
        self.blocks = blocks
        self.host_blocks = host_blocks or HostBlockPool(0)
        self.waiting = WaitingQueue(cfg.priority_aging_steps)
        self.running: list[Request] = []  # sorted by (priority, arrival)
        self.requests: dict[int, Request] = {}
        self.step = 0
        self._finished_ids: list[int] = []  # to tell the executor in the next plan
        self._preempted_ids: list[int] = []
        self.num_preemptions = 0
        self.num_swap_preemptions = 0  # of num_preemptions, those swapped rather than recomputed
        self.num_priority_preemptions = 0
        self._swap_out: list[tuple[int, int]] = []
        self.prefix_queried_tokens = 0  # prompt tokens looked up in the prefix cache
        self.prefix_hit_tokens = 0  # of which found cached
        self._checked_at = -INTEGRITY_CHECK_S  # last full check of the block accounting
        spec = cfg.speculative
        self.proposer = None if spec is None or spec.drafts_in_executor else NgramProposer(
            spec.prompt_lookup_min, spec.prompt_lookup_max)
        self.accept_s = 0.0  # the last update's grammar accept (0: no constrained row)
        self.spec_drafts = 0  # drafted requests (one per request per step)
        self.spec_draft_tokens = 0
        self.spec_accepted_tokens = 0
        self.spec_accepted_per_pos = [0] * (spec.num_speculative_tokens if spec else 0)
        self.lora = LoraSlots(cfg.max_loras) if cfg.max_loras else None
        share = cfg.long_prefill_decode_share
        self.prefill_share = PrefillShare(share) if share > 0 else None
        self.num_held_chunks = 0  # partial prefills' chunks held for the decoders
        # adapter id -> name (the engine's LoraRegistry shares its own, loaded at run time too)
        self.lora_names = {i + 1: name for i, (name, _) in enumerate(cfg.lora_modules)}

    # ------------------------------------------------------------------ queue
    def admission_error(self, prompt_len: int) -> str | None:
        """Why a new request of prompt_len tokens cannot be queued now, or None."""
        cfg = self.cfg
        if cfg.max_waiting_requests and len(self.waiting) >= cfg.max_waiting_requests:
            return f"{len(self.waiting)} requests are waiting (max_waiting_requests)"
        if (cfg.max_waiting_prompt_tokens
                and self.waiting.prompt_tokens + prompt_len > cfg.max_waiting_prompt_tokens):
            return (f"{self.waiting.prompt_tokens} prompt tokens are waiting "
                    f"(max_waiting_prompt_tokens {cfg.max_waiting_prompt_tokens})")
        return None

    def add(self, req: Request) -> None:
        p = req.params
        if p.min_tokens:
            eos = () if p.ignore_eos else tuple(sorted(self.eos_token_ids))
            req.min_tokens_masked_ids = tuple(dict.fromkeys(eos + p.stop_token_ids))
        self.requests[req.req_id] = req
        self._enqueue(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._finished_ids or self._preempted_ids)

    def finish(self, req_id: int) -> Request | None:
        """Remove a request (finished or aborted) and free its blocks at once."""
        req = self.requests.pop(req_id, None)
        if req is None:
            return None
        req.drop_pending()  # an in-flight step's token for it will be ignored
        req.spec_token_ids = []
        if self.proposer is not None:
            self.proposer.forget(req_id)
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.status == RequestStatus.WAITING:
            self.waiting.remove(req)
        self.blocks.free(req_id)
        self.host_blocks.free(req.swapped_blocks)
        req.swapped_blocks = []
        self._release_lora(req)
        if req.on_executor:
            self._finished_ids.append(req_id)
        req.status = RequestStatus.FINISHED
        return req

    def preempt_all(self, blocks: BlockManager, host_blocks: HostBlockPool) -> None:
        """A new executor joined, without any of the KV: every request recomputes, on the new
        executor's block pools."""
        for req in self.requests.values():
            req.drop_pending()  # the steps that would have sampled them are lost
            req.spec_token_ids = []
        for req in list(self.running):
            self._preempt(req, allow_swap=False)
        self._preempted_ids.clear()
        self._finished_ids.clear()
        self._swap_out.clear()
        for req in self.waiting:
            req.on_executor = False
            req.swapped_blocks = []
            req.num_computed_tokens = 0
        self.blocks, self.host_blocks = blocks, host_blocks
        if self.lora is not None:
            self.lora.reset()

    # ------------------------------------------------------------------ planning
    def schedule(self, ahead: bool = False) -> SchedulerOutput:
        """Plan the next step. ahead=True: another step is still in flight (async
        scheduling); then nothing is preempted (a request in flight has placeholder tokens whose
        KV is being computed), and if the queue's head needs a priority preemption the plan is
        empty, so the engine waits for the in-flight step and plans again with ahead=False."""
        if ahead and self._make_room_for_priority(dry_run=True):
            return SchedulerOutput()
        self.step += 1
        out = SchedulerOutput(finished_req_ids=self._finished_ids)
        self._finished_ids = []
        self.waiting.age(self.step)
        if not ahead:
            self._make_room_for_priority()
        drafts = 0 if ahead else self.num_drafts()
        if drafts and self.cfg.speculative.drafts_in_executor:
            out.num_lookahead_tokens = drafts
        budget, ran_out = self._schedule_running(out, self.cfg.max_num_batched_tokens,
                                                 preempt=not ahead, drafts=drafts)
        if not ran_out:
            budget = self._admit_waiting(out, budget)
        out.preempted_req_ids, out.swap_out = self._preempted_ids, self._swap_out
        self._preempted_ids, self._swap_out = [], []
        if self.lora is not None:
            out.lora_loads = self.lora.take_loads()
        out.num_batched_tokens = self.cfg.max_num_batched_tokens - budget
        return out

    def num_drafts(self) -> int:
        """Drafts per request the next step would give (0: speculation is off, or the batch is
        past the sizes that speculate)."""
        spec = self.cfg.speculative
        return 0 if spec is None else spec.tokens_for(max(len(self.running), 1))

    def _schedule_running(self, out: SchedulerOutput, budget: int,
                          preempt: bool = True, drafts: int = 0) -> tuple[int, bool]:
        """Give running requests their tokens (and up to `drafts` speculative ones each),
        preempting the least important when blocks run out (unless preempt is False: then stop
        there). Returns the budget left and whether blocks ran out."""
        ran_out = False
        # the decoders' share (prefill_share.py) covers partial prefills no more important
        # than the most important decoder (its priority: `guard`); they wait while it is spent
        guard = None
        if self.prefill_share is not None:
            guard = min((r.priority for r in self.running
                         if r.num_tokens - r.num_computed_tokens <= 1), default=None)
        closed = guard is not None and not self.prefill_share.open
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = self._chunk(req, budget)
            left = req.num_tokens - req.num_computed_tokens
            guarded = (guard is not None and left > 1 and req.num_computed_tokens > 0
                       and guard <= req.priority)
            if guarded and closed:
                out.held_chunks += 1
                self.num_held_chunks += 1
                n = 0
            if n <= 0:
                i += 1
                continue
            if left <= 1:
                out.decoding = True
            elif guarded:
                out.chunked = True
            spec = self._draft(req, min(drafts, budget - n)) if drafts and n == 1 else []
            # a draft model proposes the next step's drafts in slots past this step's tokens,
            # never past the last position the request can reach (within max_model_len)
            look = drafts if drafts and self.proposer is None and self._draftable(req) else 0
            if look:
                look = max(0, min(look, req.prompt_len + req.params.max_tokens
                                  - (req.num_computed_tokens + n + len(spec))))
            new_blocks = None
            if spec or look:  # drafts need blocks of their own; without room, the step goes on
                new_blocks = self.blocks.allocate_slots(
                    req.req_id, req.num_computed_tokens + n + len(spec) + look)
                if new_blocks is None:
                    spec = []
            if new_blocks is None:
                new_blocks = self.blocks.allocate_slots(req.req_id, req.num_computed_tokens + n)
            if new_blocks is None and not preempt:
                return budget, True
            while new_blocks is None:
                victim = self.running[-1]
                self._preempt(victim)
                ran_out = True
                if victim is req:
                    break
                new_blocks = self.blocks.allocate_slots(req.req_id, req.num_computed_tokens + n)
            if new_blocks is None:
                break
            self._emit(out, req, n, new_blocks, spec)
            budget -= n + len(spec)
            i += 1
        return budget, ran_out

    def _draft(self, req: Request, k: int) -> list[int]:
        """Up to k drafts for a request whose step starts at its last token; none for what
        speculation does not cover (_draftable, docs/speculative_decoding.md)."""
        if req.num_pending or req.num_computed_tokens != req.num_tokens - 1 or \
                not self._draftable(req):
            return []
        # the last of 1 + k outputs may be max_tokens' last
        k = min(k, req.params.max_tokens - req.num_output_tokens - 1)
        if k <= 0:
            return []
        if self.proposer is None:  # a draft model's, made after the token they follow
            return req.proposed[:k] if req.proposed_at == req.num_tokens else []
        return self.proposer.propose(req.req_id, req.token_ids, k)

    @staticmethod
    def _draftable(req: Request) -> bool:
        """Whether speculation covers the request: not with a grammar, penalties (their
        counts would include rejected drafts), min_tokens (the executor masks by a request's
        output count, one per step) or prompt logprobs."""
        p = req.params
        return not (req.matcher is not None or req.needs_prompt_logprobs
                    or p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0
                    or p.min_tokens)

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> int:
        """Admit from the queue in order. A request whose adapter finds every LoRA slot held by
        another adapter's running requests waits, and so does every adapter request behind it,
        but the base's requests pass it: they hold no slot, so the slots still drain to it.
        Once one waits, the walk ends at the last base request (`base`: those not yet passed)."""
        i, slot_wait, base = 0, False, self.waiting.base
        while i < len(self.waiting) and budget > 0 and len(self.running) < self.cfg.max_num_seqs:
            if slot_wait and not base:
                break
            req = self.waiting.at(i)
            if self._waits_for_first(req):
                break
            if req.lora_id and (slot_wait or not self.lora.can_take(req.lora_id)):
                slot_wait, i = True, i + 1
                continue
            base -= not req.lora_id
            admit = self._resume_swapped if req.swapped_blocks else self._admit_fresh
            n = admit(out, req, budget)
            if n is None:
                break
            if req.lora_id:  # (the plan's NewRequest is encoded once the plan is sent)
                req.lora_slot = self.lora.take(req.lora_id)
            self.waiting.remove(req)
            req.status = RequestStatus.RUNNING
            bisect.insort(self.running, req, key=_by_priority)
            budget -= n
        return budget

    def _waits_for_first(self, req: Request) -> bool:
        """Whether a completion of an n > 1 request waits for completion 0 to schedule its
        whole prompt, whose blocks it then takes from the prefix cache (scheduler_svc/
        parallel.py). Only while completion 0 runs: a waiting one may be behind this one in
        the queue (preempted and requeued), and waiting for it then would wait forever."""
        first = req.first_sibling
        return (first is not None and self.cfg.enable_prefix_caching and req.num_output_tokens == 0
                and first.status == RequestStatus.RUNNING
                and first.num_computed_tokens < first.prompt_len)

    def _admit_fresh(self, out: SchedulerOutput, req: Request, budget: int) -> int | None:
        """Start (or restart) a request from its cached prefix; None if it does not fit."""
        # positions found in the cache would not be computed, so not scored (vLLM: the same)
        prefix = CachedPrefix() if req.needs_prompt_logprobs else \
            self.blocks.cached_prefix(req.token_ids, prefix_root(req.lora_id))
        req.num_computed_tokens = prefix.num_tokens
        n = self._chunk(req, budget)
        new_blocks = self.blocks.allocate_slots(req.req_id, req.num_computed_tokens + n,
                                                admit=bool(self.running), prefix=prefix)
        if new_blocks is None:
            req.num_computed_tokens = 0
            return None
        if self.cfg.enable_prefix_caching:
            self.prefix_queried_tokens += req.num_tokens
            self.prefix_hit_tokens += req.num_computed_tokens
        self._emit(out, req, n, new_blocks)
        return n

    def _resume_swapped(self, out: SchedulerOutput, req: Request, budget: int) -> int | None:
        """Bring a swapped request back: fresh device blocks, its host blocks copied in."""
        n = self._chunk(req, budget)
        table = self.blocks.allocate_slots(req.req_id, req.num_computed_tokens + n,
                                           admit=bool(self.running))
        if table is None:
            return None
        out.swap_in.extend(zip(req.swapped_blocks, table, strict=False))
        self.host_blocks.free(req.swapped_blocks)
        req.swapped_blocks = []
        self._emit(out, req, n, table)
        return n

    def _make_room_for_priority(self, dry_run: bool = False) -> bool:
        """Preempt lower-priority running work that stands in the way of the queue's head;
        whether it did (dry_run: whether it would, preempting nothing)."""
        if not self.waiting:
            return False
        head = self.waiting.head
        if not self.running or self.running[-1].priority <= head.effective_priority:
            return False  # no running request is less important (the common case): O(1)
        did = self._free_slot_for(head, dry_run)
        if did and dry_run:
            return True
        first_chunk = min(head.num_tokens, self.cfg.max_num_batched_tokens,
                          self.cfg.long_prefill_token_threshold or head.num_tokens)
        need = self.blocks.blocks_to_admit(first_chunk)
        need += sum(self._growth(r) for r in self.running)
        while self.running and (len(self.running) >= self.cfg.max_num_seqs
                                or self.blocks.num_free_blocks < need):
            victim = self.running[-1]
            if victim.priority <= head.effective_priority:
                return did
            if dry_run:
                return True
            need -= self._growth(victim)
            self._preempt(victim)
            self.num_priority_preemptions += 1
            did = True
        return did

    def _free_slot_for(self, head: Request, dry_run: bool) -> bool:
        """If the head's adapter finds every LoRA slot held, preempt the running requests of
        one slot whose holders are all less important than the head (the slot with the fewest
        holders, then the least important); whether it did (dry_run: would)."""
        if not head.lora_id or self.lora is None or self.lora.can_take(head.lora_id):
            return False
        holders: dict[int, list[Request]] = {}
        for r in self.running:
            if r.lora_slot:
                holders.setdefault(r.lora_slot, []).append(r)
        outranked = [rs for rs in holders.values()
                     if all(r.priority > head.effective_priority for r in rs)]
        if not outranked:
            return False
        if not dry_run:
            victims = min(outranked, key=lambda rs: (  # fewest, then least important
                len(rs), [-v for v in min(map(_by_priority, rs))]))
            for victim in sorted(victims, key=_by_priority, reverse=True):
                self._preempt(victim)
                self.num_priority_preemptions += 1
        return True

    def update(self, req_ids: list[int], token_ids: list[int],
               logprobs: dict[int, TokenLogprob] | None = None,
               proposals: dict[int, list[int]] | None = None) -> list[Sampled]:
        """Record a step's sampled tokens and decide, here and only here, which requests they
        end (EOS, a stop token, max_tokens): those are finished at once, so they are out of
        the next plan. Before min_tokens only max_tokens ends one. Finished and aborted
        requests are skipped. logprobs: by row, for the requests that asked; proposals: a
        draft model's drafts to follow each request's last token here."""
        sampled = []
        if self.cfg.speculative is not None:
            self._verified(req_ids)
        accepted = self._accept(req_ids, token_ids)
        for row, (rid, tok) in enumerate(zip(req_ids, token_ids, strict=True)):
            req = self.requests.get(rid)
            if req is None or req.status != RequestStatus.RUNNING:
                continue
            req.add_token(tok)
            out = Sampled(req, tok, logprob=logprobs.get(row) if logprobs else None)
            params = req.params
            # the mask allowed only tokens the matcher accepts: a refusal means a broken
            # executor, and the request ends rather than go on off its grammar
            refused = req.matcher is not None and not accepted[rid]
            if refused:
                log.error("request %s: the executor sampled token %d, which its grammar "
                          "refuses; ending it", req.external_id, tok)
            # (the executor masks EOS and stop ids before min_tokens: this only makes sure)
            if req.num_known_output_tokens >= params.min_tokens and (
                    tok in params.stop_token_ids
                    or (tok in self.eos_token_ids and not params.ignore_eos)):
                out.finish_reason, out.stop_reason = "stop", tok
            elif refused or (req.matcher is not None and req.matcher.is_terminated()):
                out.finish_reason = "stop"  # (EOS under ignore_eos: stop_reason stays None)
            elif req.fills_max_tokens(req.num_known_output_tokens):
                out.finish_reason = "length"
            if out.finish_reason is not None:
                self.finish(rid)
            sampled.append(out)
        for rid, drafts in (proposals or {}).items():
            req = self.requests.get(rid)
            if req is not None and req.status == RequestStatus.RUNNING:
                # (they follow the token sampled here: a step planned ahead may have added a
                # placeholder after it)
                req.proposed, req.proposed_at = drafts, req.num_tokens - req.num_pending
        return sampled

    def _verified(self, req_ids: list[int]) -> None:
        """Speculation: a drafted request's result has a + 1 tokens for a drafts kept; its
        computed tokens go back by the k - a rejected (their KV is overwritten later)."""
        counts: dict[int, int] = {}
        for rid in req_ids:
            counts[rid] = counts.get(rid, 0) + 1
        drafted = [(req, m) for rid, m in counts.items()
                   if (req := self.requests.get(rid)) is not None and req.spec_token_ids]
        for req, m in drafted:  # all checked before anything changes
            if m > len(req.spec_token_ids) + 1:
                raise ValueError(f"request {req.req_id}: {m} tokens for "
                                 f"{len(req.spec_token_ids)} drafts")
        for req, m in drafted:
            k, a = len(req.spec_token_ids), m - 1
            req.num_computed_tokens -= k - a
            req.spec_token_ids = []
            self.spec_drafts += 1
            self.spec_draft_tokens += k
            self.spec_accepted_tokens += a
            for pos in range(a):
                self.spec_accepted_per_pos[pos] += 1

    def _accept(self, req_ids: list[int], token_ids: list[int]) -> dict[int, bool]:
        """The running constrained requests' matchers advanced by their tokens, in one call
        for the step: whether each accepted its token, by request id."""
        self.accept_s = 0.0
        rows = [(rid, req.matcher, tok) for rid, tok in zip(req_ids, token_ids, strict=True)
                if (req := self.requests.get(rid)) is not None
                and req.status == RequestStatus.RUNNING and req.matcher is not None]
        if not rows:
            return {}
        rids, matchers, tokens = zip(*rows, strict=True)
        t0 = time.perf_counter()
        accepted = Grammars.accept(list(matchers), list(tokens))
        self.accept_s = time.perf_counter() - t0
        return dict(zip(rids, accepted, strict=True))

    def expect_tokens(self, out: SchedulerOutput) -> None:
        """Async scheduling: give every request that samples in `out` a pending token, so the
        next step can be planned before the result arrives. None for a request whose token
        there is its last by max_tokens: that one is not scheduled again."""
        for s in out.scheduled():
            req = s.req
            if (req.num_computed_tokens == req.num_tokens
                    and not req.fills_max_tokens(req.num_output_tokens + 1)):
                req.add_pending()

    def stats(self) -> SchedulerStats:
        b = self.blocks
        return SchedulerStats(
            running=len(self.running), waiting=len(self.waiting),
            swapped=sum(1 for r in self.waiting if r.swapped_blocks),
            num_blocks=b.num_blocks, free_blocks=b.num_free_blocks, block_size=b.block_size,
            kv_tokens_held=sum(r.num_computed_tokens for r in self.running)
            - b.block_size * b.num_shared_refs,
            preemptions=self.num_preemptions, swap_preemptions=self.num_swap_preemptions,
            priority_preemptions=self.num_priority_preemptions,
            prefix_queried_tokens=self.prefix_queried_tokens,
            prefix_hit_tokens=self.prefix_hit_tokens, held_chunks=self.num_held_chunks,
            spec_drafts=self.spec_drafts, spec_draft_tokens=self.spec_draft_tokens,
            spec_accepted_tokens=self.spec_accepted_tokens,
            spec_accepted_per_pos=tuple(self.spec_accepted_per_pos),
            **self._lora_stats())

    def _lora_stats(self) -> dict:
        """The adapters of the running and of the waiting requests, by name."""
        if self.lora is None:
            return {}
        names = self.lora_names

        def of(requests) -> tuple[str, ...]:
            return tuple(sorted({names.get(r.lora_id, "") for r in requests if r.lora_id}))

        return {"max_loras": self.lora.max_loras, "running_lora": of(self.running),
                "waiting_lora": of(self.waiting)}

    def check_idle(self, full: bool = False) -> None:
        """With no work left every block must be back on the free list (else a leak). The
        block manager's whole accounting is checked too when `full` or when INTEGRITY_CHECK_S
        passed since the last time: it is O(blocks), tens of ms on a GPU-sized pool, which a
        request arriving meanwhile would wait for."""
        if full or time.monotonic() - self._checked_at >= INTEGRITY_CHECK_S:
            self.blocks.check_integrity()
            self._checked_at = time.monotonic()
        if self.blocks.num_free_blocks != self.blocks.num_blocks:
            raise AssertionError("idle scheduler holds KV blocks: leak")

    # ------------------------------------------------------------------ helpers
    def _growth(self, req: Request) -> int:
        """Blocks a running request takes if it gets its next chunk (estimated with the whole
        budget)."""
        n = self._chunk(req, self.cfg.max_num_batched_tokens)
        return self.blocks.blocks_to_grow(req.req_id, req.num_computed_tokens + n)

    def _chunk(self, req: Request, budget: int) -> int:
        n = min(req.num_tokens - req.num_computed_tokens, budget)
        if self.cfg.long_prefill_token_threshold > 0:
            n = min(n, self.cfg.long_prefill_token_threshold)
        return n

    def _emit(self, out: SchedulerOutput, req: Request, n: int, new_blocks: list[int],
              spec: list[int] | None = None) -> None:
        """n tokens of req in the step, and after them its drafts (spec) if any."""
        if spec:  # (running, so on the executor)
            out.cached.append(ScheduledRequest(req, n + len(spec), req.num_computed_tokens,
                                               new_blocks, spec))
            req.spec_token_ids = spec
            req.num_computed_tokens += len(spec)
        elif req.on_executor:
            out.cached.append(ScheduledRequest(req, n, req.num_computed_tokens, new_blocks))
        else:
            out.new.append(ScheduledRequest(req, n, req.num_computed_tokens,
                                            self.blocks.block_table(req.req_id)))
            req.on_executor = True
        req.num_computed_tokens += n
        # blocks holding a placeholder are registered once its token is known (a later step)
        known = req.num_tokens - req.num_pending
        self.blocks.cache_full_blocks(req.req_id, req.token_ids,
                                      min(req.num_computed_tokens, known),
                                      prefix_root(req.lora_id))

    def _preempt(self, req: Request, allow_swap: bool = True) -> None:
        self.running.remove(req)
        req.spec_token_ids = []
        host = self._swap_target(req) if allow_swap else None
        if host is not None:  # keep num_computed_tokens: the KV comes back on resume
            self._swap_out.extend(zip(self.blocks.block_table(req.req_id), host, strict=False))
            req.swapped_blocks = host
            self.num_swap_preemptions += 1
        else:
            req.num_computed_tokens = 0
        self.blocks.free(req.req_id)
        self._release_lora(req)
        if req.on_executor:
            self._preempted_ids.append(req.req_id)
        req.on_executor = False
        req.num_preemptions += 1
        self.num_preemptions += 1
        req.status = RequestStatus.WAITING
        self._enqueue(req)

    def _swap_target(self, req: Request) -> list[int] | None:
        """Host blocks to swap req's computed KV into, or None to recompute it instead."""
        mode = self.cfg.preemption_mode
        if mode == "recompute" or req.num_computed_tokens == 0:
            return None
        if mode == "auto" and req.num_computed_tokens < self.cfg.swap_min_tokens:
            return None
        return self.host_blocks.allocate(self.blocks.blocks_for(req.num_computed_tokens))

    def _release_lora(self, req: Request) -> None:
        if req.lora_slot:
            self.lora.release(req.lora_slot)
            req.lora_slot = 0

    def _enqueue(self, req: Request) -> None:
        self.waiting.push(req, self.step)
