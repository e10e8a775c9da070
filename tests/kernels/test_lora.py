"""Multi-LoRA: the torch reference against a per-token float64 loop, the Triton shrink and
expand against the reference (ranks, a padded rank, fp32 and bf16, segments without an adapter,
empty segments, one segment of every token, decode- and prefill-like steps, an offset into a
wider y, split K), the grid's tile bound, the registration and the argument checks."""

from __future__ import annotations

import random

import pytest
import torch
from kernel_utils import rel_err

from pagedserve import kernels
from pagedserve.kernels import lora
from pagedserve.kernels import lora_reference as ref

H_IN, H_OUT, SLOTS = 64, 48, 3  # H_OUT not a power of two: the column masks
MIXED = ([5, 0, 17, 1, 0, 9], [1, 2, -1, 0, 1, 2])  # empty segments, one without an adapter


def step(lens, slots, rank=16, dtype=torch.float32, device="cpu", seed=0, h_in=H_IN,
         h_out=H_OUT):
    """(x, a, b, seg_starts, seg_slots) of one step, fresh random data."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(lens), h_in, generator=g)
    a = torch.randn(SLOTS, rank, h_in, generator=g) * h_in**-0.5
    b = torch.randn(SLOTS, h_out, rank, generator=g) * rank**-0.5
    starts = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    to = {"device": device, "dtype": dtype}
    return (x.to(**to), a.to(**to), b.to(**to), starts.to(device),
            torch.tensor(slots, dtype=torch.int32, device=device))


def without_adapter(lens, slots) -> torch.Tensor:
    """[T] bool: the tokens of segments with slot -1."""
    return torch.tensor([s < 0 for n, s in zip(lens, slots, strict=True) for _ in range(n)],
                        dtype=torch.bool)


def reference(x, a, b, starts, slots, y0, offset):
    """(out, y) of the reference's shrink and expand."""
    out, y = torch.empty(x.shape[0], a.shape[1], device=x.device), y0.clone()
    ref.lora_shrink(x, a, starts, slots, out)
    ref.lora_expand(out, b, starts, slots, y, offset)
    return out, y


def run_both(x, a, b, starts, slots, y0, offset):
    """((out, y) of Triton, (out, y) of the reference). Triton's out starts as NaN, so a row it
    leaves unwritten shows; its expand takes the reference's t, to test expand alone."""
    want = reference(x, a, b, starts, slots, y0, offset)
    out = torch.full_like(want[0], float("nan"))
    lora.lora_shrink(x, a, starts, slots, out)
    y = y0.clone()
    lora.lora_expand(want[0], b, starts, slots, y, offset)
    return (out, y), want


def check(lens, slots, got, want, y0, offset, h_out=H_OUT):
    (out, y), (want_out, want_y) = got, want
    # exact products summed in float32 for either dtype: only the order of the sums differs
    torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-5 * want_out.abs().max().item())
    if y.dtype == torch.float32:
        torch.testing.assert_close(y, want_y, rtol=1e-5, atol=1e-5 * want_y.abs().max().item())
    else:  # the interpreter truncates fp32 -> bf16 (the GPU rounds): 2 ulps apart at most
        assert rel_err(y, want_y) < (1e-2 if lora.INTERPRETED else 4e-3)
    off = without_adapter(lens, slots).to(out.device)
    assert torch.equal(out[off], torch.zeros_like(out[off]))  # no adapter: exactly 0
    assert torch.equal(y[off], y0[off])  # ... and y's rows as they were
    outside = torch.ones(y.shape[1], dtype=torch.bool, device=y.device)
    outside[offset:offset + h_out] = False
    assert torch.equal(y[:, outside], y0[:, outside])


def run_and_check(lens, slots, rank=16, dtype=torch.float32, device="cpu", offset=5,
                  width=None, **kw):
    """Both paths on one random step; y is [T, width], by default 8 columns wider than the
    delta."""
    x, a, b, starts, seg_slots = step(lens, slots, rank, dtype, device, **kw)
    h_out = b.shape[1]
    g = torch.Generator().manual_seed(9)
    y0 = torch.randn(x.shape[0], width or h_out + 8, generator=g).to(device, dtype)
    got, want = run_both(x, a, b, starts, seg_slots, y0, offset)
    check(lens, slots, got, want, y0, offset, h_out)


# ---- the torch reference

def per_token_loop(x, a, b, lens, slots, y0, offset):
    """x @ A.T @ B.T token by token, in float64."""
    x, a, b = x.double(), a.double(), b.double()
    out = torch.zeros(x.shape[0], a.shape[1], dtype=torch.float64)
    y = y0.double().clone()
    tok = 0
    for n, s in zip(lens, slots, strict=True):
        for i in range(tok, tok + n):
            if s >= 0:
                out[i] = a[s] @ x[i]
                y[i, offset:offset + b.shape[1]] += b[s] @ out[i]
        tok += n
    return out, y


def test_reference_equals_a_per_token_loop():
    lens, slots = MIXED
    x, a, b, starts, seg_slots = step(lens, slots, seed=1)
    y0 = torch.randn(x.shape[0], H_OUT + 9, generator=torch.Generator().manual_seed(2))
    out, y = torch.empty(x.shape[0], 16), y0.clone()
    ref.lora_shrink(x, a, starts, seg_slots, out)
    ref.lora_expand(out, b, starts, seg_slots, y, 4)
    want_out, want_y = per_token_loop(x, a, b, lens, slots, y0, 4)
    torch.testing.assert_close(out.double(), want_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(y.double(), want_y, rtol=1e-5, atol=1e-5)


def test_reference_checks_the_segment_values():
    x, a, b, starts, slots = step([3, 2], [0, 1])
    out = torch.empty(5, 16)
    for bad_starts, bad_slots, match in [([1, 3, 5], [0, 1], "rise from 0"),
                                         ([0, 3, 4], [0, 1], "rise from 0"),
                                         ([0, 4, 3, 5], [0, 1, 0], "rise from 0"),
                                         ([0, 3, 5], [0, 3], "seg_slots"),
                                         ([0, 3, 5], [-2, 0], "seg_slots")]:
        s = torch.tensor(bad_starts, dtype=torch.int32)
        with pytest.raises(ValueError, match=match):
            ref.lora_shrink(x, a, s, torch.tensor(bad_slots, dtype=torch.int32), out)


# ---- Triton against the reference

@pytest.mark.parametrize("rank", [8, 16, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_equals_reference(rank, dtype, device):
    """Empty segments, one without an adapter, a segment over two 16-row tiles, y wider than
    the delta at an offset."""
    run_and_check(*MIXED, rank, dtype, device, seed=rank)


def test_padded_rank(device):
    """A rank-8 adapter in slots of R = 16, zeros past its rank: t's padding columns are
    exactly 0 and y gets the rank-8 delta."""
    lens, slots = [7, 12], [0, 2]
    x, a, b, starts, seg_slots = step(lens, slots, 8, device=device, seed=3)
    a16 = torch.cat([a, torch.zeros_like(a)], 1)  # [S, 16, H_in]
    b16 = torch.cat([b, torch.zeros_like(b)], 2)  # [S, H_out, 16]
    y0 = torch.randn(19, H_OUT, generator=torch.Generator().manual_seed(4)).to(device)
    got, _ = run_both(x, a16, b16, starts, seg_slots, y0, 0)
    out8, want_y = reference(x, a, b, starts, seg_slots, y0, 0)  # the rank-8 adapter itself
    want_out = torch.cat([out8, torch.zeros(19, 8, device=device)], 1)
    check(lens, slots, got, (want_out, want_y), y0, 0)
    assert torch.equal(got[0][:, 8:], torch.zeros(19, 8, device=device))


@pytest.mark.parametrize("lens,slots", [([40], [1]), ([40], [-1]), ([0, 40, 0, 0], [2, 0, -1, 1])])
def test_one_segment_of_every_token(lens, slots, device):
    run_and_check(lens, slots, device=device, offset=0, width=H_OUT)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_like_step(dtype, device):
    """64 one-token segments, mixed slots and none: one 16-row tile each."""
    rng = random.Random(4)
    slots = [rng.randrange(-1, SLOTS) for _ in range(64)]
    run_and_check([1] * 64, slots, 16, dtype, device, seed=4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_like_step(dtype, device):
    """Few long segments over 64-row tiles: lengths off the tile size, one without an adapter,
    a one-token one, an empty one."""
    lens, slots = [301, 1, 0, 530, 168], [0, -1, 1, 2, 0]
    assert lora.block_m_for(sum(lens), len(lens)) == 64
    run_and_check(lens, slots, 32, dtype, device, seed=5)


def test_split_k(monkeypatch, device):
    """Few tiles and a long K split over programs that add into out (zeroed first); K is not
    a multiple of the split or of BLOCK_K."""
    monkeypatch.setattr(lora, "MIN_K_PER_SPLIT", 48)
    monkeypatch.setattr(lora, "CONFIGS", {})
    lens, slots = [3, 9, 0, 2], [2, -1, 0, 1]
    assert lora.shrink_config(16, lora.max_tiles(14, 4, 16), 200)["SPLIT_K"] == 4
    run_and_check(lens, slots, 16, torch.float32, device, seed=6, h_in=200)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gathered_rows(dtype, device):
    """With `rows` (a shuffled subset of x's and y's rows, as the executor passes a step's
    adapter tokens grouped by slot) both paths equal the dense call on the copied rows, and
    the rows not named stay as they were; the reference equals the copied rows exactly."""
    lens, slots = [4, 0, 9, 1, 3], [2, 0, -1, 0, 1]
    xs, a, b, starts, seg_slots = step(lens, slots, 16, dtype, device, seed=11)
    g = torch.Generator().manual_seed(12)
    rows = torch.randperm(30, generator=g)[:17].to(device)  # 17 of 30 rows, any order
    x = torch.randn(30, H_IN, generator=g).to(device, dtype)
    x[rows] = xs
    y0 = torch.randn(30, H_OUT + 8, generator=g).to(device, dtype)
    want = reference(xs, a, b, starts, seg_slots, y0[rows], 5)  # the dense call on copies
    for impl in (ref, lora):
        out = torch.full((17, 16), float("nan"), device=device)
        impl.lora_shrink(x, a, starts, seg_slots, out, rows)
        y = y0.clone()
        impl.lora_expand(want[0], b, starts, seg_slots, y, 5, rows)
        check(lens, slots, (out, y[rows]), want, y0[rows], 5)
        untouched = torch.ones(30, dtype=torch.bool, device=device)
        untouched[rows] = False
        assert torch.equal(y[untouched], y0[untouched])
        if impl is ref:
            assert torch.equal(out, want[0]) and torch.equal(y[rows], want[1])


@pytest.mark.parametrize("sizes,rank", [((48, 16, 16), 8), ((40, 56), 16), ((24, 40, 8), 32)])
def test_fused_parts(sizes, rank, device):
    """A fused projection in one shrink (the parts' A stacked along the rank; 96 columns at
    rank 32: two of shrink's 64-column chunks) and one expand (`parts`), gathered: both paths
    equal the reference run part by part, each into its column slice."""
    lens, slots = [3, 0, 6, 2, 5], [1, 0, -1, 2, 0]
    g = torch.Generator().manual_seed(13)
    p, n = len(sizes), sum(sizes)
    a = (torch.randn(SLOTS, p * rank, H_IN, generator=g) * H_IN**-0.5).to(device)
    b = (torch.randn(SLOTS, n, rank, generator=g) * rank**-0.5).to(device)
    _, _, _, starts, seg_slots = step(lens, slots, device=device)
    rows = torch.randperm(20, generator=g)[:16].to(device)
    x = torch.randn(20, H_IN, generator=g).to(device)
    y0 = torch.randn(20, n + 4, generator=g).to(device)
    want_t, want_y, col = [], y0.clone(), 2
    for i, size in enumerate(sizes):  # part by part, as separate modules
        t_i = torch.empty(16, rank, device=device)
        ref.lora_shrink(x, a[:, i * rank:(i + 1) * rank].contiguous(), starts, seg_slots, t_i,
                        rows)
        ref.lora_expand(t_i, b[:, col - 2:col - 2 + size].contiguous(), starts, seg_slots,
                        want_y, col, rows)
        want_t.append(t_i)
        col += size
    want_t = torch.cat(want_t, 1)
    for impl in (ref, lora):
        t = torch.full((16, p * rank), float("nan"), device=device)
        impl.lora_shrink(x, a, starts, seg_slots, t, rows)
        y = y0.clone()
        impl.lora_expand(want_t, b, starts, seg_slots, y, 2, rows, sizes)
        torch.testing.assert_close(t, want_t, rtol=1e-5, atol=1e-5 * want_t.abs().max().item())
        torch.testing.assert_close(y, want_y, rtol=1e-5, atol=1e-5 * want_y.abs().max().item())
        untouched = torch.ones(20, dtype=torch.bool, device=device)
        untouched[rows] = False
        assert torch.equal(y[untouched], y0[untouched])


def test_grid_bounds_the_tiles_of_any_segmentation():
    """max_tiles (the grid, from T and G alone) covers every segmentation; decode's T
    one-token segments fill it exactly."""
    rng = random.Random(7)
    for _ in range(200):
        g = rng.randrange(1, 40)
        lens = [rng.choice([0, 1, rng.randrange(200)]) for _ in range(g)]
        bm = lora.block_m_for(sum(lens), g)
        assert sum(-(-n // bm) for n in lens) <= lora.max_tiles(sum(lens), g, bm)
    assert lora.max_tiles(256, 256, lora.block_m_for(256, 256)) == 256


def test_registered_ops():
    for name in ("lora_shrink", "lora_expand"):
        assert getattr(kernels.get_ops("triton"), name) is getattr(lora, name)
        assert getattr(kernels.get_ops("torch"), name) is getattr(ref, name)


@pytest.mark.parametrize("impl", [(ref.lora_shrink, ref.lora_expand),
                                  (lora.lora_shrink, lora.lora_expand)])
def test_bad_arguments_raise(impl):
    shrink, expand = impl
    x, a, b, starts, slots = step([3, 2], [0, 1])
    out, y = torch.empty(5, 16), torch.zeros(5, H_OUT + 2)
    for args, match in [((x[:, :-1], a, starts, slots, out), "H_in"),
                        ((x, a.half(), starts, slots, out), "a dtype"),
                        ((x, a, starts[:-1], slots, out), "G \\+ 1"),
                        ((x, a, starts.long(), slots, out), "seg_starts dtype"),
                        ((x, a, starts, slots, out.half()), "out dtype"),
                        ((x, a, starts, slots, out[:, :8]), "out shape"),
                        ((x, torch.zeros(3, 385, H_IN), starts, slots, torch.empty(5, 385)),
                         "3 x 128")]:
        with pytest.raises(ValueError, match=match):
            shrink(*args)
    for args, match in [((out, b, starts, slots, y, 3), "offset"),
                        ((out, b, starts, slots, y[:4], 0), "y"),
                        ((out, b.half(), starts, slots, y, 0), "b dtype"),
                        ((out[:, :8], b, starts, slots, y, 0), "R: t's"),
                        ((out.half(), b, starts, slots, y, 0), "t dtype"),
                        ((out, b, starts, slots, y, 0, torch.arange(4)), "rows has 4"),
                        ((out, b, starts, slots, y[:4], 0, torch.arange(5)), "more than"),
                        ((out, b, starts, slots, y, 0, torch.arange(5.0)), "rows dtype"),
                        ((out, b, starts, slots, y, 0, None, (40, 8)), "R: t's"),
                        ((out, b, starts, slots, y, 0, None, (40,)), "summing"),
                        ((out, b, starts, slots, y, 0, None, (1, 1, 1, H_OUT - 3)), "1 to 3"),
                        ((out, torch.zeros(3, H_OUT, 129), starts, slots, y, 0), "R <= 128")]:
        with pytest.raises(ValueError, match=match):
            expand(*args)
    with pytest.raises(ValueError, match="out shape"):  # T is rows', not x's
        shrink(x, a, starts, slots, out, torch.arange(4))
    if shrink is ref.lora_shrink:  # the reference checks the values (a host sync)
        for rows, match in [([0, 1, 1, 2, 3], "distinct"), ([0, 1, 2, 3, 5], "distinct")]:
            with pytest.raises(ValueError, match=match):
                shrink(x, a, starts, slots, out, torch.tensor(rows))


# ---- model sizes and CUDA graphs (GPU only)

@pytest.mark.skipif(not torch.cuda.is_available(), reason="model sizes: CUDA")
@pytest.mark.parametrize("lens", [[1] * 256, [1] * 8, [2000, 17, 2079]])
def test_cuda_model_sizes(lens):
    """Qwen3-8B's q projection (4096 -> 4096) at rank 64 in bf16: decode, a small decode batch
    (split K), prefill."""
    slots = [i % (SLOTS + 1) - 1 for i in range(len(lens))]
    run_and_check(lens, slots, 64, torch.bfloat16, "cuda", offset=4096, width=3 * 4096,
                  h_in=4096, h_out=4096)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs")
@pytest.mark.parametrize("num_segs", [1, 16])
def test_cuda_graph_replays_new_segments(num_segs):
    """A grid of shapes only and no host sync: a captured step replays right for segment
    lengths and slots it was not captured with."""
    lens = [64 // num_segs] * num_segs
    x, a, b, starts, slots = step(lens, [0] * num_segs, 16, torch.bfloat16, "cuda")
    t = torch.empty(64, 16, device="cuda")
    y = torch.zeros(64, H_OUT, dtype=torch.bfloat16, device="cuda")
    lora.lora_shrink(x, a, starts, slots, t)  # compile outside the capture
    lora.lora_expand(t, b, starts, slots, y, 0)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        lora.lora_shrink(x, a, starts, slots, t)
        lora.lora_expand(t, b, starts, slots, y, 0)
    rng = random.Random(8)
    for _ in range(3):
        cuts = sorted(rng.randrange(65) for _ in range(num_segs - 1))
        new_lens = [hi - lo for lo, hi in zip([0, *cuts], [*cuts, 64], strict=True)]
        new_slots = [rng.randrange(-1, SLOTS) for _ in range(num_segs)]
        starts.copy_(torch.tensor([0, *cuts, 64], dtype=torch.int32))
        slots.copy_(torch.tensor(new_slots, dtype=torch.int32))
        y.zero_()
        graph.replay()
        want_t, want_y = torch.empty_like(t), torch.zeros_like(y)
        ref.lora_shrink(x, a, starts, slots, want_t)
        ref.lora_expand(want_t, b, starts, slots, want_y, 0)
        check(new_lens, new_slots, (t, y), (want_t, want_y), torch.zeros_like(y), 0)
