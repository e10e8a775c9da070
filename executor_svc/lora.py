"""LoRA adapters in the executor: PEFT checkpoints read into host memory at start, copied into
device slots when a plan says so (StepPlan.lora_loads), and applied to each token of a step by
its request's slot (NewRequest.lora_slot), adapters and the base mixed in one batch.

A slot holds, for every layer and target module, A [R, in] and B [out, R] with the adapter's
scale folded into B and its rank zero-padded to R (--max-lora-rank): a module an adapter does not
target stays zero. Slot 0 is the base model (all zeros, never computed). The projections are
fused (qkv, gate_up), so a module's delta lands in its slice of the fused output; for the rows
of tokens with an adapter, grouped by slot (LoraStep):

    y[rows, offset:offset + out] += (x[rows] @ A[slot].T) @ B[slot].T   (lora_shrink, expand)
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from pagedserve.core.lora import LoraConfig
from pagedserve.executor.config import ModelConfig

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_KEY = re.compile(r"(?:base_model\.model\.)?model\.layers\.(\d+)\.(?:self_attn|mlp)\."
                  r"(\w+)\.lora_([AB])(?:\.default)?\.weight")
_UNSUPPORTED = {"use_dora": "DoRA", "fan_in_fan_out": "fan_in_fan_out weights",
                "modules_to_save": "modules_to_save (full weights beside the adapter)",
                "rank_pattern": "a rank per module (rank_pattern)",
                "alpha_pattern": "an alpha per module (alpha_pattern)"}


class LoraError(ValueError):
    """An adapter that cannot be served, with the reason (the service keeps serving)."""


def module_dims(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """Each target module's (in, out) features in this model."""
    h, q, kv, i = (cfg.hidden_size, cfg.num_heads * cfg.head_dim,
                   cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size)
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}


def check_model(cfg: ModelConfig) -> None:
    """Refuse LoRA where this executor cannot apply it (one line, at start)."""
    if cfg.impl != "native":
        raise LoraError("LoRA needs a native model module (--model-impl native)")
    if cfg.moe is not None:
        raise LoraError(f"LoRA on mixture-of-experts models ({cfg.model_type}) is not "
                        "supported yet")
    if cfg.tp_size > 1:
        raise LoraError("LoRA with --tensor-parallel-size > 1 is not supported yet")


@dataclass(slots=True)
class HostAdapter:
    name: str
    rank: int
    # (layer, module) -> (A [rank, in], B [out, rank] times the scale), float32 on the host
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(repr=False)


def load_adapter(name: str, path: str | Path, cfg: ModelConfig, max_rank: int) -> HostAdapter:
    """A PEFT LoRA checkpoint (adapter_config.json, adapter_model.safetensors), checked
    against this model; LoraError naming the problem otherwise."""
    where = f"LoRA adapter {name!r} ({path})"
    conf = _read_config(Path(path), where)
    rank, alpha = conf.get("r"), conf.get("lora_alpha", conf.get("r"))
    if not isinstance(rank, int) or rank < 1:
        raise LoraError(f"{where}: adapter_config.json: r must be a positive integer, "
                        f"got {rank!r}")
    if rank > max_rank:
        raise LoraError(f"{where}: rank {rank} is more than --max-lora-rank {max_rank}")
    if not isinstance(alpha, int | float):
        raise LoraError(f"{where}: adapter_config.json: lora_alpha must be a number")
    scale = alpha / math.sqrt(rank) if conf.get("use_rslora") else alpha / rank
    targets = conf.get("target_modules")
    if isinstance(targets, list):
        unknown = sorted(set(targets) - set(TARGETS))
        if unknown:
            raise LoraError(f"{where}: unknown target modules {', '.join(unknown)} "
                            f"(supported: {', '.join(TARGETS)})")
    tensors = _read_tensors(Path(path), where)
    weights = _pair(tensors, cfg, rank, scale, where)
    return HostAdapter(name, rank, weights)


def _read_config(path: Path, where: str) -> dict[str, Any]:
    try:
        conf = json.loads((path / "adapter_config.json").read_text())
    except FileNotFoundError:
        raise LoraError(f"{where}: no adapter_config.json") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise LoraError(f"{where}: adapter_config.json: {e}") from None
    if not isinstance(conf, dict):
        raise LoraError(f"{where}: adapter_config.json is not a JSON object")
    if conf.get("peft_type", "LORA") != "LORA":
        raise LoraError(f"{where}: peft_type {conf['peft_type']!r} is not LORA")
    for key, what in _UNSUPPORTED.items():
        if conf.get(key):
            raise LoraError(f"{where}: {what} is not supported")
    if conf.get("bias", "none") != "none":
        raise LoraError(f"{where}: bias {conf['bias']!r} is not supported (only 'none')")
    return conf


def _read_tensors(path: Path, where: str) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    file = path / "adapter_model.safetensors"
    if not file.exists():
        raise LoraError(f"{where}: no adapter_model.safetensors")
    try:
        return load_file(str(file))
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise LoraError(f"{where}: adapter_model.safetensors: {e}") from None


def _pair(tensors: dict[str, torch.Tensor], cfg: ModelConfig, rank: int, scale: float,
          where: str) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    dims = module_dims(cfg)
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        m = _KEY.fullmatch(key)
        if m is None or m.group(2) not in dims:
            raise LoraError(f"{where}: weight {key} is not a LoRA A or B of "
                            f"{', '.join(TARGETS)} in a decoder layer")
        layer, module, half = int(m.group(1)), m.group(2), m.group(3)
        if layer >= cfg.num_layers:
            raise LoraError(f"{where}: {key}: the base model has {cfg.num_layers} layers")
        fan_in, fan_out = dims[module]
        want = (rank, fan_in) if half == "A" else (fan_out, rank)
        if tuple(t.shape) != want:
            raise LoraError(f"{where}: {key} is {list(t.shape)}, the base model takes "
                            f"{list(want)}: not an adapter of this model")
        halves.setdefault((layer, module), {})[half] = t.float()
    weights = {}
    for (layer, module), pair in sorted(halves.items()):
        if len(pair) != 2:
            raise LoraError(f"{where}: layer {layer} {module} has lora_{''.join(pair)} "
                            "without its other half")
        weights[layer, module] = (pair["A"], pair["B"] * scale)
    if not weights:
        raise LoraError(f"{where}: adapter_model.safetensors holds no LoRA weights")
    return weights


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
        rows, starts, seg_slots = self.step.current
        xs = x.index_select(0, rows)  # [T', in]: the adapters' tokens, grouped by slot
        t = torch.empty(len(rows), self.slots.rank, dtype=torch.float32, device=x.device)
        for module, offset in self.parts:
            b = self.slots.b[module][self.layer]  # [S + 1, out, R]
            self.ops.lora_shrink(xs, self.slots.a[module][self.layer], starts, seg_slots, t)
            delta = torch.zeros(len(rows), b.shape[1], dtype=y.dtype, device=y.device)
            self.ops.lora_expand(t, b, starts, seg_slots, delta, 0)
            y[:, offset:offset + b.shape[1]].index_add_(0, rows, delta)
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
    """What the runner holds: the host adapters by id (--lora-modules are 1..N, those added at
    run time follow), the slots, the step."""

    def __init__(self, adapters: dict[int, HostAdapter], slots: LoraSlots, step: LoraStep,
                 cfg: ModelConfig, max_rank: int) -> None:
        self.adapters, self.slots, self.step = adapters, slots, step
        self.cfg, self.max_rank = cfg, max_rank
        self.num_static = len(adapters)  # --lora-modules: ids 1..num_static

    def load(self, slot: int, adapter_id: int) -> None:
        if not 1 <= slot <= self.slots.max_loras:
            raise ValueError(f"LoRA slot {slot} is not one of 1..{self.slots.max_loras}")
        self.slots.holds[slot] = 0  # whatever follows, not the adapter it held before
        if adapter_id not in self.adapters:
            raise ValueError(f"LoRA adapter id {adapter_id} is not loaded")
        self.slots.load(slot, adapter_id, self.adapters[adapter_id])

    def add(self, adapter_id: int, name: str, path: str) -> None:
        """Read an adapter at run time (LoraError naming the problem; nothing changes then)."""
        if adapter_id in self.adapters:
            raise LoraError(f"LoRA adapter id {adapter_id} is in use")
        self.adapters[adapter_id] = load_adapter(name, path, self.cfg, self.max_rank)

    def remove(self, adapter_id: int) -> None:
        """Forget an adapter (no running request uses it: the scheduler saw to that)."""
        self.adapters.pop(adapter_id, None)
        self.slots.holds = [0 if a == adapter_id else a for a in self.slots.holds]

    def reset(self) -> None:
        """A new scheduler session: no slot holds anything it knows of, and the adapters
        added at run time are forgotten (it adds those it serves again, ids of its own)."""
        self.slots.holds = [0] * len(self.slots.holds)
        for adapter_id in [i for i in self.adapters if i > self.num_static]:
            del self.adapters[adapter_id]

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
    adapters = {i + 1: load_adapter(name, path, cfg, lora.max_lora_rank)
                for i, (name, path) in enumerate(lora.modules)}
    slots, step = LoraSlots(cfg, lora, dtype, device), LoraStep(device)
    attach(model, cfg, slots, step, ops)
    return LoraRuntime(adapters, slots, step, cfg, lora.max_lora_rank)
