from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from kernel_utils import make_paged_batch, rel_err

from pagedserve.kernels import reference
from pagedserve.kernels.paged_attention import paged_attention

CUDA = torch.cuda.is_available()
# Small fp32 cases (2 CPU cores under the interpreter). float32 dots are exact (ieee) on CUDA
# too, so tf32 creeping back (1e-3) fails there; CUDA's exp2 and sum order differ a little.
DTYPE = torch.float32
TOL = 1e-4 if CUDA else 1e-5

# Mixed batch: decodes (one exactly at a block boundary, one with a single token of context),
# a prefill from scratch, chunked prefills with cached context, lengths crossing blocks.
MIXED_Q = [1, 7, 1, 33, 1, 20, 1]
MIXED_CTX = [45, 7, 16, 70, 1, 52, 33]


def _run(batch, scale: float, **kw) -> torch.Tensor:
    out = torch.full_like(batch.q, float("nan"))
    return paged_attention(*batch.args(), scale, out=out, **kw)


def _ref(batch, scale: float, **opts) -> torch.Tensor:
    """opts: sliding_window, logits_soft_cap."""
    b = batch
    return reference.paged_attention(b.q.float(), b.k_cache.float(), b.v_cache.float(),
                                     b.block_tables, b.seq_lens, b.cu_seqlens_q, scale, **opts)


def _check(batch, scale: float, tol: float, opts: dict | None = None, ref_batch=None,
           **kw) -> None:
    """Kernel against the reference, both with the attention options opts; kw go to the
    kernel alone (num_splits splits the long rows' keys too). ref_batch: the reference's
    input, when the kernel's differs (poisoned)."""
    opts = opts or {}
    kw.setdefault("num_long_splits", kw.get("num_splits"))
    out = _run(batch, scale, **opts, **kw)
    assert not out.isnan().any(), "unwritten or NaN-polluted output rows"
    err = rel_err(out, _ref(ref_batch or batch, scale, **opts))
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


def test_hopper_takes_256_query_rows_for_long_half_precision_rows():
    import pagedserve.kernels.paged_attention as pa

    big = pa.Config(256, 64, 16, 3)
    assert pa.long_config(8192, 4, torch.bfloat16, 128, hopper=True) == big
    assert pa.long_config(8192, 4, torch.float16, 64, hopper=True) == big
    for args in [(8192, 4, torch.bfloat16, 128, False), (8192, 4, torch.float32, 128, True),
                 (8192, 4, torch.bfloat16, 256, True), (32, 4, torch.bfloat16, 128, True)]:
        assert pa.long_config(*args[:4], hopper=args[4]).block_m <= 128, args
    assert pa.long_config(8192, 4, torch.bfloat16, 128, hopper=True, fp8_cache=True) != big


def test_the_256_row_config_covers_partial_query_blocks(device, monkeypatch):
    """Two 64-token query blocks of a 70-token chunk (GQA 4) and a decode beside them."""
    import pagedserve.kernels.paged_attention as pa

    monkeypatch.setattr(pa, "long_config", lambda *a, **kw: pa.Config(256, 64, 16, 3))
    batch = make_paged_batch([70, 1, 9], [150, 40, 9], 8, 2, 64, 16, DTYPE, device, seed=21)
    _check(batch, 0.125, TOL)
    _check(batch, 0.125, TOL, num_splits=1, num_long_splits=2)


@pytest.mark.parametrize("window", [0, 48])
def test_a_chunk_deep_in_a_long_prompt_splits_its_keys(device, window, monkeypatch):
    """Few long-row programs (one 40-token chunk at depth 600, 2 KV heads): the keys are
    split over programs and merged per token; a decode and a second chunk beside it."""
    import pagedserve.kernels.paged_attention as pa

    splits = []
    launch = pa.launch
    monkeypatch.setattr(pa, "launch", lambda *a, per_seq, num_splits=1, **kw: (
        splits.append((per_seq, num_splits)), launch(*a, per_seq=per_seq,
                                                     num_splits=num_splits, **kw))[1])
    batch = make_paged_batch([40, 1, 20], [600, 300, 20], 4, 2, 64, 16, DTYPE, device, seed=13)
    opts = {"sliding_window": window} if window else {}
    _check(batch, 0.125, TOL, opts, num_splits=None)
    # 2 programs: 3 splits of >= 4 64-key tiles each; a 48-key window sees ~3 tiles: none
    assert splits[1] == (False, 1 if window else 3)
    for forced in (2, 5):
        _check(batch, 0.125, TOL, opts, num_splits=1, num_long_splits=forced)


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


def _check_fp8(batch, scale: float, k_scale: float, v_scale: float, tol: float,
               opts: dict | None = None, **kw) -> None:
    """Kernel on an FP8 cache against the reference on the same cache; and the reference's
    FP8 read against attention over the dequantized values in float32 (its definition)."""
    opts = opts or {}
    b8 = _to_fp8(batch, k_scale, v_scale)
    scales = {"k_scale": k_scale, "v_scale": v_scale}
    out = _run(b8, scale, **kw, **scales, **opts)
    assert not out.isnan().any(), "unwritten or NaN-polluted output rows"
    ref = reference.paged_attention(b8.q.float(), *b8.args()[1:], scale, **scales, **opts)
    err = rel_err(out, ref)
    assert err < tol, err
    deq = replace(b8, q=b8.q.float(), k_cache=b8.k_cache.float() * k_scale,
                  v_cache=b8.v_cache.float() * v_scale)
    assert rel_err(ref, _ref(deq, scale, **opts)) < 1e-6
    # FP8 storage moved the result, but only by e4m3's rounding (3 mantissa bits)
    exact = _ref(batch, scale, **opts)
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


# Sliding window and soft cap. Contexts equal to some windows below (7, 16, 37, 100), shorter
# and longer than others; decodes, a prefill from scratch, chunks over a cached prefix.
WIN_Q = [1, 7, 1, 33, 1, 20, 1, 5]
WIN_CTX = [45, 7, 16, 70, 1, 37, 200, 100]


def test_reference_window_and_cap_by_hand():
    """The reference against the masked softmax written out, the mask from transformers'
    sliding_window_causal_mask_function (kv_idx > q_idx - W, and causal): one decode, one
    chunk over a cached prefix, one prefill from scratch, GQA, a window cutting each."""
    from transformers.masking_utils import sliding_window_causal_mask_function

    b = make_paged_batch([1, 6, 9], [23, 30, 9], 4, 2, 16, 8, DTYPE, torch.device("cpu"),
                         seed=31)
    scale, window, cap = 0.4, 5, 1.5
    hf_mask = sliding_window_causal_mask_function(window)
    want = torch.empty_like(b.q, dtype=torch.float64)
    cu, lens = b.cu_seqlens_q.tolist(), b.seq_lens.tolist()
    for s, ctx in enumerate(lens):
        n_blocks = -(-ctx // 8)
        slots = (b.block_tables[s, :n_blocks].long()[:, None] * 8 + torch.arange(8)).flatten()
        k = b.k_cache.flatten(0, 1)[slots[:ctx]].double()  # [ctx, Hkv, D]
        v = b.v_cache.flatten(0, 1)[slots[:ctx]].double()
        q_len = cu[s + 1] - cu[s]
        q_idx = torch.arange(ctx - q_len, ctx)[:, None]
        mask = hf_mask(0, 0, q_idx, torch.arange(ctx)[None, :])  # [q_len, ctx]
        for h in range(4):
            q = b.q[cu[s]:cu[s + 1], h].double()
            x = q @ k[:, h // 2].T * scale
            x = cap * torch.tanh(x / cap)
            p = torch.where(mask, x.exp(), 0.0)
            want[cu[s]:cu[s + 1], h] = (p / p.sum(1, keepdim=True)) @ v[:, h // 2]
    got = reference.paged_attention(*b.args(), scale, sliding_window=window,
                                    logits_soft_cap=cap)
    assert rel_err(got, want) < 1e-6
    # and the options do something: neither alone gives the same
    for opts in ({"sliding_window": window}, {"logits_soft_cap": cap}):
        assert rel_err(reference.paged_attention(*b.args(), scale, **opts), want) > 1e-2


def test_reference_causal_rows_by_hand_on_the_cpu_flash_passes(monkeypatch):
    """Without a window or cap the reference's prompt rows take two CPU flash passes merged
    by their log-sum-exps (the keys before a chunk, then the chunk's own): the masked
    softmax written out, for chunks over cached prefixes (one a block's worth, one of 1
    token past it), a prefill from scratch and GQA; and the same as SDPA's masked path."""
    b = make_paged_batch([6, 9, 40, 2], [30, 9, 57, 17], 4, 2, 16, 8, DTYPE,
                         torch.device("cpu"), seed=37)
    scale = 0.3
    want = torch.empty_like(b.q, dtype=torch.float64)
    cu, lens = b.cu_seqlens_q.tolist(), b.seq_lens.tolist()
    for s, ctx in enumerate(lens):
        slots = (b.block_tables[s, :-(-ctx // 8)].long()[:, None] * 8
                 + torch.arange(8)).flatten()
        k = b.k_cache.flatten(0, 1)[slots[:ctx]].double()
        v = b.v_cache.flatten(0, 1)[slots[:ctx]].double()
        q_len = cu[s + 1] - cu[s]
        mask = torch.arange(ctx)[None, :] <= torch.arange(ctx - q_len, ctx)[:, None]
        for h in range(4):
            x = b.q[cu[s]:cu[s + 1], h].double() @ k[:, h // 2].T * scale
            p = torch.where(mask, (x - x.max()).exp(), 0.0)
            want[cu[s]:cu[s + 1], h] = (p / p.sum(1, keepdim=True)) @ v[:, h // 2]
    assert reference._cpu_flash() is not None  # (this torch has it: the passes are tested)
    got = reference.paged_attention(*b.args(), scale)
    assert rel_err(got, want) < 1e-6
    monkeypatch.setattr(reference, "_cpu_flash", lambda: None)  # SDPA's masked path
    assert rel_err(reference.paged_attention(*b.args(), scale), got) < 1e-6


@pytest.mark.parametrize("window,cap,num_splits", [
    (1, 0.0, 1), (7, 0.0, 3), (16, 2.5, 1), (37, 0.0, 3), (37, 2.5, 1), (64, 0.0, 1),
    (100, 2.5, 3), (1000, 0.0, 3), (0, 2.5, 3),
])
def test_window_cap_mixed_batch(device, window, cap, num_splits):
    batch = make_paged_batch(WIN_Q, WIN_CTX, 8, 2, 64, 16, DTYPE, device, seed=window + 1)
    opts = {"sliding_window": window, "logits_soft_cap": cap}
    _check(batch, 0.3, TOL, opts, num_splits=num_splits)


def _poison_before_window(batch, window: int, tile: int = 64):
    """batch with NaN K/V in every slot of the 64-key tiles wholly before each sequence's
    window (the lowest first key of its queries); a kernel reading such a tile, even masked,
    gives NaN (0 * NaN in p @ V)."""
    k, v = batch.k_cache.clone(), batch.v_cache.clone()
    cu, lens = batch.cu_seqlens_q.tolist(), batch.seq_lens.tolist()
    bs = k.shape[1]
    for s, ctx in enumerate(lens):
        lo = max(0, ctx - (cu[s + 1] - cu[s]) + 1 - window) // tile * tile
        for pos in range(0, lo, bs):
            blk = int(batch.block_tables[s, pos // bs])
            k[blk], v[blk] = float("nan"), float("nan")
    return replace(batch, k_cache=k, v_cache=v)


@pytest.mark.parametrize("num_splits", [1, 4])
def test_window_skips_tiles_before_it(device, num_splits):
    """Decodes, a short chunk and a long-row chunk (q_len x group > 64) on long contexts."""
    batch = make_paged_batch([1, 1, 6, 40], [300, 260, 280, 330], 4, 2, 64, 16, DTYPE, device,
                             seed=41 + num_splits)
    window = 45
    _check(_poison_before_window(batch, window), 0.3, TOL, {"sliding_window": window},
           ref_batch=batch, num_splits=num_splits)


@pytest.mark.parametrize("window,cap", [(50, 0.0), (21, 3.0)])
def test_window_long_prefill(device, window, cap):
    # q_len * group > 64: the 128-row blocks, two per long sequence, next to decodes
    batch = make_paged_batch([1, 70, 1, 66], [9, 150, 65, 66], 4, 2, 64, 32, DTYPE, device,
                             seed=window)
    _check(batch, 0.2, TOL, {"sliding_window": window, "logits_soft_cap": cap})


@pytest.mark.parametrize("head_dim", [96, 256])
@pytest.mark.parametrize("window,cap", [(0, 0.0), (24, 3.0)])
def test_head_dims_not_power_of_two_or_large(device, head_dim, window, cap):
    """96 (Phi-3) pads to 128 with masked lanes; 256 (Gemma); split and long-row paths."""
    batch = make_paged_batch([1, 9, 1, 40], [40, 30, 70, 45], 4, 2, head_dim, 16, DTYPE,
                             device, seed=head_dim + window)
    opts = {"sliding_window": window, "logits_soft_cap": cap}
    _check(batch, head_dim**-0.5, TOL, opts, num_splits=3)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_latent_attention_one_wide_head_read_as_key_and_value(device, num_splits):
    """DeepSeek V3's latent cache: one KV head of 576 (padded to 1024 lanes, wide_config's
    tiles) for 8 query heads, the one tensor passed as K and V; decode, chunked and long
    rows."""
    batch = make_paged_batch([1, 9, 1, 20], [30, 25, 50, 20], 8, 1, 576, 16, DTYPE, device,
                             seed=576)
    batch = replace(batch, v_cache=batch.k_cache)
    _check(batch, 192**-0.5, TOL, num_splits=num_splits)
    # 40 query heads read it as 4 KV heads aliasing the one (a stride-0 view, as
    # layers.LatentAttention reads it past 16 heads): the reference's 40-head group
    wide = make_paged_batch([1, 9, 1], [30, 25, 50], 40, 1, 576, 16, DTYPE, device, seed=40)
    wide = replace(wide, v_cache=wide.k_cache)
    split = replace(wide, k_cache=wide.k_cache.expand(-1, -1, 4, -1),
                    v_cache=wide.k_cache.expand(-1, -1, 4, -1))
    _check(split, 192**-0.5, TOL, ref_batch=wide, num_splits=num_splits)


def test_fp8_latent_cache_one_wide_head(device):
    """DeepSeek's latent in an FP8 cache (--kv-cache-dtype fp8): the one head of 576 lanes at
    one scale, read as key and value on wide_config's tiles; decode, chunked and long rows."""
    batch = make_paged_batch([1, 9, 1, 20], [30, 25, 50, 20], 8, 1, 576, 16, DTYPE, device,
                             seed=577)
    _check_fp8(replace(batch, v_cache=batch.k_cache), 192**-0.5, 0.5, 0.5, TOL)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_fp8_cache_window_cap(device, num_splits):
    batch = make_paged_batch(WIN_Q, WIN_CTX, 8, 2, 64, 16, DTYPE, device, seed=26)
    _check_fp8(batch, 0.125, 0.5, 2.0, TOL, {"sliding_window": 37, "logits_soft_cap": 2.0},
               num_splits=num_splits)


def test_rejects_bad_window_or_cap(device):
    b = make_paged_batch([1, 3], [5, 3], 4, 2, 64, 16, DTYPE, device)
    bad = [{"sliding_window": -1}, {"sliding_window": 2.5}, {"sliding_window": True},
           {"logits_soft_cap": -1.0}, {"logits_soft_cap": float("inf")},
           {"logits_soft_cap": float("nan")}]
    for opts in bad:
        for fn in (paged_attention, reference.paged_attention):
            with pytest.raises(ValueError):
                fn(*b.args(), 0.1, **opts)


# Attention sinks (gpt-oss): a logit per query head in each row's softmax, with no value.
def _sinks(num_heads: int, device, seed: int = 0) -> torch.Tensor:
    """Random sinks (randn * 2), head 0's large (+8) so that it takes most of that head's
    weight."""
    sinks = torch.randn(num_heads, generator=torch.Generator().manual_seed(seed)) * 2
    sinks[0] = 8.0
    return sinks.to(device)


def test_reference_sinks_by_hand(monkeypatch):
    """The reference against transformers' gpt-oss eager_attention_forward (the definition)
    over each sequence's gathered K/V: a decode, a chunk over a cached prefix, a prefill from
    scratch, GQA; without a window (the CPU flash passes, the sink applied through their
    log-sum-exp), with one (the scores by hand) and without the CPU flash (by hand too)."""
    from transformers.masking_utils import sliding_window_causal_mask_function
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    b = make_paged_batch([1, 6, 9], [23, 30, 9], 4, 2, 16, 8, DTYPE, torch.device("cpu"),
                         seed=33)
    scale, sinks = 0.4, _sinks(4, "cpu", seed=1)
    module = torch.nn.Module()
    module.num_key_value_groups, module.sinks = 2, sinks.double()

    def by_hand(window: int) -> torch.Tensor:
        want = torch.empty_like(b.q, dtype=torch.float64)
        cu, lens = b.cu_seqlens_q.tolist(), b.seq_lens.tolist()
        for s, ctx in enumerate(lens):
            slots = (b.block_tables[s, :-(-ctx // 8)].long()[:, None] * 8
                     + torch.arange(8)).flatten()[:ctx]
            k = b.k_cache.flatten(0, 1)[slots].double().transpose(0, 1)[None]  # [1, Hkv, ctx, D]
            v = b.v_cache.flatten(0, 1)[slots].double().transpose(0, 1)[None]
            q = b.q[cu[s]:cu[s + 1]].double().transpose(0, 1)[None]  # [1, H, q_len, D]
            q_idx = torch.arange(ctx - q.shape[2], ctx)[:, None]
            k_idx = torch.arange(ctx)[None, :]
            seen = (sliding_window_causal_mask_function(window)(0, 0, q_idx, k_idx) if window
                    else k_idx <= q_idx)
            mask = torch.zeros(seen.shape, dtype=torch.float64).masked_fill(~seen, float("-inf"))
            o, _ = eager_attention_forward(module, q, k, v, mask, scale)  # [1, q_len, H, D]
            want[cu[s]:cu[s + 1]] = o[0]
        return want

    for window in (0, 5):
        want = by_hand(window)
        opts = {"sliding_window": window, "sinks": sinks}
        got = reference.paged_attention(*b.args(), scale, **opts)
        assert rel_err(got, want) < 1e-6, window
        # the sinks do something, and a sink of -inf is none
        assert rel_err(reference.paged_attention(*b.args(), scale, sliding_window=window),
                       want) > 1e-2
        off = reference.paged_attention(*b.args(), scale, sliding_window=window,
                                        sinks=torch.full((4,), float("-inf")))
        assert rel_err(off, reference.paged_attention(*b.args(), scale,
                                                      sliding_window=window)) < 1e-6
    monkeypatch.setattr(reference, "_cpu_flash", lambda: None)
    assert rel_err(reference.paged_attention(*b.args(), scale, sinks=sinks), by_hand(0)) < 1e-6


# (window, soft cap, num_splits, num_long_splits): context splits of the short and the long
# rows forced, 1-token contexts leaving most splits without a key
@pytest.mark.parametrize("window,cap,num_splits,num_long_splits", [
    (0, 0.0, 1, 1), (0, 0.0, 2, 4), (37, 0.0, 4, 2), (16, 2.5, 2, 1),
])
def test_sinks_mixed_batch(device, window, cap, num_splits, num_long_splits):
    """Decodes, a prefill from scratch and chunks over cached prefixes, scattered blocks,
    GQA 4, head 64."""
    batch = make_paged_batch(WIN_Q, WIN_CTX, 8, 2, 64, 16, DTYPE, device, seed=window + 51)
    opts = {"sliding_window": window, "logits_soft_cap": cap,
            "sinks": _sinks(8, device, seed=num_splits)}
    _check(batch, 0.3, TOL, opts, num_splits=num_splits, num_long_splits=num_long_splits)


def test_sinks_splits_that_see_no_key(device):
    """Short contexts over many splits: split 0 carries the sink, the empty ones add
    nothing (decode rows, and a long row's split keys)."""
    batch = make_paged_batch([1, 1, 1, 20], [1, 2, 65, 20], 8, 2, 64, 16, DTYPE, device,
                             seed=52)
    _check(batch, 0.3, TOL, {"sinks": _sinks(8, device, seed=2)}, num_splits=8,
           num_long_splits=4)


def test_sinks_bf16(device):
    batch = make_paged_batch(MIXED_Q, MIXED_CTX, 8, 2, 64, 16, torch.bfloat16, device, seed=53)
    for num_splits in (1, 3):
        _check(batch, 0.125, 1e-2, {"sinks": _sinks(8, device, seed=3)}, num_splits=num_splits)


def test_sinks_fp8_cache_are_not_scaled_by_k_scale(device):
    """The sink is in units of the scaled score: the FP8 cache's k_scale folds into the
    scores' scale, not into the sink."""
    batch = make_paged_batch(MIXED_Q, MIXED_CTX, 8, 2, 64, 16, DTYPE, device, seed=54)
    _check_fp8(batch, 0.125, 0.05, 3.0, TOL, {"sinks": _sinks(8, device, seed=4)},
               num_splits=3)


def test_rejects_bad_sinks(device):
    b = make_paged_batch([1, 3], [5, 3], 4, 2, 64, 16, DTYPE, device)
    bad = [torch.zeros(3, device=device), torch.zeros(4, dtype=torch.int32, device=device),
           torch.zeros(1, 4, device=device), [0.0] * 4]
    for sinks in bad:
        for fn in (paged_attention, reference.paged_attention):
            with pytest.raises(ValueError, match="sinks must be a 1-D float tensor"):
                fn(*b.args(), 0.1, sinks=sinks)


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


# (heads, kv heads, head_dim, window, soft cap): Mistral-7B, Gemma-2-9B's local layers,
# Gemma-3's, Phi-3-mini (head_dim 96, window 2047)
CUDA_WINDOW_MODELS = [(32, 8, 128, 4096, 0.0), (16, 8, 256, 4096, 50.0), (8, 4, 256, 1024, 0.0),
                      (32, 32, 96, 2047, 0.0)]


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("model", CUDA_WINDOW_MODELS, ids=["mistral", "gemma2", "gemma3", "phi3"])
@pytest.mark.parametrize("fp8", [False, True])
def test_cuda_window_model_shapes(model, fp8):
    h, hkv, d, window, cap = model
    gen = torch.Generator().manual_seed(d + window)
    q_lens = [1] * 12 + [700, 37, 300]
    ctxs = torch.randint(1, 9000, (12,), generator=gen).tolist() + [700, 5000, 9000]
    opts = {"sliding_window": window, "logits_soft_cap": cap}
    dev = torch.device("cuda")
    for q, c in ((q_lens, ctxs), ([1, 1], [6000, 20000])):  # the second splits the context
        batch = make_paged_batch(q, c, h, hkv, d, 16, torch.bfloat16, dev, seed=window)
        if fp8:
            _check_fp8(batch, d**-0.5, 0.02, 0.03, 1e-2, opts)
        else:
            _check(batch, d**-0.5, 1e-2, opts)


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("window", [0, 128])
def test_cuda_gpt_oss_sinks(window):
    """gpt-oss's attention (64 q heads, 8 KV heads, head 64, bf16; window 128 on its sliding
    layers): decodes beside long prefill rows, which take the portable kernel on Hopper too,
    and two decodes alone (split contexts)."""
    gen = torch.Generator().manual_seed(window)
    q_lens = [1] * 12 + [700, 37, 300]
    ctxs = torch.randint(1, 9000, (12,), generator=gen).tolist() + [700, 5000, 9000]
    dev = torch.device("cuda")
    opts = {"sliding_window": window, "sinks": _sinks(64, dev, seed=window)}
    for q, c in ((q_lens, ctxs), ([1, 1], [6000, 20000])):
        batch = make_paged_batch(q, c, 64, 8, 64, 16, torch.bfloat16, dev, seed=window)
        _check(batch, 64**-0.5, 1e-2, opts)


# ----------------------------------------------------------------------------- warm-up
def test_recording_keeps_each_layer_kinds_signature_inside_it_only(device):
    from pagedserve.kernels import paged_attention as pa

    batch = make_paged_batch([1, 5], [9, 5], 4, 2, 64, 16, DTYPE, device)
    _run(batch, 0.125)  # outside: nothing kept
    with pa.recording() as kinds:
        for window in (0, 4, 0):
            _run(batch, 0.125, sliding_window=window)
        _run(batch, 0.125, sinks=torch.zeros(4, device=device))
    _run(batch, 0.125, logits_soft_cap=5.0)
    dev = batch.q.device  # cuda:0, where the fixture's is cuda
    assert kinds == {pa.Signature(DTYPE, 4, 64, DTYPE, 16, 2, window, False, dev, sinks)
                     for window, sinks in ((False, False), (True, False), (False, True))}


def test_merge_widths_are_two():
    from pagedserve.kernels.paged_attention import merge_width

    assert [merge_width(s) for s in (2, 3, 8, 9, 16, 64, 65)] == [8, 8, 8, 64, 64, 64, 128]


@pytest.mark.parametrize("sinks", [False, True])
def test_warm_up_variants_launches_each_rows_config_and_split(device, sinks, monkeypatch):
    from pagedserve.kernels import paged_attention as pa

    # GQA 4: short rows of 16 (4 tokens); long rows' configs 64 rows (q_len 16 or less
    # x 4) and 128 (above); float32 takes neither the 256-row config nor the Hopper kernel
    # on an sm_90 GPU (test_cuda_no_step_compiles_after_the_warm_up covers those, in bf16)
    given = []  # each launch's sinks: the HAS_SINKS variants compile with a signature's sinks
    launch = pa.launch
    monkeypatch.setattr(pa, "launch", lambda *a, **kw: (given.append(kw.get("sinks")),
                                                        launch(*a, **kw))[1])
    sig = pa.Signature(DTYPE, 4, 64, DTYPE, 16, 1, True, True, device, sinks)
    launched = pa.warm_up_variants(sig)
    expected = [(1, 16, s) for s in (1, 2, 16)] + [(5, 64, s) for s in (1, 2, 16)]
    assert launched == expected + [(17, 128, s) for s in (1, 2, 16)]
    assert len(given) == len(launched)
    assert all(s is None for s in given) if not sinks else all(
        s.shape == (4,) and s.dtype == torch.float32 for s in given)


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("window,sinks", [(0, False), (4096, False), (128, True)])
def test_cuda_no_step_compiles_after_the_warm_up(window, sinks):
    """Every launch a serving step makes (decode batches beside a long prompt's chunks, at
    any depth, split or not) was compiled by warm_up_variants: nothing compiles in a step.
    With sinks (gpt-oss) the long rows stay on the portable kernel."""
    from pagedserve.kernels import paged_attention as pa

    dev = torch.device("cuda")
    dtype, scale = torch.bfloat16, 128**-0.5
    kernels = [pa._paged_attn_kernel, pa._merge_splits_kernel, pa._merge_long_splits_kernel]
    if (hopper_kernel := getattr(pa.hopper, "_prefill_kernel", None)) is not None:
        kernels.append(hopper_kernel)

    def compiled() -> int:
        return sum(len(c[0]) for k in kernels for c in k.device_caches.values())

    opts = {"sliding_window": window, "sinks": _sinks(32, dev) if sinks else None}
    with pa.recording() as kinds:
        warm = make_paged_batch([1, 5], [9, 5], 32, 8, 128, 16, dtype, dev)
        pa.paged_attention(*warm.args(), scale, **opts)
    for kind in kinds:
        pa.warm_up_variants(kind)
    before = compiled()
    for decoders, chunk, depth in [(1, 512, 0), (64, 512, 3584), (1, 512, 8192),
                                   (8, 2048, 30000), (0, 8192, 0), (200, 512, 120000),
                                   (3, 33, 5000), (0, 64, 70000)]:
        q_lens = [1] * decoders + [chunk]
        ctxs = [100 + 37 * i for i in range(decoders)] + [depth + chunk]
        batch = make_paged_batch(q_lens, ctxs, 32, 8, 128, 16, dtype, dev, seed=depth)
        pa.paged_attention(*batch.args(), scale, **opts)
    torch.cuda.synchronize()
    assert compiled() == before
