"""Mirrors request state from step plans, builds the flat batch, runs the model and samples."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch

from pagedserve.core.wire import PENDING_TOKEN
from pagedserve.executor.block_table import BlockTableArray
from pagedserve.executor.cuda_graphs import DecodeGraphs
from pagedserve.executor.model import AttentionMetadata, LlamaForCausalLM
from pagedserve.executor.penalties import TokenCounts
from pagedserve.executor.prompt_logprobs import PromptLogprobs, PromptRows, score
from pagedserve.executor.sampler import (
    HostLogprobs,
    SampleOutput,
    Sampler,
    SamplingBatch,
    SamplingSpec,
    read_logprobs,
)
from pagedserve.executor.swap import SwapSpace
from pagedserve.protos.internal.v1 import executor_pb2 as pb


@dataclass(slots=True)
class Launched:
    """A step whose forward pass and sampling are queued on the device, tokens unread."""

    req_ids: list[int]
    states: list[RequestState]
    indices: list[int]  # where each state's token goes in its token_ids
    tokens: torch.Tensor  # [S] int64 on the device
    graphed: bool
    sampled: SampleOutput | None = None  # the logprobs of the rows that asked
    logprobs: HostLogprobs | None = None  # set by finish()
    prompt: PromptLogprobs | None = None  # prompt tokens scored this step, if any
    prompt_read: tuple[list[int], list[float]] | None = None  # set by finish()
    # CUDA: tokens copied to pinned host memory behind the sampling, and the event after it
    host_tokens: torch.Tensor | None = None
    ready: torch.cuda.Event | None = None


@dataclass(slots=True)
class RequestState:
    # prompt + generated (the executor appends what it samples; PENDING_TOKEN until read back)
    token_ids: list[int]
    row: int  # its row in the runner's BlockTableArray (the block table, mirrored from plans)
    num_computed: int  # tokens whose KV is in the cache
    sampling: SamplingSpec
    num_prompt: int = 0  # of token_ids, the prompt's (penalties and min_tokens count the rest)
    count_slot: int = -1  # its TokenCounts slot if it uses a penalty
    prompt_logprobs: int = -1  # k alternatives per scored prompt token; -1: not asked
    # the launched step whose token is this request's last (pending) entry, and its row there
    pending: tuple[Launched, int] | None = None


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
        model: LlamaForCausalLM,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        block_size: int,
        device: torch.device,
        sampler: Sampler,
        swap: SwapSpace | None = None,
        counts: TokenCounts | None = None,
    ) -> None:
        self.model, self.kv_caches = model, kv_caches
        self.swap = swap or SwapSpace(0, [])
        self.block_size, self.device, self.sampler = block_size, device, sampler
        self.requests: dict[int, RequestState] = {}
        self.tables = BlockTableArray()
        self.counts = counts or TokenCounts(model.cfg.vocab_size, device)
        self.graphs: DecodeGraphs | None = None  # set by the worker after capture (CUDA)
        self.last_step_graphed = False  # whether the last step replayed a CUDA graph
        self.scoring: set[int] = set()  # requests with prompt tokens still to score

    def reset(self) -> None:
        self.requests.clear()
        self.scoring.clear()
        self.tables = BlockTableArray()
        self.counts.reset()

    def execute(self, plan: pb.StepPlan, bitmask: pb.StepBitmask | None = None
                ) -> tuple[list[int], list[int]]:
        """Run one step; return (req_ids, sampled token ids) of requests that sampled."""
        launched = self.launch(plan, lambda: bitmask)
        return self.finish(launched) if launched is not None else ([], [])

    def finish(self, launched: Launched) -> tuple[list[int], list[int]]:
        """Wait for a launched step's tokens and put them in place of its pending entries."""
        if launched.ready is not None:  # waits for this step's sampling, not what follows it
            launched.ready.synchronize()
            tokens = launched.host_tokens.tolist()
        else:
            tokens = launched.tokens.tolist()
        if launched.sampled is not None:
            launched.logprobs = read_logprobs(launched.sampled)
        if launched.prompt is not None:
            launched.prompt_read = launched.prompt.read()
        for st, i, tok in zip(launched.states, launched.indices, tokens, strict=True):
            st.token_ids[i] = tok
            if st.pending is not None and st.pending[0] is launched:
                st.pending = None  # else a later launch's token is the pending one now
        return launched.req_ids, tokens

    def launch(self, plan: pb.StepPlan,
               await_bitmask: Callable[[], pb.StepBitmask | None] = lambda: None,
               ) -> Launched | None:
        """Apply a plan and queue its forward pass and sampling on the device; None if nothing
        samples. A decode row whose input is the token of a step launched but not finished
        reads it on the device, so step N+1 can be launched before N's tokens are read.
        With plan.bitmask_follows, await_bitmask() gives the step's StepBitmask; it is called
        once the forward pass is queued, before sampling."""
        for rid in (*plan.finished_req_ids, *plan.preempted_req_ids):
            self._forget(rid)
        if plan.swap_out_src or plan.swap_in_src:
            self.swap.swap_out(self.kv_caches, list(plan.swap_out_src), list(plan.swap_out_dst))
            self.swap.swap_in(self.kv_caches, list(plan.swap_in_src), list(plan.swap_in_dst))
        batch: list[tuple[int, int]] = []  # (req_id, num tokens scheduled)
        arrivals = []  # (count slot, token ids, prompt tokens) of new penalized requests
        for new, n in zip(plan.new_requests, plan.new_num_scheduled_tokens, strict=True):
            self._forget(new.req_id)  # none unless the mirror drifted
            st = RequestState(list(new.token_ids), self.tables.add(list(new.block_ids)),
                              new.num_computed_tokens, sampling_spec(new.sampling),
                              new.num_prompt_tokens or len(new.token_ids))
            if new.sampling.HasField("prompt_logprobs"):
                st.prompt_logprobs = new.sampling.prompt_logprobs
                self.scoring.add(new.req_id)
            if st.sampling.penalized:
                st.count_slot = self.counts.acquire()
                arrivals.append((st.count_slot, st.token_ids, st.num_prompt))
            self.requests[new.req_id] = st
            batch.append((new.req_id, n))
        self.counts.load(arrivals)
        offset = 0
        for rid, start, n, nb in zip(plan.cached_req_ids, plan.cached_num_computed_tokens,
                                     plan.cached_num_scheduled_tokens, plan.cached_num_new_blocks,
                                     strict=True):
            st = self.requests.get(rid)
            if st is None:
                raise ValueError(f"request {rid}: planned as cached, but this executor does not "
                                 f"hold it")
            if st.num_computed != start:
                raise ValueError(f"request {rid}: the scheduler has {start} computed tokens, this "
                                 f"executor {st.num_computed}: the mirrors drifted")
            if nb:
                self.tables.append(st.row, plan.cached_new_block_ids[offset:offset + nb])
            offset += nb
            batch.append((rid, n))
        if not batch:
            return None
        return self._run(batch, plan, await_bitmask)

    def _run(self, batch: list[tuple[int, int]], plan: pb.StepPlan,
             await_bitmask: Callable[[], pb.StepBitmask | None]) -> Launched | None:
        bs, dev = self.block_size, self.device
        states = [self.requests[rid] for rid, _ in batch]
        b = len(batch)
        ns = np.fromiter((n for _, n in batch), np.int64, b)
        starts = np.fromiter((st.num_computed for st in states), np.int64, b)
        ends = starts + ns
        known = np.fromiter((len(st.token_ids) for st in states), np.int64, b)
        rows = np.fromiter((st.row for st in states), np.int64, b)
        num_blocks = self.tables.lengths[rows]
        bad = (ends > known) | (ends > num_blocks * bs)
        if bad.any():
            rid = batch[int(np.argmax(bad))][0]
            raise ValueError(f"request {rid}: plan runs past its tokens or blocks")
        cu_q = np.zeros(b + 1, np.int64)
        np.cumsum(ns, out=cu_q[1:])
        if cu_q[-1] == b:  # decode only: one token each
            positions, token_rows = starts, rows
            input_ids = [st.token_ids[st.num_computed] for st in states]
        else:
            seq_of_token = np.repeat(np.arange(b), ns)
            positions = starts[seq_of_token] + np.arange(cu_q[-1]) - cu_q[:-1][seq_of_token]
            token_rows = rows[seq_of_token]
            input_ids = list(chain.from_iterable(
                st.token_ids[s:e] for st, s, e in zip(states, starts.tolist(), ends.tolist(),
                                                      strict=True)))
        # rows whose token is still on the device (the previous launch's sample): (row, source)
        # (a request with a PENDING token computed everything before it: it is the last input)
        fixes = [(i, st.pending) for i, st in zip((cu_q[1:] - 1).tolist(), states, strict=True)
                 if st.pending is not None]
        patch = None
        if fixes:
            by_launch: dict[int, tuple[Launched, list[int], list[int]]] = {}
            for i, (src, row) in fixes:  # one launch in practice (the step before this one)
                by_launch.setdefault(id(src), (src, [], []))
                by_launch[id(src)][1].append(i)
                by_launch[id(src)][2].append(row)
            patch = (torch.tensor([i for _, pos, _ in by_launch.values() for i in pos], device=dev),
                     torch.cat([src.tokens[torch.tensor(rows, device=dev)]
                                for src, _, rows in by_launch.values()]))
            input_ids = [0 if t == PENDING_TOKEN else t for t in input_ids]
        table = self.tables.array
        slots = table[token_rows, positions // bs].astype(np.int64) * bs + positions % bs
        sample = ends == known  # prompt (or chunk) complete: its last row's logits are needed
        max_blocks = int(num_blocks.max())
        graphs = self.graphs
        self.last_step_graphed = (graphs is not None and cu_q[-1] == b
                                  and graphs.fits(b, max_blocks))
        scored = self._prompt_rows(batch, states, starts, ends, cu_q)
        prompt = None
        if self.last_step_graphed:
            logits = graphs.run(np.asarray(input_ids, np.int64), positions, slots,
                                table[rows, :max_blocks], ends, patch)
            if scored is not None:  # one token a row: flat rows are batch rows
                full = logits
                prompt = score(scored, lambda idx: full[idx], dev)
            if not sample.all():  # a one-token prefill chunk shares the step: no logits wanted
                logits = logits[torch.from_numpy(np.flatnonzero(sample)).to(dev)]
        else:
            meta = AttentionMetadata(
                slot_mapping=torch.from_numpy(slots).to(dev),
                block_tables=torch.from_numpy(table[rows, :max_blocks]).to(dev),
                seq_lens=torch.from_numpy(ends.astype(np.int32)).to(dev),
                cu_seqlens_q=torch.from_numpy(cu_q.astype(np.int32)).to(dev),
                max_query_len=int(ns.max()),
                max_seq_len=int(ends.max()),
            )
            ids = torch.tensor(input_ids, dtype=torch.int64, device=dev)
            if patch is not None:
                ids[patch[0]] = patch[1]
            pos = torch.from_numpy(positions).to(dev)
            last_rows = torch.from_numpy(cu_q[1:][sample] - 1).to(dev)
            if scored is None:
                logits = self.model(ids, pos, self.kv_caches, meta, last_rows)
            else:
                hidden = self.model.hidden(ids, pos, self.kv_caches, meta)
                logits = self.model.logits_of(hidden, last_rows)
                prompt = score(scored, lambda idx: self.model.logits_of(hidden, idx), dev)
        for st, n in zip(states, ns.tolist(), strict=True):
            st.num_computed += n
        samplers = [(rid, st) for (rid, _), st, s in zip(batch, states, sample.tolist(),
                                                        strict=True) if s]
        if not samplers:
            if prompt is None:
                return None
            return Launched([], [], [], torch.empty(0, dtype=torch.int64, device=dev),
                            self.last_step_graphed, prompt=prompt)
        sampling = self._sampling_batch([st for _, st in samplers])
        if plan.bitmask_follows:
            bitmask = await_bitmask()
            if bitmask is None:
                raise ValueError(f"step {plan.step_id}: its token bitmask did not come")
            self._add_bitmask(sampling, [rid for rid, _ in samplers], bitmask, logits.shape[-1])
        sampled = self.sampler.sample(logits, sampling)
        launched = Launched([rid for rid, _ in samplers], [st for _, st in samplers],
                            [len(st.token_ids) for _, st in samplers], sampled.tokens,
                            self.last_step_graphed,
                            sampled if sampled.logprobs is not None else None, prompt=prompt)
        if sampled.tokens.is_cuda:  # finish() reads them without waiting for later launches
            launched.host_tokens = torch.empty(sampled.tokens.shape, dtype=torch.int64,
                                               pin_memory=True)
            launched.host_tokens.copy_(sampled.tokens, non_blocking=True)
            launched.ready = torch.cuda.Event()
            launched.ready.record()
        for row, (_, st) in enumerate(samplers):
            st.token_ids.append(PENDING_TOKEN)
            st.pending = (launched, row)
        return launched

    def _prompt_rows(self, batch: list[tuple[int, int]], states: list[RequestState],
                     starts: np.ndarray, ends: np.ndarray, cu_q: np.ndarray
                     ) -> PromptRows | None:
        """The prompt tokens this step scores for the requests that asked, or None (at once,
        without a look at each row, while no request still has prompt tokens to score)."""
        if not self.scoring:
            return None
        rows = PromptRows()
        for i, ((rid, _), st) in enumerate(zip(batch, states, strict=True)):
            if rid in self.scoring:
                rows.add(rid, st.token_ids, st.num_prompt, st.prompt_logprobs, int(starts[i]),
                         int(ends[i]), int(cu_q[i]))
                if ends[i] >= st.num_prompt - 1:
                    self.scoring.discard(rid)
        return rows if rows.req_ids else None

    def _forget(self, rid: int) -> None:
        """Drop a request's state, its block-table row and its token-count slot, if held."""
        self.scoring.discard(rid)
        if (st := self.requests.pop(rid, None)) is not None:
            self.tables.remove(st.row)
            if st.count_slot >= 0:
                self.counts.release(st.count_slot)

    def _add_bitmask(self, sampling: SamplingBatch, req_ids: list[int], bitmask: pb.StepBitmask,
                     vocab: int) -> None:
        """The step's token bitmask rows, on the device in sampling-row order."""
        words, ids = (vocab + 31) // 32, list(bitmask.req_ids)
        if len(bitmask.token_bitmask) != 4 * words * len(ids):
            raise ValueError(f"token_bitmask: {len(bitmask.token_bitmask)} bytes for {len(ids)} "
                             f"rows of {words} words")
        if not ids:  # every constrained request ended meanwhile
            return
        row_of = {rid: row for row, rid in enumerate(req_ids)}
        rows = [row_of.get(rid, -1) for rid in ids]
        if min(rows) < 0 or len(set(ids)) != len(ids):
            raise ValueError("bitmask_req_ids: a request that does not sample in this step, or "
                             "twice")
        order = sorted(range(len(ids)), key=rows.__getitem__)  # ascending sampling rows
        host = torch.frombuffer(bytearray(bitmask.token_bitmask), dtype=torch.int32)
        mask = host.view(len(ids), words)[order]
        sampling.bitmask = mask.to(self.device, non_blocking=False)
        sampling.bitmask_rows = [rows[i] for i in order]

    def _sampling_batch(self, states: list[RequestState]) -> SamplingBatch:
        batch = SamplingBatch([st.sampling for st in states], [len(st.token_ids) for st in states])
        if any(st.sampling.min_tokens for st in states):
            batch.num_output = [len(st.token_ids) - st.num_prompt for st in states]
        if any(st.count_slot >= 0 for st in states):
            batch.count_slots = [st.count_slot for st in states]
            batch.counts = self.counts
        return batch
