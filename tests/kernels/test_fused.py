from __future__ import annotations

import pytest
import torch
from kernel_utils import rel_err

from pagedserve.kernels import reference
from pagedserve.kernels.fused import (
    gelu_tanh_and_mul,
    rms_norm,
    rotary_and_cache,
    rotary_embedding,
    silu_and_mul,
)
from pagedserve.kernels.kv_cache import write_kv_cache

CUDA = torch.cuda.is_available()
# (tokens, dtype, tolerance): interpreter fp32 small; CUDA bf16 at model sizes.
CASES = [(13, torch.float32, 1e-5)]
if CUDA:
    CASES += [(4096, torch.bfloat16, 1e-2), (4096, torch.float16, 1e-2)]


def _dev(device, dtype):
    if dtype != torch.float32 and not CUDA:
        pytest.skip("half precision is checked on CUDA")
    return device


def _nan(shape, dtype, device):
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


@pytest.mark.parametrize("tokens,dtype,tol", CASES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm(device, tokens, dtype, tol, with_residual):
    device = _dev(device, dtype)
    hidden = 4096 if CUDA else 96  # 96: not a power of two, exercises the mask
    big = torch.randn(tokens, 2 * hidden, device=device, dtype=dtype)
    x = big[:, :hidden]  # strided rows
    w = (1 + 0.1 * torch.randn(hidden, device=device)).to(dtype)
    res = torch.randn(tokens, hidden, device=device, dtype=dtype) if with_residual else None
    ref_out, ref_res = reference.rms_norm(x, w, 1e-6, res)
    out, new_res = rms_norm(x, w, 1e-6, res, out=_nan((tokens, hidden), dtype, device),
                            residual_out=_nan((tokens, hidden), dtype, device))
    assert rel_err(out, ref_out) < tol
    assert rel_err(new_res, ref_res) < tol / 10
    if not with_residual:
        assert new_res is x


@pytest.mark.parametrize("tokens,dtype,tol", CASES)
@pytest.mark.parametrize("head_dim", [64, 96, 128, 256])  # 96: Phi-3, half of it padded
def test_rotary(device, tokens, dtype, tol, head_dim):
    device = _dev(device, dtype)
    h, hkv, max_pos = (32, 8, 8192) if CUDA else (4, 2, 64)
    qkv = torch.randn(tokens, h + 2 * hkv, head_dim, device=device, dtype=dtype)
    q, k = qkv[:, :h], qkv[:, h:h + hkv]
    pos = torch.randint(0, max_pos, (tokens,), device=device)
    inv = 1.0 / 10000 ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim)
    ang = torch.arange(max_pos, device=device).float()[:, None] * inv[None, :]
    cache = torch.cat((ang.cos(), ang.sin()), dim=-1)
    ref_q, ref_k = reference.rotary_embedding(pos, q, k, cache)
    out_q, out_k = rotary_embedding(pos, q, k, cache, q_out=_nan(q.shape, dtype, device),
                                    k_out=_nan(k.shape, dtype, device))
    assert rel_err(out_q, ref_q) < tol
    assert rel_err(out_k, ref_k) < tol
    in_q, in_k = rotary_embedding(pos, q.clone(), k.clone(), cache)
    assert rel_err(in_q, ref_q) < tol and rel_err(in_k, ref_k) < tol


@pytest.mark.parametrize("tokens,dtype,tol", CASES)
@pytest.mark.parametrize("head_dim", [96, 128])  # Phi-3's 96: padded lanes stay out of the sum
def test_rotary_with_each_heads_norm_first(device, tokens, dtype, tol, head_dim):
    """Qwen3's q_norm and k_norm folded into the rotation: equal to rms_norm over each head,
    then the rotation (the reference does both steps, the kernel one pass over the qkv view)."""
    device = _dev(device, dtype)
    h, hkv, max_pos = (32, 8, 8192) if CUDA else (4, 2, 64)
    qkv = 3 * torch.randn(tokens, h + 2 * hkv, head_dim, device=device, dtype=dtype)
    q, k = qkv[:, :h], qkv[:, h:h + hkv]
    qw, kw = ((1 + 0.5 * torch.randn(head_dim, device=device)).to(dtype) for _ in range(2))
    pos = torch.randint(0, max_pos, (tokens,), device=device)
    cache = torch.randn(max_pos, head_dim, device=device)
    two_q = reference.rms_norm(q.reshape(-1, head_dim), qw, 1e-6)[0].reshape(q.shape)
    two_k = reference.rms_norm(k.reshape(-1, head_dim), kw, 1e-6)[0].reshape(k.shape)
    want_q, want_k = reference.rotary_embedding(pos, two_q, two_k, cache)
    norms = {"q_norm_weight": qw, "k_norm_weight": kw, "norm_eps": 1e-6}
    ref_q, ref_k = reference.rotary_embedding(pos, q, k, cache, **norms)
    assert torch.equal(ref_q, want_q) and torch.equal(ref_k, want_k)
    out_q, out_k = rotary_embedding(pos, q, k, cache, q_out=_nan(q.shape, dtype, device),
                                    k_out=_nan(k.shape, dtype, device), **norms)
    assert rel_err(out_q, want_q) < tol and rel_err(out_k, want_k) < tol
    plain_q, _ = rotary_embedding(pos, q, k, cache)
    assert rel_err(plain_q, want_q) > 0.1  # the norm did something
    with pytest.raises(ValueError, match="go together"):
        rotary_embedding(pos, q, k, cache, q_norm_weight=qw)
    with pytest.raises(ValueError, match="k_norm_weight must be contiguous"):
        rotary_embedding(pos, q, k, cache, q_norm_weight=qw, k_norm_weight=kw[:-2])


@pytest.mark.parametrize("tokens,dtype,tol", CASES)
@pytest.mark.parametrize("head_dim,norm,cache", [(128, False, "same"), (96, True, "same"),
                                                 (64, False, "fp8"), (96, True, "fp8")])
def test_rotary_and_cache_equals_the_pair_bit_for_bit(device, tokens, dtype, tol, head_dim, norm,
                                                      cache):
    """One launch stores exactly what rotary_embedding then write_kv_cache store (the rotated
    k rounded to the activations' dtype first, an FP8 cache quantized from that), leaves the
    slots it was not given and the padding tokens' (-1) alone, and returns the pair's q; both
    are the torch reference's to within tol."""
    device = _dev(device, dtype)
    h, hkv, max_pos, blocks, bs = (32, 8, 8192, 512, 16) if CUDA else (4, 2, 64, 4, 16)
    gen = torch.Generator().manual_seed(head_dim + norm)
    qkv = (3 * torch.randn(tokens, (h + 2 * hkv) * head_dim, generator=gen)).to(device, dtype)
    q, k, v = (x.view(tokens, -1, head_dim) for x in
               qkv.split([h * head_dim, hkv * head_dim, hkv * head_dim], dim=-1))
    pos = torch.randint(0, max_pos, (tokens,), generator=gen).to(device)
    table = torch.randn(max_pos, head_dim, generator=gen).to(device)
    slots = torch.randperm(blocks * bs, generator=gen)[:tokens]
    slots[::5] = -1
    slots = slots.to(device)
    norms = {}
    if norm:
        qw, kw = ((1 + 0.5 * torch.randn(head_dim, generator=gen)).to(device, dtype)
                  for _ in range(2))
        norms = {"q_norm_weight": qw, "k_norm_weight": kw, "norm_eps": 1e-6}
    scales = (0.5, 2.0) if cache == "fp8" else (1.0, 1.0)
    kv_dtype = torch.float8_e4m3fn if cache == "fp8" else dtype
    nan = torch.full((blocks, bs, hkv, head_dim), 0x7F, dtype=torch.uint8, device=device)
    kc, vc, kc2, vc2, kc3, vc3 = ((nan.view(kv_dtype) if cache == "fp8" else
                                   _nan(nan.shape, dtype, device)).clone() for _ in range(6))
    pq, pk = rotary_embedding(pos, q, k, table, **norms)
    write_kv_cache(pk, v, kc, vc, slots, *scales)
    out_q = rotary_and_cache(pos, q, k, v, table, kc2, vc2, slots, *scales,
                             q_out=_nan(q.shape, dtype, device), **norms)
    assert torch.equal(out_q, pq)
    for want, got in ((kc, kc2), (vc, vc2)):
        assert torch.equal(want.view(torch.uint8), got.view(torch.uint8))
    written = (slots >= 0).sum().item() * hkv * head_dim
    assert (~kc2.float().isnan()).sum().item() == written
    ref_q = reference.rotary_and_cache(pos, q, k, v, table, kc3, vc3, slots, *scales, **norms)
    assert rel_err(out_q, ref_q) < tol
    ok = ~kc3.float().isnan()
    assert rel_err(kc2.float()[ok], kc3.float()[ok]) < (0.07 if cache == "fp8" else tol)
    assert torch.equal(vc2.view(torch.uint8), vc3.view(torch.uint8))


def test_rotary_and_cache_rejects_misuse(device):
    q = torch.randn(3, 4, 64, device=device)
    k = v = torch.randn(3, 2, 64, device=device)
    pos = torch.arange(3, device=device)
    table = torch.randn(8, 64, device=device)
    cache = torch.zeros(2, 16, 2, 64, device=device)
    slots = torch.arange(3, device=device)
    with pytest.raises(ValueError, match="slot_mapping has 2 entries"):
        rotary_and_cache(pos, q, k, v, table, cache, cache.clone(), slots[:2])
    with pytest.raises(ValueError, match="value shape"):
        rotary_and_cache(pos, q, k, v[:, :1], table, cache, cache.clone(), slots)
    with pytest.raises(ValueError, match="v dtype"):
        rotary_and_cache(pos, q, k, v.half(), table, cache, cache.clone(), slots)
    with pytest.raises(ValueError, match="go together"):
        rotary_and_cache(pos, q, k, v, table, cache, cache.clone(), slots, q_norm_weight=q[0, 0])


@pytest.mark.parametrize("tokens,dtype,tol", CASES)
def test_silu_and_mul(device, tokens, dtype, tol):
    device = _dev(device, dtype)
    inter = 14336 if CUDA else 2500  # 2500: two column blocks, the second ragged
    x = torch.randn(tokens, 2 * inter, device=device, dtype=dtype)
    out = silu_and_mul(x, out=_nan((tokens, inter), dtype, device))
    assert rel_err(out, reference.silu_and_mul(x)) < tol


@pytest.mark.parametrize("tokens,dtype,tol", CASES)
def test_gelu_tanh_and_mul(device, tokens, dtype, tol):
    device = _dev(device, dtype)
    inter = 16384 if CUDA else 2500  # 16384: Gemma-2-2B's MLP; 2500: a ragged second block
    big = 3 * torch.randn(tokens, 2 * inter + 8, device=device, dtype=dtype)
    x = big[:, :2 * inter]  # strided rows; |x| up to ~12 reaches both tails of the GELU
    out = gelu_tanh_and_mul(x, out=_nan((tokens, inter), dtype, device))
    gate, up = x.float().chunk(2, dim=-1)
    assert rel_err(out, reference.gelu_tanh_and_mul(x)) < tol
    # the reference is torch's tanh GELU: 0.5 g (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3)))
    by_hand = 0.5 * gate * (1 + torch.tanh(0.7978845608028654 * (gate + 0.044715 * gate**3)))
    assert rel_err(reference.gelu_tanh_and_mul(x), by_hand * up) < max(tol, 1e-6)


def test_fused_reject_misuse(device):
    x = torch.randn(4, 8, device=device)
    with pytest.raises(ValueError):
        rms_norm(x, torch.ones(7, device=device), 1e-6)
    with pytest.raises(ValueError):
        rms_norm(x.t(), torch.ones(4, device=device), 1e-6)
    with pytest.raises(ValueError):
        silu_and_mul(torch.randn(4, 7, device=device))
    with pytest.raises(ValueError):
        gelu_tanh_and_mul(torch.randn(4, 7, device=device))
    q = torch.randn(4, 2, 8, device=device)
    with pytest.raises(ValueError):
        rotary_embedding(torch.arange(4, device=device), q, q, torch.randn(10, 6, device=device))
    with pytest.raises(ValueError):
        rotary_embedding(torch.arange(4, device=device).int(), q, q,
                         torch.randn(10, 8, device=device))
