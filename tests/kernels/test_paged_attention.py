from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from kernel_utils import make_paged_batch, rel_err

from pagedserve.kernels import reference
from pagedserve.kernels.paged_attention import paged_attention

CUDA = torch.cuda.is_available()
# Small fp32 cases (2 CPU cores under the interpreter, exact dots there; tf32 dots on CUDA).
DTYPE = torch.float32
TOL = 5e-3 if CUDA else 1e-5

# Mixed batch: decodes (one exactly at a block boundary, one with a single token of context),
# a prefill from scratch, chunked prefills with cached context, lengths crossing blocks.
MIXED_Q = [1, 7, 1, 33, 1, 20, 1]
MIXED_CTX = [45, 7, 16, 70, 1, 52, 33]


def _run(batch, scale: float, **kw) -> torch.Tensor:
    out = torch.full_like(batch.q, float("nan"))
    return paged_attention(*batch.args(), scale, out=out, **kw)


def _ref(batch, scale: float) -> torch.Tensor:
    b = batch
    return reference.paged_attention(b.q.float(), b.k_cache.float(), b.v_cache.float(),
                                     b.block_tables, b.seq_lens, b.cu_seqlens_q, scale)


def _check(batch, scale: float, tol: float, **kw) -> None:
    out = _run(batch, scale, **kw)
    assert not out.isnan().any(), "unwritten or NaN-polluted output rows"
    err = rel_err(out, _ref(batch, scale))
    assert err < tol, err


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_mixed_batch_gqa(device, block_size, head_dim, num_splits):
    batch = make_paged_batch(MIXED_Q, MIXED_CTX, 8, 2, head_dim, block_size, DTYPE, device,
                             seed=block_size + head_dim + num_splits)
    _check(batch, head_dim**-0.5, TOL, num_splits=num_splits)


@pytest.mark.parametrize("heads", [(4, 4), (6, 2), (4, 1)], ids=["mha", "group3", "mqa"])
def test_group_sizes(device, heads):
    batch = make_paged_batch([1, 5, 1, 12], [30, 5, 17, 40], *heads, 64, 16, DTYPE, device)
    _check(batch, 0.1, TOL)


@pytest.mark.parametrize("num_splits", [None, 4, 7])
def test_decode_only_split(device, num_splits):
    ctxs = [1, 17, 100, 64, 200]
    batch = make_paged_batch([1] * len(ctxs), ctxs, 4, 2, 64, 16, DTYPE, device, seed=3)
    _check(batch, 0.125, TOL, num_splits=num_splits, max_query_len=1, max_seq_len=200)


@pytest.mark.parametrize("num_splits", [1, 2])
def test_tile_boundaries(device, num_splits):
    # Contexts and query-block starts sitting just before, on and after 64-key tile edges.
    q_lens = [1, 1, 1, 1, 1, 3, 6, 4]
    ctxs = [63, 64, 65, 127, 128, 65, 70, 132]
    batch = make_paged_batch(q_lens, ctxs, 4, 4, 64, 16, DTYPE, device, seed=9)
    _check(batch, 0.125, TOL, num_splits=num_splits)


def test_long_prefill_large_tiles(device):
    # q_len * group > 64 takes the 128-row query block; mixed with decodes and a skipped seq.
    batch = make_paged_batch([1, 70, 0, 1], [9, 90, 12, 65], 4, 2, 64, 32, DTYPE, device, seed=5)
    _check(batch, 0.125, TOL)


def test_hints_match_computed(device):
    batch = make_paged_batch(MIXED_Q, MIXED_CTX, 4, 2, 64, 16, DTYPE, device, seed=7)
    a = _run(batch, 0.125)
    b = _run(batch, 0.125, max_query_len=max(MIXED_Q), max_seq_len=max(MIXED_CTX))
    torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_rejects_misuse(device):
    b = make_paged_batch([1, 3], [5, 3], 4, 2, 64, 16, DTYPE, device)
    args = list(b.args())
    bad = [
        (0, b.q[:, :3]),  # heads not a multiple of kv heads
        (0, b.q.transpose(0, 1).contiguous().transpose(0, 1)[..., ::2]),  # strided head_dim
        (3, b.block_tables.long()),
        (4, b.seq_lens.long()),
        (5, b.cu_seqlens_q[:-1]),
        (2, b.v_cache[..., :32]),
    ]
    for i, t in bad:
        with pytest.raises(ValueError):
            paged_attention(*args[:i], t, *args[i + 1:], 0.1)
    with pytest.raises(ValueError):
        paged_attention(*args, 0.1, out=torch.empty(1, device=device))


def _to_fp8(batch, k_scale: float, v_scale: float):
    """batch with its caches stored as the FP8 cache stores them (NaN slots stay NaN)."""
    return replace(batch, k_cache=reference.quantize_fp8(batch.k_cache, k_scale),
                   v_cache=reference.quantize_fp8(batch.v_cache, v_scale))


def _check_fp8(batch, scale: float, k_scale: float, v_scale: float, tol: float, **kw) -> None:
    """Kernel on an FP8 cache against the reference on the same cache; and the reference's
    FP8 read against attention over the dequantized values in float32 (its definition)."""
    b8 = _to_fp8(batch, k_scale, v_scale)
    scales = {"k_scale": k_scale, "v_scale": v_scale}
    out = _run(b8, scale, **kw, **scales)
    assert not out.isnan().any(), "unwritten or NaN-polluted output rows"
    ref = reference.paged_attention(b8.q.float(), *b8.args()[1:], scale, **scales)
    err = rel_err(out, ref)
    assert err < tol, err
    deq = replace(b8, q=b8.q.float(), k_cache=b8.k_cache.float() * k_scale,
                  v_cache=b8.v_cache.float() * v_scale)
    assert rel_err(ref, _ref(deq, scale)) < 1e-6
    # FP8 storage moved the result, but only by e4m3's rounding (3 mantissa bits)
    exact = _ref(batch, scale)
    assert 1e-4 < rel_err(ref, exact) < 0.1


@pytest.mark.parametrize("scales", [(1.0, 1.0), (0.05, 3.0)])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_fp8_cache_mixed_batch(device, scales, num_splits):
    batch = make_paged_batch(MIXED_Q, MIXED_CTX, 8, 2, 64, 16, DTYPE, device, seed=21)
    _check_fp8(batch, 0.125, *scales, TOL, num_splits=num_splits)


def test_fp8_cache_long_prefill(device):
    batch = make_paged_batch([1, 70, 1], [9, 90, 65], 4, 2, 64, 32, DTYPE, device, seed=22)
    _check_fp8(batch, 0.125, 0.5, 0.25, TOL)


def test_fp8_cache_decode_split(device):
    ctxs = [1, 17, 200]
    batch = make_paged_batch([1] * 3, ctxs, 4, 2, 64, 16, DTYPE, device, seed=23)
    _check_fp8(batch, 0.125, 2.0, 0.5, TOL, num_splits=4, max_query_len=1, max_seq_len=200)


def test_fp8_cache_with_bf16_queries_widens_to_fp16(device):
    """bf16 q over an FP8 cache runs the dots in fp16 (the kernel's WIDEN_F16): as close to the
    reference as bf16 output allows, decode and prefill rows, split and not."""
    batch = make_paged_batch(MIXED_Q, MIXED_CTX, 8, 2, 64, 16, torch.bfloat16, device, seed=25)
    for num_splits in (1, 3):
        _check_fp8(batch, 0.125, 0.5, 2.0, 1e-2, num_splits=num_splits)


def test_fp8_scales_ignored_for_float_cache(device):
    batch = make_paged_batch([1, 5], [9, 20], 4, 2, 64, 16, DTYPE, device, seed=24)
    a = _run(batch, 0.125)
    b = _run(batch, 0.125, k_scale=3.0, v_scale=7.0)
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    with pytest.raises(ValueError, match="scales must be > 0"):
        _run(_to_fp8(batch, 1.0, 1.0), 0.125, k_scale=-1.0)


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("block_size", [16, 32])
def test_cuda_llama_shapes(dtype, block_size):
    gen = torch.Generator().manual_seed(11)
    q_lens = [1] * 24 + [512, 37, 300]
    ctxs = torch.randint(1, 3000, (24,), generator=gen).tolist() + [512, 1500, 4000]
    batch = make_paged_batch(q_lens, ctxs, 32, 8, 128, block_size, dtype,
                             torch.device("cuda"), seed=block_size)
    _check(batch, 128**-0.5, 1e-2)
    decode = make_paged_batch([1, 1], [5000, 20000], 32, 8, 128, block_size, dtype,
                              torch.device("cuda"), seed=2)
    _check(decode, 128**-0.5, 1e-2)  # small batch: takes the split-context path
    _check(decode, 128**-0.5, 1e-2, num_splits=1)


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_fp8_llama_shapes(dtype):
    gen = torch.Generator().manual_seed(12)
    q_lens = [1] * 24 + [512, 37, 300]
    ctxs = torch.randint(1, 3000, (24,), generator=gen).tolist() + [512, 1500, 4000]
    batch = make_paged_batch(q_lens, ctxs, 32, 8, 128, 16, dtype, torch.device("cuda"), seed=4)
    _check_fp8(batch, 128**-0.5, 0.02, 0.03, 1e-2)
    decode = make_paged_batch([1, 1], [5000, 20000], 32, 8, 128, 16, dtype,
                              torch.device("cuda"), seed=5)
    _check_fp8(decode, 128**-0.5, 1.0, 1.0, 1e-2)
    _check_fp8(decode, 128**-0.5, 1.0, 1.0, 1e-2, num_splits=1)
