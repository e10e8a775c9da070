"""FP8 W8A8: the quantizers against the e4m3 value table, the GEMM's production call
(torch._scaled_mm, which this torch also runs on the CPU; on CUDA at sm89+) and its float
emulation against float64 math on the dequantized operands, the Triton per-token quantization
against the torch one."""

from __future__ import annotations

import pytest
import torch

from pagedserve.kernels import fp8
from pagedserve.kernels import fp8_reference as ref

CUDA = torch.cuda.is_available()
# every finite e4m3fn value, from its 256 bit patterns (0x7f and 0xff are NaN)
TABLE = torch.arange(256, dtype=torch.uint8).view(ref.FP8).float()
TABLE = TABLE[torch.isfinite(TABLE)].unique()


def nearest_e4m3(v: torch.Tensor) -> torch.Tensor:
    """Round to the nearest e4m3 value by search (ties: either neighbour accepted by callers)."""
    return TABLE[(v.reshape(-1, 1) - TABLE[None]).abs().argmin(1)].reshape(v.shape)


def test_per_token_codes_are_the_nearest_e4m3_values_and_the_amax_maps_to_448():
    x = torch.randn(7, 300, generator=torch.Generator().manual_seed(0)) * 5
    x[3] = 0.0  # an all-zero row: zeros, a finite scale
    q, s = ref.quantize_per_token(x)
    assert q.dtype == ref.FP8 and s.shape == (7, 1) and s.dtype == torch.float32
    assert torch.equal(s[:, 0], (x.abs().amax(1) / 448).clamp(min=ref.MIN_SCALE))
    assert torch.equal(q.float().abs().amax(1)[[0, 1, 2, 4, 5, 6]], torch.full((6,), 448.0))
    assert not q[3].float().any()
    scaled = x / s
    near = nearest_e4m3(scaled)
    off = q.float() != near
    # only exact ties may differ (round-half-even picks the even one of the two)
    assert torch.equal((scaled[off] - near[off]).abs(), (scaled[off] - q.float()[off]).abs())


def test_weight_codes_per_output_channel():
    w = torch.randn(24, 40, generator=torch.Generator().manual_seed(1))
    q, s = ref.quantize_weight(w.bfloat16())
    assert s.shape == (24,) and torch.equal(s, w.bfloat16().float().abs().amax(1) / 448)
    assert torch.equal(q.float().abs().amax(1), torch.full((24,), 448.0))
    # dequantized error within half an e4m3 step: 3 mantissa bits, |err| <= |w| * 2^-4 + tiny
    err = (q.float() * s[:, None] - w.bfloat16().float()).abs()
    assert (err <= w.bfloat16().float().abs() * 2**-4 + s[:, None] * 2**-9).all()


def operands(m, n, k, seed=0, device="cpu", dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, k, generator=g) * 3).to(device, dtype)
    wq, ws = ref.quantize_weight(torch.randn(n, k, generator=g) * 0.02)
    bias = torch.randn(n, generator=g).to(device, dtype)
    return x, wq.to(device), ws.to(device), bias


def float64_math(x, wq, ws, input_scale, bias):
    xq, sa = ref.quantize_input(x.float(), input_scale)
    y = (xq.double() * sa.double()) @ (wq.double() * ws.double()[:, None]).t()
    return y + bias.double()


@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("m,n,k", [(1, 64, 32), (9, 48, 80), (33, 128, 576)])
def test_gemm_equals_the_quantized_math(m, n, k, static):
    x, wq, ws, bias = operands(m, n, k)
    s = torch.tensor([0.02]) if static else None
    want = float64_math(x, wq, ws, s, bias)
    emulated = ref.fp8_gemm(x, wq, ws, s, bias)
    production = fp8.fp8_gemm(x, wq, ws, s, bias)  # torch._scaled_mm where this CPU torch has it
    # fp32 accumulation of exact products: a few fp32 ulps of the largest partial sums
    tol = 1e-5 * want.abs().max().item()
    torch.testing.assert_close(emulated.double(), want, rtol=0, atol=tol)
    torch.testing.assert_close(production.double(), want, rtol=0, atol=tol)


def test_gemm_sizes_off_the_mma_grid_fall_back_to_the_emulation():
    x, wq, ws, bias = operands(5, 40, 24)  # 40, 24: not multiples of 16
    assert torch.equal(fp8.fp8_gemm(x, wq, ws, None, bias), ref.fp8_gemm(x, wq, ws, None, bias))


@pytest.mark.skipif(not CUDA or not fp8.has_scaled_mm(torch.device("cuda")),
                    reason="FP8 tensor cores: CUDA compute capability 8.9+")
@pytest.mark.parametrize("m", [1, 16, 300])
def test_cuda_scaled_mm_bf16_matches_the_emulation(m):
    x, wq, ws, bias = operands(m, 4096, 1024, device="cuda", dtype=torch.bfloat16)
    want = float64_math(x, wq, ws, None, bias)
    got = fp8.fp8_gemm(x, wq, ws, None, bias)
    assert got.dtype == torch.bfloat16
    # bf16 output rounding (2^-8 relative) dominates
    torch.testing.assert_close(got.double(), want, rtol=8e-3, atol=1e-2)


def test_triton_per_token_quantization_matches_torch():
    dev = "cuda" if CUDA else "cpu"
    x = (torch.randn(6, 2100, generator=torch.Generator().manual_seed(2)) * 4).to(dev)
    x[1] = 0.0
    q, s = fp8.quantize_per_token_triton(x)
    want_q, want_s = ref.quantize_per_token(x)
    assert torch.equal(s, want_s)
    # on the CPU too: tests/conftest.py applies kernels._interpreter's fix of the interpreter's
    # e4m3 cast (it lost the rounding carry into the exponent: 124.07 -> 64, not 128)
    assert torch.equal(q.float(), want_q.float())
