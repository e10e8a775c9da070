"""Mirrors request state from step plans, builds the flat batch, runs the model and samples."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from pagedserve.executor.block_table import BlockTableArray, RowColumns
from pagedserve.executor.cuda_graphs import DecodeGraphs
from pagedserve.executor.draft import DraftModel
from pagedserve.executor.eagle import EagleDraft
from pagedserve.executor.lora import LoraRuntime
from pagedserve.executor.model import AttentionMetadata, CausalLM
from pagedserve.executor.penalties import TokenCounts
from pagedserve.executor.prompt_logprobs import PromptLogprobs, PromptRows, score
from pagedserve.executor.sampler import (
    MIN_TOKENS,
    PENALTY,
    HostLogprobs,
    SampleOutput,
    Sampler,
    SamplingBatch,
    SamplingSpec,
    read_logprobs,
)
from pagedserve.executor.step_clock import DeviceClock
from pagedserve.executor.swap import SwapSpace
from pagedserve.executor.transfer import to_device
from pagedserve.protos.internal.v1 import executor_pb2 as pb


@dataclass(frozen=True, slots=True)
class Bitmask:
    """A step's token bitmask rows (StepBitmask): req_ids and their rows' bytes, which travel
    in the message or, to save the copies of a message that size, as a frame of their own."""
    req_ids: list[int]
    bits: bytes | memoryview

    @classmethod
    def of(cls, msg: pb.StepBitmask, frame: bytes | memoryview | None = None) -> Bitmask:
        return cls(list(msg.req_ids), msg.token_bitmask if frame is None else frame)


SPEC_UNREAD = -2  # RowColumns.pending_launch of a drafted row until finish() verifies it


@dataclass(frozen=True, slots=True)
class Drafted:
    """A step's drafted rows (speculative decoding): their RowColumns rows, where each one's
    k + 1 samples start in the step's sampled tokens, and its k drafts."""

    rows: list[int]
    first: list[int]
    drafts: list[list[int]]


@dataclass(slots=True)
class EagleRows:
    """A step's sampled rows as an EAGLE head's propose pass reads them once the tokens are
    known (executor_svc/eagle.py): each row's candidates for its last kept position are its
    last 1 + per flat rows (per: its drafts), whose samples start at `base` in the step's
    sampled tokens, as their target states do in `tapped`."""

    rows: np.ndarray  # RowColumns rows
    req_ids: np.ndarray  # who held them at launch (a row since given to another is skipped)
    base: np.ndarray  # where each row's samples (and tapped rows) start
    pos0: np.ndarray  # the position of its first candidate
    tapped: torch.Tensor  # [sum(per + 1), W] the target's states at the candidates


@dataclass(slots=True)
class Launched:
    """A step whose forward pass and sampling are queued on the device, tokens unread."""

    req_ids: list[int]
    rows: np.ndarray  # [S] the sampling requests' rows in the runner's RowColumns
    launch_id: int  # what those rows' pending_launch holds until finish() reads the tokens
    tokens: torch.Tensor  # [S] int64 on the device
    graphed: bool
    sampled: SampleOutput | None = None  # the logprobs of the rows that asked
    logprobs: HostLogprobs | None = None  # set by finish()
    prompt: PromptLogprobs | None = None  # prompt tokens scored this step, if any
    prompt_read: tuple[list[int], list[float]] | None = None  # set by finish()
    # CUDA: tokens copied to pinned host memory behind the sampling, and the event after it
    host_tokens: torch.Tensor | None = None
    ready: torch.cuda.Event | None = None
    drafted: Drafted | None = None  # speculative rows, verified by finish()
    lookahead: int = 0  # a draft model's proposals per sampled row, made by finish()
    eagle: EagleRows | None = None  # an EAGLE head's pass after the tokens, made by finish()
    # set by finish(): the requests given drafts, how many each, the drafts concatenated
    proposals: tuple[list[int], list[int], list[int]] | None = None


@dataclass(slots=True)
class RequestState:
    """What a request needs beyond its RowColumns scalars: only its prefill chunks, penalty
    counts and prompt logprobs read it, never a decode step."""

    # as it arrived (prompt, then what it generated before a preemption): the inputs of its
    # prefill chunks. What it samples here is not appended: once it samples, every step it is
    # in starts at its last token (RowColumns.last_token, or pending on the device).
    token_ids: list[int]
    row: int  # its row in the runner's BlockTableArray and RowColumns
    sampling: SamplingSpec
    num_prompt: int
    count_slot: int = -1  # its TokenCounts slot if it uses a penalty
    prompt_logprobs: int = -1  # k alternatives per scored prompt token; -1: not asked


def sampling_spec(s: pb.Sampling) -> SamplingSpec:
    return SamplingSpec(
        s.temperature, s.top_k, s.top_p, s.seed if s.has_seed else None, min_p=s.min_p,
        presence_penalty=s.presence_penalty, frequency_penalty=s.frequency_penalty,
        repetition_penalty=s.repetition_penalty or 1.0,
        logit_bias=tuple(zip(s.logit_bias_ids, s.logit_bias_values, strict=True)),
        min_tokens=s.min_tokens, min_tokens_masked_ids=tuple(s.min_tokens_masked_ids),
        logprobs=s.top_logprobs if s.logprobs else -1)


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        block_size: int,
        device: torch.device,
        sampler: Sampler,
        swap: SwapSpace | None = None,
        counts: TokenCounts | None = None,
        draft: DraftModel | EagleDraft | None = None,
        lora: LoraRuntime | None = None,
    ) -> None:
        self.model, self.kv_caches = model, kv_caches
        self.lora = lora  # LoRA adapters and their device slots (executor_svc/lora.py)
        self.swap = swap or SwapSpace(0, [])
        # speculative decoding's draft model (executor_svc/draft.py) or EAGLE head (eagle.py)
        self.eagle = draft if isinstance(draft, EagleDraft) else None
        self.draft = draft if self.eagle is None else None
        # what a swap copies: the target's layers, then the draft's (they share the blocks)
        self.swap_kv = kv_caches + (draft.kv_caches if draft is not None else [])
        self.block_size, self.device, self.sampler = block_size, device, sampler
        self.requests: dict[int, RequestState] = {}
        # the held req_ids sorted, and their rows; None: to be rebuilt (requests came or went)
        self._by_id: tuple[np.ndarray, np.ndarray] | None = None
        self.tables = BlockTableArray()
        self.cols = RowColumns(self.tables.array.shape[0])
        self.counts = counts or TokenCounts(model.cfg.vocab_size, device)
        self.graphs: DecodeGraphs | None = None  # set by the worker after capture (CUDA)
        self.last_step_graphed = False  # whether the last step replayed a CUDA graph
        self.scoring: set[int] = set()  # requests with prompt tokens still to score
        # sampled tokens of launches not finished yet, by launch id (rows pending on them read
        # their input there); ids are never reused, so a launch outliving a reset matches none
        self._unread: dict[int, torch.Tensor] = {}
        self._next_launch = 0
        self.device_time = DeviceClock(device)

    def reset(self) -> None:
        self.requests.clear()
        self._by_id = None
        self.scoring.clear()
        self._unread.clear()
        self.device_time.reset()
        self.tables = BlockTableArray()
        self.cols = RowColumns(self.tables.array.shape[0])
        self.counts.reset()
        if self.lora is not None:  # a new scheduler loads what its requests need
            self.lora.reset()

    def execute(self, plan: pb.StepPlan, bitmask: pb.StepBitmask | None = None
                ) -> tuple[list[int], list[int]]:
        """Run one step; return (req_ids, sampled token ids) of requests that sampled."""
        mask = Bitmask.of(bitmask) if bitmask is not None else None
        launched = self.launch(plan, lambda: mask)
        return self.finish(launched) if launched is not None else ([], [])

    def finish(self, launched: Launched) -> tuple[list[int], list[int]]:
        """Wait for a launched step's tokens; they become the last token of the rows still
        pending on it (a row in a later launch since waits for that one's)."""
        if launched.ready is not None:  # waits for this step's sampling, not what follows it
            launched.ready.synchronize()
            host = launched.host_tokens
        else:
            host = launched.tokens.cpu()
        tokens = host.tolist()
        if launched.sampled is not None:
            launched.logprobs = read_logprobs(launched.sampled)
        if launched.prompt is not None:
            launched.prompt_read = launched.prompt.read()
        cols, rows = self.cols, launched.rows
        if len(rows):
            mine = cols.pending_launch[rows] == launched.launch_id
            cols.last_token[rows[mine]] = host.numpy()[mine]
            cols.pending_launch[rows[mine]] = -1
        self._unread.pop(launched.launch_id, None)
        req_ids, sampled, accepted = launched.req_ids, tokens, []
        if launched.drafted is not None:
            keep, accepted = self._verify(launched.drafted, tokens)
            if launched.logprobs is not None:
                launched.logprobs = launched.logprobs.select(keep)
            req_ids = [r for r, k in zip(req_ids, keep, strict=True) if k]
            tokens = [t for t, k in zip(tokens, keep, strict=True) if k]
        if launched.lookahead > 0 and self.draft is not None and len(rows):
            launched.proposals = self._propose(rows, launched.lookahead)
        if launched.eagle is not None:
            launched.proposals = self._propose_eagle(launched, sampled, accepted)
        return req_ids, tokens

    def _propose(self, rows: np.ndarray, k: int) -> tuple[list[int], list[int], list[int]]:
        """The draft model's proposals (up to k each) for the rows that sampled, each after
        its last token, in the slots its blocks hold past it; none for rows whose sampling
        counts outputs (penalties, min_tokens), which speculation does not cover."""
        _, first = np.unique(rows, return_index=True)
        rows = rows[np.sort(first)]
        cols = self.cols
        rows = rows[(cols.req_id[rows] >= 0) & (cols.pending_launch[rows] == -1)
                    & ((cols.features[rows] & (PENALTY | MIN_TOKENS)) == 0)]
        starts = cols.num_computed[rows]
        ks = self._room(rows, starts, k, getattr(self.draft.model, "max_pos", 1 << 62))
        if not len(rows) or not ks.any():
            return [], [], []
        drafts = self.draft.propose(self.tables.array, rows, starts, cols.last_token[rows], ks)
        return self._given(rows, drafts)

    def _room(self, rows: np.ndarray, starts: np.ndarray, k: int, reach: int) -> np.ndarray:
        """Drafts each row may take from position starts on: at most k, within its blocks'
        slots and the positions its RoPE tables reach."""
        room = np.minimum(self.tables.lengths[rows] * self.block_size, reach) - starts
        return np.clip(np.minimum(room, k), 0, None)

    def _given(self, rows: np.ndarray, drafts: list[list[int]]
               ) -> tuple[list[int], list[int], list[int]]:
        """Launched.proposals of these rows' drafts: the requests given some, how many each,
        the drafts concatenated."""
        given = [i for i, d in enumerate(drafts) if d]
        return (self.cols.req_id[rows[given]].tolist(), [len(drafts[i]) for i in given],
                [t for i in given for t in drafts[i]])

    def _propose_eagle(self, launched: Launched, tokens: list[int], accepted: list[int]
                       ) -> tuple[list[int], list[int], list[int]]:
        """The EAGLE head's pass over each sampled row's last kept position (its KV, and the
        first draft), then its proposals (up to launched.lookahead each, for the rows a draft
        model would give them: executor_svc/eagle.py)."""
        ew, cols = launched.eagle, self.cols
        acc = np.zeros(len(ew.rows), np.int64)
        if accepted:  # a drafted row's samples start where its candidates do
            acc[np.searchsorted(ew.base, launched.drafted.first)] = accepted
        sel = np.flatnonzero(cols.req_id[ew.rows] == ew.req_ids)
        if not len(sel):
            return [], [], []
        rows, at = ew.rows[sel], ew.base[sel] + acc[sel]
        last = ew.pos0[sel] + acc[sel]
        ks = np.zeros(len(rows), np.int64)
        if launched.lookahead > 0:
            on = (cols.pending_launch[rows] == -1) & ((cols.features[rows]
                                                       & (PENALTY | MIN_TOKENS)) == 0)
            ks = np.where(on, self._room(rows, last + 1, launched.lookahead,
                                         self.eagle.max_pos), 0)
        drafts = self.eagle.propose(np.asarray(tokens, np.int64)[at],
                                    ew.tapped[to_device(at, self.device)], last,
                                    self.tables.array, rows, ks)
        return self._given(rows, drafts)

    def _eagle_launch(self, rows: np.ndarray, starts: np.ndarray, ns: np.ndarray,
                      cu_q: np.ndarray, sample: np.ndarray, spec: np.ndarray | None,
                      input_ids: np.ndarray, positions: np.ndarray, slots: np.ndarray,
                      tapped: torch.Tensor) -> EagleRows | None:
        """The EAGLE head's part of a launch: it catches up on every position whose next token
        is known now (all but each sampled row's last), and keeps the target's states at the
        sampled rows' candidates for finish(). None if nothing samples."""
        b, dev, cols = len(rows), self.device, self.cols
        flat = int(cu_q[-1])
        seg = np.repeat(np.arange(b), ns)
        ends_flat = cu_q[1:] - 1
        keep = np.ones(flat, bool)
        keep[ends_flat[sample]] = False
        next_ids = np.zeros(flat, np.int64)
        next_ids[:-1] = input_ids[1:]  # within a segment: the token after it
        for i in np.flatnonzero(~sample).tolist():  # a prefill chunk: the prompt token after it
            toks, end = self.requests[int(cols.req_id[rows[i]])].token_ids, int(cu_q[i + 1])
            e = int(starts[i] + ns[i])
            if e < len(toks):
                next_ids[end - 1] = toks[e]
            else:
                keep[end - 1] = False
        idx = np.flatnonzero(keep)
        if len(idx):
            q_lens = np.bincount(seg[idx], minlength=b)
            live = np.flatnonzero(q_lens)
            seq_lens = starts[live] + q_lens[live]
            width = int(seq_lens.max() - 1) // self.block_size + 1
            self.eagle.catch_up(next_ids[idx], tapped[to_device(idx, dev)], positions[idx],
                                slots[idx], np.ascontiguousarray(self.tables.array[rows[live],
                                                                                   :width]),
                                q_lens[live], seq_lens)
        s_idx = np.flatnonzero(sample)
        if not len(s_idx):
            return None
        per = spec[s_idx] if spec is not None else np.zeros(len(s_idx), np.int64)
        cand = _logit_rows(cu_q[1:][s_idx], per)
        return EagleRows(rows[s_idx], cols.req_id[rows[s_idx]].copy(),
                         np.cumsum(per + 1) - (per + 1), starts[s_idx] + ns[s_idx] - 1 - per,
                         tapped[to_device(cand, dev)])

    def _verify(self, drafted: Drafted, tokens: list[int]) -> tuple[list[bool], list[int]]:
        """Keep each drafted row's samples up to and including the first that differs from its
        draft (all k + 1 if none does); its computed tokens go back by the drafts rejected.
        Which of the step's sampled tokens are kept, and each drafted row's accepted drafts."""
        keep, accepted = [True] * len(tokens), []
        cols = self.cols
        for row, first, drafts in zip(drafted.rows, drafted.first, drafted.drafts, strict=True):
            k, a = len(drafts), 0
            while a < k and tokens[first + a] == drafts[a]:
                a += 1
            for i in range(first + a + 1, first + k + 1):
                keep[i] = False
            cols.last_token[row] = tokens[first + a]
            cols.known[row] += a + 1
            cols.num_computed[row] -= k - a
            cols.pending_launch[row] = -1
            accepted.append(a)
        return keep, accepted

    def launch(self, plan: pb.StepPlan,
               await_bitmask: Callable[[], Bitmask | None] = lambda: None,
               ) -> Launched | None:
        """Apply a plan and queue its forward pass and sampling on the device; None if nothing
        samples. A decode row whose input is the token of a step launched but not finished
        reads it on the device, so step N+1 can be launched before N's tokens are read.
        With plan.bitmask_follows, await_bitmask() gives the step's StepBitmask; it is called
        once the forward pass is queued, before sampling. Its work on the device is timed
        (self.device_time)."""
        launched = None
        try:
            launched = self._launch(plan, await_bitmask)
            return launched
        finally:
            self.device_time.close(launched.ready if launched is not None else None)

    def _launch(self, plan: pb.StepPlan,
                await_bitmask: Callable[[], Bitmask | None]) -> Launched | None:
        for rid in (*plan.finished_req_ids, *plan.preempted_req_ids):
            self._forget(rid)
        if plan.swap_out_src or plan.swap_in_src:
            self.swap.swap_out(self.swap_kv, list(plan.swap_out_src), list(plan.swap_out_dst))
            self.swap.swap_in(self.swap_kv, list(plan.swap_in_src), list(plan.swap_in_dst))
        if plan.lora_loads:
            if self.lora is None:
                raise ValueError("the plan loads LoRA adapters; this executor has none")
            for load in plan.lora_loads:
                self.lora.load(load.slot, load.adapter_id)
        if len(plan.new_requests) != len(plan.new_num_scheduled_tokens):
            raise ValueError("the plan's new_requests and new_num_scheduled_tokens differ in "
                             "length")
        cached = self._cached_rows(plan)  # checked before anything changes
        spec, drafts = self._drafts(plan, cached)
        arrivals = []  # (count slot, token ids, prompt tokens) of new penalized requests
        new_rows = [self._admit(new, arrivals) for new in plan.new_requests]
        self.counts.load(arrivals)
        n_new, n_cached = len(new_rows), len(cached)
        if not n_new + n_cached:
            return None
        rows = np.concatenate([np.asarray(new_rows, np.int64), cached])
        ns = np.concatenate([np.array(plan.new_num_scheduled_tokens, np.int64),
                             np.array(plan.cached_num_scheduled_tokens, np.int64)])
        if spec is not None:
            spec = np.concatenate([np.zeros(n_new, np.int64), spec])
            drafts = [[]] * n_new + drafts
        return self._run(rows, ns, plan, await_bitmask, spec, drafts)

    def _drafts(self, plan: pb.StepPlan, cached: np.ndarray
                ) -> tuple[np.ndarray | None, list[list[int]]]:
        """The cached requests' draft counts and drafts (speculative decoding); None if the
        plan has none. Raises if they do not add up, or a drafted row is one this step cannot
        verify (its last step's drafts unread, or sampling stages that count outputs)."""
        if not plan.cached_num_spec_tokens:
            return None, []
        spec = np.array(plan.cached_num_spec_tokens, np.int64)
        ids = list(plan.cached_spec_token_ids)
        if len(spec) != len(cached) or spec.min() < 0 or int(spec.sum()) != len(ids):
            raise ValueError("the plan's cached_num_spec_tokens and cached_spec_token_ids do "
                             "not add up")
        cols = self.cols
        on = spec > 0
        bad = on & ((cols.pending_launch[cached] != -1)
                    | ((cols.features[cached] & (PENALTY | MIN_TOKENS)) != 0))
        if bad.any():
            rid = cols.req_id[cached[int(np.argmax(bad))]]
            raise ValueError(f"request {rid}: drafted while its last token is unread, or with "
                             f"penalties or min_tokens, which speculation does not cover")
        if not on.any():
            return None, []
        ends = np.cumsum(spec)
        return spec, [ids[e - n:e] for n, e in zip(spec.tolist(), ends.tolist(), strict=True)]

    def _cached_rows(self, plan: pb.StepPlan) -> np.ndarray:
        """The rows of the plan's cached requests, their new blocks appended; raises if one is
        not held or its computed tokens differ (nothing changed then)."""
        ids = np.array(plan.cached_req_ids, np.int64)
        if not (len(ids) == len(plan.cached_num_computed_tokens)
                == len(plan.cached_num_scheduled_tokens) == len(plan.cached_num_new_blocks)):
            raise ValueError("the plan's cached_* fields differ in length")
        rows = self._rows_of(ids)
        if len(rows) and rows.min() < 0:
            raise ValueError(f"request {ids[int(np.argmin(rows))]}: planned as cached, but this "
                             f"executor does not hold it")
        if len(rows) and (self.cols.pending_launch[rows] == SPEC_UNREAD).any():
            i = int(np.argmax(self.cols.pending_launch[rows] == SPEC_UNREAD))
            raise ValueError(f"request {ids[i]}: planned before its drafts were verified")
        starts = np.array(plan.cached_num_computed_tokens, np.int64)
        if (drift := np.flatnonzero(self.cols.num_computed[rows] != starts)).size:
            i = int(drift[0])
            raise ValueError(f"request {ids[i]}: the scheduler has {starts[i]} computed tokens, "
                             f"this executor {self.cols.num_computed[rows[i]]}: the mirrors "
                             f"drifted")
        if plan.cached_new_block_ids:
            self.tables.extend(rows, np.array(plan.cached_num_new_blocks, np.int64),
                               np.array(plan.cached_new_block_ids, np.int32))
        return rows

    def _rows_of(self, ids: np.ndarray) -> np.ndarray:
        """The rows of these request ids (-1: not held), by a binary search of the held ids,
        sorted again only after requests came or went."""
        if self._by_id is None:
            held = np.flatnonzero(self.cols.req_id >= 0)
            order = np.argsort(self.cols.req_id[held])
            self._by_id = (self.cols.req_id[held][order], held[order])
        sorted_ids, sorted_rows = self._by_id
        if not len(sorted_ids):
            return np.full(len(ids), -1, np.int64)
        at = np.minimum(np.searchsorted(sorted_ids, ids), len(sorted_ids) - 1)
        return np.where(sorted_ids[at] == ids, sorted_rows[at], -1)

    def _admit(self, new: pb.NewRequest, arrivals: list) -> int:
        """Take a new request's state and row; its row."""
        if new.lora_slot:
            if self.lora is None:
                raise ValueError(f"request {new.req_id} names LoRA slot {new.lora_slot}; this "
                                 "executor has no LoRA adapters")
            self.lora.check_slot(new.lora_slot, new.lora_adapter)
        self._forget(new.req_id)  # none unless the mirror drifted
        token_ids = list(new.token_ids)
        row = self.tables.add(list(new.block_ids))
        st = RequestState(token_ids, row, sampling_spec(new.sampling),
                          new.num_prompt_tokens or len(token_ids))
        if new.sampling.HasField("prompt_logprobs"):
            st.prompt_logprobs = new.sampling.prompt_logprobs
            self.scoring.add(new.req_id)
        if st.sampling.penalized:
            st.count_slot = self.counts.acquire()
            arrivals.append((st.count_slot, token_ids, st.num_prompt))
        self.requests[new.req_id], self._by_id = st, None
        cols = self.cols
        cols.ensure(self.tables.array.shape[0])
        cols.req_id[row], cols.num_computed[row], cols.known[row] = (
            new.req_id, new.num_computed_tokens, len(token_ids))
        cols.num_prompt[row], cols.count_slot[row] = st.num_prompt, st.count_slot
        cols.last_token[row] = token_ids[-1] if token_ids else 0
        cols.pending_launch[row] = -1
        cols.features[row], cols.spec[row] = st.sampling.features, st.sampling
        cols.lora_slot[row] = new.lora_slot
        return row

    def _run(self, rows: np.ndarray, ns: np.ndarray, plan: pb.StepPlan,
             await_bitmask: Callable[[], Bitmask | None],
             spec: np.ndarray | None = None, drafts: list[list[int]] | None = None,
             ) -> Launched | None:
        """spec: drafts per row (speculative decoding), drafts: theirs; None: no row has any."""
        bs, dev, cols = self.block_size, self.device, self.cols
        b = len(rows)
        starts = cols.num_computed[rows]
        ends = starts + ns
        known = cols.known[rows] if spec is None else cols.known[rows] + spec
        num_blocks = self.tables.lengths[rows]
        bad = (ends > known) | (ends > num_blocks * bs)
        if spec is not None:  # a drafted row runs its last token and its drafts, no less
            bad |= (spec > 0) & (ends != known)
        if bad.any():
            rid = cols.req_id[rows[int(np.argmax(bad))]]
            raise ValueError(f"request {rid}: plan runs past its tokens or blocks")
        cu_q = np.zeros(b + 1, np.int64)
        np.cumsum(ns, out=cu_q[1:])
        if cu_q[-1] == b:  # decode only: one token each
            positions, token_rows = starts, rows
        else:
            seq_of_token = np.repeat(np.arange(b), ns)
            positions = starts[seq_of_token] + np.arange(cu_q[-1]) - cu_q[:-1][seq_of_token]
            token_rows = rows[seq_of_token]
        input_ids, patch = self._inputs(rows, starts, ends, known if spec is None else known -
                                        spec, cu_q)
        if spec is not None:
            for i in np.flatnonzero(spec).tolist():
                input_ids[cu_q[i] + 1:cu_q[i + 1]] = drafts[i]
        table = self.tables.array
        slots = table[token_rows, positions // bs].astype(np.int64) * bs + positions % bs
        sample = ends == known  # prompt (or chunk) complete: its last row's logits are needed
        max_blocks = int(num_blocks.max())
        graphs = self.graphs
        # decode graphs run one query token per row: a drafted row's 1 + k tokens become 1 + k
        # rows with its block table, each attending up to its own position (the step writes
        # every row's K/V before attention reads it), so a verification step replays them too
        one = ns == 1 if spec is None else ns - spec == 1
        self.last_step_graphed = (graphs is not None and bool(one.all())
                                  and graphs.fits(int(cu_q[-1]), max_blocks))
        scored = self._prompt_rows(rows, starts, ends, cu_q)
        prompt = None
        self.device_time.begin(plan.after_idle)  # the device's part starts here
        if self.last_step_graphed:
            flat_tables, flat_lens = table[token_rows, :max_blocks], positions + 1
            logits = graphs.run(input_ids, positions, slots, flat_tables, flat_lens, patch,
                                None if self.lora is None else cols.lora_slot[token_rows])
            if self.draft is not None:
                self.draft.mirror_graphed(input_ids, positions, slots, flat_tables, flat_lens,
                                          patch)
            tapped = graphs.tapped[:len(input_ids)] if self.eagle is not None else None
            if scored is not None:  # one token a row: flat rows are the logits' rows
                full = logits
                prompt = score(scored, lambda idx: full[idx], dev)
            if not sample.all():  # a one-token prefill chunk shares the step: no logits wanted
                logits = logits[to_device(cu_q[1:][sample] - 1 if spec is None else
                                          _logit_rows(cu_q[1:][sample], spec[sample]), dev)]
        else:
            meta = AttentionMetadata(
                slot_mapping=to_device(slots, dev),
                block_tables=to_device(table[rows, :max_blocks], dev),
                seq_lens=to_device(ends.astype(np.int32), dev),
                cu_seqlens_q=to_device(cu_q.astype(np.int32), dev),
                max_query_len=int(ns.max()),
                max_seq_len=int(ends.max()),
                query_lens_host=ns,
                seq_lens_host=ends,
            )
            ids = to_device(input_ids, dev)
            if patch is not None:
                ids[patch[0]] = patch[1]
            pos = to_device(positions, dev)
            last_rows = to_device(cu_q[1:][sample] - 1 if spec is None else
                                  _logit_rows(cu_q[1:][sample], spec[sample]), dev)
            if self.lora is not None:
                self.lora.step.begin(cu_q, cols.lora_slot[rows])
            try:
                if scored is None:
                    logits = self.model(ids, pos, self.kv_caches, meta, last_rows)
                else:
                    hidden = self.model.hidden(ids, pos, self.kv_caches, meta)
                    logits = self.model.logits_of(hidden, last_rows)
                    prompt = score(scored, lambda idx: self.model.logits_of(hidden, idx), dev)
            finally:
                if self.lora is not None:
                    self.lora.step.end()
            if self.draft is not None:
                self.draft.mirror(ids, pos, meta)
            tapped = self.model.tapped if self.eagle is not None else None
        eagle = None
        if self.eagle is not None:
            self.model.tapped = None
            eagle = self._eagle_launch(rows, starts, ns, cu_q, sample, spec, input_ids,
                                       positions, slots, tapped)
        cols.num_computed[rows] += ns  # (a request is in a batch once: rows are distinct)
        srows = rows[sample]
        if not len(srows):
            if prompt is None:
                return None
            return Launched([], srows, -1, torch.empty(0, dtype=torch.int64, device=dev),
                            self.last_step_graphed, prompt=prompt)
        drafted = None
        if spec is None:
            sampling = self._sampling_batch(srows, ends[sample])
        else:  # a drafted row samples at each of its k + 1 positions, k + 1 rows in a row
            per = spec[sample]
            positions = _logit_rows(ends[sample] + 1, per)  # where each sample goes
            srows = np.repeat(srows, per + 1)
            sampling = self._sampling_batch(srows, positions)
            on = np.flatnonzero(per)
            firsts = np.cumsum(per + 1) - (per + 1)
            drafted = Drafted(srows[firsts[on]].tolist(), firsts[on].tolist(),
                              [drafts[i] for i in np.flatnonzero(sample)[on].tolist()])
        req_ids = cols.req_id[srows].tolist()
        if plan.bitmask_follows:  # the device waits for the scheduler meanwhile: a gap
            self.device_time.close()
            bitmask = await_bitmask()
            self.device_time.begin()
            if bitmask is None:
                raise ValueError(f"step {plan.step_id}: its token bitmask did not come")
            self._add_bitmask(sampling, req_ids, bitmask, logits.shape[-1])
        sampled = self.sampler.sample(logits, sampling)
        launched = Launched(req_ids, srows, self._next_launch, sampled.tokens,
                            self.last_step_graphed,
                            sampled if sampled.logprobs is not None else None, prompt=prompt,
                            lookahead=plan.num_lookahead_tokens
                            if self.draft or self.eagle else 0, eagle=eagle)
        self._next_launch += 1
        if sampled.tokens.is_cuda:  # finish() reads them without waiting for later launches
            launched.host_tokens = torch.empty(sampled.tokens.shape, dtype=torch.int64,
                                               pin_memory=True)
            launched.host_tokens.copy_(sampled.tokens, non_blocking=True)
            launched.ready = torch.cuda.Event(enable_timing=self.device_time.on)
            launched.ready.record()
        if drafted is None:
            cols.known[srows] += 1
            cols.pending_launch[srows] = launched.launch_id
            cols.pending_index[srows] = np.arange(len(srows))
        else:  # the drafted rows' known tokens move in finish(), once verified
            plain = np.ones(len(srows), bool)
            plain[_logit_rows(np.asarray(drafted.first) + per[on] + 1, per[on])] = False
            cols.known[srows[plain]] += 1
            cols.pending_launch[srows[plain]] = launched.launch_id
            cols.pending_index[srows[plain]] = np.flatnonzero(plain)
            cols.pending_launch[drafted.rows] = SPEC_UNREAD
            launched.drafted = drafted
        self._unread[launched.launch_id] = sampled.tokens
        return launched

    def _inputs(self, rows: np.ndarray, starts: np.ndarray, ends: np.ndarray, known: np.ndarray,
                cu_q: np.ndarray) -> tuple[np.ndarray, tuple[torch.Tensor, torch.Tensor] | None]:
        """The step's input ids [T] and the patch (flat rows, ids on the device) for the rows
        whose input is still on the device (a launch's sample not read back yet).

        A row starting at its last token (every decode row; once a request has sampled, all
        its steps are such) takes RowColumns.last_token, or the patch if it is pending; only
        prefill chunks read their request's token_ids."""
        cols = self.cols
        last = cu_q[:-1]  # each row's first flat index: a row at its last token starts there
        tail = starts == known - 1  # then it schedules one token (ends <= known), or drafts
        if tail.all() and cu_q[-1] == len(rows):
            input_ids = cols.last_token[rows]
        else:
            input_ids = np.zeros(cu_q[-1], np.int64)
            input_ids[last[tail]] = cols.last_token[rows[tail]]
            for i in np.flatnonzero(~tail).tolist():  # prefill chunks: a few rows a step
                s, e = int(starts[i]), int(ends[i])
                input_ids[cu_q[i]:cu_q[i + 1]] = self.requests[int(cols.req_id[rows[i]])
                                                                ].token_ids[s:e]
        launch = cols.pending_launch[rows]
        pending = np.flatnonzero(launch >= 0)
        if not pending.size:
            return input_ids, None
        # flat row, row in its launch's tokens, launch id: one copy to the device
        where = to_device(np.stack([last[pending], cols.pending_index[rows[pending]],
                                    launch[pending]]), self.device)
        sources = launch[pending]
        if (sources == sources[0]).all():  # one launch (the step before) in practice
            return input_ids, (where[0], self._unread[int(sources[0])][where[1]])
        flat, ids = [], []
        for src in np.unique(sources).tolist():
            of = where[2] == src
            flat.append(where[0][of])
            ids.append(self._unread[src][where[1][of]])
        return input_ids, (torch.cat(flat), torch.cat(ids))

    def _prompt_rows(self, rows: np.ndarray, starts: np.ndarray, ends: np.ndarray,
                     cu_q: np.ndarray) -> PromptRows | None:
        """The prompt tokens this step scores for the requests that asked, or None (at once,
        without a look at each row, while no request still has prompt tokens to score)."""
        if not self.scoring:
            return None
        prompt = PromptRows()
        req_ids = self.cols.req_id[rows]
        for i in np.flatnonzero(np.isin(req_ids, list(self.scoring))).tolist():
            rid = int(req_ids[i])
            st = self.requests[rid]
            prompt.add(rid, st.token_ids, st.num_prompt, st.prompt_logprobs, int(starts[i]),
                       int(ends[i]), int(cu_q[i]))
            if ends[i] >= st.num_prompt - 1:
                self.scoring.discard(rid)
        return prompt if prompt.req_ids else None

    def _forget(self, rid: int) -> None:
        """Drop a request's state, its row and its token-count slot, if held."""
        self.scoring.discard(rid)
        if (st := self.requests.pop(rid, None)) is not None:
            self._by_id = None
            self.tables.remove(st.row)
            self.cols.clear(st.row)
            if st.count_slot >= 0:
                self.counts.release(st.count_slot)

    def _add_bitmask(self, sampling: SamplingBatch, req_ids: list[int], bitmask: Bitmask,
                     vocab: int) -> None:
        """The step's token bitmask rows, on the device in sampling-row order: rows of at
        most the vocabulary's words, the ids past a narrower row's never allowed."""
        most, ids, bits = (vocab + 31) // 32, bitmask.req_ids, bitmask.bits
        words = len(bits) // (4 * len(ids)) if ids else 0
        if len(bits) != 4 * words * len(ids) or (ids and not 1 <= words <= most):
            raise ValueError(f"token_bitmask: {len(bits)} bytes for {len(ids)} "
                             f"rows of 1 to {most} words")
        if not ids:  # every constrained request ended meanwhile
            return
        row_of = {rid: row for row, rid in enumerate(req_ids)}
        rows = [row_of.get(rid, -1) for rid in ids]
        if min(rows) < 0 or len(set(ids)) != len(ids):
            raise ValueError("bitmask_req_ids: a request that does not sample in this step, or "
                             "twice")
        order = sorted(range(len(ids)), key=rows.__getitem__)  # ascending sampling rows
        # the gather copies the (read-only) rows once, into sampling-row order
        mask = torch.from_numpy(np.frombuffer(bits, np.int32).reshape(len(ids), words)[order])
        sampling.bitmask = to_device(mask, self.device)
        sampling.bitmask_rows = [rows[i] for i in order]

    def _sampling_batch(self, rows: np.ndarray, positions: np.ndarray) -> SamplingBatch:
        """The sampling rows of these RowColumns rows; positions: where each token goes. A
        batch whose rows need no stage beyond argmax is a couple of column reads."""
        cols = self.cols
        features = int(np.bitwise_or.reduce(cols.features[rows]))
        batch = SamplingBatch(cols.spec[rows].tolist(), positions.tolist(), features=features)
        if features & MIN_TOKENS:
            batch.num_output = (cols.known[rows] - cols.num_prompt[rows]).tolist()
        if features & PENALTY:
            batch.count_slots = cols.count_slot[rows].tolist()
            batch.counts = self.counts
        return batch


def _logit_rows(ends: np.ndarray, per: np.ndarray) -> np.ndarray:
    """For each row, the per + 1 indices ending at its end - 1: ends - per - 1 .. ends - 1, in
    row order (a drafted row's k + 1 flat rows, or its k + 1 sampled positions' ends)."""
    counts = per + 1
    total = int(counts.sum())
    starts = np.repeat(ends - counts, counts)
    offsets = np.arange(total) - np.repeat(np.cumsum(counts) - counts, counts)
    return starts + offsets
