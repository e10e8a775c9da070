"""LoRA adapters on the host: PEFT checkpoints (adapter_config.json, adapter_model.safetensors)
read and checked against the model, and the host memory that keeps them (--max-cpu-loras of
them, least recently used dropped: read again from their directory when a slot needs one)."""

from __future__ import annotations

import json
import math
import re
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from pagedserve.executor.config import ModelConfig
from pagedserve.executor.tp_layers import shard_lora

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_KEY = re.compile(r"(?:base_model\.model\.)?model\.layers\.(\d+)\.(self_attn|mlp)\."
                  r"(\w+)\.lora_([AB])(?:\.default)?\.weight")
_EXPERTS = re.compile(r"\.(?:block_sparse_moe|experts|shared_expert|shared_expert_gate|gate)\.")
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
    """Refuse LoRA where this executor cannot apply it (one line, at start). On a
    mixture-of-experts model adapters apply to attention and to any dense MLP layer; an
    adapter of the experts is refused when read (_pair)."""
    if cfg.impl != "native":
        raise LoraError("LoRA needs a native model module (--model-impl native)")
    if cfg.latent is not None:
        raise LoraError(f"{cfg.model_type}: LoRA on latent attention is not supported")


def _sparse(cfg: ModelConfig, layer: int) -> bool:
    """Whether the layer's MLP is a mixture of experts (no gate/up/down of its own)."""
    return cfg.moe is not None and cfg.moe.sparse_layers[layer]


@dataclass(slots=True)
class HostAdapter:
    name: str
    rank: int
    # (layer, module) -> (A [rank, in], B [out, rank] times the scale), float32 on the host
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(repr=False)


def load_adapter(name: str, path: str | Path, cfg: ModelConfig, max_rank: int,
                 whole: ModelConfig | None = None) -> HostAdapter:
    """A PEFT LoRA checkpoint (adapter_config.json, adapter_model.safetensors), checked
    against the model (`whole`: the unsharded config of a tensor-parallel rank's `cfg`) and
    cut to this rank's share of each layer; LoraError naming the problem otherwise."""
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
    weights = _pair(tensors, whole or cfg, rank, scale, where)
    if cfg.tp_size > 1:
        weights = {(layer, m): shard_lora(m, a, b, cfg)
                   for (layer, m), (a, b) in weights.items()}
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
        if _EXPERTS.search(key):
            raise LoraError(f"{where}: weight {key} adapts a mixture-of-experts layer's "
                            f"experts or router, which LoRA is not served on (attention "
                            f"and dense MLP layers are)")
        if m is None or m.group(3) not in dims:
            raise LoraError(f"{where}: weight {key} is not a LoRA A or B of "
                            f"{', '.join(TARGETS)} in a decoder layer")
        layer, parent, module, half = int(m.group(1)), m.group(2), m.group(3), m.group(4)
        mlp = module in ("gate_proj", "up_proj", "down_proj")
        if mlp != (parent == "mlp"):  # AFMoE's self_attn.gate_proj: its attention's gate
            raise LoraError(f"{where}: weight {key}: {parent}.{module} is not a projection "
                            f"LoRA is served on")
        if mlp and not cfg.mlp_gated:
            raise LoraError(f"{where}: {key}: the base model's MLP is ungated (Jais 2's), "
                            f"which LoRA is not served on (attention is)")
        if layer >= cfg.num_layers:
            raise LoraError(f"{where}: {key}: the base model has {cfg.num_layers} layers")
        if mlp and _sparse(cfg, layer):
            raise LoraError(f"{where}: {key}: layer {layer}'s MLP is a mixture of experts, "
                            f"which LoRA is not served on (attention and dense MLP layers "
                            f"are)")
        if (cfg.rotary_dim or cfg.rotary_interleaved) and module in ("q_proj", "k_proj"):
            raise LoraError(f"{where}: {key}: the base model's q and k heads are served in "
                            f"another order (partial rotary embeddings), which LoRA on "
                            f"q_proj and k_proj is not served with")
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


class HostCache:
    """Every adapter's source by id (--lora-modules are 1..N, those added at run time follow)
    and the adapters read into host memory, at most `capacity` (0: all), least recently used
    dropped first."""

    def __init__(self, cfg: ModelConfig, max_rank: int, capacity: int = 0,
                 whole: ModelConfig | None = None) -> None:
        self.cfg, self.max_rank, self.capacity, self.whole = cfg, max_rank, capacity, whole
        self.sources: dict[int, tuple[str, str]] = {}  # id -> (name, PEFT directory)
        self._held: OrderedDict[int, HostAdapter] = OrderedDict()

    def read(self, name: str, path: str) -> HostAdapter:
        """An adapter read and checked against the model, held by nothing yet (LoraError
        naming the problem). Changes no state: safe on another thread than the loop's."""
        return load_adapter(name, path, self.cfg, self.max_rank, self.whole)

    def add(self, adapter_id: int, name: str, path: str,
            adapter: HostAdapter | None = None) -> None:
        """Hold an adapter, read here unless `adapter` is its read (LoraError naming the
        problem; nothing changes then)."""
        if adapter_id in self.sources:
            raise LoraError(f"LoRA adapter id {adapter_id} is in use")
        if adapter is None:
            adapter = self.read(name, path)
        self.sources[adapter_id] = (name, path)
        self._keep(adapter_id, adapter)

    def get(self, adapter_id: int) -> HostAdapter:
        """The adapter, read again from its directory if host memory let it go (LoraError if
        it can no longer be read)."""
        if adapter_id not in self.sources:
            raise ValueError(f"LoRA adapter id {adapter_id} is not loaded")
        adapter = self._held.get(adapter_id)
        if adapter is None:
            adapter = load_adapter(*self.sources[adapter_id], self.cfg, self.max_rank,
                                   self.whole)
            self._keep(adapter_id, adapter)
        self._held.move_to_end(adapter_id)
        return adapter

    def remove(self, adapter_id: int) -> None:
        self.sources.pop(adapter_id, None)
        self._held.pop(adapter_id, None)

    def held(self) -> list[int]:
        """Ids in host memory, least recently used first."""
        return list(self._held)

    def _keep(self, adapter_id: int, adapter: HostAdapter) -> None:
        self._held[adapter_id] = adapter
        while self.capacity and len(self._held) > self.capacity:
            self._held.popitem(last=False)
