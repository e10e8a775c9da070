"""The Hopper paged prefill kernel (kernels/paged_prefill_hopper.py): built for sm_90 here (no
GPU needed: Triton compiles and ptxas assembles on any machine), run against the reference on an
sm_90 GPU (skipped elsewhere)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from kernel_utils import make_paged_batch, rel_err

from pagedserve.kernels import paged_attention as pa
from pagedserve.kernels import paged_prefill_hopper as hopper
from pagedserve.kernels import reference

ROOT = Path(__file__).resolve().parents[2]
SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
needs_sm90 = pytest.mark.skipif(not SM90 or hopper.gluon is None,
                                reason="Gluon wgmma/TMA kernel: sm_90 GPU only")


@pytest.mark.skipif(hopper.gluon is None, reason="Triton without Gluon")
@pytest.mark.parametrize("args", [[], ["--head-dim", "64", "--block-size", "32", "--group", "1",
                                       "--window"],
                                  ["--head-dim", "256", "--block-size", "256", "--group", "2",
                                   "--window", "--soft-cap", "--fp16", "--split"],
                                  ["--fp8", "--split"]],
                         ids=["d128", "d64-window", "d256-window-cap-split", "d128-fp8-split"])
def test_builds_for_sm90_without_spills_within_shared_memory(args):
    """The kernel compiles to sm_90 machine code (outside the interpreter: a process of its
    own) at each head size, with the window and soft-cap variants and pages smaller and larger
    than a tile: Q plus the stages of K and V tiles within an SM's 227 KB of shared memory,
    the launch's 168 registers a thread (12 warps in 64K; the two warpgroups that multiply
    take 240 each from the load warp's), and no spills (at head 256 with a window and a soft
    cap, 64-key tiles spilled: config_for takes 32). Over an FP8 cache the stages hold 1-byte
    tiles and one K and one V tile more, widened to fp16."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks/kernels/sm90_build.py"), *args],
                         capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    cfg = hopper.config_for(got["head_dim"])
    tile = cfg.tile_n * got["head_dim"]
    # K and V: the stages (2 bytes, FP8's 1), and FP8's widened pair (2 bytes)
    tiles = 2 * cfg.num_stages * tile * 2 if not got["fp8"] else 2 * cfg.num_stages * tile \
        + 2 * tile * 2
    assert tiles + cfg.block_m * got["head_dim"] * 2 <= got["shared_bytes"] <= 227 * 1024
    assert got["registers"] == hopper.MAXNREG, got
    assert got["spill_bytes"] == 0, got


def test_not_available_off_sm90_or_for_what_it_does_not_cover():
    q = torch.zeros(4, 8, 128, dtype=torch.bfloat16)
    cache = torch.zeros(2, 16, 2, 128, dtype=torch.bfloat16)
    assert not hopper.available(q, cache)  # a CPU tensor
    assert hopper.config_for(256).tile_n == 32 and hopper.config_for(128).tile_n == 128


def test_chosen_from_min_keys_by_default_and_forced_either_way(monkeypatch, caplog):
    monkeypatch.delenv(hopper.ENV, raising=False)
    assert not hopper.chosen(1024, 1024)  # 16 x 1k: the portable kernel is the faster
    assert hopper.chosen(512, 131072)  # a chunk deep in a long prompt
    assert hopper.chosen(4096, None) and not hopper.chosen(4095, None)  # keys unknown: q_len
    assert hopper.chosen(8192, 8192, fp8_cache=True) == hopper.FP8_AUTO
    monkeypatch.setenv(hopper.ENV, "hopper")
    assert hopper.chosen(64, 64) and hopper.chosen(8192, 8192, fp8_cache=True)
    monkeypatch.setenv(hopper.ENV, "portable")
    assert not hopper.chosen(8192, 131072)
    monkeypatch.setenv(hopper.ENV, "hoper")  # a typo: auto, and a warning
    assert hopper.chosen(8192, 8192) and not hopper.chosen(128, 128)
    assert "'hoper' is not auto, hopper or portable" in caplog.text


def test_key_splits_fill_the_last_wave_and_keep_tiles_enough():
    # a 512-token chunk deep in a 128k prompt (17 blocks x 8 KV heads on 132 SMs): 8 splits
    assert hopper.num_splits(136, 132, 1024) == 8
    assert hopper.num_splits(520, 132, 1024) == 1  # a 2,048-token chunk: 3.9 waves already
    assert hopper.num_splits(8200, 132, 256) == 1  # a whole 32k prompt
    assert hopper.num_splits(136, 132, 16) == 2  # 8 tiles a split at least
    assert hopper.num_splits(8, 132, 8) == 1


def _check(batch, scale, opts=None, tol=1e-2, splits=1):
    """paged_attention with the Hopper kernel taking the long rows (one key split unless
    `splits`; None: as chosen in service) against the reference; the portable launch must not
    see long rows."""
    opts = opts or {}
    seen = []
    real = pa.launch

    def spy(*a, **kw):
        seen.append(kw["per_seq"])
        return real(*a, **kw)

    out = torch.full_like(batch.q, float("nan"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(hopper.ENV, "hopper")
        mp.setattr(pa, "launch", spy)
        pa.paged_attention(*batch.args(), scale, out=out, num_long_splits=splits, **opts)
    assert seen == [True], seen  # the short rows' launch only: the long rows went to Hopper
    b = batch
    fp8 = b.k_cache.dtype == pa.FP8_KV_DTYPE  # (the reference reads it with opts' scales)
    ref = reference.paged_attention(b.q.float(), b.k_cache if fp8 else b.k_cache.float(),
                                    b.v_cache if fp8 else b.v_cache.float(),
                                    b.block_tables, b.seq_lens, b.cu_seqlens_q, scale, **opts)
    assert not out.isnan().any(), "unwritten or NaN-polluted output rows"
    err = rel_err(out, ref)
    assert err < tol, err


@needs_sm90
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("block_size", [16, 32, 256])
def test_llama_shapes_prefill_and_chunks(dtype, block_size):
    """Whole prompts, chunks over a cached prefix (q_len < context) and decode rows in one
    batch; lengths off every tile and page boundary; NaN in every slot no sequence owns."""
    gen = torch.Generator().manual_seed(block_size)
    q_lens = [1] * 8 + [512, 37, 300, 1000, 129]
    ctxs = torch.randint(1, 3000, (8,), generator=gen).tolist() + [512, 1500, 4000, 1000, 7000]
    batch = make_paged_batch(q_lens, ctxs, 32, 8, 128, block_size, dtype,
                             torch.device("cuda"), seed=block_size)
    _check(batch, 128**-0.5)


@needs_sm90
@pytest.mark.parametrize("splits", [3, 16])
def test_key_splits_merge_to_the_reference(splits):
    """Chunks over cached prefixes with each block's keys split (3: uneven shares; 16: some
    splits of the short rows' blocks get no tile), beside decode rows, a window and a cap."""
    batch = make_paged_batch([1] * 4 + [512, 100, 64], [300, 2000, 40, 9] + [6000, 9000, 64],
                             32, 8, 128, 16, torch.bfloat16, torch.device("cuda"), seed=splits)
    _check(batch, 128**-0.5, splits=splits)
    _check(batch, 128**-0.5, {"sliding_window": 1000, "logits_soft_cap": 30.0}, splits=splits)


@needs_sm90
def test_a_chunk_deep_in_a_long_prompt_splits_as_served():
    """A 512-token chunk at the end of 64k keys, splits chosen as in service (num_splits)."""
    batch = make_paged_batch([512], [65536], 32, 8, 128, 16, torch.bfloat16,
                             torch.device("cuda"), seed=5)
    _check(batch, 128**-0.5, splits=None)


@needs_sm90
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(8, 8, 64), (16, 2, 128), (16, 8, 256),
                                                     (28, 4, 128)])
def test_head_sizes_and_groups(heads, kv_heads, head_dim):
    """MHA at 64, GQA 8 at 128, Gemma's 256, and a group of 7 (Qwen2-7B: 128 rows hold 18
    tokens, two rows dead)."""
    batch = make_paged_batch([200, 1, 700], [900, 40, 700], heads, kv_heads, head_dim, 16,
                             torch.bfloat16, torch.device("cuda"), seed=head_dim + heads)
    _check(batch, head_dim**-0.5)


@needs_sm90
@pytest.mark.parametrize("window,cap", [(4096, 0.0), (300, 0.0), (1000, 50.0), (0, 30.0)])
def test_sliding_window_and_soft_cap(window, cap):
    batch = make_paged_batch([700, 37, 900, 1], [700, 5000, 9000, 60], 16, 8, 256, 16,
                             torch.bfloat16, torch.device("cuda"), seed=window)
    _check(batch, 256**-0.5, {"sliding_window": window, "logits_soft_cap": cap})


@needs_sm90
def test_long_prompt_at_model_size():
    """One 16k-token prompt of the 8B's attention (32 q / 8 KV heads, 128): the long rows'
    launch alone against the portable kernel's (checked against the reference above)."""
    batch = make_paged_batch([16384], [16384], 32, 8, 128, 16, torch.bfloat16,
                             torch.device("cuda"), seed=3)
    out = torch.full_like(batch.q, float("nan"))
    hopper.launch_long(*batch.args(), 128**-0.5, out, min_q_len=1)
    want = torch.full_like(batch.q, float("nan"))
    pa.launch(*batch.args(), 128**-0.5, want, pa.long_config(16384, 4, torch.bfloat16),
              per_seq=False, min_q_len=1)
    assert not out.isnan().any()
    assert rel_err(out, want) < 1e-2


@needs_sm90
@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size,dtype,opts", [
    (32, 8, 128, 16, torch.bfloat16, {}),
    (8, 8, 64, 32, torch.float16, {"sliding_window": 1000}),
    (16, 8, 256, 256, torch.bfloat16, {"sliding_window": 300, "logits_soft_cap": 30.0}),
], ids=["d128-bf16", "d64-fp16-window", "d256-bf16-window-cap"])
def test_fp8_cache(heads, kv_heads, head_dim, block_size, dtype, opts):
    """An FP8 (e4m3) cache, scales off one: its K and V tiles widened to fp16 in shared
    memory (q too, as the portable kernel's WIDEN_F16), against the reference over the same
    cache; whole prompts, chunks over cached prefixes and decode rows, NaN in every slot no
    sequence owns (FP8's NaN: a last page's tail must not reach P V); keys split 3 ways too."""
    batch = make_paged_batch([1] * 4 + [700, 37, 300], [300, 2000, 40, 9, 700, 5000, 1300],
                             heads, kv_heads, head_dim, block_size, dtype,
                             torch.device("cuda"), seed=head_dim)
    b8 = replace(batch, k_cache=reference.quantize_fp8(batch.k_cache, 0.5),
                 v_cache=reference.quantize_fp8(batch.v_cache, 2.0))
    assert hopper.available(b8.q, b8.k_cache)
    opts = {**opts, "k_scale": 0.5, "v_scale": 2.0}
    _check(b8, head_dim**-0.5, opts)
    _check(b8, head_dim**-0.5, opts, splits=3)
