"""The executor with an FP8 KV cache (--kv-cache-dtype fp8) on the CPU: its memory sizing, the
checkpoint's scales, and greedy tokens through chunked prefill, decode, swap and a prefix-cache
hit against HF transformers whose attention reads K and V through the same e4m3 rounding
(written here from torch's float8 cast alone; fp32)."""

from __future__ import annotations

import argparse

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AttentionInterface, AutoConfig, AutoModelForCausalLM
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from pagedserve.executor import flags
from pagedserve.executor.worker import ExecutorConfig, Worker, executor_config
from tests.executor_svc.test_tensor_parallel import BS, CONFIGS, script

FP8 = torch.float8_e4m3fn
HF_FP8 = "pagedserve_test_fp8_kv"
_hf_scales: dict[int, tuple[float, float]] = {}  # layer -> (k_scale, v_scale) for HF_FP8


def fp8_round_trip(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x as an FP8 cache gives it back: x / scale saturated to e4m3's 448, rounded, * scale."""
    return (x / scale).clamp(-448.0, 448.0).to(FP8).to(x.dtype) * scale


def _fp8_kv_attention(module, query, key, value, attention_mask, **kwargs):
    # key/value: [B, Hkv, S, D], every cached position (post-RoPE); rounding each step again
    # is idempotent, so this equals storing them rounded once
    k_scale, v_scale = _hf_scales.get(module.layer_idx, (1.0, 1.0))
    return sdpa_attention_forward(module, query, fp8_round_trip(key, k_scale),
                                  fp8_round_trip(value, v_scale), attention_mask, **kwargs)


AttentionInterface.register(HF_FP8, _fp8_kv_attention)


def hf_greedy(hf, prompts: list[list[int]], lengths: list[int]) -> list[list[int]]:
    out = []
    for p, n in zip(prompts, lengths, strict=True):
        with torch.no_grad():
            gen = hf.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False,
                              pad_token_id=0, eos_token_id=None)
        out.append(gen[0, len(p):].tolist())
    return out


def save_tiny(path, scales: dict[str, float] | None = None):
    """The tensor-parallel tests' Llama (2 layers, 2 KV heads of 16), plus FP8 KV scale
    tensors named as checkpoints name them. Weights of std 0.1, not 0.02: attention then moves
    the logits enough that e4m3's rounding changes greedy tokens (18 of 62 in script())."""
    torch.manual_seed(0)
    d = dict(CONFIGS["llama"])
    hf = AutoModelForCausalLM.from_config(
        AutoConfig.for_model(d.pop("model_type"), initializer_range=0.1, **d),
        dtype=torch.float32).eval()
    hf.save_pretrained(path)
    if scales:
        f = path / "model.safetensors"
        tensors = load_file(f)
        tensors.update({k: torch.tensor(v) for k, v in scales.items()})
        save_file(tensors, f, metadata={"format": "pt"})
    return hf


def fp8_worker(path, *extra: str) -> Worker:
    p = argparse.ArgumentParser()
    p.add_argument("--model")
    flags.add_args(p)
    args = p.parse_args(["--model", str(path), "--device", "cpu", "--block-size", str(BS),
                         "--num-kv-blocks", "48", "--swap-space-gib", "0.001",
                         "--kv-cache-dtype", "fp8", *extra])
    return Worker(executor_config(args, 0, 1, "cpu"))


def _script_prompts():
    """The prompts script() sends (same generator draws), whole."""
    g = torch.Generator().manual_seed(3)
    p1, p2 = (torch.randint(0, 255, (n,), generator=g).tolist() for n in (13, 9))
    p3 = p1[:8] + torch.randint(0, 255, (6,), generator=g).tolist()
    return [p1, p2, p3]


@pytest.mark.parametrize("scales", [{}, {
    "model.layers.0.self_attn.k_scale": 0.01, "model.layers.0.self_attn.v_scale": 0.002,
    "model.layers.1.self_attn.k_proj.output_scale": 0.05,  # compressed-tensors' name
}], ids=["default-scales", "checkpoint-scales"])
def test_greedy_tokens_match_hf_reading_kv_through_fp8(tmp_path, scales):
    hf = save_tiny(tmp_path, scales)
    worker = fp8_worker(tmp_path)
    assert all(k.dtype == v.dtype == FP8 for k, v in worker.runner.kv_caches)
    attn = [layer.self_attn for layer in worker.runner.model.layers]
    want_scales = [(0.01, 0.002), (0.05, 1.0)] if scales else [(1.0, 1.0)] * 2
    got_scales = [s for a in attn for s in (a.k_scale, a.v_scale)]
    assert got_scales == pytest.approx([s for pair in want_scales for s in pair])
    got, _ = script(worker.runner)  # chunked prefill, decode, swap out/in, a prefix-cache hit
    prompts = _script_prompts()
    lengths = [len(got[r]) for r in (1, 2, 3)]
    plain = hf_greedy(hf, prompts, lengths)
    _hf_scales.clear()
    _hf_scales.update(enumerate(want_scales))
    hf.set_attn_implementation(HF_FP8)
    try:
        want = hf_greedy(hf, prompts, lengths)
    finally:
        _hf_scales.clear()
    assert [got[r] for r in (1, 2, 3)] == want
    # the rounding is visible in the tokens: this script tells an FP8 cache from a float one
    assert want != plain


def test_latent_cache_in_fp8_matches_hf_rounding_its_cached_latent(tmp_path):
    """Latent attention (DeepSeek V3) over an FP8 cache: the one tensor of [latent, rotated
    rope part] goes through e4m3 once, at the layer's k_scale; HF's equal is its cached latent
    and rope part rounded alike before expand_kv makes keys and values of them."""
    from safetensors.torch import load_file, save_file

    from tests.executor_svc.test_families import FAMILIES, hf_and_ours_of

    hf, _, _ = hf_and_ours_of({**FAMILIES["deepseek_v3"], "initializer_range": 0.2}, tmp_path)
    if not hasattr(hf.model.layers[0].self_attn, "expand_kv"):
        pytest.skip("this transformers' DeepseekV3Attention caches expanded keys and values")
    f = tmp_path / "model.safetensors"
    save_file({**load_file(f), "model.layers.0.self_attn.k_scale": torch.tensor(0.02)}, f,
              metadata={"format": "pt"})
    worker = fp8_worker(tmp_path)
    (k, v), attn = worker.runner.kv_caches[0], worker.runner.model.layers[0].self_attn
    assert k.dtype == FP8 and k.data_ptr() == v.data_ptr()
    assert attn.k_scale == pytest.approx(0.02)
    got, _ = script(worker.runner)
    prompts = _script_prompts()
    lengths = [len(got[r]) for r in (1, 2, 3)]
    plain = hf_greedy(hf, prompts, lengths)
    for i, layer in enumerate(hf.model.layers):
        expand, s = layer.self_attn.expand_kv, 0.02 if i == 0 else 1.0
        layer.self_attn.expand_kv = (lambda kv, rot, expand=expand, s=s: expand(
            fp8_round_trip(kv, s), fp8_round_trip(rot, s)))
    want = hf_greedy(hf, prompts, lengths)
    assert [got[r] for r in (1, 2, 3)] == want
    assert want != plain  # the rounding shows in the tokens


def test_bad_checkpoint_scale_is_refused_with_its_name(tmp_path):
    save_tiny(tmp_path, {"model.layers.1.self_attn.v_scale": 0.0})
    with pytest.raises(ValueError, match=r"layers.1.self_attn.v_scale: an FP8 KV scale must be "
                                         r"positive and finite, got 0.0"):
        fp8_worker(tmp_path)


def test_fp8_cache_holds_twice_the_tokens_of_bf16_in_the_same_budget(tmp_path):
    save_tiny(tmp_path)
    # (K, V) x 2 layers x 2 KV heads x 16: 256 bytes a token in bf16, 128 in FP8; 16-token blocks
    common = dict(model=str(tmp_path), device="cpu", dtype="bfloat16", block_size=16,
                  kv_cache_bytes=1 << 20, swap_space_bytes=1 << 18)
    bf16 = Worker(ExecutorConfig(**common))
    fp8 = Worker(ExecutorConfig(**common, kv_cache_dtype="fp8"))
    assert (bf16.num_blocks, fp8.num_blocks) == (256, 512)
    assert (bf16.swap.num_blocks, fp8.swap.num_blocks) == (64, 128)
    assert (bf16.capacity.num_kv_blocks, fp8.capacity.num_kv_blocks) == (256, 512)
    assert (bf16.capacity.kv_cache_dtype, fp8.capacity.kv_cache_dtype) == (
        "bfloat16", "float8_e4m3fn")
    assert bf16.capacity.dtype == fp8.capacity.dtype == "bfloat16"  # the model's own
    k, v = fp8.runner.kv_caches[0]
    assert k.dtype == v.dtype == FP8 and k.nbytes == bf16.runner.kv_caches[0][0].nbytes


def test_unknown_kv_cache_dtype_is_refused(tmp_path):
    save_tiny(tmp_path)
    with pytest.raises(ValueError, match="kv cache dtype must be auto or fp8, got 'fp16'"):
        Worker(ExecutorConfig(model=str(tmp_path), device="cpu", kv_cache_dtype="fp16",
                              num_kv_blocks=8))
    p = argparse.ArgumentParser()
    flags.add_args(p)
    with pytest.raises(SystemExit):  # the flag offers auto and fp8 only
        p.parse_args(["--kv-cache-dtype", "fp8_e5m2"])
