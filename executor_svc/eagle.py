"""Speculative decoding by an EAGLE head (--speculative-config method eagle or eagle3): a one-
layer decoder that drafts from the target's own hidden states, in the public checkpoint formats
(EAGLE-1: yuhuili/EAGLE-LLaMA3-Instruct-8B and the like; EAGLE-3: yuhuili/EAGLE3-LLaMA3.1-
Instruct-8B, the speculators' Llama heads).

What a head reads at position i is the token at i + 1 and the target's hidden state at i, and
it predicts the token at i + 2:
- EAGLE-1: x = fc([embed(token), h]), h the target's final-norm output; one or more Llama
  layers (the first without its input norm); the sum out of the last is the next pass's h, and
  the target's lm_head turns it into logits.
- EAGLE-3: h = fc([h_a, h_b, h_c]), the target's residual stream entering three layers (vLLM's
  default 2, L/2 and L-3, or the config's eagle_aux_hidden_state_layer_ids); one layer whose
  q/k/v read [input_norm(embed(token)), hidden_norm(h)]; its pre-norm sum is the next pass's h,
  its own norm and lm_head give logits over a draft vocabulary that d2t maps to the target's
  (target id = d + d2t[d]). The residual is h, or hidden_norm(h) where the config says
  norm_before_residual (the speculators library's heads, whose config.json nests the layer's
  config under transformer_layer_config: read here too).

Its paged KV cache lives in the target's blocks, as a draft model's does (executor_svc/
draft.py): the same block ids and slots, its own tensors. The runner keeps the target's hidden
states of each step (CausalLM.taps) and feeds the head twice:
- at launch (catch_up), every position whose next token is known then: prefill chunks (the
  chunk's own tokens, and the prompt token after it) and a drafted row's positions before its
  last (the drafts are its next tokens; those rejected are written over later);
- once the step's tokens are read (propose), each sampled row at its last kept position with the
  token it sampled there: that pass writes the position's KV and gives the first draft; each
  further pass feeds a draft and the head's own h, one position on, up to k.
On CUDA the proposal passes replay graphs of their own (HeadGraphs) for batches of up to
HEAD_GRAPH_ROWS rows: each pass's graph writes its drafts and h into the next pass's inputs, so
the host launches one graph a pass and waits once. Larger batches run the passes eagerly.
So a head's KV at position i always holds the token that followed i, and what the target
computed there; prefix-cache hits, swaps and recomputes need nothing more (a swap copies the
head's cache with the target's). A slot the head misses only lowers the acceptance rate:
drafts are one token with certainty each, verified by the target's own sample, and outputs
follow the target's distribution whatever the head proposes.
"""

from __future__ import annotations

import bisect
import functools
import json
import logging
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch
from torch import nn

from pagedserve.executor.checkpoint import CheckpointFilesError, iter_checkpoint
from pagedserve.executor.config import ModelConfig
from pagedserve.executor.cuda_graphs import capture_graphs, capture_sizes
from pagedserve.executor.draft import DraftModelError, pass_grid
from pagedserve.executor.families import text_weight_name
from pagedserve.executor.layers import (
    MLP,
    Attention,
    AttentionMetadata,
    Ops,
    RMSNorm,
    make_linear,
    rope_cos_sin_cache,
)
from pagedserve.executor.model import CausalLM
from pagedserve.executor.transfer import to_device

log = logging.getLogger(__name__)

# the largest batch whose proposal passes replay CUDA graphs (speculation pays most at small
# batches; past this the passes run eagerly, and the graphs' pool stays small)
HEAD_GRAPH_ROWS = 128

VERSIONS = {"eagle": 1, "eagle3": 3}


@dataclass(frozen=True, slots=True)
class HeadLayout:
    """What a head's config and tensors say about it, checked against the target."""

    version: int  # 1 (EAGLE) or 3 (EAGLE-3)
    taps: tuple[int, ...]  # the target layers it reads (CausalLM.taps)
    fc_in: int  # the width fc reads: 2 H (EAGLE-1), 3 H of the target's (EAGLE-3)
    fc_bias: bool
    own_embed: bool  # its own embed_tokens (else the target's)
    own_lm_head: bool  # its own lm_head (else the target's)
    draft_vocab: int  # the rows of its lm_head (EAGLE-3's draft vocabulary)


def aux_layers(head_hf, num_layers: int) -> tuple[int, ...]:
    """The target layers an EAGLE-3 head reads: its config's, else vLLM's default."""
    ids = getattr(head_hf, "eagle_aux_hidden_state_layer_ids", None)
    if ids is None:
        ids = (getattr(head_hf, "eagle_config", None) or {}).get(
            "eagle_aux_hidden_state_layer_ids")
    if ids is None:
        ids = (2, num_layers // 2, num_layers - 3)
    ids = tuple(sorted(int(i) for i in ids))
    if not ids or ids[0] < 0 or ids[-1] >= num_layers:
        raise DraftModelError(f"--speculative-config: the EAGLE-3 head reads layers {ids}; the "
                              f"target has {num_layers}")
    return ids


def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    """A head's tensors by their checkpoint names (safetensors, else pytorch_model.bin), with
    the prefixes heads are saved under taken off (model., midlayer. as layers.0.)."""
    out: dict[str, torch.Tensor] = {}
    try:
        out = dict(iter_checkpoint(path))
    except CheckpointFilesError:
        raise DraftModelError(f"--speculative-config: no *.safetensors or "
                              f"pytorch_model*.bin in the EAGLE head {path}") from None
    except Exception as e:  # a corrupt or truncated file: one line, not a traceback
        raise DraftModelError(f"--speculative-config: the EAGLE head {path} cannot be read "
                              f"({type(e).__name__}: {str(e).splitlines()[0][:200]})") from None
    named = {}
    for name, t in out.items():
        name = name.removeprefix("model.")
        if name.startswith("midlayer."):
            name = "layers.0." + name.removeprefix("midlayer.")
        named[name] = t
    return named


def layout(method: str, hc: ModelConfig, target: ModelConfig,
           names: dict[str, tuple[int, ...]] | None) -> HeadLayout:
    """The head's layout from its config and tensor shapes (None: random weights, the
    config's shapes); DraftModelError naming what does not fit the method or the target."""
    version = VERSIONS[method]
    h, th = hc.hidden_size, target.hidden_size
    where = f"--speculative-config: the {method} head"
    if version == 1 and h != th:
        raise DraftModelError(f"{where} has hidden size {h}, the target {th}: an EAGLE head "
                              f"reads the target's hidden states as they are")
    if version == 3 and hc.num_layers != 1:
        raise DraftModelError(f"{where} has {hc.num_layers} layers; EAGLE-3 heads have one")
    taps = (target.num_layers,) if version == 1 else aux_layers(hc.hf_config,
                                                                target.num_layers)
    width = 2 * h if version == 1 else len(taps) * th
    names = names or {}
    fc = names.get("fc.weight", (h, width))
    if fc != (h, width):
        other = "eagle3" if version == 1 else "eagle"
        raise DraftModelError(f"{where}: fc.weight is {list(fc)}, where method {method!r} "
                              f"reads [{h}, {width}] from this target (a head of the other "
                              f"kind is method {other!r}, or a head for another target)")
    draft_vocab = getattr(hc.hf_config, "draft_vocab_size", None) or hc.vocab_size
    own_lm_head = "lm_head.weight" in names or (not names and version == 3)
    if own_lm_head:
        draft_vocab = names.get("lm_head.weight", (draft_vocab,))[0]
    if not own_lm_head and hc.vocab_size != target.vocab_size:
        raise DraftModelError(f"{where} has a vocabulary of {hc.vocab_size} tokens, the target "
                              f"{target.vocab_size}: a head must share the target's tokenizer")
    if version == 3 and own_lm_head and draft_vocab != target.vocab_size \
            and names and "d2t" not in names:
        raise DraftModelError(f"{where} drafts over {draft_vocab} tokens, the target has "
                              f"{target.vocab_size}, and it has no d2t to map them")
    own_embed = "embed_tokens.weight" in names
    if not own_embed and h != th:
        raise DraftModelError(f"{where} has hidden size {h}, the target {th}, and no "
                              f"embed_tokens of its own (the target's embeddings are {th} wide)")
    if own_embed and names["embed_tokens.weight"][0] != target.vocab_size:
        raise DraftModelError(f"{where} embeds {names['embed_tokens.weight'][0]} tokens, the "
                              f"target has {target.vocab_size}")
    return HeadLayout(version, taps, width, "fc.bias" in names, own_embed, own_lm_head,
                      draft_vocab)


class EagleLayer(nn.Module):
    """A Llama layer as the heads have it: EAGLE-1's first without its input norm; EAGLE-3's
    reading [input_norm(embedding), hidden_norm(h)], twice the hidden size."""

    def __init__(self, cfg: ModelConfig, index: int, version: int, ops: Ops) -> None:
        super().__init__()
        self.index, self.version = index, version
        eps, h = cfg.rms_norm_eps, cfg.hidden_size
        self.input_layernorm = RMSNorm(h, eps, ops)
        self.post_attention_layernorm = RMSNorm(h, eps, ops)
        self.self_attn = Attention(cfg, 0, ops)
        self.norm_before_residual = bool(getattr(cfg.hf_config, "norm_before_residual", False))
        if version == 3:
            self.hidden_norm = RMSNorm(h, eps, ops)
            attn = self.self_attn
            attn.qkv_proj = make_linear(2 * h, (attn.h + 2 * attn.hkv) * attn.d,
                                        cfg.attention_bias, None, ops)
        self.mlp = MLP(cfg, ops)

    def forward(self, x, residual, embeds, positions, cos_sin, kv_cache, meta):
        if self.version == 3:
            h = self.hidden_norm(x)[0]
            residual = h if self.norm_before_residual else x
            x = torch.cat([self.input_layernorm(embeds)[0], h], dim=-1)
        elif self.index == 0:
            residual = x
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, positions, cos_sin, kv_cache, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class EagleHead(nn.Module):
    def __init__(self, cfg: ModelConfig, lay: HeadLayout, target: CausalLM, ops: Ops,
                 max_pos: int) -> None:
        super().__init__()
        self.cfg, self.lay, self.version = cfg, lay, lay.version
        h = cfg.hidden_size
        self.fc = nn.Linear(lay.fc_in, h, bias=lay.fc_bias)
        self.layers = nn.ModuleList(EagleLayer(cfg, i, lay.version, ops)
                                    for i in range(cfg.num_layers))
        if lay.own_embed:
            self.embed_tokens = nn.Embedding(target.cfg.vocab_size, h)
        if lay.version == 3:
            self.norm = RMSNorm(h, cfg.rms_norm_eps, ops)
        if lay.own_lm_head:
            self.lm_head = nn.Linear(h, lay.draft_vocab, bias=False)
        self.register_buffer("d2t", torch.zeros(lay.draft_vocab, dtype=torch.int64))
        self._target = [target]  # (a list: not a submodule, its weights are not the head's)
        self.max_pos = max_pos
        self.cos_sin = torch.empty(0)

    @property
    def target(self) -> CausalLM:
        return self._target[0]

    def combine(self, tapped: torch.Tensor) -> torch.Tensor:
        """The target's tapped states as the head's first pass reads them (EAGLE-3: fc)."""
        return self.fc(tapped.to(self.fc.weight.dtype)) if self.version == 3 else tapped

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                meta: AttentionMetadata) -> torch.Tensor:
        """[T, H]: the pre-norm sum out of the last layer (the next pass's h)."""
        embed = self.embed_tokens if self.lay.own_embed else self.target.embed_tokens
        e = embed(ids)
        x = self.fc(torch.cat([e, hidden], dim=-1)) if self.version == 1 else hidden
        residual = None
        for layer, kv in zip(self.layers, kv_caches, strict=True):
            x, residual = layer(x, residual, e, positions, self.cos_sin, kv, meta)
        return x + residual

    @torch.inference_mode()
    def greedy(self, hidden: torch.Tensor) -> torch.Tensor:
        """The target token ids the head ranks first after these rows of forward()'s output."""
        x = self.norm(hidden)[0] if self.version == 3 else hidden
        if self.lay.own_lm_head:
            d = self.lm_head(x).argmax(dim=-1)
            return d + self.d2t[d]
        return self.target.logits(x).argmax(dim=-1)

    def load(self, tensors: dict[str, torch.Tensor], path: Path) -> None:
        """The checkpoint's tensors, q/k/v and gate/up fused as the layers hold them."""
        params = dict(self.named_parameters())
        cfg = self.cfg
        h, hkv, d, inter = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size
        parts = {"q_proj": ("qkv_proj", 0, h * d), "k_proj": ("qkv_proj", h * d, hkv * d),
                 "v_proj": ("qkv_proj", (h + hkv) * d, hkv * d),
                 "gate_proj": ("gate_up_proj", 0, inter), "up_proj": ("gate_up_proj", inter,
                                                                      inter)}
        filled: set[str] = set()
        for name, t in tensors.items():
            if name == "t2d" or name.endswith("rotary_emb.inv_freq"):
                continue  # (t2d: which target ids the draft vocabulary covers, unused here)
            if name == "d2t":
                if tuple(t.shape) != tuple(self.d2t.shape):
                    raise DraftModelError(f"--speculative-config: {path}: d2t is "
                                          f"{list(t.shape)}, the head drafts over "
                                          f"{self.d2t.shape[0]} tokens")
                self.d2t.copy_(t.long())
                ids = torch.arange(len(t)) + t.long()
                if int(ids.min()) < 0 or int(ids.max()) >= self.target.cfg.vocab_size:
                    raise DraftModelError(f"--speculative-config: {path}: d2t maps a draft "
                                          f"token outside the target's vocabulary")
                continue
            if self.version == 1 and name == "layers.0.input_layernorm.weight":
                continue  # saved by the trainer, not applied to the first layer
            target, rows = name, None
            for part, (fused, start, size) in parts.items():
                if f".{part}." in name:
                    target, rows = name.replace(part, fused), (start, size)
            if target not in params:
                raise DraftModelError(f"--speculative-config: {path}: unexpected tensor "
                                      f"{name} for an EAGLE{'-3' if self.version == 3 else ''}"
                                      f" head")
            dst = params[target].data
            if rows is not None:
                dst = dst.narrow(0, *rows)
            if tuple(dst.shape) != tuple(t.shape):
                raise DraftModelError(f"--speculative-config: {path}: {name} is "
                                      f"{list(t.shape)}, the head's config makes it "
                                      f"{list(dst.shape)}")
            dst.copy_(t)
            filled.add(target if rows is None else f"{target}[{rows[0]}]")
        missing = []  # under the checkpoint's names
        for n in sorted(params):
            if self.version == 1 and n == "layers.0.input_layernorm.weight":
                continue
            fused = [(part, start) for part, (f, start, _) in parts.items() if f".{f}." in n]
            missing += [n.replace(f".{f}", f".{part}") for part, start in fused
                        for f in ("qkv_proj", "gate_up_proj") if f".{f}." in n
                        and f"{n}[{start}]" not in filled] if fused else \
                [n] if n not in filled else []
        if missing:
            raise DraftModelError(f"--speculative-config: {path}: the head has no "
                                  f"{missing[0]} ({len(missing)} tensors missing)")

    def fill_random(self, seed: int = 0) -> None:
        """N(0, 0.02) weights, norms 1, d2t 0 (benchmarks: --load-format random)."""
        gen = torch.Generator(device=self.fc.weight.device).manual_seed(seed)
        for name, p in self.named_parameters():
            if "norm" in name:
                p.data.fill_(1.0)
            else:
                p.data.normal_(0.0, 0.02, generator=gen)


def target_vocab(path: Path, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The target's whole embed_tokens and lm_head (tied: the embeddings), read alone from its
    safetensors: with tensor parallelism rank 0 holds only its slice of each, and a head reads
    them whole."""
    from safetensors import safe_open

    found: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            for name in st.keys():  # noqa: SIM118 (not a dict)
                n = text_weight_name(name) if cfg.multimodal else name
                if n is not None and n.removeprefix("model.") in ("embed_tokens.weight",
                                                                  "lm_head.weight"):
                    found[n.removeprefix("model.")] = st.get_tensor(name)
    if "embed_tokens.weight" not in found:
        raise DraftModelError(f"--speculative-config: the target {path} has no embed_tokens "
                              f"in its safetensors for the EAGLE head to read")
    found.setdefault("lm_head.weight", found["embed_tokens.weight"])
    return found


def head_config(path: Path, method: str) -> ModelConfig:
    """The head's layer config: its config.json, or for a speculators-library head the
    transformer_layer_config inside it with the EAGLE keys beside it (norm_before_residual
    true unless it says otherwise, as that library writes its heads)."""
    raw = json.loads((path / "config.json").read_text())
    kind = raw.get("speculators_model_type")
    if kind is None:
        return ModelConfig.from_pretrained(path, "native")
    if kind != method:
        raise ValueError(f"a speculators {kind!r} head, not one for method {method!r}")
    from transformers import AutoConfig

    layer = dict(raw.get("transformer_layer_config") or {})
    if not layer:
        raise ValueError("no transformer_layer_config in its config.json")
    hf = AutoConfig.for_model(layer.pop("model_type", "llama"), **layer)
    hf.norm_before_residual = raw.get("norm_before_residual", True)
    for key in ("draft_vocab_size", "target_hidden_size", "eagle_aux_hidden_state_layer_ids"):
        if raw.get(key) is not None:
            setattr(hf, key, raw[key])
    return ModelConfig.from_hf(hf)


def load_head(method: str, path: str, target: CausalLM, ops: Ops, dtype: torch.dtype,
              device: torch.device, max_pos: int, random: bool,
              target_dir: str = "") -> EagleHead:
    """The head at `path` for this target, on its device; DraftModelError if it cannot serve.
    A target split over tensor-parallel ranks (rank 0's share here) lends the head its whole
    embeddings, and EAGLE-1 its whole lm_head, read from `target_dir` (random: drawn)."""
    where = Path(path)
    if not (where / "config.json").is_file():
        raise DraftModelError(f"--speculative-config: the {method} head {path} has no "
                              f"config.json")
    try:
        hc = head_config(where, method)
    except (ValueError, OSError, json.JSONDecodeError) as e:
        raise DraftModelError(f"--speculative-config: the {method} head {path}: "
                              f"{str(e).splitlines()[0]}") from None
    if hc.rotary_dim or hc.rotary_interleaved:  # its q and k are read as they are, not in
        # layers.rotary_order
        raise DraftModelError(f"--speculative-config: the {method} head {path} has partial "
                              "rotary embeddings, which EAGLE heads are not served with")
    tensors = None if random else read_tensors(where)
    sharded = target.cfg.tp_size > 1
    lend = ("embed_tokens.weight",) + (("lm_head.weight",) if VERSIONS[method] == 1 else ())
    if sharded and tensors is not None and any(n not in tensors for n in lend):
        whole = target_vocab(Path(target_dir), target.cfg)
        tensors.update({n: whole[n] for n in lend if n not in tensors})
    lay = layout(method, hc, target.cfg,
                 None if tensors is None else {n: tuple(t.shape) for n, t in tensors.items()})
    if sharded and tensors is None:  # random: drawn whole with the head
        lay = replace(lay, own_embed=True, own_lm_head=True,
                      draft_vocab=lay.draft_vocab if lay.own_lm_head else target.cfg.vocab_size)
    head = EagleHead(hc, lay, target, ops, max_pos)
    head.to(dtype=dtype)
    if tensors is None:
        head.fill_random()
    else:
        head.load(tensors, where)
    head.to(device)
    head.cos_sin = rope_cos_sin_cache(hc, max_pos, device)
    return head


class HeadGraphs:
    """CUDA graphs of one proposal pass of the head, one per batch size of capture_sizes up
    to HEAD_GRAPH_ROWS, over static buffers: a pass reads ids, h, positions, slots and
    sequence lengths, and writes its drafts into ids and its output into h, the next pass's
    inputs. Padding rows and rows that sit a pass out have slot -1 and length 0 (no KV
    written, no key read); their drafts are garbage nobody reads."""

    def __init__(self, head: EagleHead, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 max_batch: int, block_size: int, device: torch.device) -> None:
        self.head, self.kv_caches, self.device = head, kv_caches, device
        self.sizes = capture_sizes(min(max_batch, HEAD_GRAPH_ROWS))
        n = self.max_batch = self.sizes[-1]
        self.max_blocks = -(-head.max_pos // block_size)
        cuda = device.type == "cuda"  # (tests build one on the CPU, replaying eagerly)
        before = torch.cuda.mem_get_info(device)[0] if cuda else 0
        i64, i32 = torch.int64, torch.int32
        self.ids = torch.zeros(n, dtype=i64, device=device)
        self.positions = torch.zeros(n, dtype=i64, device=device)
        self.slots = torch.full((n,), -1, dtype=i64, device=device)
        self.seq_lens = torch.zeros(n, dtype=i32, device=device)
        self.tables = torch.zeros((n, self.max_blocks), dtype=i32, device=device)
        self.cu = torch.arange(n + 1, dtype=i32, device=device)
        self.hidden = torch.zeros((n, head.cfg.hidden_size), dtype=head.fc.weight.dtype,
                                  device=device)
        self.drafts = torch.zeros(n, dtype=i64, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.capture_bytes = before - torch.cuda.mem_get_info(device)[0] if cuda else 0

    @staticmethod
    def estimate_bytes(head: EagleHead, max_batch: int) -> int:
        """An upper estimate of the graphs' buffers and pool (the memory profile's share):
        per row the logits in float32 twice over (the lm_head's output, its argmax's input),
        and the layers' activations in float32 at most."""
        rows = capture_sizes(min(max_batch, HEAD_GRAPH_ROWS))[-1]
        vocab = head.lay.draft_vocab if head.lay.own_lm_head else head.target.cfg.vocab_size
        cfg = head.cfg
        per_layer = 8 * cfg.hidden_size + 3 * cfg.intermediate_size
        return rows * 4 * (2 * vocab + per_layer * max(cfg.num_layers, 1) + 4 * cfg.hidden_size)

    def forward(self, bs: int) -> None:
        """What a graph of bs rows records: one pass, its drafts and h into the inputs."""
        meta = AttentionMetadata(
            slot_mapping=self.slots[:bs], block_tables=self.tables[:bs],
            seq_lens=self.seq_lens[:bs], cu_seqlens_q=self.cu[:bs + 1], max_query_len=1,
            max_seq_len=self.head.max_pos)
        x = self.head(self.ids[:bs], self.positions[:bs], self.hidden[:bs], self.kv_caches,
                      meta)
        self.drafts[:bs].copy_(self.head.greedy(x))
        self.ids[:bs].copy_(self.drafts[:bs])
        self.hidden[:bs].copy_(x)

    def capture(self) -> None:
        """Capture every size, largest first so the smaller graphs reuse its memory pool
        (slot -1 everywhere: the warm-ups write no KV)."""
        start = time.perf_counter()
        sizes = list(reversed(self.sizes))
        graphs, used = capture_graphs(self.device, [
            (None, functools.partial(self.forward, bs)) for bs in sizes])
        self.graphs = dict(zip(sizes, graphs, strict=True))
        self.capture_bytes += used
        log.info("captured %d CUDA graphs of the EAGLE head's pass (batch %d..%d) in %.1f s, "
                 "%.0f MiB", len(self.sizes), self.sizes[0], self.max_batch,
                 time.perf_counter() - start, used / (1 << 20))

    def fits(self, batch: int, num_blocks: int) -> bool:
        """Whether the graphs take this pass (never before capture: the warm-up's steps
        propose eagerly)."""
        return bool(self.graphs) and batch <= self.max_batch and num_blocks <= self.max_blocks

    def chain(self, tokens: torch.Tensor, hidden: torch.Tensor, pos: np.ndarray,
              slots: np.ndarray, tables: np.ndarray) -> torch.Tensor:
        """The passes of pass_grid's positions and slots [K, B] (slot -1: the row sits the pass
        out) over B rows with their tokens [B] and h [B, H] on the device, back to back; the
        drafts of every pass, [K, B] on the device (garbage where a row sat out)."""
        passes, b = pos.shape
        bs = self.sizes[bisect.bisect_left(self.sizes, b)]
        dev = self.device
        steps = to_device(np.stack([pos, slots, np.where(slots >= 0, pos + 1, 0)]), dev)
        self.ids[:b].copy_(tokens)
        self.hidden[:b].copy_(hidden)
        self.slots[b:bs], self.seq_lens[b:bs] = -1, 0
        self.tables[:b, :tables.shape[1]].copy_(to_device(tables, dev))
        out = torch.empty((passes, b), dtype=torch.int64, device=dev)
        for j in range(passes):
            self.positions[:b].copy_(steps[0, j])
            self.slots[:b].copy_(steps[1, j])
            self.seq_lens[:b].copy_(steps[2, j])
            self.graphs[bs].replay()
            out[j].copy_(self.drafts[:b])
        return out


class EagleDraft:
    """The head at serving time: its KV cache and the two passes the runner asks for."""

    def __init__(self, head: EagleHead, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 block_size: int, device: torch.device) -> None:
        self.head, self.kv_caches = head, kv_caches
        self.block_size, self.device = block_size, device
        self.proposed_tokens = 0  # drafts proposed since start (tests, logs)
        self.max_pos = head.max_pos
        self.graphs: HeadGraphs | None = None  # set by the worker (CUDA, not eager)

    @torch.inference_mode()
    def catch_up(self, next_ids: np.ndarray, tapped: torch.Tensor, positions: np.ndarray,
                 slots: np.ndarray, tables: np.ndarray, q_lens: np.ndarray,
                 seq_lens: np.ndarray) -> None:
        """The positions whose next token is known at launch, for the head's KV only: rows
        next_ids / tapped / positions / slots [T], in segments of q_lens, one per table row,
        each ending at its seq_len."""
        dev = self.device
        cu = np.zeros(len(q_lens) + 1, np.int32)
        np.cumsum(q_lens, out=cu[1:])
        meta = AttentionMetadata(
            slot_mapping=to_device(slots, dev), block_tables=to_device(tables, dev),
            seq_lens=to_device(seq_lens.astype(np.int32), dev), cu_seqlens_q=to_device(cu, dev),
            max_query_len=int(q_lens.max()), max_seq_len=int(seq_lens.max()))
        head = self.head
        head(to_device(next_ids.astype(np.int64), dev), to_device(positions, dev),
             head.combine(tapped), self.kv_caches, meta)

    @torch.inference_mode()
    def propose(self, tokens: np.ndarray, tapped: torch.Tensor, positions: np.ndarray,
                table: np.ndarray, rows: np.ndarray, ks: np.ndarray) -> list[list[int]]:
        """Each row's last kept position (positions [R]) with the token sampled there
        (tokens [R]) and the target's state there (tapped [R, W]): one pass writes their KV
        and drafts a first token for the rows with ks > 0, then each further pass one more,
        up to ks[i] (which never reaches past the row's blocks: the caller caps it). The
        drafts of each row, in row order."""
        n, dev, head = len(rows), self.device, self.head
        passes = int(ks.max()) if n else 0
        # (pass 0 writes every row's KV, drafting or not)
        pos, on, slots, tables = pass_grid(table, rows, positions, np.maximum(ks, 1),
                                           self.block_size)
        cur = to_device(tokens.astype(np.int64), dev)
        hid = head.combine(tapped)  # each row's h, its own from the first pass on
        if self.graphs is not None and self.graphs.fits(n, tables.shape[1]):
            out = self.graphs.chain(cur, hid, pos, slots, tables)
        else:
            out = self._passes(cur, hid.clone() if hid is tapped else hid, pos, on, slots,
                               tables, ks)
        if not passes:  # only the KV writes: no wait (under async scheduling the device may
            return [[] for _ in range(n)]  # already run the next step, planned meanwhile)
        drafts = out.cpu().numpy()  # the one wait for the device
        self.proposed_tokens += int(ks.sum())
        return [drafts[:k, i].tolist() for i, k in enumerate(ks.tolist())]

    def _passes(self, cur: torch.Tensor, hid: torch.Tensor, pos: np.ndarray, on: np.ndarray,
                slots: np.ndarray, tables: np.ndarray, ks: np.ndarray) -> torch.Tensor:
        """propose()'s passes eagerly, each over the rows that run it: [K, B] drafts."""
        n, dev, head = len(ks), self.device, self.head
        passes = len(pos)
        out = torch.zeros((passes, n), dtype=torch.int64, device=dev)
        # every pass's inputs in one copy to the device; a pass takes its live rows there
        staged = to_device(np.stack([pos, slots, pos + 1]), dev)  # [3, pass, row]
        tables_dev = to_device(tables, dev)
        counts = torch.arange(n + 1, dtype=torch.int32, device=dev)
        for j in range(passes):
            live = np.flatnonzero(on[j])
            m = len(live)
            index = to_device(live, dev)
            step = staged[:, j, index]
            meta = AttentionMetadata(
                slot_mapping=step[1], block_tables=tables_dev[index],
                seq_lens=step[2].to(torch.int32), cu_seqlens_q=counts[:m + 1],
                max_query_len=1, max_seq_len=int(pos[j, live].max()) + 1)
            x = head(cur[index], step[0], hid[index], self.kv_caches, meta)
            drafting = np.flatnonzero(ks[live] > j)
            if not len(drafting):
                break
            sel = to_device(drafting, dev)
            out[j, index[sel]] = head.greedy(x[sel])
            hid[index] = x
            cur = out[j].clone()
        return out
