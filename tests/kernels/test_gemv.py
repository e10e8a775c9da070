"""kernels/gemv.py (a few rows times a weight, the dense projections of a decode step) against
F.linear, and the executor's Linear taking it on CUDA when PAGEDSERVE_DENSE_GEMV_ROWS says so."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kernel_utils import rel_err

from pagedserve.executor import layers
from pagedserve.kernels import gemv as gv

CUDA = torch.cuda.is_available()


def operands(m, n, k, dtype, device, bias=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(device, dtype)
    w = (torch.randn(n, k, generator=g) * k**-0.5).to(device, dtype)
    b = torch.randn(n, generator=g).to(device, dtype) if bias else None
    return x, w, b


@pytest.mark.parametrize("m,n,k", [(1, 64, 64), (3, 37, 100), (4, 130, 48)])
@pytest.mark.parametrize("bias", [False, True])
def test_gemv_equals_linear(m, n, k, bias, device):
    """Widths that are not powers of two (masked lanes), several N blocks, a bias."""
    x, w, b = operands(m, n, k, torch.float32, device, bias)
    want = F.linear(x.double(), w.double(), None if b is None else b.double()).float()
    torch.testing.assert_close(gv.gemv(x, w, b), want, rtol=1e-5, atol=1e-5)
    # several K steps and N blocks of small tiles, and another warp count (bench_gemv --sweep)
    torch.testing.assert_close(gv.gemv(x, w, b, block=(8, 16)), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gv.gemv(x, w, b, block=(2, 32), num_warps=8), want, rtol=1e-5,
                               atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gemv_half_precision(dtype, device):
    x, w, b = operands(2, 96, 256, dtype, device, bias=True)
    want = F.linear(x.float(), w.float(), b.float())
    got = gv.gemv(x, w, b)
    assert got.dtype == dtype and rel_err(got, want) < 1e-2


def test_gemv_refuses_bad_operands():
    x, w, _ = operands(2, 8, 16, torch.float32, "cpu")
    for args, match in (((x, w[:, :-1]), r"\[N, 16\]"), ((x, w.half()), "weight dtype"),
                        ((x, w, torch.zeros(9)), "bias"), ((x.t(), w.t()), "stride|N, 2")):
        with pytest.raises(ValueError, match=match):
            gv.gemv(*args)
    assert gv.gemv(x[:0], w).shape == (0, 8)


def test_linear_takes_gemv_only_for_a_few_half_rows_on_cuda(monkeypatch):
    """GEMV_ROWS off, float32, more rows than it, a weight over GEMV_MAX_BYTES or not of unit
    stride in K, or a CPU tensor: nn.Linear's own forward."""
    calls = []
    monkeypatch.setattr(gv, "gemv", lambda x, w, b: calls.append(x.shape[0]) or F.linear(x, w, b))
    dev = "cuda" if CUDA else "cpu"
    lin = layers.Linear(16, 8, bias=False).to(dev, torch.bfloat16)
    x = torch.randn(5, 16, device=dev, dtype=torch.bfloat16)
    monkeypatch.setattr(layers, "GEMV_ROWS", 0)
    lin(x[:1])
    monkeypatch.setattr(layers, "GEMV_ROWS", 4)
    monkeypatch.setattr(layers, "GEMV_MAX_BYTES", 16 * 8 * 2 - 1)  # one byte short of lin's
    lin(x[:1])
    monkeypatch.setattr(layers, "GEMV_MAX_BYTES", 16 * 8 * 2)
    lin_t = layers.Linear(16, 8, bias=False).to(dev, torch.bfloat16)
    lin_t.weight = torch.nn.Parameter(lin_t.weight.detach().t().contiguous().t())  # stride (1, 8)
    torch.testing.assert_close(lin_t(x[:1]), F.linear(x[:1], lin_t.weight))
    for rows in (x[:1], x[:4], x, x[:2].float()):
        if rows.dtype == torch.float32:
            lin.float()
        torch.testing.assert_close(lin(rows), F.linear(rows, lin.weight))
    assert calls == ([1, 4] if CUDA else [])



@pytest.mark.skipif(not CUDA, reason="model sizes: CUDA")
@pytest.mark.parametrize("m", [1, 4])
@pytest.mark.parametrize("shape", [(5120, 2048), (2048, 4096), (128, 2048), (4096, 14336)],
                         ids=["qwen3-qkv", "qwen3-o", "qwen3-router", "llama8b-down"])
def test_cuda_gemv_model_shapes(m, shape):
    n, k = shape
    x, w, _ = operands(m, n, k, torch.bfloat16, "cuda", seed=m)
    want = F.linear(x.float(), w.float())
    assert rel_err(gv.gemv(x, w), want) < 1e-2
    graph = torch.cuda.CUDAGraph()  # a decode step's graph captures it
    with torch.cuda.graph(graph):
        out = gv.gemv(x, w)
    x.copy_(torch.randn_like(x))
    graph.replay()
    assert rel_err(out, F.linear(x.float(), w.float())) < 1e-2
