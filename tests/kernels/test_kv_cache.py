from __future__ import annotations

import pytest
import torch

from pagedserve.kernels import reference
from pagedserve.kernels.kv_cache import write_kv_cache

CUDA = torch.cuda.is_available()


def _case(num_tokens, hkv, d, block_size, dtype, device, seed):
    gen = torch.Generator().manual_seed(seed)
    num_blocks = 8
    # key/value are strided views into a fused qkv projection output, as in the model.
    qkv = torch.randn((num_tokens, (4 + 2) * hkv, d), generator=gen).to(device, dtype)
    key, value = qkv[:, 4 * hkv:5 * hkv], qkv[:, 5 * hkv:]
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[::5] = -1  # padding tokens are skipped
    cache = torch.full((num_blocks, block_size, hkv, d), float("nan"), dtype=dtype, device=device)
    return key, value, cache, slots.to(device)


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_matches_reference_exactly(device, block_size, head_dim):
    key, value, cache, slots = _case(37, 2, head_dim, block_size, torch.float32, device, 1)
    k_ref, v_ref = cache.clone(), cache.clone() + 1
    k_out, v_out = k_ref.clone(), v_ref.clone()
    reference.write_kv_cache(key, value, k_ref, v_ref, slots)
    write_kv_cache(key, value, k_out, v_out, slots)
    # Untouched slots stay NaN in both; written ones must be bit-identical.
    torch.testing.assert_close(k_out, k_ref, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(v_out, v_ref, rtol=0, atol=0, equal_nan=True)
    written = (slots >= 0).sum().item() * 2 * head_dim
    assert (~k_out.isnan()).sum().item() == written


def test_rejects_misuse(device):
    key, value, cache, slots = _case(5, 2, 64, 16, torch.float32, device, 2)
    other = cache.clone()
    with pytest.raises(ValueError):
        write_kv_cache(key, value, cache, other, slots.int())
    with pytest.raises(ValueError):
        write_kv_cache(key, value, cache, other, slots[:-1])
    with pytest.raises(ValueError):
        write_kv_cache(key[:, :1], value, cache, other, slots)
    with pytest.raises(ValueError):
        write_kv_cache(key, value, cache.transpose(1, 2), other.transpose(1, 2), slots)


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_large(dtype):
    gen = torch.Generator().manual_seed(3)
    n_tok, hkv, d, bs, n_blocks = 4000, 8, 128, 16, 300
    key = torch.randn(n_tok, hkv, d, generator=gen).to("cuda", dtype)
    value = torch.randn(n_tok, hkv, d, generator=gen).to("cuda", dtype)
    slots = torch.randperm(n_blocks * bs, generator=gen)[:n_tok].cuda()
    slots[7::9] = -1
    cache = torch.full((n_blocks, bs, hkv, d), float("nan"), dtype=dtype, device="cuda")
    k_ref, v_ref, k_out, v_out = (cache.clone() for _ in range(4))
    reference.write_kv_cache(key, value, k_ref, v_ref, slots)
    write_kv_cache(key, value, k_out, v_out, slots)
    torch.testing.assert_close(k_out, k_ref, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(v_out, v_ref, rtol=0, atol=0, equal_nan=True)


FP8 = torch.float8_e4m3fn


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scales", [(1.0, 1.0), (0.37, 2.5)])
def test_fp8_matches_reference_bits(device, dtype, scales):
    key, value, _, slots = _case(37, 2, 64, 16, dtype, device, 4)
    # spread over every e4m3 binade, past the +-448 saturation and into subnormals
    key.mul_(torch.logspace(-4, 3, 64, device=device).to(dtype))
    value.mul_(300)
    cache = torch.full((8, 16, 2, 64), 0x7F, dtype=torch.uint8, device=device).view(FP8)  # NaN
    k_ref, v_ref, k_out, v_out = (cache.clone() for _ in range(4))
    reference.write_kv_cache(key, value, k_ref, v_ref, slots, *scales)
    write_kv_cache(key, value, k_out, v_out, slots, *scales)
    assert torch.equal(_bits(k_out), _bits(k_ref))
    assert torch.equal(_bits(v_out), _bits(v_ref))
    written = _bits(k_out) != 0x7F
    assert written.sum().item() == (slots >= 0).sum().item() * 2 * 64
    # the reference is what its docstring says: x / scale saturated and rounded to e4m3
    flat = k_ref.view(-1, 2, 64)[slots[slots >= 0]].float()
    want = (key[slots >= 0].float() / scales[0]).clamp(-448, 448)
    assert flat.abs().max().item() == 448.0
    assert torch.equal(flat, want.to(FP8).float())
    assert ((flat - want).abs() <= want.abs() / 16 + 2**-10).all()  # 3 mantissa bits


def test_fp8_rejects_bad_scale(device):
    key, value, _, slots = _case(5, 2, 64, 16, torch.float32, device, 5)
    cache = torch.zeros((8, 16, 2, 64), dtype=FP8, device=device)
    with pytest.raises(ValueError, match="scales must be > 0"):
        write_kv_cache(key, value, cache, cache.clone(), slots, 0.0, 1.0)
    with pytest.raises(ValueError):  # K and V caches of different dtypes
        write_kv_cache(key, value, cache, cache.float(), slots)


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_fp8_large(dtype):
    gen = torch.Generator().manual_seed(6)
    n_tok, hkv, d, bs, n_blocks = 4000, 8, 128, 16, 300
    key = (torch.randn(n_tok, hkv, d, generator=gen) * 100).to("cuda", dtype)
    value = (torch.randn(n_tok, hkv, d, generator=gen) * 0.01).to("cuda", dtype)
    slots = torch.randperm(n_blocks * bs, generator=gen)[:n_tok].cuda()
    slots[7::9] = -1
    cache = torch.zeros((n_blocks, bs, hkv, d), dtype=FP8, device="cuda")
    k_ref, v_ref, k_out, v_out = (cache.clone() for _ in range(4))
    reference.write_kv_cache(key, value, k_ref, v_ref, slots, 0.3, 0.002)
    write_kv_cache(key, value, k_out, v_out, slots, 0.3, 0.002)
    assert torch.equal(_bits(k_out), _bits(k_ref))
    assert torch.equal(_bits(v_out), _bits(v_ref))
