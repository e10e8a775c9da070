"""bf16 numerics on real weights: how far pagedserve's bf16 drifts from fp32, beside HF's own.

On the default model (SmolLM2-135M-Instruct: its GGUF, converted as `serve` converts it), over
a fixed text read teacher-forced: the mean |log p(token)| difference of each engine's bf16 from
HF's fp32 (the drift), and the same of pagedserve's fp32; then greedy continuations of 13 chat
and raw prompts, counted equal to HF fp32's. The paged model runs its Triton kernels on CUDA
(torch on the CPU), a whole prompt in one prefill step and then one token a step.

    python -m benchmarks.numerics --gguf /tmp/SmolLM2-135M-Instruct.Q4_1.gguf   # on the GPU

--ablate (CUDA) adds, per kernel, the bf16 drift with that one op run by its torch reference on
the GPU (fields drift_pagedserve_bf16_torch_<op>), and with every op so: where a drift comes
from; and both engines' bf16 drift with cuBLAS's split-K sums kept in float32
(drift_*_bf16_fp32_reduction), with the projections unfused, with the rotation rounded as
HF's (drift_pagedserve_bf16_hf_rotary), and over a longer text.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from benchmarks.common import write_records

TEXT = (
    "The history of the printing press begins in the fifteenth century, when Johannes "
    "Gutenberg combined movable metal type, oil-based ink and a wooden screw press into a "
    "system that could produce books quickly and cheaply. Before that, texts were copied by "
    "hand, usually by monks in monasteries, and a single book could take months to finish. "
    "The new technology spread across Europe within decades, and by 1500 printing shops in "
    "more than two hundred cities had produced millions of copies. Literacy rose, ideas "
    "travelled faster than ever before, and the Reformation and the scientific revolution "
    "both owed much to pamphlets and books that anyone could buy. Today we take for granted "
    "that a text can be copied without error, but for most of history every copy was a new "
    "chance for mistakes to creep in."
)
# a longer fixed text of other kinds (prose, code, dialogue, numbers) for the same measure over
# ~4x the tokens: the mean over 155 tokens has a standard error of ~10 % of itself
LONG_TEXT = TEXT + (
    "\n\nIn a small town by the sea, the bakery opened at five every morning. Maria, who had "
    "run it for thirty years, said the secret was patience: dough that rests overnight tastes "
    "of wheat, not of yeast. Her customers were fishermen coming back from the night, nurses "
    "ending their shifts, and children who spent their pocket money on almond biscuits.\n\n"
    "def merge_sorted(a, b):\n    \"\"\"Merge two sorted lists into one sorted list.\"\"\"\n"
    "    out, i, j = [], 0, 0\n    while i < len(a) and j < len(b):\n"
    "        if a[i] <= b[j]:\n            out.append(a[i])\n            i += 1\n"
    "        else:\n            out.append(b[j])\n            j += 1\n"
    "    return out + a[i:] + b[j:]\n\n"
    "Q: How far is the Moon from the Earth?\nA: On average about 384,400 kilometres, which "
    "light crosses in a little over one second.\nQ: And the Sun?\nA: About 150 million "
    "kilometres: its light takes roughly eight minutes and twenty seconds to reach us.\n\n"
    "The recipe needs 250 grams of flour, 125 grams of butter, two eggs and a pinch of salt. "
    "Rub the butter into the flour until it looks like breadcrumbs, add the eggs, and knead "
    "briefly; chill the pastry for half an hour before rolling it out. Bake at 180 degrees "
    "for twenty-five minutes, or until golden.\n\nPhotosynthesis converts light energy into "
    "chemical energy. In the chloroplasts of plant cells, water is split, oxygen is released, "
    "and carbon dioxide is fixed into sugars through the Calvin cycle. Almost all life on "
    "Earth depends, directly or indirectly, on this process, which also produced the oxygen "
    "in the atmosphere over billions of years.")
PROMPTS = [("text", "The capital of France is"), ("text", "def fibonacci(n):"),
           ("text", "Once upon a time, in a land far away, there lived a"),
           ("text", "The three laws of motion are"), ("text", "import numpy as np\n"),
           ("chat", "What is the capital of France?"), ("chat", "Write a haiku about the sea."),
           ("chat", "Explain in one sentence what a GPU is."),
           ("chat", "List three primary colors."), ("chat", "How do I reverse a list in Python?"),
           ("chat", "Give me a synonym for happy."), ("chat", "What is 12 times 12?"),
           ("chat", "Name a famous painting by Leonardo da Vinci.")]
NEW_TOKENS = 32


class Paged:
    """The executor's model over a paged cache of one sequence at a time."""

    def __init__(self, model_dir: Path, dtype: torch.dtype, device: str,
                 torch_ops: tuple[str, ...] = ()) -> None:
        from pagedserve.executor.config import ModelConfig
        from pagedserve.executor.loader import build_model
        from pagedserve.kernels import get_ops

        self.cfg = ModelConfig.from_pretrained(model_dir)
        ops = get_ops("triton" if device == "cuda" else "torch")
        reference = get_ops("torch")
        for op in torch_ops:  # these by their torch reference (--ablate)
            setattr(ops, op, getattr(reference, op))
        self.model = build_model(self.cfg, ops, dtype, torch.device(device), 2048, model_dir)
        self.dtype, self.device, self.block = dtype, device, 16

    def _caches(self, n: int):
        shape = (-(-n // self.block), self.block, self.cfg.num_kv_heads, self.cfg.head_dim)
        return [(torch.zeros(shape, dtype=self.dtype, device=self.device),
                 torch.zeros(shape, dtype=self.dtype, device=self.device))
                for _ in range(self.cfg.num_layers)]

    def _step(self, ids: list[int], start: int, kv, all_rows: bool) -> torch.Tensor:
        from pagedserve.executor.model import AttentionMetadata

        def t(x, dt=torch.int64):
            return torch.tensor(x, dtype=dt, device=self.device)

        n, end = len(ids), start + len(ids)
        table = list(range(kv[0][0].shape[0]))
        meta = AttentionMetadata(t(list(range(start, end))), t([table], torch.int32),
                                 t([end], torch.int32), t([0, n], torch.int32), n, end)
        hidden = self.model.hidden(t(ids), t(list(range(start, end))), kv, meta)
        return self.model.logits(hidden if all_rows else hidden[-1:])

    def logprobs(self, ids: list[int]) -> torch.Tensor:  # [n - 1]: log p(ids[i] | ids[:i])
        logits = self._step(ids, 0, self._caches(len(ids)), True)
        return logits[:-1].log_softmax(-1).gather(1, torch.tensor(ids[1:], device=self.device)
                                                  [:, None])[:, 0]

    def greedy(self, ids: list[int], n: int, eos: set[int]) -> list[int]:
        """Up to n tokens, the EOS that ends them included (as HF generate stops)."""
        kv = self._caches(len(ids) + n)
        out = [int(self._step(ids, 0, kv, False)[0].argmax())]
        while len(out) < n and out[-1] not in eos:
            out.append(int(self._step(out[-1:], len(ids) + len(out) - 1, kv, False)[0].argmax()))
        return out


def hf_logprobs(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([ids], device=model.device)).logits[0].float()
    return logits[:-1].log_softmax(-1).gather(1, torch.tensor(ids[1:], device=model.device)
                                              [:, None])[:, 0]


def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([ids], device=model.device), max_new_tokens=n,
                             do_sample=False, pad_token_id=2)
    return out[0, len(ids):].tolist()


ABLATE = ("paged_attention", "rotary_and_cache", "rms_norm", "silu_and_mul")


class _Unfused(torch.nn.Module):
    """A fused projection as HF computes it: one GEMM per part of its output (q, k and v;
    gate and up), each part's rows of the same weight."""

    def __init__(self, fused: torch.nn.Module, parts: list[int]) -> None:
        super().__init__()
        self.fused, self.parts = fused, parts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w, b = self.fused.weight, self.fused.bias
        ws = w.split(self.parts)
        bs = b.split(self.parts) if b is not None else [None] * len(ws)
        return torch.cat([torch.nn.functional.linear(x, wi, bi) for wi, bi in zip(
            ws, bs, strict=True)], dim=-1)


def hf_rotary_and_cache(positions, q, k, v, cos_sin_cache, k_cache, v_cache, slot_mapping,
                        k_scale=1.0, v_scale=1.0, **norms):
    """reference.rotary_and_cache with the rotation rounded as HF's bf16 path rounds it: cos
    and sin cast to the activations' dtype, q * cos + rotate_half(q) * sin in that dtype."""
    from pagedserve.kernels import reference

    if any(w is not None for w in norms.values()):
        raise ValueError("hf_rotary_and_cache: no q/k norms (the default model has none)")
    half = cos_sin_cache.shape[1] // 2
    cs = cos_sin_cache[positions]
    cos = torch.cat([cs[:, :half]] * 2, dim=-1)[:, None].to(q.dtype)
    sin = torch.cat([cs[:, half:]] * 2, dim=-1)[:, None].to(q.dtype)

    def rot(x: torch.Tensor) -> torch.Tensor:
        return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin

    q, k = rot(q), rot(k)
    reference.write_kv_cache(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    return q


def unfuse(paged: Paged) -> Paged:
    """paged with its q/k/v and gate/up projections split back into HF's GEMMs."""
    for layer in paged.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        attn.qkv_proj = _Unfused(attn.qkv_proj, [attn.h * attn.d, attn.hkv * attn.d,
                                                 attn.hkv * attn.d])
        half = mlp.gate_up_proj.weight.shape[0] // 2
        mlp.gate_up_proj = _Unfused(mlp.gate_up_proj, [half, half])
    return paged


def measure(model_dir: Path, device: str, ablate: bool = False) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    text = tok.encode(TEXT)
    prompts = [tok.encode(c) if kind == "text" else list(tok.apply_chat_template(
        [{"role": "user", "content": c}], add_generation_prompt=True, tokenize=True,
        return_dict=False)) for kind, c in PROMPTS]
    hf = {dt: AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dt).to(device).eval()
          for dt in (torch.float32, torch.bfloat16)}
    ours = {dt: Paged(model_dir, dt, device) for dt in (torch.float32, torch.bfloat16)}
    eos = hf[torch.float32].generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    ref = hf_logprobs(hf[torch.float32], text)
    want = [hf_greedy(hf[torch.float32], p, NEW_TOKENS) for p in prompts]

    def drift(lp: torch.Tensor) -> float:
        return float((lp.float() - ref).abs().mean())

    rec = {"kind": "numerics", "model": "smollm2-135m-instruct", "device": device,
           "text_tokens": len(text), "prompts": len(prompts), "new_tokens": NEW_TOKENS,
           "drift_hf_bf16": drift(hf_logprobs(hf[torch.bfloat16], text)),
           "drift_pagedserve_fp32": drift(ours[torch.float32].logprobs(text)),
           "drift_pagedserve_bf16": drift(ours[torch.bfloat16].logprobs(text))}
    if ablate:
        for ops in [(op,) for op in ABLATE] + [ABLATE]:
            paged = Paged(model_dir, torch.bfloat16, device, ops)
            name = ops[0] if len(ops) == 1 else "all"
            rec[f"drift_pagedserve_bf16_torch_{name}"] = drift(paged.logprobs(text))
        rec["drift_pagedserve_bf16_unfused"] = drift(unfuse(Paged(
            model_dir, torch.bfloat16, device)).logprobs(text))
        hf_rot = Paged(model_dir, torch.bfloat16, device)
        # (every layer holds the one ops namespace build_model was given)
        hf_rot.model.layers[0].self_attn.ops.rotary_and_cache = hf_rotary_and_cache
        rec["drift_pagedserve_bf16_hf_rotary"] = drift(hf_rot.logprobs(text))
        # the same measure over LONG_TEXT (~4x the tokens), and the per-token difference of
        # the two engines' drifts with its standard error: is the gap more than noise?
        long = tok.encode(LONG_TEXT)
        ref_long = hf_logprobs(hf[torch.float32], long)
        theirs = (hf_logprobs(hf[torch.bfloat16], long).float() - ref_long).abs()
        mine = (ours[torch.bfloat16].logprobs(long).float() - ref_long).abs()
        gap = mine - theirs
        rec.update({"long_text_tokens": len(long),
                    "drift_hf_bf16_long": float(theirs.mean()),
                    "drift_pagedserve_bf16_long": float(mine.mean()),
                    "drift_gap_long": float(gap.mean()),
                    "drift_gap_long_se": float(gap.std() / len(gap) ** 0.5)})
        if device == "cuda":  # cuBLAS's split-K partial sums in float32, not bf16 (torch's
            # default lets a bf16 GEMM reduce them in bf16): both engines' drift so
            matmul = torch.backends.cuda.matmul
            allowed = matmul.allow_bf16_reduced_precision_reduction
            matmul.allow_bf16_reduced_precision_reduction = False
            try:
                rec["drift_hf_bf16_fp32_reduction"] = drift(hf_logprobs(hf[torch.bfloat16],
                                                                        text))
                rec["drift_pagedserve_bf16_fp32_reduction"] = drift(
                    ours[torch.bfloat16].logprobs(text))
            finally:
                matmul.allow_bf16_reduced_precision_reduction = allowed
    for name, run in (("hf_bf16", lambda p: hf_greedy(hf[torch.bfloat16], p, NEW_TOKENS)),
                      ("pagedserve_fp32",
                       lambda p: ours[torch.float32].greedy(p, NEW_TOKENS, eos)),
                      ("pagedserve_bf16",
                       lambda p: ours[torch.bfloat16].greedy(p, NEW_TOKENS, eos))):
        rec[f"greedy_equal_{name}"] = sum(run(p) == w for p, w in zip(prompts, want,
                                                                      strict=True))
    return rec


def main() -> None:
    from pagedserve.core.models import gguf_to_hf_dir, resolve_model

    p = argparse.ArgumentParser()
    p.add_argument("--gguf", type=Path, default=None, help="default: the installed default model")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--ablate", action="store_true", help="each kernel by its torch reference")
    args = p.parse_args()
    model_dir = gguf_to_hf_dir(args.gguf) if args.gguf else resolve_model("default")
    rec = measure(model_dir, args.device, args.ablate)
    print(", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                    for k, v in rec.items()), flush=True)
    print("appended to", write_records("numerics", [rec]))


if __name__ == "__main__":
    main()
