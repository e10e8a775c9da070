"""A tensor-parallel executor: rank 0 (the executor process) and N-1 follower processes.

Rank 0 alone talks to the scheduler, mirrors the requests, builds each step's batch and
samples. The followers hold no request state: for each forward pass rank 0 sends them a small
header over a pipe (what runs, and the sizes) and then broadcasts the step's decoded input
tensors (ids, positions, slots, context lengths, block tables) in one collective, so a row
whose id is still on the device (async scheduling) travels without a host sync. Swaps of KV
blocks travel in the header alone (host lists). Why this and not every rank reading the plan:
docs/tensor_parallel.md.

Faults: the group lives and dies as one. Rank 0 watches its followers and exits non-zero the
moment one exits (serve then restarts the executor); a follower dies with rank 0 (the kernel's
parent-death signal, and its pipe reads end-of-file).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import logging
import multiprocessing as mp
import os
import signal
import socket
import sys
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from pagedserve.core.collector import freeze_long_lived
from pagedserve.executor.model import AttentionMetadata

log = logging.getLogger("pagedserve.executor")
# HIDDEN and LOGITS: a forward pass that keeps its hidden states, then logits of some of its
# rows (prompt logprobs score rows in slices): lm_head's all-gather runs once per slice
FORWARD, GRAPH, SWAP, STOP, HIDDEN, LOGITS = 1, 2, 3, 4, 5, 6
# LoRA adapters (executor_svc/lora.py): a slot loaded, an adapter read or dropped at run time,
# a new scheduler's reset; each rank keeps its share of every adapter
# (LORA_READ: an adapter added at run time, to read on a thread while steps go on)
LORA_LOAD, LORA_ADD, LORA_REMOVE, LORA_RESET, LORA_READ = 7, 8, 9, 10, 11
# a collective that waits this long for a peer fails; a dead peer is noticed sooner (above)
TIMEOUT = timedelta(minutes=10)


def device_of(rank: int, size: int, device: str) -> torch.device:
    """Rank r drives cuda:r (one host); `cpu` keeps every rank on the CPU (gloo)."""
    if device == "cpu" or (device == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if device not in ("auto", "cuda"):
        raise ValueError(f"--tensor-parallel-size {size} picks the GPUs itself (cuda:0.."
                         f"cuda:{size - 1}); give --device cuda, cpu or auto, not {device!r}")
    if torch.cuda.device_count() < size:
        raise ValueError(f"--tensor-parallel-size {size} needs {size} GPUs, this host has "
                         f"{torch.cuda.device_count()}")
    return torch.device("cuda", rank)


def init_group(rank: int, size: int, port: int, device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=size, timeout=TIMEOUT, device_id=device)
    else:  # ranks share the host's cores
        torch.set_num_threads(max(1, torch.get_num_threads() // size))
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=size, timeout=TIMEOUT)



class Link:
    """Rank 0's side: headers down the followers' pipes, input tensors by broadcast."""

    def __init__(self, pipes: list[Connection]) -> None:
        self.pipes = pipes
        self.lora_step: Any = None  # rank 0's LoraStep (--enable-lora)

    def send(self, *header: int, payload: bytes | None = None) -> None:
        data = np.asarray(header, np.int64).tobytes()
        for pipe in self.pipes:
            pipe.send_bytes(data)
            if payload is not None:
                pipe.send_bytes(payload)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                logits_indices: torch.Tensor, kind: int = FORWARD) -> None:
        b, nb = meta.block_tables.shape
        lora = self.lora_step.current if self.lora_step is not None else None
        rows, starts, slots = lora if lora is not None else (ids[:0],) * 3
        self.send(kind, len(ids), b, nb, len(logits_indices), meta.max_query_len,
                  meta.max_seq_len, len(rows), len(slots))
        dist.broadcast(torch.cat([ids, positions, meta.slot_mapping, meta.seq_lens.long(),
                                  meta.cu_seqlens_q.long(), logits_indices,
                                  meta.block_tables.flatten().long(), rows.long(),
                                  starts.long(), slots.long()]), src=0)

    def graph(self, graphs: Any, bs: int, b: int, nb: int, with_lora: bool) -> None:
        self.send(GRAPH, bs, b, nb, with_lora)
        lora = [graphs.lora_rows[:bs], graphs.lora_starts.long()] if with_lora else []
        dist.broadcast(torch.cat([graphs.input_ids[:bs], graphs.positions[:bs],
                                  graphs.slot_mapping[:bs], graphs.seq_lens[:bs].long(),
                                  graphs.block_tables[:b, :nb].flatten().long(), *lora]),
                       src=0)


class LeaderModel:
    """The model as rank 0's runner calls it: the followers run the same forward pass."""

    def __init__(self, model: Any, link: Link) -> None:
        self.model, self.link, self.cfg = model, link, model.cfg

    def __call__(self, ids, positions, kv_caches, meta, logits_indices) -> torch.Tensor:
        self.link.forward(ids, positions, meta, logits_indices)
        return self.model(ids, positions, kv_caches, meta, logits_indices)

    @property
    def tapped(self) -> torch.Tensor | None:  # the states an EAGLE head reads (rank 0's)
        return self.model.tapped

    @tapped.setter
    def tapped(self, value: torch.Tensor | None) -> None:
        self.model.tapped = value

    def hidden(self, ids, positions, kv_caches, meta) -> torch.Tensor:
        self.link.forward(ids, positions, meta, ids[:0], kind=HIDDEN)
        return self.model.hidden(ids, positions, kv_caches, meta)

    def logits_of(self, hidden: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        self.link.send(LOGITS, len(rows))
        dist.broadcast(rows.long().contiguous(), src=0)
        return self.model.logits_of(hidden, rows)


class LeaderLora:
    """Rank 0's LoRA runtime: slot loads and run-time adapter changes happen on every rank,
    each reading the adapter's files for its own share (rank 0 first: an adapter it refuses
    reaches no follower)."""

    def __init__(self, lora: Any, link: Link) -> None:
        self.lora, self.link = lora, link
        self.host, self.slots, self.step = lora.host, lora.slots, lora.step

    def load(self, slot: int, adapter_id: int) -> None:
        self.lora.load(slot, adapter_id)
        self.link.send(LORA_LOAD, slot, adapter_id)

    def begin_read(self, adapter_id: int, name: str, path: str) -> None:
        """An adapter added at run time: each follower starts reading its share on a thread
        of its own (as rank 0 does), and holds it when the LORA_ADD comes."""
        self.lora.begin_read(adapter_id, name, path)
        self.link.send(LORA_READ, adapter_id, payload=json.dumps([name, path]).encode())

    def read(self, name: str, path: str) -> Any:
        return self.lora.read(name, path)

    def add(self, adapter_id: int, name: str, path: str, adapter: Any = None) -> None:
        """Rank 0 holds its read (made off the loop); each follower holds its own, begun at
        the LORA_READ (or read on its loop now if none was)."""
        self.lora.add(adapter_id, name, path, adapter)
        self.link.send(LORA_ADD, adapter_id, payload=json.dumps([name, path]).encode())

    def remove(self, adapter_id: int) -> None:
        self.lora.remove(adapter_id)
        self.link.send(LORA_REMOVE, adapter_id)

    def reset(self) -> None:
        self.lora.reset()
        self.link.send(LORA_RESET)

    def check_slot(self, slot: int, adapter_id: int = 0) -> None:
        self.lora.check_slot(slot, adapter_id)


class LeaderSwap:
    """Rank 0's swap space: every rank moves its own heads of the same blocks."""

    def __init__(self, swap: Any, link: Link) -> None:
        self.swap, self.link, self.num_blocks = swap, link, swap.num_blocks

    def swap_out(self, kv, src: list[int], dst: list[int]) -> None:
        self._both(0, kv, src, dst)

    def swap_in(self, kv, src: list[int], dst: list[int]) -> None:
        self._both(1, kv, src, dst)

    def _both(self, way: int, kv, src: list[int], dst: list[int]) -> None:
        if src:
            self.link.send(SWAP, way, *src, *dst)
            (self.swap.swap_in if way else self.swap.swap_out)(kv, src, dst)


class Group:
    """Rank 0's view of the group: starts the followers, wires the worker, stops them."""

    def __init__(self, args: argparse.Namespace, size: int) -> None:
        self.size = size
        self.device = device_of(0, size, args.device)
        port = _free_port()
        ctx = mp.get_context("spawn")  # a fresh interpreter: no CUDA state forked
        self.procs, pipes = [], []
        for rank in range(1, size):
            recv, send = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=_follower_main, name=f"tp-rank-{rank}", daemon=True,
                               args=(args, rank, size, port, recv, os.getpid(),
                                     logging.getLogger().level))
            proc.start()
            recv.close()
            self.procs.append(proc)
            pipes.append(send)
        self.link = Link(pipes)
        self.stopping = False
        threading.Thread(target=self._watch, name="tp-watch", daemon=True).start()
        init_group(0, size, port, self.device)
        log.info("tensor parallel group of %d ranks on %s", size,
                 "cpu (gloo)" if self.device.type == "cpu" else f"cuda:0..{size - 1} (nccl)")

    def lead(self, worker: Any) -> None:
        """Route the worker's forward passes and swaps through the link (before warm_up)."""
        runner = worker.runner
        runner.model = LeaderModel(runner.model, self.link)
        runner.swap = LeaderSwap(runner.swap, self.link)
        if runner.lora is not None:
            runner.lora = LeaderLora(runner.lora, self.link)
            self.link.lora_step = runner.lora.step
        if worker.graphs is not None:
            worker.graphs.before_replay = lambda bs, b, nb, with_lora: self.link.graph(
                worker.graphs, bs, b, nb, with_lora)

    def _watch(self) -> None:
        ended = wait([p.sentinel for p in self.procs])
        if self.stopping:
            return
        dead = next(p for p in self.procs if p.sentinel in ended)
        dead.join()
        log.error("tensor parallel %s exited with %s: the executor is lost, rank 0 exits",
                  dead.name, dead.exitcode)
        logging.shutdown()
        os._exit(1)

    def stop(self) -> None:
        self.stopping = True
        with contextlib.suppress(OSError):  # a follower already gone
            self.link.send(STOP)
        for proc in self.procs:
            proc.join(timeout=15)
            if proc.is_alive():
                proc.kill()
        dist.destroy_process_group()


class Follower:
    """A follower's loop: run what rank 0 sends until it says stop (or is gone)."""

    def __init__(self, worker: Any, pipe: Connection) -> None:
        self.worker, self.pipe = worker, pipe
        self.model, self.kv = worker.runner.model, worker.runner.kv_caches
        self.swap, self.device = worker.runner.swap, worker.device
        self.lora = worker.lora  # this rank's LoRA runtime (--enable-lora), or None
        self._reads: dict[int, Future] = {}  # adapters being read (LORA_READ) until added
        self._reader: ThreadPoolExecutor | None = None
        self.hidden = torch.empty(0)  # the last HIDDEN pass's, for the LOGITS after it

    def run(self) -> None:
        while self.step():
            pass

    def step(self) -> bool:
        try:
            header = np.frombuffer(self.pipe.recv_bytes(), np.int64).tolist()
        except EOFError:  # rank 0 is gone
            raise SystemExit(1) from None
        kind, rest = header[0], header[1:]
        if kind in (FORWARD, HIDDEN):
            self._forward(kind, *rest)
        elif kind == LOGITS:
            self.model.logits_of(self.hidden, self._recv(rest[0]))
        elif kind == GRAPH:
            self._graph(*rest)
        elif kind == SWAP:
            way, n = rest[0], (len(rest) - 1) // 2
            fn = self.swap.swap_in if way else self.swap.swap_out
            fn(self.kv, rest[1:1 + n], rest[1 + n:])
        elif kind == LORA_LOAD:
            self.lora.load(*rest)
        elif kind == LORA_READ:
            if self._reader is None:
                self._reader = ThreadPoolExecutor(1, thread_name_prefix="lora-read")
            self._reads[rest[0]] = self._reader.submit(self.lora.read,
                                                       *json.loads(self.pipe.recv_bytes()))
        elif kind == LORA_ADD:
            read = self._reads.pop(rest[0], None)
            self.lora.add(rest[0], *json.loads(self.pipe.recv_bytes()),
                          read.result() if read is not None else None)
        elif kind == LORA_REMOVE:  # (also an adapter whose read rank 0 refused)
            self._reads.pop(rest[0], None)
            self.lora.remove(rest[0])
        elif kind == LORA_RESET:
            self._reads.clear()
            self.lora.reset()
        return kind != STOP

    def _recv(self, n: int) -> torch.Tensor:
        t = torch.empty(n, dtype=torch.int64, device=self.device)
        dist.broadcast(t, src=0)
        return t

    def _forward(self, kind: int, t: int, b: int, nb: int, s: int, max_q: int,
                 max_seq: int, lora_rows: int, lora_segs: int) -> None:
        ids, pos, slots, lens, cu, rows, tables, l_rows, l_starts, l_slots = self._recv(
            3 * t + 2 * b + 1 + s + b * nb + lora_rows + 2 * lora_segs + (lora_segs > 0)).split(
            [t, t, t, b, b + 1, s, b * nb, lora_rows, lora_segs + (lora_segs > 0), lora_segs])
        meta = AttentionMetadata(slots, tables.view(b, nb).int(), lens.int(), cu.int(), max_q,
                                 max_seq)
        if lora_segs:  # the step's adapter rows, grouped by slot as rank 0 grouped them
            self.lora.step.current = (l_rows, l_starts.int(), l_slots.int())
        try:
            if kind == HIDDEN:
                self.hidden = self.model.hidden(ids, pos, self.kv, meta)
            else:
                self.model(ids, pos, self.kv, meta, rows)
        finally:
            if lora_segs:
                self.lora.step.end()

    def _graph(self, bs: int, b: int, nb: int, with_lora: int) -> None:
        g = self.worker.graphs
        n_lora = bs + len(g.lora_starts) if with_lora else 0
        ids, pos, slots, lens, tables, lora = self._recv(4 * bs + b * nb + n_lora).split(
            [bs, bs, bs, bs, b * nb, n_lora])
        g.input_ids[:bs].copy_(ids)
        g.positions[:bs].copy_(pos)
        g.slot_mapping[:bs].copy_(slots)
        g.seq_lens[:bs].copy_(lens)
        g.block_tables[:b, :nb].copy_(tables.view(b, nb))
        if with_lora:
            g.lora_rows[:bs].copy_(lora[:bs])
            g.lora_starts.copy_(lora[bs:])
        (g.lora_graphs if with_lora else g.graphs)[bs].replay()


class _WarmUpRunner:
    """Stands in for a follower's runner in Worker.warm_up: each step rank 0's warm-up runs
    is one forward pass here."""

    graphs = None

    def __init__(self, follower: Follower) -> None:
        self.follower = follower

    def execute(self, plan: Any) -> None:
        self.follower.step()

    def reset(self) -> None:
        if self.follower.lora is not None:  # rank 0's runner reset sent a LORA_RESET
            self.follower.step()


def _follower_main(args: argparse.Namespace, rank: int, size: int, port: int, pipe: Connection,
                   leader: int, level: int) -> None:
    _die_with_parent(leader)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # rank 0 stops the group
    logging.basicConfig(level=level, stream=sys.stderr,
                        format=f"%(asctime)s %(levelname)s rank {rank} %(name)s: %(message)s")
    from pagedserve.executor.worker import Worker, executor_config

    device = device_of(rank, size, args.device)
    init_group(rank, size, port, device)
    worker = Worker(executor_config(args, rank, size, str(device)))
    follower = Follower(worker, pipe)
    worker.runner = _WarmUpRunner(follower)
    worker.warm_up()
    freeze_long_lived()
    follower.run()
    dist.destroy_process_group()


def _die_with_parent(leader: int) -> None:
    """Linux: SIGKILL this process when rank 0 dies, even inside a collective."""
    with contextlib.suppress(OSError, AttributeError):  # not Linux: the pipe's EOF remains
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != leader:  # it died before the signal was armed
        os._exit(1)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
