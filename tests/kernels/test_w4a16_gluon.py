"""The Gluon W4A16 kernel (kernels/w4a16_gluon.py): exact dequantized weights and full GEMMs on
an sm_90 GPU; without one, that its sm_90 build keeps the weight out of shared memory."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from kernel_utils import rel_err
from test_w4a16 import make, poisoned

from pagedserve.kernels import w4a16, w4a16_gluon
from pagedserve.kernels.w4a16_reference import dequantize

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
needs_hopper = pytest.mark.skipif(not (HOPPER and w4a16_gluon.gluon is not None),
                                  reason="Gluon wgmma kernel: sm_90 GPU only")
G = w4a16_gluon.GluonConfig
CONFIGS = [G(32, 8, 3, 2), G(64, 4, 4, 3), G(128, 8, 3, 1), G(256, 8, 2, 4)]
IDS = ["m32-split2", "m64-w4-split3", "m128", "m256-split4"]


@needs_hopper
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("cfg", CONFIGS, ids=IDS)
@pytest.mark.parametrize("n,k,group", [(200, 576, 128), (4096, 4096, 128), (96, 1664, 256)])
def test_gluon_dequant_is_exact(dtype, cfg, n, k, group):
    """One-hot rows pick rows of W: every nibble position, group edges, the partial last
    tile (K=576: 4.5 tiles; 1664: 13, an odd count with a dead partner)."""
    dev = torch.device("cuda")
    _, qw, s, z, _ = make(8, n, k, group, dtype, dev, seed=6)
    picks = sorted({0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 15, 16, 17, 127, 128, group - 1, group,
                    group + 3, k // 2 + 5, k - 8, k - 2, k - 1})
    m = 40
    rows = [picks[i % len(picks)] for i in range(m)]
    x = torch.zeros(m, k, dtype=dtype, device=dev)
    x[torch.arange(m), torch.tensor(rows)] = 1
    w = dequantize(qw, s, z, group, dtype)
    out = w4a16_gluon.w4a16_gluon(x, qw, s, z, group, out=poisoned(m, n, dtype, dev),
                                  config=cfg)
    assert torch.equal(out, w[rows])


@needs_hopper
@pytest.mark.parametrize("cfg", CONFIGS, ids=IDS)
@pytest.mark.parametrize("m", [17, 100, 256, 300])
def test_gluon_gemm(cfg, m):
    """Dense x against the fp32 reference, with a bias, out rows strided; 300 rows take
    several M tiles."""
    dev = torch.device("cuda")
    n, k, group = 1000, 4096, 128
    x, qw, s, z, bias = make(m, n, k, group, torch.bfloat16, dev, seed=7)
    s = s / 10
    ref = x.float() @ dequantize(qw, s, z, group, torch.float32) + bias.float()
    wide = torch.empty(m, n + 24, dtype=torch.bfloat16, device=dev)[:, :n]  # strided out rows
    out = w4a16_gluon.w4a16_gluon(x, qw, s, z, group, bias, out=wide, config=cfg)
    assert rel_err(out, ref) < 1e-2


@needs_hopper
def test_dispatch_takes_gluon_where_it_won():
    """w4a16_gemm routes 17-256 rows on Hopper through the Gluon kernel (pick_gluon_config),
    which must then give the same result as the kernel called directly."""
    dev = torch.device("cuda")
    x, qw, s, z, bias = make(100, 4096, 4096, 128, torch.bfloat16, dev, seed=8)
    cfg = w4a16.pick_gluon_config(100, 4096, 4096)
    assert w4a16.choose(x, 4096, 128) == cfg
    direct = w4a16_gluon.w4a16_gluon(x, qw, s, z, 128, bias, config=cfg)
    assert torch.equal(w4a16.w4a16_gemm(x, qw, s, z, 128, bias), direct)


def test_gluon_refuses_what_it_cannot_run(device):
    x, qw, s, z, _ = make(4, 16, 128, 64, torch.float32, device)
    with pytest.raises(ValueError, match="Gluon W4A16"):
        w4a16_gluon.w4a16_gluon(x, qw, s, z, 64)


@pytest.mark.skipif(w4a16_gluon.gluon is None, reason="this Triton has no Gluon")
def test_gluon_kernel_builds_for_sm90():
    """Compiled here for sm_90 (no GPU needed): wgmma with the weight as a register operand,
    and no shared-memory stores in the K loop (the weight never goes through shared memory)."""
    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "benchmarks/quant/sass_w4a16.py", "--gluon"],
                         cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    line = [ln for ln in run.stdout.splitlines() if ln.startswith("gluon")]
    assert line, run.stdout
    assert "'HGMMA': 16" in line[0] and "'STS': 0" in line[0], line[0]
