"""CUDA graphs for decode-only steps.

A decode step of B requests launches the same few hundred kernels whatever the tokens are;
eagerly, the host spends more time launching them than a small model spends running them. At
start the executor captures the model's forward once per batch size in ``capture_sizes`` into
static input buffers; a decode step of B requests then pads to the next captured size, copies
its inputs into those buffers and replays the graph (one launch).

Padding rows have slot -1 (their K/V is not written) and context length 0 (attention reads no
key); their outputs are garbage nobody reads. The graphs were captured with max_seq_len =
max_model_len, so the attention kernels' split decision covers any context the cache can hold,
and a block-table width of max_model_len / block_size.

With LoRA adapters (executor_svc/lora.py) each size is captured twice: without the adapters'
kernels, for steps of the base model alone, and with them over static buffers holding every
row of the padded batch sorted by slot, one segment per slot (the base's and the padding's:
computed as zero), so that the kernels' grid is the same whichever slots a step uses.
"""

from __future__ import annotations

import bisect
import functools
import logging
import time
from collections.abc import Callable

import numpy as np
import torch

from pagedserve.executor.lora import LoraStep
from pagedserve.executor.model import AttentionMetadata, CausalLM
from pagedserve.executor.transfer import to_device

log = logging.getLogger(__name__)


def capture_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, then every multiple of 8 up to max_batch (vLLM's ladder): at most 7 padding
    rows per step past 8."""
    sizes = [s for s in (1, 2, 4) if s < max_batch]
    sizes += range(8, max_batch + 1, 8)
    if not sizes or sizes[-1] < max_batch:
        sizes.append(max_batch)
    return sorted(set(sizes))


def capture_graphs(device: torch.device,
                   runs: list[tuple[Callable[[], None] | None, Callable[[], None]]]
                   ) -> tuple[list[torch.cuda.CUDAGraph], int]:
    """Capture each run, a (prepare, forward) pair, in order on a stream of its own: prepare
    (if any) and one eager forward outside the capture (it compiles and autotunes), then the
    forward captured. The graphs share one memory pool, so give the largest run first: the
    later ones reuse its memory. The graphs, and the device memory they took."""
    before = torch.cuda.mem_get_info(device)[0]
    graphs, pool = [], None
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for prepare, forward in runs:
            if prepare is not None:
                prepare()
            forward()
            torch.cuda.synchronize(device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                forward()
            pool = graph.pool()
            graphs.append(graph)
    torch.cuda.current_stream(device).wait_stream(stream)
    torch.cuda.synchronize(device)
    # the eager warm-up runs above left free segments in the ordinary pool, which neither
    # the graphs nor the profile's estimate hold: give them back before measuring
    torch.cuda.empty_cache()
    return graphs, before - torch.cuda.mem_get_info(device)[0]


class DecodeGraphs:
    def __init__(self, model: CausalLM, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 max_batch: int, max_model_len: int, block_size: int,
                 device: torch.device, lora: LoraStep | None = None,
                 max_loras: int = 0) -> None:
        self.model, self.kv_caches, self.device = model, kv_caches, device
        self.sizes = capture_sizes(max_batch)
        self.max_batch = self.sizes[-1]
        self.max_model_len = max_model_len
        self.max_blocks = -(-max_model_len // block_size)
        n = self.max_batch
        cuda = device.type == "cuda"  # (tests build one on the CPU, replaying eagerly)
        before = torch.cuda.mem_get_info(device)[0] if cuda else 0
        i64, i32 = torch.int64, torch.int32
        self.input_ids = torch.zeros(n, dtype=i64, device=device)
        self.positions = torch.zeros(n, dtype=i64, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=i64, device=device)
        self.block_tables = torch.zeros((n, self.max_blocks), dtype=i32, device=device)
        self.seq_lens = torch.zeros(n, dtype=i32, device=device)
        self.cu_seqlens_q = torch.arange(n + 1, dtype=i32, device=device)
        self.logits_indices = torch.arange(n, dtype=i64, device=device)
        # every graph writes its logits here: an output allocated inside a capture lives in the
        # shared pool for good, so one per size would keep sum(sizes) x vocab floats (34 GB at
        # 1024 sequences and a 128k vocabulary: the executor ran out of memory at start)
        self.logits = torch.empty((n, model.cfg.vocab_size), dtype=torch.float32,
                                  device=device)
        # the target's states an EAGLE head reads (CausalLM.taps), copied here by each graph
        self.tapped = None if not model.taps else torch.empty(
            (n, len(model.taps) * model.cfg.hidden_size), dtype=model.embed_tokens.weight.dtype,
            device=device)
        # (the memory profile sets these aside too: static_bytes)
        # pinned staging rows (ids, positions, slots, seq lens), two sets used in turn: with
        # async scheduling step N+1 is staged before step N's tokens are read, so N's copy may
        # not have run yet; N-1's has (its tokens were read before N+1 is launched)
        self._stages = [torch.zeros((4, n), dtype=i64, pin_memory=cuda) for _ in range(2)]
        self._turn = 0
        self._stage_dev = torch.zeros((4, n), dtype=i64, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        # LoRA: the step's rows sorted by slot and the segments' starts, one per slot 0..S
        # (slot 0, the base, as the kernels' -1: nothing added); graphs that run the adapters
        self.lora, self.lora_graphs = lora, {}
        if lora is not None:
            self.lora_rows = torch.arange(n, dtype=i64, device=device)
            self.lora_starts = torch.zeros(max_loras + 2, dtype=i32, device=device)
            self.lora_slots = torch.tensor([-1, *range(1, max_loras + 1)], dtype=i32,
                                           device=device)
        # tensor parallelism: rank 0 hands the staged inputs (padded batch, batch, table width)
        # to the other ranks, which replay their own graphs (executor_svc/distributed.py); the
        # graphs hold the NCCL all-reduces and all-gather, captured on every rank in one order
        # (bs, b, nb, with_lora) once a replay's inputs are staged (tensor parallelism)
        self.before_replay: Callable[[int, int, int, bool], None] | None = None
        # device memory the graphs hold: these buffers, then the capture's pool and graphs
        self.capture_bytes = before - torch.cuda.mem_get_info(device)[0] if cuda else 0

    @staticmethod
    def static_bytes(max_batch: int, max_model_len: int, block_size: int, vocab_size: int) -> int:
        """Bytes of the buffers the constructor allocates for graphs of up to max_batch rows."""
        n = capture_sizes(max_batch)[-1]
        # per row: float32 logits, an int32 block-table row, four int64 inputs, two int32,
        # and the four int64 staging columns
        return n * (vocab_size * 4 + -(-max_model_len // block_size) * 4 + 4 * 8 + 2 * 4 + 4 * 8)

    def _args(self, bs: int):
        meta = AttentionMetadata(
            slot_mapping=self.slot_mapping[:bs], block_tables=self.block_tables[:bs],
            seq_lens=self.seq_lens[:bs], cu_seqlens_q=self.cu_seqlens_q[:bs + 1],
            max_query_len=1, max_seq_len=self.max_model_len)
        return (self.input_ids[:bs], self.positions[:bs], self.kv_caches, meta,
                self.logits_indices[:bs], self.logits[:bs])

    def forward(self, bs: int, with_lora: bool = False) -> None:
        """What a graph of bs rows records: the model over the static buffers, with the
        adapters' kernels over the static LoRA segments or without."""
        if with_lora:
            self.lora.current = (self.lora_rows[:bs], self.lora_starts, self.lora_slots)
        try:
            self.model(*self._args(bs))
            if self.tapped is not None:
                self.tapped[:bs].copy_(self.model.tapped)
                self.model.tapped = None
        finally:
            if self.lora is not None:
                self.lora.current = None

    def capture(self) -> None:
        """Capture every size, largest first so the smaller graphs reuse its memory pool."""
        start = time.perf_counter()
        variants = [(bs, with_lora) for bs in reversed(self.sizes)
                    for with_lora in ((False, True) if self.lora is not None else (False,))]
        graphs, used = capture_graphs(self.device, [
            (functools.partial(self._base_segment, bs) if with_lora else None,
             functools.partial(self.forward, bs, with_lora)) for bs, with_lora in variants])
        for (bs, with_lora), graph in zip(variants, graphs, strict=True):
            (self.lora_graphs if with_lora else self.graphs)[bs] = graph
        self.capture_bytes += used
        log.info("captured %d CUDA graphs (decode batch %d..%d) in %.1f s, %.0f MiB",
                 len(self.sizes), self.sizes[0], self.max_batch, time.perf_counter() - start,
                 used / (1 << 20))

    def _base_segment(self, bs: int) -> None:
        """Every row of bs in the base's segment (valid, adds nothing): the LoRA graphs'
        capture input."""
        self.lora_starts.fill_(bs)
        self.lora_starts[0] = 0

    def fits(self, batch: int, num_blocks: int) -> bool:
        return batch <= self.max_batch and num_blocks <= self.max_blocks

    def padded(self, batch: int) -> int:
        """The captured size a batch of this many rows replays."""
        return self.sizes[bisect.bisect_left(self.sizes, batch)]

    def greedy_chain(self, tokens: np.ndarray, positions: np.ndarray, slots: np.ndarray,
                     tables: np.ndarray, seq_lens: np.ndarray) -> torch.Tensor:
        """K decode passes of the same B rows, each pass's input the argmax of the pass before
        it (a draft model's proposals): tokens [B] go into the first pass; positions, slots
        and seq_lens [K, B] are every pass's (slot -1 and length 0 where a row sits a pass
        out); tables [B, width] hold every pass's blocks. All inputs go to the device at once
        and the passes replay back to back, the host waiting for none of them. The argmaxes,
        [K, B] on the device."""
        passes, b = positions.shape
        bs = self.padded(b)
        dev = self.device
        steps = to_device(np.stack([positions, slots, seq_lens]).astype(np.int64), dev)
        self.input_ids[:b].copy_(to_device(tokens.astype(np.int64), dev))
        self.slot_mapping[b:bs], self.seq_lens[b:bs] = -1, 0
        self.block_tables[:b, :tables.shape[1]].copy_(to_device(tables, dev))
        out = torch.empty((passes, b), dtype=torch.int64, device=dev)
        for j in range(passes):
            self.positions[:b].copy_(steps[0, j])
            self.slot_mapping[:b].copy_(steps[1, j])
            self.seq_lens[:b].copy_(steps[2, j])
            self.graphs[bs].replay()
            torch.argmax(self.logits[:b], dim=-1, out=out[j])
            self.input_ids[:b].copy_(out[j])
        return out

    def run(self, input_ids: np.ndarray, positions: np.ndarray, slots: np.ndarray,
            tables: np.ndarray, seq_lens: np.ndarray,
            patch: tuple[torch.Tensor, torch.Tensor] | None = None,
            lora_slots: np.ndarray | None = None) -> torch.Tensor:
        """Logits [B, vocab] float32 of a decode step of B = len(input_ids) requests;
        patch = (rows, ids on the device) overrides those rows' input ids; lora_slots: each
        row's LoRA slot (0: the base)."""
        b = len(input_ids)
        bs = self.padded(b)
        pinned = self._stages[self._turn]
        self._turn ^= 1
        stage = pinned.numpy()
        stage[0, :b], stage[1, :b], stage[2, :b], stage[3, :b] = (input_ids, positions, slots,
                                                                  seq_lens)
        stage[2, b:bs], stage[3, b:bs] = -1, 0  # padding: write nothing, attend to nothing
        self._stage_dev[:, :bs].copy_(pinned[:, :bs], non_blocking=True)
        self.input_ids[:bs].copy_(self._stage_dev[0, :bs])
        if patch is not None:
            self.input_ids[patch[0]] = patch[1]
        self.positions[:bs].copy_(self._stage_dev[1, :bs])
        self.slot_mapping[:bs].copy_(self._stage_dev[2, :bs])
        self.seq_lens[:bs].copy_(self._stage_dev[3, :bs])
        nb = tables.shape[1]
        self.block_tables[:b, :nb].copy_(to_device(tables, self.block_tables.device))
        with_lora = lora_slots is not None and bool(lora_slots.any())
        if with_lora:
            self._stage_lora(lora_slots, bs)
        if self.before_replay is not None:
            self.before_replay(bs, b, nb, with_lora)
        (self.lora_graphs if with_lora else self.graphs)[bs].replay()
        return self.logits[:b]

    def _stage_lora(self, lora_slots: np.ndarray, bs: int) -> None:
        """The padded batch's rows sorted by slot (padding with the base) and the segments'
        starts, into the LoRA graphs' static buffers."""
        by_row = np.zeros(bs, np.int64)
        by_row[:len(lora_slots)] = lora_slots
        rows = np.argsort(by_row, kind="stable")
        counts = np.bincount(by_row, minlength=len(self.lora_slots))
        starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
        dev = self.device
        self.lora_rows[:bs].copy_(to_device(rows, dev))
        self.lora_starts.copy_(to_device(starts, dev))
