"""Quantize an HF Llama-family model layer by layer on calibration text, and write it as an
AWQ or GPTQ checkpoint (what `pagedserve quantize` runs).

Each decoder layer sees the calibration hidden states produced by the already-quantized layers
before it (GPTQ's sequential recipe; AWQ's scales are equivalences, so it loses nothing).
"""

from __future__ import annotations

import json
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from pagedserve.executor.quantization import algorithms as alg
from pagedserve.executor.quantization.formats import to_awq, to_gptq

log = logging.getLogger(__name__)
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
INPUTS = {"q_proj": "q", "o_proj": "o", "gate_proj": "gate", "down_proj": "down"}


@dataclass(frozen=True, slots=True)
class QuantizeOptions:
    method: str  # rtn | awq | gptq
    group_size: int = 128
    sym: bool = False  # GPTQ only (AWQ and RTN are asymmetric)
    act_order: bool = True  # GPTQ only
    num_samples: int = 16
    seq_len: int = 256
    layers: int = 0  # quantize only the first N decoder layers (tests); 0: all


def calibration_ids(tokenizer, text: str, num_samples: int, seq_len: int) -> torch.Tensor:
    ids = tokenizer(text, return_tensors="pt").input_ids[0]
    n = min(num_samples, len(ids) // seq_len)
    if n < 1:
        raise ValueError(f"calibration text has {len(ids)} tokens, need at least {seq_len}")
    return ids[: n * seq_len].view(n, seq_len)


class _Capture:
    """Inputs of the linears that read each distinct activation, flattened to [T, K]."""

    def __init__(self, layer: nn.Module) -> None:
        self.x: dict[str, torch.Tensor] = {}
        self.hooks = [getattr(layer, part.split(".")[0]).get_submodule(part.split(".")[1])
                      .register_forward_hook(self._hook(INPUTS[part.split(".")[1]]))
                      for part in LINEARS if part.split(".")[1] in INPUTS]

    def _hook(self, key):
        def hook(_mod, args, _out):
            self.x[key] = args[0].detach().reshape(-1, args[0].shape[-1]).float()
        return hook

    def remove(self) -> None:
        for h in self.hooks:
            h.remove()


def _awq_layer(layer: nn.Module, x: dict[str, torch.Tensor], group: int) -> None:
    """Search and fold AWQ scales (into the norms and up/v projections), then clip."""
    attn, mlp = layer.self_attn, layer.mlp
    plan = [(layer.input_layernorm, [attn.q_proj, attn.k_proj, attn.v_proj], "q"),
            (layer.post_attention_layernorm, [mlp.gate_proj, mlp.up_proj], "gate"),
            (mlp.up_proj, [mlp.down_proj], "down")]
    if attn.v_proj.out_features == attn.o_proj.in_features:  # not with GQA, as AutoAWQ
        plan.insert(1, (attn.v_proj, [attn.o_proj], "o"))
    with torch.no_grad():
        for prev, linears, key in plan:
            s = alg.awq_scale_search([m.weight for m in linears], x[key], group)
            if isinstance(prev, nn.Linear):
                prev.weight.div_(s[:, None])
            else:
                prev.weight.div_(s)
            for m in linears:
                m.weight.mul_(s)
            x[key] = x[key] / s
        for _prev, linears, key in plan:
            for m in linears:
                if m not in (attn.q_proj, attn.k_proj):  # AutoAWQ clips neither
                    m.weight.copy_(alg.awq_clip(m.weight, x[key], group))


def _quantize_layer(layer: nn.Module, x: dict[str, torch.Tensor] | None,
                    opt: QuantizeOptions) -> dict[str, alg.Quantized]:
    if opt.method == "awq":
        _awq_layer(layer, x, opt.group_size)
    out = {}
    min_zero = 1 if opt.method in ("gptq", "rtn") else 0  # GPTQ v1 files store zero - 1
    for part in LINEARS:
        lin = layer.get_submodule(part)
        w = lin.weight.detach().float()
        if opt.method == "gptq":
            key = INPUTS.get(part.split(".")[1]) or {"k_proj": "q", "v_proj": "q",
                                                     "up_proj": "gate"}[part.split(".")[1]]
            h = 2 * x[key].t().double() @ x[key].double() / x[key].shape[0]
            qt = alg.gptq(w, h, opt.group_size, opt.sym, opt.act_order, min_zero=min_zero)
        else:
            qt = alg.rtn(w, opt.group_size, min_zero=min_zero)
        with torch.no_grad():
            lin.weight.copy_(qt.dequantize())  # later layers see this layer quantized
        out[part] = qt
    return out


def quantize_model(model, ids: torch.Tensor, opt: QuantizeOptions) -> dict[str, alg.Quantized]:
    """Quantize `model` (an HF *ForCausalLM, float32) in place; returns every linear's integers
    keyed by HF module name."""
    base = model.model
    pos = torch.arange(ids.shape[1])[None].expand(ids.shape[0], -1)
    with torch.no_grad():
        hidden = base.embed_tokens(ids)
        cos_sin = base.rotary_emb(hidden, pos)
    result = {}
    layers = base.layers if not opt.layers else base.layers[: opt.layers]
    for i, layer in enumerate(layers):
        x = None
        if opt.method != "rtn":
            cap = _Capture(layer)
            with torch.no_grad():
                layer(hidden, position_ids=pos, position_embeddings=cos_sin)
            cap.remove()
            x = cap.x
        for part, qt in _quantize_layer(layer, x, opt).items():
            result[f"model.layers.{i}.{part}"] = qt
        if opt.method != "rtn":
            with torch.no_grad():
                out = layer(hidden, position_ids=pos, position_embeddings=cos_sin)
            hidden = out[0] if isinstance(out, tuple) else out
        log.info("layer %d/%d quantized (%s)", i + 1, len(layers), opt.method)
    return result


def save_checkpoint(model, quantized: dict[str, alg.Quantized], src: Path, out: Path,
                    opt: QuantizeOptions) -> None:
    from safetensors.torch import save_file

    fmt = "awq" if opt.method == "awq" else "gptq"  # rtn is written in GPTQ's format
    tensors = {}
    for name, t in model.state_dict().items():
        module = name.rpartition(".")[0]
        if module in quantized or (model.config.tie_word_embeddings and name == "lm_head.weight"):
            continue
        tensors[name] = t.contiguous()
    for module, qt in quantized.items():
        parts = (to_awq(qt.q, qt.scales, qt.zeros) if fmt == "awq"
                 else to_gptq(qt.q, qt.scales, qt.zeros, qt.g_idx))
        tensors.update({f"{module}.{k}": v.contiguous() for k, v in parts.items()})
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = quantization_config(opt)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if fmt == "gptq":  # AutoGPTQ's own copy
        qc = {k: v for k, v in config["quantization_config"].items() if k != "quant_method"}
        (out / "quantize_config.json").write_text(json.dumps(qc, indent=2) + "\n")
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.name != "config.json" and f.is_file():
            shutil.copy(f, out / f.name)


def quantization_config(opt: QuantizeOptions) -> dict:
    if opt.method == "awq":  # as AutoAWQ writes it
        return {"quant_method": "awq", "bits": 4, "group_size": opt.group_size,
                "zero_point": True, "version": "gemm", "modules_to_not_convert": None}
    act_order = opt.act_order and opt.method == "gptq"
    return {"quant_method": "gptq", "bits": 4, "group_size": opt.group_size,
            "desc_act": act_order, "sym": opt.sym and opt.method == "gptq",
            "damp_percent": 0.01, "true_sequential": False, "static_groups": False,
            "checkpoint_format": "gptq", "quantizer": f"pagedserve-{opt.method}"}
