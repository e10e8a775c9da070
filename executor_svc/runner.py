"""Mirrors request state from step plans, builds the flat batch, runs the model and samples."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from executor_svc.model import AttentionMetadata, LlamaForCausalLM
from executor_svc.sampler import Sampler, SamplingSpec
from executor_svc.swap import SwapSpace
from protos.pagedserve.internal.v1 import executor_pb2 as pb


@dataclass(slots=True)
class RequestState:
    token_ids: list[int]  # prompt + generated (the executor appends what it samples)
    block_ids: list[int]  # block table, mirrored from the plans
    num_computed: int  # tokens whose KV is in the cache
    sampling: SamplingSpec


def sampling_spec(s: pb.Sampling) -> SamplingSpec:
    return SamplingSpec(s.temperature, s.top_k, s.top_p, s.seed if s.has_seed else None)


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        block_size: int,
        device: torch.device,
        sampler: Sampler,
        swap: SwapSpace | None = None,
    ) -> None:
        self.model, self.kv_caches = model, kv_caches
        self.swap = swap or SwapSpace(0, [])
        self.block_size, self.device, self.sampler = block_size, device, sampler
        self.requests: dict[int, RequestState] = {}

    def reset(self) -> None:
        self.requests.clear()

    def execute(self, plan: pb.StepPlan) -> tuple[list[int], list[int]]:
        """Run one step; return (req_ids, sampled token ids) of requests that sampled."""
        for rid in (*plan.finished_req_ids, *plan.preempted_req_ids):
            self.requests.pop(rid, None)
        if plan.swap_out_src or plan.swap_in_src:
            self.swap.swap_out(self.kv_caches, list(plan.swap_out_src), list(plan.swap_out_dst))
            self.swap.swap_in(self.kv_caches, list(plan.swap_in_src), list(plan.swap_in_dst))
        batch: list[tuple[int, int]] = []  # (req_id, num tokens scheduled)
        for new, n in zip(plan.new_requests, plan.new_num_scheduled_tokens, strict=True):
            self.requests[new.req_id] = RequestState(
                list(new.token_ids), list(new.block_ids), new.num_computed_tokens,
                sampling_spec(new.sampling),
            )
            batch.append((new.req_id, n))
        offset = 0
        for rid, n, nb in zip(plan.cached_req_ids, plan.cached_num_scheduled_tokens,
                              plan.cached_num_new_blocks, strict=True):
            self.requests[rid].block_ids.extend(plan.cached_new_block_ids[offset:offset + nb])
            offset += nb
            batch.append((rid, n))
        if not batch:
            return [], []
        return self._run(batch)

    def _run(self, batch: list[tuple[int, int]]) -> tuple[list[int], list[int]]:
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        seq_lens: list[int] = []
        cu_q = [0]
        logits_rows: list[int] = []
        samplers: list[tuple[int, RequestState]] = []
        for rid, n in batch:
            st = self.requests[rid]
            start, end = st.num_computed, st.num_computed + n
            if end > len(st.token_ids) or end > len(st.block_ids) * bs:
                raise ValueError(f"request {rid}: plan runs past its tokens or blocks")
            input_ids.extend(st.token_ids[start:end])
            positions.extend(range(start, end))
            table = st.block_ids
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            seq_lens.append(end)
            cu_q.append(cu_q[-1] + n)
            if end == len(st.token_ids):
                logits_rows.append(cu_q[-1] - 1)
                samplers.append((rid, st))
        max_blocks = max(len(self.requests[rid].block_ids) for rid, _ in batch)
        tables = [table + [0] * (max_blocks - len(table))
                  for table in (self.requests[rid].block_ids for rid, _ in batch)]
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            block_tables=torch.tensor(tables, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            cu_seqlens_q=torch.tensor(cu_q, dtype=torch.int32, device=dev),
            max_query_len=max(n for _, n in batch),
            max_seq_len=max(seq_lens),
        )
        logits = self.model(
            torch.tensor(input_ids, dtype=torch.int64, device=dev),
            torch.tensor(positions, dtype=torch.int64, device=dev),
            self.kv_caches, meta,
            torch.tensor(logits_rows, dtype=torch.int64, device=dev),
        )
        for rid, n in batch:
            self.requests[rid].num_computed += n
        if not samplers:
            return [], []
        tokens = self.sampler(logits, [st.sampling for _, st in samplers],
                              [len(st.token_ids) for _, st in samplers])
        for (_, st), tok in zip(samplers, tokens, strict=True):
            st.token_ids.append(tok)
        return [rid for rid, _ in samplers], tokens
