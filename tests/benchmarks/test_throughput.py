"""benchmarks/throughput.py measures what it claims: a run of one request prefills all of it
(the warm-up leaves nothing of the measured prompts in the prefix cache), and a throughput
above the run's bound is never recorded."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks import throughput
from benchmarks.common import AboveTheBound, write_records


def test_a_one_request_run_prefills_its_whole_prompt(tmp_path) -> None:
    prompts, outputs = throughput.workload("", 1, 48, 3)
    ours = throughput.run_pagedserve(prompts, outputs, ["--max-num-batched-tokens", "256"])
    assert ours["prefix_cache_hit_tokens"] == 0
    assert ours["kv_cache_dtype"] == "float32"  # the CPU default's cache: the bound reads it


def test_warmup_prompts_share_lengths_not_ids() -> None:
    prompts, _ = throughput.workload("W2", 0, 0, 0)
    warm = throughput.warmup_prompts(prompts)
    assert [len(p) for p in warm] == [len(p) for p in prompts]
    assert all(w[:16] != p[:16] for w, p in zip(warm, prompts, strict=True))  # no shared block


def test_a_throughput_above_its_bound_is_refused(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("PAGEDSERVE_RESULTS", str(tmp_path))
    fine = {"engine": "pagedserve", "workload": "W1", "output_tok_s": 90.0,
            "bound_output_tok_s": 100.0, "bound_weight_bytes_per_param": 2.0}
    write_records("throughput", [fine])
    with pytest.raises(AboveTheBound, match=r"130 out tok/s is above its bound .*'bound_weight"):
        write_records("throughput", [fine, {**fine, "output_tok_s": 130.0}])
    lines = (tmp_path / "throughput.jsonl").read_text().splitlines()
    assert [json.loads(x)["output_tok_s"] for x in lines] == [90.0]  # the refused run: nothing


def test_the_bound_reads_weights_at_their_loaded_size() -> None:
    from types import SimpleNamespace

    cfg = SimpleNamespace(hidden_size=64, head_dim=16, num_heads=4, num_kv_heads=2,
                          intermediate_size=128, num_layers=2, vocab_size=1000,
                          tie_word_embeddings=False, moe=None,
                          kv_bytes_per_token=lambda b: 2 * 2 * 2 * 16 * b)
    params = throughput.weight_params(cfg)
    loaded = params.dense + 2 * params.head
    bf16 = throughput.bound_basis(cfg, 2.0 * loaded, "bfloat16")
    fp8 = throughput.bound_basis(cfg, 1.0 * loaded, "fp8_e4m3")
    assert bf16 == {"bound_weight_bytes_per_param": 2.0, "bound_kv_bytes": 2,
                    "bound_model": "dense"}
    assert fp8 == {"bound_weight_bytes_per_param": 1.0, "bound_kv_bytes": 1,
                   "bound_model": "dense"}
    bf16.pop("bound_model")
    args = (cfg, [8], [64], 1.0, 1000.0)  # bandwidth-bound: half the bytes, half the time
    t2 = throughput.roofline_seconds(*args, **dict(zip(("weight_bytes_per_param", "kv_bytes"),
                                                       bf16.values(), strict=True)))
    t1 = throughput.roofline_seconds(*args, 1.0, 1)
    assert t1 == pytest.approx(t2 / 2, rel=1e-3)


def test_the_bound_runs_max_num_seqs_at_a_time() -> None:
    """2 requests at --max-num-seqs 1 run one after the other: twice one request's time, more
    than both at once (which reads each step's weights once for two tokens)."""
    from types import SimpleNamespace

    cfg = SimpleNamespace(hidden_size=64, head_dim=16, num_heads=4, num_kv_heads=2,
                          intermediate_size=128, num_layers=2, vocab_size=1000,
                          tie_word_embeddings=False, moe=None,
                          kv_bytes_per_token=lambda b: 2 * 2 * 2 * 16 * b)
    one = throughput.roofline_seconds(cfg, [8], [64], 1.0, 1000.0)
    both = throughput.roofline_seconds(cfg, [8, 8], [64, 64], 1.0, 1000.0)
    waves = throughput.roofline_seconds(cfg, [8, 8], [64, 64], 1.0, 1000.0, max_running=1)
    assert waves == pytest.approx(2 * one)
    assert both < 1.1 * one
    assert throughput.roofline_seconds(cfg, [8, 8], [64, 64], 1.0, 1000.0,
                                       max_running=2) == both


def test_an_moe_bound_reads_the_experts_a_step_touches() -> None:
    from pagedserve.executor.config import ModelConfig

    cfg = ModelConfig.from_pretrained("benchmarks/models/qwen3-30b-a3b")
    params = throughput.weight_params(cfg)
    assert params.expert == 3 * 2048 * 768 and params.sparse_layers == 48
    assert params.touched(1) == pytest.approx(8) and params.touched(4096) == pytest.approx(128)
    # 30.5B loaded, 3.3B active (Qwen's figures: 30.5B and 3.3B)
    assert params.loaded(False) / 1e9 == pytest.approx(30.5, abs=0.1)
    assert params.active() / 1e9 == pytest.approx(3.3 - 0.3, abs=0.1)  # less the embedding


def test_a_latent_attention_bound_counts_its_projections_and_its_cache() -> None:
    from pagedserve.executor.config import ModelConfig

    cfg = ModelConfig.from_pretrained("benchmarks/models/deepseek-v2-lite")
    params = throughput.weight_params(cfg)
    # DeepSeek's figures for V2-Lite: 15.7B in all, 2.4B active (here less the embedding)
    assert params.loaded(False) / 1e9 == pytest.approx(15.7, abs=0.05)
    assert params.active() / 1e9 == pytest.approx(2.45, abs=0.01)
    assert cfg.kv_bytes_per_token(2) == 27 * 576 * 2  # the latent and its rope part, once
    # a decode step's KV read is the latent's: one sequence at context 1,000 and its weights
    one = throughput.roofline_seconds(cfg, [999], [2], 1.0, 1e9)
    two = throughput.roofline_seconds(cfg, [999], [3], 1.0, 1e9)
    assert (two - one) * 1e12 == pytest.approx(
        2 * params.read(1) + 1001 * 27 * 576 * 2, rel=1e-6)


def test_the_hf_peer_halves_its_batch_until_it_fits(monkeypatch) -> None:
    tried = []

    def generate(model, prompts, outputs, batch, device):
        tried.append(batch)
        if batch > 64:
            raise torch.OutOfMemoryError("CUDA out of memory")
        return 100.0

    monkeypatch.setattr(throughput, "run_hf_generate", generate)
    assert throughput.run_hf_generate_fitting(None, [[1]] * 256, [4] * 256, 256, "cpu") == \
        (100.0, 64)
    assert tried == [256, 128, 64]


def test_the_sequential_floor_adds_attention_to_the_gemms() -> None:
    """sequential=True: a decode step costs its KV read plus its GEMMs (weight read or FLOPs,
    the larger), not the larger of the step's bytes and FLOPs; prefill alike in both."""
    from types import SimpleNamespace

    cfg = SimpleNamespace(hidden_size=64, head_dim=16, num_heads=4, num_kv_heads=2,
                          intermediate_size=128, num_layers=2, vocab_size=1000,
                          tie_word_embeddings=False, moe=None,
                          kv_bytes_per_token=lambda b: 2 * 2 * 2 * 16 * b)
    prompt = throughput.roofline_seconds(cfg, [8], [1], 1.0, 1000.0)
    assert throughput.roofline_seconds(cfg, [8], [1], 1.0, 1000.0, sequential=True) == prompt
    # one decode step at context 9 (bandwidth-bound: FLOPs at 1,000 TFLOP/s are nothing)
    params = throughput.weight_params(cfg)
    weights, kv = 2.0 * params.read(1), 2 * 2 * 2 * 16 * 2 * 9
    plain = throughput.roofline_seconds(cfg, [8], [2], 1.0, 1000.0)
    seq = throughput.roofline_seconds(cfg, [8], [2], 1.0, 1000.0, sequential=True)
    assert plain - prompt == pytest.approx((weights + kv) / 1e12)
    assert seq - prompt == pytest.approx(kv / 1e12 + weights / 1e12)
    # compute-bound GEMMs (a slow rate): the KV read now adds to them
    slow = throughput.roofline_seconds(cfg, [8], [2], 1.0, 1e-6, sequential=True)
    gemm = 2 * params.active() / 1e6
    attn = 4 * 2 * 4 * 16 * 9 / 1e6
    assert slow - throughput.roofline_seconds(cfg, [8], [1], 1.0, 1e-6) == pytest.approx(
        max(kv / 1e12, attn) + max(weights / 1e12, gemm))
