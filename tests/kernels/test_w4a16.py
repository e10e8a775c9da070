"""W4A16 GEMM kernels against the torch dequantize+matmul reference (interpreter on the CPU at
small sizes; bf16/fp16 at model sizes on CUDA)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import triton
import triton.language as tl
from kernel_utils import rel_err

from pagedserve.kernels import w4a16
from pagedserve.kernels.w4a16_common import plane_major
from pagedserve.kernels.w4a16_decode import DecodeConfig, w4a16_decode
from pagedserve.kernels.w4a16_prefill import PrefillConfig, w4a16_prefill
from pagedserve.kernels.w4a16_reference import dequantize, pack_int4, unpack_int4
from pagedserve.kernels.w4a16_reference import w4a16_gemm as reference
from pagedserve.kernels.w4a16_tiles import join_planes, split_planes

CUDA = torch.cuda.is_available()
# fp32 through tl.dot runs as TF32 on a GPU's tensor cores (10-bit mantissa): ~1e-3 relative
FP32_TOL = 2e-3 if CUDA else 1e-5


def make(m, n, k, group, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (k, n), generator=g)
    groups = -(-k // group)
    s = torch.rand(groups, n, generator=g) * 0.1 + 0.01
    z = torch.randint(0, 17, (groups, n), generator=g).float()  # GPTQ v1 zeros reach 16
    x = torch.randn(m, k, generator=g)
    bias = torch.randn(n, generator=g)
    to = {"device": device, "dtype": dtype}
    return x.to(**to), pack_int4(q).to(device), s.to(**to), z.to(**to), bias.to(**to)


def poisoned(m, n, dtype, device):
    return torch.full((m, n), float("nan"), dtype=dtype, device=device)


def test_pack_roundtrip():
    q = torch.randint(0, 16, (24, 5))
    assert torch.equal(unpack_int4(pack_int4(q)), q)
    assert pack_int4(torch.arange(8)[:, None])[0, 0].item() == 0x76543210


DECODE = [
    DecodeConfig(block_n=16),  # split-K, the last program of a column tile sums
    DecodeConfig(block_n=32, target_programs=1),  # no split: one program per column tile
]


@pytest.mark.parametrize("cfg", DECODE, ids=["split", "direct"])
@pytest.mark.parametrize("m,n,k,group", [(1, 48, 96, 32), (3, 40, 576, 128), (16, 24, 128, 64)])
def test_decode_kernel(device, cfg, m, n, k, group):
    x, qw, s, z, bias = make(m, n, k, group, torch.float32, device)
    ref = reference(x, qw, s, z, group, bias)
    out = w4a16_decode(x, qw, s, z, group, bias, out=poisoned(m, n, x.dtype, device), config=cfg)
    assert rel_err(out, ref) < FP32_TOL


@pytest.mark.parametrize("split,planes", [(1, False), (3, False), (1, True), (3, True)])
@pytest.mark.parametrize("m,n,k,group", [(37, 40, 576, 128), (20, 64, 192, 32)])
def test_prefill_kernel(device, split, planes, m, n, k, group):
    """planes: one dot per nibble plane against plane-major x (BLOCK_K 128, so group 32 falls
    back to the reshaped tile; K=576 ends in a partial 128 block). 16-row M tiles: 37 rows
    take three, which the grouped program order must cover."""
    x, qw, s, z, bias = make(m, n, k, group, torch.float32, device, seed=1)
    ref = reference(x, qw, s, z, group, bias)
    cfg = PrefillConfig(block_m=16, block_n=32, block_k=128 if planes else 64, split_k=split,
                        planes=planes)
    out = w4a16_prefill(x, qw, s, z, group, bias, out=poisoned(m, n, x.dtype, device),
                        config=cfg)
    assert rel_err(out, ref) < FP32_TOL


def test_plane_major_order(device):
    """Column 8i + j of each 128 block moves to 16j + i; K pads with zeros to a multiple of 128."""
    x = torch.arange(3 * 200, dtype=torch.float32, device=device).reshape(3, 200) + 1
    xp = plane_major(x)
    assert xp.shape == (3, 256) and xp.is_contiguous()
    for b, i, j in ((0, 0, 1), (0, 15, 7), (1, 2, 3), (1, 8, 0)):
        assert torch.equal(xp[:, 128 * b + 16 * j + i], x[:, 128 * b + 8 * i + j])
    assert torch.equal(xp[:, 128 + 16 * 0 + 9], torch.zeros(3, device=device))  # column 200
    assert torch.equal(xp[:, 128 + 16 * 7 + 8], x[:, 199])
    assert xp.sum() == x.sum()


@pytest.mark.parametrize("m", [1, 5, 24])
def test_gemm_act_order_and_strided_rows(device, m):
    """The dispatching entry point: act-order gather, x rows strided (a slice of a wider
    tensor), no bias."""
    k, n, group = 128, 32, 32
    x, qw, s, z, _ = make(m, n, k, group, torch.float32, device, seed=2)
    wide = torch.cat((x, torch.randn_like(x)), 1)[:, :k]
    perm = torch.randperm(k, generator=torch.Generator().manual_seed(3)).to(device)
    ref = reference(wide, qw, s, z, group, None, perm)
    out = w4a16.w4a16_gemm(wide, qw, s, z, group, perm=perm, out=poisoned(m, n, x.dtype, device))
    assert rel_err(out, ref) < FP32_TOL


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("n,k,group", [(40, 576, 128), (136, 96, 32)])
def test_dequant_matmul_path(device, bias, n, k, group):
    """Many rows: the kernel's dequantized weight is the reference's bit for bit, and the
    entry point sends 2 * DEQUANT_MIN_ROWS rows there (act-order gather included)."""
    m = 2 * w4a16.DEQUANT_MIN_ROWS
    assert w4a16.use_dequant_matmul(m, n, k)
    x, qw, s, z, b = make(m, n, k, group, torch.float32, device, seed=4)
    assert torch.equal(w4a16.dequantize_weight(qw, s, z, group, torch.float32),
                       dequantize(qw, s, z, group, torch.float32))
    b = b if bias else None
    perm = torch.randperm(k, generator=torch.Generator().manual_seed(5)).to(device)
    ref = reference(x, qw, s, z, group, b, perm)
    out = w4a16.w4a16_gemm(x, qw, s, z, group, b, perm, out=poisoned(m, n, x.dtype, device))
    assert rel_err(out, ref) < FP32_TOL


def test_bands():
    """w4a16_gemm's bands on the Llama-3.1-8B shapes (docs/kernels.md, "Dispatch")."""
    attn, mlp = (4096, 4096), (14336, 4096)  # (N, K): q/k/v/o, gate_up
    assert w4a16.pick_config(16, *attn) == DecodeConfig(block_n=64, target_programs=528)
    assert w4a16.pick_config(16, *mlp) == DecodeConfig(block_n=256, target_programs=264)
    assert w4a16.pick_config(32, *attn) == PrefillConfig(
        block_m=32, block_n=64, block_k=128, num_warps=4, num_stages=4, split_k=4, planes=True)
    assert w4a16.pick_config(32, *mlp).split_k == 2  # 112 column tiles: 224 programs
    assert not w4a16.pick_config(32, *attn, 64).planes  # groups under 128 rows
    assert [w4a16.use_dequant_matmul(m, *attn) for m in (64, 65)] == [False, True]
    assert [w4a16.use_dequant_matmul(m, *mlp) for m in (128, 129)] == [False, True]
    gluon = {m: w4a16.pick_gluon_config(m, *attn) for m in (16, 32, 33, 128, 129)}
    assert [m for m, cfg in gluon.items() if cfg is not None] == [33, 128]
    gluon = {m: w4a16.pick_gluon_config(m, *mlp) for m in (16, 17, 64, 65, 256, 257)}
    assert [cfg and cfg.block_m for cfg in gluon.values()] == [None, 32, 64, 128, 256, None]
    # off Hopper the Triton kernels and cuBLAS share the rows
    assert w4a16.choose(torch.empty(33, 4096), 4096, 128) == w4a16.pick_config(33, *attn)
    assert w4a16.choose(torch.empty(65, 4096), 4096, 128) is None


def test_dequantize_matches_formula():
    q = torch.randint(0, 16, (64, 8))
    s, z = torch.rand(2, 8), torch.randint(0, 16, (2, 8)).float()
    w = dequantize(pack_int4(q), s, z, 32, torch.float32)
    assert torch.equal(w, (q.float() - z.repeat_interleave(32, 0)) * s.repeat_interleave(32, 0))


def test_argument_checks(device):
    x, qw, s, z, _ = make(2, 16, 64, 32, torch.float32, device)
    with pytest.raises(ValueError, match="group_size"):
        w4a16.w4a16_gemm(x, qw, s, z, 48)
    with pytest.raises(ValueError, match="scales shape"):
        w4a16.w4a16_gemm(x, qw, s[:1], z, 32)
    with pytest.raises(ValueError, match="qweight"):
        w4a16.w4a16_gemm(x[:, :56], qw, s, z, 32)
    with pytest.raises(ValueError, match="at most 16 rows"):
        w4a16_decode(torch.randn(17, 64, device=device), qw, s, z, 32)


@pytest.mark.skipif(not CUDA, reason="half precision at model sizes needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 4, 16, 32, 64, 100, 256])
@pytest.mark.parametrize("n,k,group", [(4096, 4096, 128), (6144, 4096, 64), (4096, 14336, 32)])
def test_gemm_cuda_model_sizes(dtype, m, n, k, group):
    x, qw, s, z, bias = make(m, n, k, group, dtype, torch.device("cuda"))
    s = s / 10
    ref = x.float() @ dequantize(qw, s, z, group, torch.float32) + bias.float()
    out = w4a16.w4a16_gemm(x, qw, s, z, group, bias, out=poisoned(m, n, dtype, x.device))
    assert rel_err(out, ref) < 1e-2


PACKED = [  # (kernel, config); group 128: per-plane dots, group 64: the planes joined
    ("decode", DecodeConfig(block_n=64)),
    ("decode", DecodeConfig(block_n=256, target_programs=264)),
    ("decode", DecodeConfig(block_n=32, target_programs=1)),  # no split-K
    ("prefill", PrefillConfig(block_m=64, block_n=128, block_k=64)),
    ("prefill", PrefillConfig(block_m=32, block_n=128, block_k=128, split_k=3)),  # joined
    ("prefill", PrefillConfig(block_m=128, block_n=128, block_k=128, num_warps=8, num_stages=3,
                              split_k=2, planes=True)),
    ("prefill", PrefillConfig(block_m=32, block_n=64, block_k=128, split_k=4, planes=True)),
    ("prefill", PrefillConfig(block_m=64, block_n=64, block_k=128, planes=True)),
]


@pytest.mark.skipif(not CUDA, reason="the packed-pair dequantization is inline PTX")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kernel,cfg", PACKED, ids=lambda v: v if isinstance(v, str) else None)
@pytest.mark.parametrize("n,k,group", [(200, 576, 128), (4096, 4096, 128), (96, 384, 64)])
def test_packed_pair_dequant_is_exact(dtype, kernel, cfg, n, k, group):
    """One-hot rows of x pick rows of W, so each output is a dequantized weight, which must equal
    the reference's bit for bit: rows at every nibble position, group edges and the tail."""
    dev = torch.device("cuda")
    _, qw, s, z, _ = make(16 if kernel == "decode" else 40, n, k, group, dtype, dev, seed=6)
    picks = sorted({0, 1, 2, 3, 4, 5, 6, 7, 9, group - 1, group, group + 3, k // 2 + 5, k - 8,
                    k - 2, k - 1})[:16]
    m = len(picks) if kernel == "decode" else 40
    x = torch.zeros(m, k, dtype=dtype, device=dev)
    rows = [picks[i % len(picks)] for i in range(m)]
    x[torch.arange(m), torch.tensor(rows)] = 1
    w = dequantize(qw, s, z, group, dtype)  # [K, N] rounded once, as the kernels must
    run = w4a16_decode if kernel == "decode" else w4a16_prefill
    out = run(x, qw, s, z, group, out=poisoned(m, n, dtype, dev), config=cfg)
    assert torch.equal(out, w[rows])
    # and a dense x against the fp32 reference, with a bias
    x, _, _, _, bias = make(m, n, k, group, dtype, dev, seed=7)
    ref = x.float() @ dequantize(qw, s, z, group, torch.float32) + bias.float()
    out = run(x, qw, s, z, group, bias, out=poisoned(m, n, dtype, dev), config=cfg)
    assert rel_err(out, ref) < 1e-2


@triton.jit
def _planes_roundtrip_kernel(x_ptr, planes_ptr, joined_ptr, R: tl.constexpr, C: tl.constexpr):
    offs = tl.arange(0, 8 * R)[:, None] * C + tl.arange(0, C)[None, :]
    x = tl.load(x_ptr + offs)  # [8R, C]
    # split as the kernels split x's columns (here rows): plane j holds rows 8i + j
    xp = split_planes(tl.reshape(tl.trans(x), (C, R, 2, 2, 2)))
    offs_p = tl.arange(0, C)[:, None] * R + tl.arange(0, R)[None, :]
    for j in tl.static_range(8):
        tl.store(planes_ptr + j * R * C + offs_p, xp[j])
    # join as the kernels join dequantized planes: plane j's row i is row 8i + j
    i = tl.arange(0, R)[:, None] * 8 * C + tl.arange(0, C)[None, :]
    p = (tl.load(x_ptr + i), tl.load(x_ptr + i + C), tl.load(x_ptr + i + 2 * C),
         tl.load(x_ptr + i + 3 * C), tl.load(x_ptr + i + 4 * C), tl.load(x_ptr + i + 5 * C),
         tl.load(x_ptr + i + 6 * C), tl.load(x_ptr + i + 7 * C))
    tl.store(joined_ptr + offs, join_planes(p))


def test_split_and_join_planes_orders(device):
    """The plane helpers of the packed-pair paths (their PTX needs CUDA; these do not)."""
    r, c = 4, 8
    x = torch.arange(8 * r * c, dtype=torch.int32, device=device).reshape(8 * r, c)
    planes = torch.empty(8, c, r, dtype=torch.int32, device=device)
    joined = torch.empty_like(x)
    _planes_roundtrip_kernel[(1,)](x, planes, joined, R=r, C=c)
    for j in range(8):
        assert torch.equal(planes[j], x[j::8].t())
    assert torch.equal(joined, x)


def test_packed_planes_compile_for_sm90_with_fewer_instructions():
    """Triton compiles for sm_90 without a GPU: the packed-pair decode kernel must build (its
    inline PTX assembles) and its K loop must be shorter than the fp32 path's; the tiled
    kernel's configs must build and use wgmma, the weight staying out of shared memory."""
    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "benchmarks/quant/sass_w4a16.py", "--rows", "16"],
                         cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    counts = dict(re.findall(r"rows 16 (\w+)\s.*?: (\d+) insns/iter.*tensor core", run.stdout))
    assert set(counts) == {"fp32", "x2", "x2planes"}, run.stdout
    assert int(counts["x2planes"]) < int(counts["x2"]) < int(counts["fp32"])
    # the tiled kernel's chosen configs build too, and multiply with wgmma (HGMMA), not mma.sync
    run = subprocess.run([sys.executable, "benchmarks/quant/sass_w4a16.py", "--tiled"],
                         cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    wgmma = re.findall(r"^rows .*'HGMMA': (\d+), 'HMMA': (\d+)", run.stdout, re.M)
    assert len(wgmma) == 10 and all(int(g) > 0 and int(h) == 0 for g, h in wgmma), run.stdout
    # all of them plane-major (G=128): the weight never goes through shared memory (no STS in
    # the K loop; the reshaped tile had 8-10 per tile)
    sts = re.findall(r"^rows .* planes=1 .*'STS': (\d+)", run.stdout, re.M)
    assert len(sts) == 10 and all(int(n) == 0 for n in sts), run.stdout
