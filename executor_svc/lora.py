"""LoRA adapters in the executor: device slots that adapters are copied into when a plan says
so (StepPlan.lora_loads), and each token of a step getting its request's slot
(NewRequest.lora_slot), adapters and the base mixed in one batch. The adapters themselves, read
from PEFT checkpoints and kept in host memory, are lora_host's.

A slot holds, for every layer and target module, A [R, in] and B [out, R] with the adapter's
scale folded into B and its rank zero-padded to R (--max-lora-rank): a module an adapter does not
target stays zero. Slot 0 is the base model (all zeros, never computed). The projections are
fused (qkv, gate_up), so a module's delta lands in its slice of the fused output; for the rows
of tokens with an adapter, grouped by slot (LoraStep), each module of a projection:

    y[rows, offset:offset + out] += (x[rows] @ A[slot].T) @ B[slot].T   (lora_shrink, expand)

one shrink and one expand per projection (its modules' A stacked, their B side by side).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

from pagedserve.core.lora import LoraConfig
from pagedserve.executor.config import ModelConfig
from pagedserve.executor.lora_host import (  # noqa: F401 (LoraError, load_adapter: its API)
    TARGETS,
    HostAdapter,
    HostCache,
    LoraError,
    check_model,
    load_adapter,
    module_dims,
)

PROJECTIONS = {"qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",),
               "gate_up": ("gate_proj", "up_proj"), "down": ("down_proj",)}


class LoraSlots:
    """The device slots, per projection (fused ones whole): A [layers, S + 1, P * R, in] (its
    P parts' A stacked along the rank) and B [layers, S + 1, out, R] (their B along the
    output, as the base's fused weight) in the model's dtype; slot 0 stays zero (the base)."""

    def __init__(self, cfg: ModelConfig, lora: LoraConfig, dtype: torch.dtype,
                 device: torch.device) -> None:
        s, r, n = lora.max_loras + 1, lora.max_lora_rank, cfg.num_layers
        self.max_loras, self.rank = lora.max_loras, r
        dims = module_dims(cfg)
        self.sizes = {p: tuple(dims[m][1] for m in ms) for p, ms in PROJECTIONS.items()}
        self.a = {p: torch.zeros(n, s, len(ms) * r, dims[ms[0]][0], dtype=dtype, device=device)
                  for p, ms in PROJECTIONS.items()}
        self.b = {p: torch.zeros(n, s, sum(self.sizes[p]), r, dtype=dtype, device=device)
                  for p in PROJECTIONS}
        self.place = {}  # module -> (projection, part, its first output column)
        for p, ms in PROJECTIONS.items():
            for i, m in enumerate(ms):
                self.place[m] = (p, i, sum(self.sizes[p][:i]))
        self.holds = [0] * s  # adapter id in each slot (0: none)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.a.values(), *self.b.values()))

    def load(self, slot: int, adapter_id: int, adapter: HostAdapter) -> None:
        for p in PROJECTIONS:
            self.a[p][:, slot].zero_()
            self.b[p][:, slot].zero_()
        r = self.rank
        for (layer, m), (a, b) in adapter.weights.items():
            p, i, col = self.place[m]
            self.a[p][layer, slot, i * r:i * r + adapter.rank].copy_(a)
            self.b[p][layer, slot, col:col + b.shape[0], :adapter.rank].copy_(b)
        self.holds[slot] = adapter_id


class LoraStep:
    """The running step's tokens that have an adapter, grouped by slot: `rows` [T'] (their
    rows in the flat batch, sorted by slot, stable), `starts` [G + 1] and `slots` [G] (one
    segment per slot used), on the device; None while no request of the step has an adapter,
    so a step of the base model alone costs nothing. Grouping by slot, not by request, reads
    each adapter once per segment: a decode step of 256 rows and 8 adapters is 8 segments,
    not 256 that each read their adapter whole."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.current = device, None

    def begin(self, cu_q: np.ndarray, slots: np.ndarray) -> None:
        """cu_q: [B + 1] the requests' token offsets; slots: [B] their slots (0: the base)."""
        token_slots = np.repeat(slots, np.diff(cu_q))
        rows = np.flatnonzero(token_slots)
        if not len(rows):
            self.current = None
            return
        rows = rows[np.argsort(token_slots[rows], kind="stable")]
        used, first = np.unique(token_slots[rows], return_index=True)
        starts = np.append(first, len(rows)).astype(np.int32)
        self.current = (torch.from_numpy(rows).to(self.device),
                        torch.from_numpy(starts).to(self.device),
                        torch.from_numpy(used.astype(np.int32)).to(self.device))

    def end(self) -> None:
        self.current = None


class LoraLinear(nn.Module):
    """A projection (possibly fused) with its adapters' delta added to its output: one shrink
    and one expand whatever its parts (LoraSlots stacks them)."""

    def __init__(self, base: nn.Module, layer: int, projection: str, slots: LoraSlots,
                 step: LoraStep, ops: Any) -> None:
        super().__init__()
        self.base, self.layer, self.projection = base, layer, projection
        self.slots, self.step, self.ops = slots, step, ops
        sizes = slots.sizes[projection]
        self.parts = sizes if len(sizes) > 1 else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [T, in]
        y = self.base(x)  # [T, out of every part]
        if self.step.current is None:
            return y
        rows, starts, seg_slots = self.step.current  # the adapters' tokens, grouped by slot
        a, b = self.slots.a[self.projection][self.layer], self.slots.b[self.projection][self.layer]
        t = torch.empty(len(rows), a.shape[1], dtype=torch.float32, device=x.device)
        # gathered from x, scattered into y: no copies
        self.ops.lora_shrink(x, a, starts, seg_slots, t, rows)
        self.ops.lora_expand(t, b, starts, seg_slots, y, 0, rows, self.parts)
        return y


def attach(model: nn.Module, cfg: ModelConfig, slots: LoraSlots, step: LoraStep,
           ops: Any) -> None:
    """Wrap every decoder layer's projections (after the weights are loaded)."""
    for i, layer in enumerate(model.layers):
        attn, mlp = layer.self_attn, layer.mlp

        def wrap(base, projection, i=i):
            return LoraLinear(base, i, projection, slots, step, ops)

        attn.qkv_proj = wrap(attn.qkv_proj, "qkv")
        attn.o_proj = wrap(attn.o_proj, "o")
        if hasattr(mlp, "gate_up_proj"):  # a dense MLP (a mixture of experts takes none)
            mlp.gate_up_proj = wrap(mlp.gate_up_proj, "gate_up")
            mlp.down_proj = wrap(mlp.down_proj, "down")


class LoraRuntime:
    """What the runner holds: the adapters on the host (HostCache), the slots, the step."""

    def __init__(self, host: HostCache, slots: LoraSlots, step: LoraStep,
                 wrapped: list[LoraLinear] | None = None) -> None:
        self.host, self.slots, self.step = host, slots, step
        self.wrapped = wrapped or []  # the first layer's projections (warm_up's)
        self.num_static = len(host.sources)  # --lora-modules: ids 1..num_static

    def load(self, slot: int, adapter_id: int) -> None:
        if not 1 <= slot <= self.slots.max_loras:
            raise ValueError(f"LoRA slot {slot} is not one of 1..{self.slots.max_loras}")
        self.slots.holds[slot] = 0  # whatever follows, not the adapter it held before
        self.slots.load(slot, adapter_id, self.host.get(adapter_id))

    def begin_read(self, adapter_id: int, name: str, path: str) -> None:
        """An adapter added at run time is about to be read (the executor's thread reads it
        here; with tensor parallelism each follower starts its own read: LeaderLora)."""

    def read(self, name: str, path: str) -> HostAdapter:
        """An adapter read and checked, not held yet (safe off the serving loop: the
        executor reads adapters added at run time on a thread of their own)."""
        return self.host.read(name, path)

    def add(self, adapter_id: int, name: str, path: str,
            adapter: HostAdapter | None = None) -> None:
        """Hold an adapter added at run time, read here unless `adapter` is its read
        (LoraError naming the problem; nothing changes then)."""
        self.host.add(adapter_id, name, path, adapter)

    def remove(self, adapter_id: int) -> None:
        """Forget an adapter (no running request uses it: the scheduler saw to that)."""
        self.host.remove(adapter_id)
        self.slots.holds = [0 if a == adapter_id else a for a in self.slots.holds]

    def reset(self) -> None:
        """A new scheduler session: no slot holds anything it knows of, and the adapters
        added at run time are forgotten (it adds those it serves again, ids of its own)."""
        self.slots.holds = [0] * len(self.slots.holds)
        for adapter_id in [i for i in self.host.sources if i > self.num_static]:
            self.host.remove(adapter_id)

    def check_slot(self, slot: int, adapter_id: int = 0) -> None:
        if not 0 <= slot <= self.slots.max_loras or (slot and not self.slots.holds[slot]):
            raise ValueError(f"LoRA slot {slot} holds no adapter")
        if slot and adapter_id and self.slots.holds[slot] != adapter_id:
            raise ValueError(f"LoRA slot {slot} holds adapter {self.slots.holds[slot]}, not "
                             f"{adapter_id}")


def build(model: nn.Module, cfg: ModelConfig, lora: LoraConfig, dtype: torch.dtype,
          device: torch.device, ops: Any, whole: ModelConfig | None = None) -> LoraRuntime:
    """Read every adapter (LoraError at the first bad one), make the slots, wrap the model.
    With tensor parallelism cfg is this rank's config and `whole` the model's: adapters are
    checked against the model and each rank keeps its share (tp_layers.shard_lora)."""
    check_model(cfg)
    host = HostCache(cfg, lora.max_lora_rank, lora.max_cpu_loras, whole)
    for i, (name, path) in enumerate(lora.modules):  # each checked at start
        host.add(i + 1, name, path)
    slots, step = LoraSlots(cfg, lora, dtype, device), LoraStep(device)
    attach(model, cfg, slots, step, ops)
    first = [m for m in model.modules() if isinstance(m, LoraLinear) and m.layer == 0]
    return LoraRuntime(host, slots, step, first)


# (tokens, segments) of warm_up's launches: tiles of 16, 32 and 64 rows (block_m_for), K split
WARM_UP_SHAPES = ((16, 1), (64, 2), (128, 1))


def warm_up(runtime: LoraRuntime, max_tokens: int) -> int:
    """Run each projection's shrink and expand once per tile height a step can pick, so that
    Triton compiles their variants at start and not in a serving step (slot 1 holds zeros or
    an adapter: nothing is written but scratch); the launches made."""
    launches, slots = 0, runtime.slots
    for lin in runtime.wrapped:
        a, b = slots.a[lin.projection][0], slots.b[lin.projection][0]
        for t, g in WARM_UP_SHAPES:
            if t > max_tokens:
                continue
            dev = a.device
            x = torch.zeros(t, a.shape[2], dtype=a.dtype, device=dev)
            y = torch.zeros(t, b.shape[1], dtype=b.dtype, device=dev)
            out = torch.empty(t, a.shape[1], dtype=torch.float32, device=dev)
            starts = torch.tensor([i * t // g for i in range(g + 1)], dtype=torch.int32,
                                  device=dev)
            seg_slots = torch.ones(g, dtype=torch.int32, device=dev)
            rows = torch.arange(t, device=dev)
            lin.ops.lora_shrink(x, a, starts, seg_slots, out, rows)
            lin.ops.lora_expand(out, b, starts, seg_slots, y, 0, rows, lin.parts)
            launches += 2
    return launches
