"""The transformers fallback (--model-impl transformers, or auto for a model_type with no
native module): HF transformers' own modeling code runs the model, with pagedserve's paged
attention plugged in through transformers' attention interface, so that scheduling, prefix
caching, preemption, sampling and the APIs work unchanged.

The flattened batch of T tokens goes in as one sequence [1, T] with its positions; each
attention module's call lands in `paged_attention_forward`, which writes the step's K and V
into the paged cache at the plan's slots and attends over each sequence's blocks. The
implementation is registered under a name transformers has no mask function for, so it builds
no attention mask. Native modules stay the fast path (no fused kernels or CUDA graphs here).

At build, one forward pass over a few tokens records what each layer hands the attention
interface (probe): a model is refused at start, naming why, unless every layer attends exactly
once through it, over the keys of its own tokens, with the heads and head size the KV cache
is sized for, and no module keeps a recurrent state. Layers that do not (linear attention,
state-space or convolution layers, compressed keys, a Mamba mixer beside the attention as
Falcon-H1's) would otherwise give wrong tokens silently. Multi-head latent attention hands
it each head's key and a value of a smaller size: the value is padded with zeros to the key's
size in the cache and the output cut back (config.for_transformers sizes the cache so).
Attention sinks (gpt-oss's per-head `s_aux` logit) go to the paged attention's `sinks`.

An MXFP4 checkpoint (gpt-oss's releases) is loaded with transformers' own dequantization
(Mxfp4Config(dequantize=True)): its experts are served in the model's dtype, four times the
bytes of their FP4 form, so the device must hold that much (checked before loading).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from pagedserve.executor.config import ModelConfig
from pagedserve.executor.families import UnsupportedModelError
from pagedserve.executor.layers import AttentionMetadata, Ops
from pagedserve.executor.quantization.mxfp4 import check_dequantized_fits

IMPLEMENTATION = "pagedserve_paged"
# tokens of the start-up probe: more than any compression rate of keys (DeepSeek V4's 128)
PROBE_TOKENS = 256
# the class names of HF's state-space, convolution and linear-attention mixers
_RECURRENT = re.compile(r"Mamba|Mixer$|ShortConv|DeltaNet|DeltaAttention|Rglru|RecurrentBlock|"
                        r"LinearAttention")


@dataclass
class _Step:
    """What the attention calls of one forward pass read: set by TransformersLM.hidden."""

    kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    meta: AttentionMetadata | None = None
    ops: Ops = None
    calls: int = 0  # attention calls in this forward pass
    probe: list[dict] | None = None  # set: record each call's shapes, touch no cache


def paged_attention_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor,
                            value: torch.Tensor, attention_mask: torch.Tensor | None,
                            scaling: float | None = None, dropout: float = 0.0,
                            **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention signature: query [1, H, T, D], key and value [1, Hkv, T, D]
    (after RoPE); returns [1, T, H, D]."""
    step: _Step = module.pagedserve_step
    step.calls += 1
    sinks = kwargs.get("s_aux")
    if step.probe is not None:
        step.probe.append(dict(layer=module.layer_idx, q=tuple(query.shape[1:]),
                               k=tuple(key.shape[1:]), v=tuple(value.shape[1:]),
                               causal=getattr(module, "is_causal", True)))
        return query.new_zeros(1, query.shape[2], query.shape[1], value.shape[-1]), None
    meta = step.meta
    k_cache, v_cache = step.kv_caches[module.layer_idx]
    q = query[0].transpose(0, 1).contiguous()
    k = key[0].transpose(0, 1).contiguous()
    v_dim = value.shape[-1]
    if v_dim < key.shape[-1]:  # multi-head latent attention: zeros pad V to K's size in the
        value = torch.nn.functional.pad(value, (0, key.shape[-1] - v_dim))  # cache, then cut
    v = value[0].transpose(0, 1).contiguous()
    step.ops.write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping, 1.0, 1.0)
    options = {}
    window = kwargs.get("sliding_window") or 0
    if window:
        options["sliding_window"] = int(window)
    if kwargs.get("softcap"):
        options["logits_soft_cap"] = float(kwargs["softcap"])
    if sinks is not None:  # gpt-oss's logit per head (the kernels start each softmax at it)
        options["sinks"] = sinks
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    o = step.ops.paged_attention(
        q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.cu_seqlens_q, scale,
        max_query_len=meta.max_query_len, max_seq_len=meta.max_seq_len, **options)
    return o[None, :, :, :v_dim], None


def register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(IMPLEMENTATION, paged_attention_forward)


class TransformersLM(nn.Module):
    """The executor's model interface (hidden, logits, logits_of) over an HF causal LM."""

    def __init__(self, cfg: ModelConfig, hf: nn.Module, ops: Ops) -> None:
        super().__init__()
        self.cfg, self.hf, self.quant = cfg, hf, None
        self.step = _Step(ops=ops)
        for m in hf.modules():
            if hasattr(m, "layer_idx"):
                m.pagedserve_step = self.step
        # the decoder under the LM head (Llama 4's causal LM names it `model` where its
        # base_model_prefix says `language_model`, so base_model is the LM itself)
        self.decoder = hf.base_model if hf.base_model is not hf else getattr(hf, "model", hf)
        self._probe()

    @torch.inference_mode()
    def _probe(self) -> None:
        """One forward pass over PROBE_TOKENS tokens, recording what the attention interface
        receives (no cache is touched): UnsupportedModelError, naming why, unless each layer
        attends once through it, causally, over keys of its own tokens only, with the heads and
        head size the KV cache is sized for, and no module keeps a recurrent state."""
        cfg, self.step.probe = self.cfg, []
        n = min(PROBE_TOKENS, cfg.max_position_embeddings)
        device = next(self.hf.parameters()).device
        try:
            out = self.decoder(input_ids=torch.zeros(1, n, dtype=torch.long, device=device),
                               position_ids=torch.arange(n, device=device)[None],
                               use_cache=False)
            out.last_hidden_state  # noqa: B018 - what hidden() reads must be there
        except Exception as e:  # noqa: BLE001 - HF's own refusal, named below
            raise UnsupportedModelError(
                f"{cfg.model_type}: the transformers fallback cannot run it over a paged KV "
                f"cache ({type(e).__name__}: {e})") from e
        finally:
            calls, self.step.probe = self.step.probe, None
        unit = "the transformers fallback serves decoders whose every layer is softmax attention"
        layers = sorted(c["layer"] for c in calls)
        if layers != list(range(cfg.num_layers)):
            missing = sorted(set(range(cfg.num_layers)) - set(layers))
            raise UnsupportedModelError(
                f"{cfg.model_type}: layers {missing or layers} do not attend once each through "
                f"transformers' attention interface (attention in the model's own code, as "
                f"ALiBi models; linear attention, state-space or convolution layers; layers "
                f"reusing another's KV): {unit}")
        want = (cfg.num_heads, n, cfg.head_dim), (cfg.num_kv_heads, n, cfg.head_dim)
        for c in calls:  # a value head smaller than the key's is padded (latent attention)
            if c["k"][1] != n or c["q"][1] != n:
                raise UnsupportedModelError(
                    f"{cfg.model_type}: layer {c['layer']} attends with {c['q'][1]} queries "
                    f"over {c['k'][1]} keys for {n} tokens (compressed or extra keys, as "
                    f"DeepSeek V4's): {unit} over the keys of its tokens")
            if (c["q"], c["k"]) != want or c["v"][:2] != want[1][:2] or \
                    c["v"][2] > cfg.head_dim:
                raise UnsupportedModelError(
                    f"{cfg.model_type}: layer {c['layer']} attends with query {c['q'][0]} x "
                    f"{c['q'][2]}, key {c['k'][0]} x {c['k'][2]} and value {c['v'][0]} x "
                    f"{c['v'][2]} (heads x size) where the config gives {cfg.num_heads} "
                    f"heads and {cfg.num_kv_heads} KV heads of {cfg.head_dim}: {unit} of "
                    f"the sizes the KV cache is made for")
            if c["causal"] is False:
                raise UnsupportedModelError(f"{cfg.model_type}: layer {c['layer']} attends "
                                            f"bidirectionally: {unit}, causal")
        # beside attention that passes all of the above, a state-space or convolution mixer
        # (Falcon-H1's Mamba-2 in every layer) keeps a state between steps that no paged
        # cache holds: each later step would be silently wrong
        stateful = sorted({type(m).__name__ for m in self.decoder.modules()
                           if _RECURRENT.search(type(m).__name__)})
        if stateful:
            raise UnsupportedModelError(
                f"{cfg.model_type}: {', '.join(stateful[:3])} keep a recurrent state between "
                f"steps (state-space, convolution or linear-attention mixers), which the paged "
                f"KV cache does not hold: {unit}")

    @classmethod
    def build(cls, cfg: ModelConfig, ops: Ops, dtype: torch.dtype, device: torch.device,
              weights_dir: Path | None, seed: int = 0,
              dequantize_mxfp4: bool = False) -> TransformersLM:
        """dequantize_mxfp4: the checkpoint is MXFP4, served dequantized to `dtype`."""
        from transformers import AutoModelForCausalLM, Mxfp4Config

        if cfg.tp_size > 1:
            raise UnsupportedModelError(f"{cfg.model_type}: the transformers fallback runs "
                                        "on one rank: --tensor-parallel-size 1")
        register()
        cfg.hf_config._attn_implementation = IMPLEMENTATION
        if weights_dir is None:
            torch.manual_seed(seed)
            with torch.device(device):
                hf = AutoModelForCausalLM.from_config(cfg.hf_config, dtype=dtype,
                                                      attn_implementation=IMPLEMENTATION)
        else:
            extra = {}
            if dequantize_mxfp4:
                check_dequantized_fits(weights_dir, dtype, device)
                extra["quantization_config"] = Mxfp4Config(dequantize=True)
            hf = AutoModelForCausalLM.from_pretrained(str(weights_dir), dtype=dtype,
                                                      attn_implementation=IMPLEMENTATION,
                                                      **extra)
        return cls(cfg, hf.to(device).eval(), ops)

    @torch.inference_mode()
    def forward(self, input_ids, positions, kv_caches, meta, logits_indices, out=None):
        logits = self.logits(self.hidden(input_ids, positions, kv_caches, meta)[logits_indices])
        return logits if out is None else out.copy_(logits)

    @torch.inference_mode()
    def hidden(self, input_ids: torch.Tensor, positions: torch.Tensor,
               kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
               meta: AttentionMetadata) -> torch.Tensor:  # [T, hidden]
        self.step.kv_caches, self.step.meta, self.step.calls = kv_caches, meta, 0
        out = self.decoder(input_ids=input_ids[None], position_ids=positions[None],
                           use_cache=False)
        if self.step.calls != self.cfg.num_layers:  # the probe saw every layer attend once
            raise RuntimeError(f"{self.step.calls} attention calls in a forward pass of "
                               f"{self.cfg.num_layers} layers")
        return out.last_hidden_state[0]

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [R, hidden] -> [R, vocab] fp32
        """The LM head and the scalings HF's causal LMs apply after it."""
        c = self.cfg.hf_config
        logits = self.hf.get_output_embeddings()(hidden).float()
        if getattr(c, "logits_scaling", None):  # Granite
            logits = logits / c.logits_scaling
        if getattr(c, "logit_scale", None):  # Cohere
            logits = logits * c.logit_scale
        cap = getattr(c, "final_logit_softcapping", None)
        return torch.tanh(logits / cap) * cap if cap else logits

    @torch.inference_mode()
    def logits_of(self, hidden: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        return self.logits(hidden[rows])

    def kv_scales_summary(self) -> str:
        return "the transformers fallback keeps no FP8 KV scales: 1.0"
