"""LoRA adapters in the executor: device slots that adapters are copied into when a plan says
so (StepPlan.lora_loads), and each token of a step getting its request's slot
(NewRequest.lora_slot), adapters and the base mixed in one batch. The adapters themselves, read
from PEFT checkpoints and kept in host memory, are lora_host's.

A slot holds, for every layer and target module, A [R, in] and B [out, R] with the adapter's
scale folded into B and its rank zero-padded to R (--max-lora-rank): a module an adapter does not
target stays zero. Slot 0 is the base model (all zeros, never computed). The projections are
fused (qkv, gate_up), so a module's delta lands in its slice of the fused output; for the rows
of tokens with an adapter, grouped by slot (LoraStep):

    y[rows, offset:offset + out] += (x[rows] @ A[slot].T) @ B[slot].T   (lora_shrink, expand)
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


class LoraSlots:
    """The device slots: per target module, A [layers, S + 1, R, in] and B [layers, S + 1, out,
    R] in the model's dtype; index 0 stays zero (the base)."""

    def __init__(self, cfg: ModelConfig, lora: LoraConfig, dtype: torch.dtype,
                 device: torch.device) -> None:
        s, r, n = lora.max_loras + 1, lora.max_lora_rank, cfg.num_layers
        self.max_loras, self.rank = lora.max_loras, r
        self.a = {m: torch.zeros(n, s, r, i, dtype=dtype, device=device)
                  for m, (i, _) in module_dims(cfg).items()}
        self.b = {m: torch.zeros(n, s, o, r, dtype=dtype, device=device)
                  for m, (_, o) in module_dims(cfg).items()}
        self.holds = [0] * s  # adapter id in each slot (0: none)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.a.values(), *self.b.values()))

    def load(self, slot: int, adapter_id: int, adapter: HostAdapter) -> None:
        for m in TARGETS:
            self.a[m][:, slot].zero_()
            self.b[m][:, slot].zero_()
        for (layer, m), (a, b) in adapter.weights.items():
            self.a[m][layer, slot, :adapter.rank].copy_(a)
            self.b[m][layer, slot, :, :adapter.rank].copy_(b)
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
    """A projection (possibly fused) with each part's LoRA delta added to its output slice."""

    def __init__(self, base: nn.Module, layer: int, parts: list[tuple[str, int]],
                 slots: LoraSlots, step: LoraStep, ops: Any) -> None:
        super().__init__()
        self.base, self.layer, self.parts = base, layer, parts
        self.slots, self.step, self.ops = slots, step, ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [T, in]
        y = self.base(x)  # [T, out of every part]
        if self.step.current is None:
            return y
        rows, starts, seg_slots = self.step.current  # the adapters' tokens, grouped by slot
        t = torch.empty(len(rows), self.slots.rank, dtype=torch.float32, device=x.device)
        for module, offset in self.parts:  # gathered from x, scattered into y: no copies
            self.ops.lora_shrink(x, self.slots.a[module][self.layer], starts, seg_slots, t, rows)
            self.ops.lora_expand(t, self.slots.b[module][self.layer], starts, seg_slots, y,
                                 offset, rows)
        return y


def attach(model: nn.Module, cfg: ModelConfig, slots: LoraSlots, step: LoraStep,
           ops: Any) -> None:
    """Wrap every decoder layer's projections (after the weights are loaded)."""
    dims = module_dims(cfg)
    q, kv, inter = dims["q_proj"][1], dims["k_proj"][1], dims["gate_proj"][1]
    for i, layer in enumerate(model.layers):
        attn, mlp = layer.self_attn, layer.mlp

        def wrap(base, parts, i=i):
            return LoraLinear(base, i, parts, slots, step, ops)

        attn.qkv_proj = wrap(attn.qkv_proj, [("q_proj", 0), ("k_proj", q), ("v_proj", q + kv)])
        attn.o_proj = wrap(attn.o_proj, [("o_proj", 0)])
        mlp.gate_up_proj = wrap(mlp.gate_up_proj, [("gate_proj", 0), ("up_proj", inter)])
        mlp.down_proj = wrap(mlp.down_proj, [("down_proj", 0)])


class LoraRuntime:
    """What the runner holds: the adapters on the host (HostCache), the slots, the step."""

    def __init__(self, host: HostCache, slots: LoraSlots, step: LoraStep) -> None:
        self.host, self.slots, self.step = host, slots, step
        self.num_static = len(host.sources)  # --lora-modules: ids 1..num_static

    def load(self, slot: int, adapter_id: int) -> None:
        if not 1 <= slot <= self.slots.max_loras:
            raise ValueError(f"LoRA slot {slot} is not one of 1..{self.slots.max_loras}")
        self.slots.holds[slot] = 0  # whatever follows, not the adapter it held before
        self.slots.load(slot, adapter_id, self.host.get(adapter_id))

    def add(self, adapter_id: int, name: str, path: str) -> None:
        """Read an adapter at run time (LoraError naming the problem; nothing changes then)."""
        self.host.add(adapter_id, name, path)

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
          device: torch.device, ops: Any) -> LoraRuntime:
    """Read every adapter (LoraError at the first bad one), make the slots, wrap the model."""
    check_model(cfg)
    host = HostCache(cfg, lora.max_lora_rank, lora.max_cpu_loras)
    for i, (name, path) in enumerate(lora.modules):  # each checked at start
        host.add(i + 1, name, path)
    slots, step = LoraSlots(cfg, lora, dtype, device), LoraStep(device)
    attach(model, cfg, slots, step, ops)
    return LoraRuntime(host, slots, step)
