"""Mixture of experts: the router against transformers' own routers, the torch expert loop
against a per-token float64 loop and HF's MixtralExperts, the alignment (Triton, torch) against
its definition, the Triton fused_moe against the torch one (fp32, bf16, FP8 weights, forced
routings, chunked passes, TP slices, tuned configs), and the argument checks."""

from __future__ import annotations

import pytest
import torch
from kernel_utils import rel_err

from pagedserve import kernels
from pagedserve.kernels import fused_moe as fm
from pagedserve.kernels import moe_reference as ref
from pagedserve.kernels.fp8_reference import quantize_weight

HID, INTER = 64, 32


def experts(e, dtype=torch.float32, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randn(e, 2 * INTER, HID, generator=g) * HID**-0.5
    w2 = torch.randn(e, HID, INTER, generator=g) * INTER**-0.5
    return w13.to(device, dtype), w2.to(device, dtype)


def batch(t, e, k, dtype=torch.float32, seed=1, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, HID, generator=g).to(device, dtype)
    weights, ids = ref.moe_route(torch.randn(t, e, generator=g).to(device), k, True)
    return x, weights, ids


def naive(x, w13, w2, weights, ids):
    """Token by token, slot by slot, in float64."""
    x, w13, w2, weights = x.double(), w13.double(), w2.double(), weights.double()
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gate, up = (w13[e] @ x[t]).chunk(2)
            out[t] += weights[t, j] * (w2[e] @ (torch.nn.functional.silu(gate) * up))
    return out


def quantize_experts(w):
    """[E, N, K] float -> (e4m3 codes, float32 scales [E, N]) per output channel."""
    e, n, k = w.shape
    codes, scale = quantize_weight(w.reshape(e * n, k))
    return codes.view(e, n, k), scale.view(e, n)


# ---- routing: transformers' own router modules on random logits (an identity gate weight)

def hf_router(family: str, e: int, k: int, norm: bool, dtype: torch.dtype):
    if family == "mixtral":
        from transformers.models.mixtral.configuration_mixtral import MixtralConfig
        from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter as R
        cfg = MixtralConfig(hidden_size=e, num_local_experts=e, num_experts_per_tok=k)
    elif family == "qwen2_moe":
        from transformers.models.qwen2_moe.configuration_qwen2_moe import Qwen2MoeConfig
        from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeTopKRouter as R
        cfg = Qwen2MoeConfig(hidden_size=e, num_experts=e, num_experts_per_tok=k,
                             norm_topk_prob=norm)
    else:
        from transformers.models.qwen3_moe.configuration_qwen3_moe import Qwen3MoeConfig
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter as R
        cfg = Qwen3MoeConfig(hidden_size=e, num_experts=e, num_experts_per_tok=k,
                             norm_topk_prob=norm)
    router = R(cfg).to(dtype)
    with torch.no_grad():
        router.weight.copy_(torch.eye(e))  # logits = the hidden states, exactly
    return router


@pytest.mark.parametrize("family,norm", [("mixtral", True), ("qwen2_moe", False),
                                         ("qwen3_moe", True)])
@pytest.mark.parametrize("e,k", [(8, 2), (60, 4), (128, 8)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_route_equals_transformers_router(family, norm, e, k, dtype):
    g = torch.Generator().manual_seed(e * 10 + k)
    logits = (torch.randn(37, e, generator=g) * 3).to(dtype)
    logits[:5] = torch.randint(0, 3, (5, e), generator=g).to(dtype)  # ties: topk's order
    router = hf_router(family, e, k, norm, dtype)
    with torch.no_grad():
        hf_logits, hf_w, hf_ids = router(logits)
    assert torch.equal(hf_logits, logits)
    w, ids = ref.moe_route(logits, k, norm)
    assert w.dtype == torch.float32 and ids.dtype == torch.int32
    assert torch.equal(ids.long(), hf_ids)
    # Mixtral keeps the weights in float32; the Qwen routers round them to the logits' dtype
    torch.testing.assert_close(w.to(hf_w.dtype), hf_w, rtol=0, atol=1e-6)
    if norm:
        torch.testing.assert_close(w.sum(1), torch.ones(37), rtol=0, atol=1e-6)


@pytest.mark.parametrize("t,e,k", [(1, 8, 2), (37, 60, 4), (64, 128, 8), (5, 4, 4), (3, 6, 1)])
@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_route_equals_the_reference(t, e, k, norm, dtype, device):
    """The one-launch router gives the reference's weights, its experts ordered by probability
    and, between equal ones, by the lower id: the set torch.topk takes on CUDA (its order
    among ties differs by device, and bf16 logits tie often); experts not a power of two,
    k = E, k = 1."""
    g = torch.Generator().manual_seed(t * e + k)
    logits = (torch.randn(t, e, generator=g) * 3).to(dtype)
    logits[: min(t, 2)] = torch.randint(0, 3, (min(t, 2), e), generator=g).to(dtype)  # ties
    logits = logits.to(device)
    w, ids = fm.moe_route(logits, k, norm)
    want_w, want_ids = ref.moe_route(logits, k, norm)
    assert w.dtype == torch.float32 and ids.dtype == torch.int32
    torch.testing.assert_close(w, want_w, rtol=1e-5, atol=1e-6)
    probs = torch.softmax(logits.float(), -1)
    by_rule = torch.sort(-probs, dim=-1, stable=True).indices[:, :k]
    assert torch.equal(ids.long(), by_rule)
    top = probs.sort(-1, descending=True).values[:, :k + 1]
    untied = (top.diff(dim=-1) != 0).all(-1)  # no ties among the top k and the next
    assert torch.equal(ids[untied], want_ids[untied])  # there: the reference's own ids
    assert untied.sum() >= (t - 2) // 2
    # weights stored in the activations' dtype: float32's, rounded as .to rounds them
    for route, (w32, ids32) in ((fm.moe_route, (w, ids)), (ref.moe_route, (want_w, want_ids))):
        w16, ids16 = route(logits, k, norm, torch.bfloat16)
        assert w16.dtype == torch.bfloat16 and torch.equal(w16, w32.to(torch.bfloat16))
        assert torch.equal(ids16, ids32)


def test_triton_route_of_no_tokens_and_a_strided_view(device):
    w, ids = fm.moe_route(torch.empty(0, 8, device=device), 2, True)
    assert w.shape == ids.shape == (0, 2)
    wide = torch.randn(6, 16, device=device)
    got = fm.moe_route(wide[:, :8], 2, True)
    want = ref.moe_route(wide[:, :8].contiguous(), 2, True)
    assert torch.equal(got[1], want[1])
    torch.testing.assert_close(got[0], want[0])
    assert kernels.get_ops("triton").moe_route is fm.moe_route


# ---- the torch expert loop

@pytest.mark.parametrize("e,k", [(8, 2), (4, 2), (8, 1)])
def test_reference_equals_a_per_token_loop(e, k):
    w13, w2 = experts(e)
    x, weights, ids = batch(16, e, k)
    torch.testing.assert_close(ref.fused_moe(x, w13, w2, weights, ids).double(),
                               naive(x, w13, w2, weights, ids), rtol=1e-5, atol=1e-5)


def test_reference_equals_transformers_experts():
    from transformers.models.mixtral.configuration_mixtral import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    w13, w2 = experts(8)
    x, weights, ids = batch(16, 8, 2)
    cfg = MixtralConfig(hidden_size=HID, intermediate_size=INTER, num_local_experts=8)
    hf = MixtralExperts(cfg)
    with torch.no_grad():
        hf.gate_up_proj.copy_(w13)
        hf.down_proj.copy_(w2)
        want = hf(x, ids.long(), weights)
    torch.testing.assert_close(ref.fused_moe(x, w13, w2, weights, ids), want,
                               rtol=1e-5, atol=1e-5)


def oai_experts(e, dtype=torch.float32, device="cpu"):
    """gpt-oss-like experts: biases, and weights large enough that the clamps bite."""
    g = torch.Generator().manual_seed(4)
    w13, w2 = experts(e)
    b13, b2 = torch.randn(e, 2 * INTER, generator=g), torch.randn(e, HID, generator=g)
    return [t.to(device, dtype) for t in (w13 * 8, w2, b13, b2)]


def test_reference_swiglu_oai_equals_transformers_gpt_oss_experts():
    """gpt-oss's experts (HF's GptOssExperts: [E, H, 2I] with gate and up interleaved, biases,
    the clamped activation) equal the reference on their de-interleaved [E, 2I, H] layout."""
    from transformers.models.gpt_oss.configuration_gpt_oss import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    w13, w2, b13, b2 = oai_experts(8)
    x, weights, ids = batch(16, 8, 2)
    hf = GptOssExperts(GptOssConfig(hidden_size=HID, intermediate_size=INTER,
                                    num_local_experts=8))
    interleave = torch.stack([torch.arange(INTER), torch.arange(INTER) + INTER], 1).reshape(-1)
    with torch.no_grad():
        hf.gate_up_proj.copy_(w13[:, interleave].transpose(1, 2))
        hf.gate_up_proj_bias.copy_(b13[:, interleave])
        hf.down_proj.copy_(w2.transpose(1, 2))
        hf.down_proj_bias.copy_(b2)
        want = hf(x, ids.long(), weights)
    got = ref.fused_moe(x, w13, w2, weights, ids, activation="swiglu_oai", w13_bias=b13,
                        w2_bias=b2, alpha=hf.alpha, limit=hf.limit)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    plain = ref.fused_moe(x, w13, w2, weights, ids, w13_bias=b13, w2_bias=b2)
    assert rel_err(plain, want) > 0.1  # the activation matters


@pytest.mark.parametrize("t", [1, 40])
@pytest.mark.parametrize("case", ["fp32", "bf16", "fp8"])
def test_triton_swiglu_oai_with_biases(t, case, device):
    """Biases in both GEMMs' epilogues (after FP8 weights' scales) and gpt-oss's activation in
    the first's, at decode and prefill sizes (the activation is always fused)."""
    dtype = torch.bfloat16 if case == "bf16" else torch.float32
    w13, w2, b13, b2 = oai_experts(8, dtype, device)
    x, weights, ids = batch(t, 8, 2, dtype, device=device)
    opts = {"activation": "swiglu_oai", "w13_bias": b13, "w2_bias": b2}
    if case == "fp8":
        (w13, s13), (w2, s2) = quantize_experts(w13), quantize_experts(w2)
        opts.update(w13_scale=s13, w2_scale=s2)
    check_close(fm.fused_moe(x, w13, w2, weights, ids, **opts),
                ref.fused_moe(x, w13, w2, weights, ids, **opts), dtype)
    logits = torch.randn(t, 8, generator=torch.Generator().manual_seed(5)).to(device)
    want = ref.routed_moe(x, logits, 2, True, w13, w2, **opts)
    check_close(fm.routed_moe(x, logits, 2, True, w13, w2, **opts), want, dtype)
    check_close(fm.moe_decode(x, logits, 2, True, w13, w2, **opts), want, dtype)  # the GEMVs
    with pytest.raises(ValueError, match="w2_bias"):
        fm.fused_moe(x, w13, w2, weights, ids, **{**opts, "w2_bias": b2[:, :-1]})


def test_reference_fp8_equals_the_dequantized_weights():
    w13, w2 = experts(8)
    (q13, s13), (q2, s2) = quantize_experts(w13), quantize_experts(w2)
    x, weights, ids = batch(16, 8, 2)
    got = ref.fused_moe(x, q13, q2, weights, ids, w13_scale=s13, w2_scale=s2)
    want = naive(x, q13.float() * s13[..., None], q2.float() * s2[..., None], weights, ids)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


# ---- alignment

def align_by_definition(ids: torch.Tensor, block_m: int, e: int):
    flat = ids.reshape(-1).tolist()
    numel = len(flat)
    sorted_ids, expert_ids = [], []
    for expert in range(e):
        run = [p for p in range(numel) if flat[p] == expert]
        run += [numel] * (-len(run) % block_m)
        sorted_ids += run
        expert_ids += [expert] * (len(run) // block_m)
    total = len(sorted_ids)
    cap = ref.align_block_size_capacity(numel, block_m, e)
    sorted_ids += [numel] * (cap - total)
    expert_ids += [e - 1] * (cap // block_m - len(expert_ids))
    return sorted_ids, expert_ids, total


@pytest.mark.parametrize("t,e,k", [(1, 8, 2), (5, 128, 8), (16, 8, 1), (200, 4, 2),
                                   (64, 60, 4)])
@pytest.mark.parametrize("block_m", [16, 64])
def test_align_equals_its_definition(t, e, k, block_m, device):
    _, _, ids = batch(t, e, k, seed=t + e, device=device)
    want = align_by_definition(ids, block_m, e)
    for fn in (fm.moe_align_block_size, ref.moe_align_block_size):
        sorted_ids, expert_ids, total = fn(ids, block_m, e)
        assert sorted_ids.dtype == expert_ids.dtype == total.dtype == torch.int32
        assert (sorted_ids.tolist(), expert_ids.tolist(), total.item()) == want


@pytest.mark.slow
def test_align_one_program_at_its_largest(device):
    _, _, ids = batch(fm.ALIGN_ONE_PROGRAM // 8, 128, 8, device=device)
    got, want = fm.moe_align_block_size(ids, 16, 128), ref.moe_align_block_size(ids, 16, 128)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


# ---- Triton fused_moe against the torch one

def check_close(got, want, dtype):
    assert got.dtype == dtype and got.shape == want.shape
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    elif dtype == torch.bfloat16 and fm.INTERPRETED:
        # the interpreter (3.9) casts fp32 -> bf16 by truncation, the GPU rounds to nearest:
        # 1.5-1.7% from the float64 loop where the reference is at 0.5%
        assert rel_err(got, want) < 3e-2
    else:  # the caches rounded to x's dtype, another accumulation order
        assert rel_err(got, want) < 1e-2


@pytest.mark.parametrize("t,e,k", [(1, 8, 2), (16, 8, 2), (16, 4, 2), (16, 8, 1),
                                   (2500, 8, 2)])
def test_triton_equals_reference(t, e, k, device):
    w13, w2 = experts(e, device=device)
    x, weights, ids = batch(t, e, k, device=device)
    check_close(fm.fused_moe(x, w13, w2, weights, ids),
                ref.fused_moe(x, w13, w2, weights, ids), torch.float32)


@pytest.mark.parametrize("t", [1, 16])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_triton_half_precision(t, dtype, device):
    w13, w2 = experts(8, dtype, device=device)
    x, weights, ids = batch(t, 8, 2, dtype, device=device)
    check_close(fm.fused_moe(x, w13, w2, weights, ids),
                ref.fused_moe(x, w13, w2, weights, ids), dtype)


def test_experts_without_tokens_and_one_expert_with_all(device):
    w13, w2 = experts(8, device=device)
    x, weights, _ = batch(40, 8, 2, device=device)
    g = torch.Generator().manual_seed(3)
    ids = torch.stack([torch.full((40,), 5), torch.randint(0, 2, (40,), generator=g)], 1)
    ids = ids.to(device, torch.int32)  # every token on expert 5; experts 2-4, 6, 7 get none
    check_close(fm.fused_moe(x, w13, w2, weights, ids),
                ref.fused_moe(x, w13, w2, weights, ids), torch.float32)
    one = torch.full((300, 1), 7, dtype=torch.int32, device=device)  # 300 rows, one expert
    x, weights, _ = batch(300, 8, 1, device=device)
    check_close(fm.fused_moe(x, w13, w2, weights, one),
                ref.fused_moe(x, w13, w2, weights, one), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_fp8_weights(dtype, device):
    w13, w2 = experts(8, device=device)
    (q13, s13), (q2, s2) = quantize_experts(w13), quantize_experts(w2)
    x, weights, ids = batch(16, 8, 2, dtype, device=device)
    scales = {"w13_scale": s13, "w2_scale": s2}
    got = fm.fused_moe(x, q13, q2, weights, ids, **scales)
    check_close(got, ref.fused_moe(x, q13, q2, weights, ids, **scales), dtype)
    dq13, dq2 = ((q.float() * s[..., None]).to(dtype) for q, s in ((q13, s13), (q2, s2)))
    if dtype == torch.float32:  # the dequantized weights, exactly representable in fp32
        check_close(got, ref.fused_moe(x, dq13, dq2, weights, ids), dtype)


def test_route_switch_takes_0_or_1_and_refuses_the_rest():
    """PAGEDSERVE_MOE_FUSE_ROUTE: unset or "1" fuses, "0" does not, a typo is an error."""
    assert [fm.route_fused(v) for v in (None, "1", "0")] == [True, True, False]
    for bad in ("true", "on", ""):
        with pytest.raises(ValueError, match="0 or 1"):
            fm.route_fused(bad)


def test_silu_fuses_up_to_its_token_count_and_the_switch_is_checked(monkeypatch, device):
    """auto: GATED GEMM 1 up to 64 tokens a pass, the separate silu_and_mul launch from 65;
    PAGEDSERVE_MOE_FUSE_SILU takes auto, 0 or 1 and refuses anything else."""
    assert [fm.silu_tokens(v) for v in (None, "auto", "0")] == [64, 64, 0]
    assert fm.silu_tokens("1") > 16 * 1024
    for bad in ("true", "128", ""):
        with pytest.raises(ValueError, match="auto, 0 or 1"):
            fm.silu_tokens(bad)
    monkeypatch.setattr(fm, "FUSE_SILU_TOKENS", fm.silu_tokens("auto"))
    apart, separate = [], fm.silu_and_mul
    monkeypatch.setattr(fm, "silu_and_mul",
                        lambda c, out: (apart.append(len(c)), separate(c, out=out))[1])
    w13, w2 = experts(4, device=device)
    for t in (64, 65):
        x, weights, ids = batch(t, 4, 2, device=device)
        fm.fused_moe(x, w13, w2, weights, ids)
    assert apart == [65 * 2]  # the 65-token pass's (token, slot) pairs, not the 64's


@pytest.mark.parametrize("case", ["fp32", "bf16", "fp8"])
def test_silu_in_the_first_gemms_epilogue_equals_the_separate_launch(case, monkeypatch, device):
    """GATED GEMM 1 (PAGEDSERVE_MOE_FUSE_SILU) against GEMM 1 then silu_and_mul: decode and
    prefill-sized passes, FP8 weights with their scales on both halves."""
    dtype = torch.bfloat16 if case == "bf16" else torch.float32
    w13, w2 = experts(8, dtype, device=device)
    scales = {}
    if case == "fp8":
        (w13, s13), (w2, s2) = quantize_experts(w13), quantize_experts(w2)
        scales = {"w13_scale": s13, "w2_scale": s2}
    for t in (1, 40):
        x, weights, ids = batch(t, 8, 2, dtype, device=device)
        monkeypatch.setattr(fm, "FUSE_SILU_TOKENS", 1 << 62)
        fused = fm.fused_moe(x, w13, w2, weights, ids, **scales)
        monkeypatch.setattr(fm, "FUSE_SILU_TOKENS", 0)
        apart = fm.fused_moe(x, w13, w2, weights, ids, **scales)
        if dtype == torch.float32:  # the same sums; the tile's width may reorder a dot's
            torch.testing.assert_close(fused, apart, rtol=1e-6, atol=1e-6 * apart.abs().max())
        else:
            check_close(fused, apart, dtype)


def test_out_workspace_and_chunked_passes(monkeypatch, device):
    monkeypatch.setattr(fm, "CHUNK_TOKENS", 8)  # three passes over 20 tokens
    w13, w2 = experts(8, device=device)
    x, weights, ids = batch(20, 8, 2, device=device)
    out = torch.full((20, HID), float("nan"), device=device)
    ws = torch.full((fm.workspace_size(20, 2, HID, INTER),), float("nan"), device=device)
    assert fm.fused_moe(x, w13, w2, weights, ids, out=out, workspace=ws) is out
    check_close(out, ref.fused_moe(x, w13, w2, weights, ids), torch.float32)
    with pytest.raises(ValueError, match="workspace"):
        fm.fused_moe(x, w13, w2, weights, ids, workspace=ws[:-1])


def test_tensor_parallel_slices_sum_to_the_whole(device):
    """A TP rank passes its share of INTER: gate rows r, up rows r, down columns r; the ranks'
    outputs add up (the caller's all-reduce) to the unsharded result."""
    w13, w2 = experts(8, device=device)
    x, weights, ids = batch(16, 8, 2, device=device)
    tp, part = 2, INTER // 2
    total = torch.zeros(16, HID, device=device)
    for r in range(tp):
        rows = torch.cat([torch.arange(r * part, (r + 1) * part),
                          INTER + torch.arange(r * part, (r + 1) * part)]).to(device)
        total += fm.fused_moe(x, w13[:, rows].contiguous(),
                              w2[:, :, r * part:(r + 1) * part].contiguous(), weights, ids)
    check_close(total, ref.fused_moe(x, w13, w2, weights, ids), torch.float32)


def test_tuned_configs_are_used_and_their_block_m_may_differ(monkeypatch, device):
    w13, w2 = experts(8, device=device)
    x, weights, ids = batch(16, 8, 2, device=device)
    up = fm.config_key(8, 2 * INTER, HID, torch.float32, torch.float32, x.device)
    down = fm.config_key(8, HID, INTER, torch.float32, torch.float32, x.device)
    table = {up: {1: fm.MoeConfig(64, 32, 16, 1, 4, 2), 64: fm.MoeConfig(32, 16, 32)},
             down: {16: fm.MoeConfig(16, 64, 16, 2, 2, 2)}}
    monkeypatch.setattr(fm, "load_configs", lambda: table)
    assert fm.pick_config(3, 2, w13, x.dtype) == table[up][1]  # the nearest bucket (log2)
    assert fm.pick_config(20, 2, w13, x.dtype) == table[up][64]
    assert fm.pick_config(1000, 2, w13, x.dtype) == fm.default_config(1000, 2, 8, 2 * INTER, HID)
    assert fm.pick_config(16, 2, w2, x.dtype).block_m == 16
    check_close(fm.fused_moe(x, w13, w2, weights, ids),
                ref.fused_moe(x, w13, w2, weights, ids), torch.float32)


def test_config_file_parses_and_round_trips():
    for buckets in fm.load_configs().values():
        for cfg in buckets.values():
            assert fm.MoeConfig.from_json(cfg.to_json()) == cfg
    assert fm.default_config(1, 8, 128, 1536, 2048).block_m == 16
    assert fm.default_config(16384, 8, 128, 1536, 2048).block_m == 128


def test_config_file_ships_in_the_wheel():
    """pyproject's package-data names the tuned tiles, so an installed pagedserve has them."""
    import fnmatch
    import tomllib
    from pathlib import Path

    pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
    data = tomllib.loads(pyproject.read_text())["tool"]["setuptools"]["package-data"]
    assert any(fnmatch.fnmatch(fm.CONFIG_FILE.name, pat) for pat in data["pagedserve.kernels"])


@pytest.mark.parametrize("t,e,k", [(1, 128, 8), (1, 8, 2), (5, 60, 6), (16, 4, 4), (64, 8, 1),
                                   (3, 6, 3)])
@pytest.mark.parametrize("block_m", [16, 32])
def test_route_and_align_in_one_launch_equal_the_two(t, e, k, block_m, device):
    """moe_route_align (FUSE_ROUTE's one program) gives moe_route's weights and ids and the
    alignment's definition over them: k not a power of two, k = E, experts left empty."""
    g = torch.Generator().manual_seed(t * e + k + block_m)
    logits = (torch.randn(t, e, generator=g) * 3).to(device)
    logits[0] = torch.randint(0, 3, (e,), generator=g).float()  # ties: the lower id first
    for norm in (True, False):
        w, ids, (sorted_ids, expert_ids, total) = fm.moe_route_align(logits, k, norm,
                                                                       torch.float32, block_m)
        want_w, want_ids = fm.moe_route(logits, k, norm)
        assert torch.equal(ids, want_ids)
        # (a GPU may sum a row of the tile in another order than the one-token kernel does)
        torch.testing.assert_close(w, want_w, rtol=1e-6, atol=1e-7)
        got = (sorted_ids.tolist(), expert_ids.tolist(), total.item())
        assert got == align_by_definition(ids, block_m, e)
    # past ROUTE_ALIGN_TOKENS tokens: the two calls, the same results
    many = torch.randn(fm.ROUTE_ALIGN_TOKENS + 1, e, generator=g).to(device)
    w, ids, align = fm.moe_route_align(many, k, True, torch.float32, block_m)
    assert torch.equal(ids, fm.moe_route(many, k, True)[1])
    assert [a.tolist() for a in align] == [a.tolist() for a in
                                           fm.moe_align_block_size(ids, block_m, e)]


@pytest.mark.parametrize("fuse", [False, True])
def test_routed_moe_equals_route_then_experts(fuse, monkeypatch, device):
    """routed_moe from the router's logits, its routing fused or not, equals the reference's
    routed_moe, and each equals moe_route then fused_moe."""
    monkeypatch.setattr(fm, "FUSE_ROUTE", fuse)
    w13, w2 = experts(8, device=device)
    for t in (1, 7, fm.ROUTE_ALIGN_TOKENS + 3):
        g = torch.Generator().manual_seed(t)
        x = torch.randn(t, HID, generator=g).to(device)
        logits = torch.randn(t, 8, generator=g).to(device)
        got = fm.routed_moe(x, logits, 2, True, w13, w2)
        want = ref.routed_moe(x, logits, 2, True, w13, w2)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
        # bitwise unfused; fused, the weights may differ in their last bit on a GPU
        torch.testing.assert_close(got, fm.fused_moe(x, w13, w2, *fm.moe_route(logits, 2, True)),
                                   rtol=1e-5 if fuse else 0, atol=1e-6 if fuse else 0)


@pytest.mark.parametrize("t,e,k", [(1, 128, 8), (3, 8, 2), (2, 6, 3), (1, 4, 4)])
@pytest.mark.parametrize("case", ["fp32", "bf16", "fp8"])
def test_decode_gemvs_equal_the_grouped_gemms(t, e, k, case, device):
    """moe_decode (routing inside GEMV 1, the top-k sum inside GEMV 2) equals the reference's
    experts over moe_route's routing (ties to the lower ids, which torch.topk on the CPU does
    not promise): k not a power of two, k = E, FP8 weights with their scales."""
    dtype = torch.bfloat16 if case == "bf16" else torch.float32
    w13, w2 = experts(e, dtype, device=device)
    scales = {}
    if case == "fp8":
        (w13, s13), (w2, s2) = quantize_experts(w13), quantize_experts(w2)
        scales = {"w13_scale": s13, "w2_scale": s2}
    g = torch.Generator().manual_seed(t * e + k)
    x = torch.randn(t, HID, generator=g).to(device, dtype)
    logits = (torch.randn(t, e, generator=g) * 2).to(device, dtype)
    logits[0] = torch.randint(0, 3, (e,), generator=g).to(dtype)  # ties
    for norm in (True, False):
        got = fm.moe_decode(x, logits, k, norm, w13, w2, **scales)
        want = ref.fused_moe(x, w13, w2, *fm.moe_route(logits, k, norm, dtype), **scales)
        if dtype == torch.float32:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max())
        else:
            check_close(got, want, dtype)


def test_decode_gemvs_of_tiles_that_do_not_divide_the_shapes(monkeypatch, device):
    """Widths that are not powers of two, several K steps and N blocks with their masks, and
    routed_moe taking moe_decode up to DECODE_TOKENS tokens (the grouped GEMMs past it)."""
    e, k, h, inter = 8, 2, 48, 24
    g = torch.Generator().manual_seed(7)
    w13 = (torch.randn(e, 2 * inter, h, generator=g) * h**-0.5).to(device)
    w2 = (torch.randn(e, h, inter, generator=g) * inter**-0.5).to(device)
    x = torch.randn(4, h, generator=g).to(device)
    logits = torch.randn(4, e, generator=g).to(device)
    want = ref.routed_moe(x, logits, k, True, w13, w2)
    tiles = (fm.DecodeTiles(8, 16), fm.DecodeTiles(16, 8))
    got = fm.moe_decode(x, logits, k, True, w13, w2, tiles=tiles)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max())
    monkeypatch.setattr(fm, "DECODE_TOKENS", 3)
    calls = []
    monkeypatch.setattr(fm, "moe_decode", lambda *a, **kw: calls.append(a[0].shape[0]))
    fm.routed_moe(x[:3], logits[:3], k, True, w13, w2)
    fm.routed_moe(x, logits, k, True, w13, w2)  # 4 tokens: the grouped GEMMs
    assert calls == [3]


def test_registered_ops():
    assert kernels.get_ops("triton").fused_moe is fm.fused_moe
    assert kernels.get_ops("torch").fused_moe is ref.fused_moe
    assert kernels.get_ops("torch").moe_route is ref.moe_route
    assert kernels.get_ops("triton").routed_moe is fm.routed_moe
    assert kernels.get_ops("torch").routed_moe is ref.routed_moe


@pytest.mark.parametrize("impl", [ref.fused_moe, fm.fused_moe])
def test_bad_arguments_raise(impl):
    w13, w2 = experts(4)
    x, weights, ids = batch(3, 4, 2)
    q13, s13 = quantize_experts(w13)
    q2, s2 = quantize_experts(w2)
    bad = [
        ((x[:, :-1], w13, w2, weights, ids), {}, "H ="),
        ((x, w13, w2[:, :, :-1], weights, ids), {}, r"\[E, H, I\]"),
        ((x, w13.half(), w2, weights, ids), {}, "w13 dtype"),
        ((x, w13, w2, weights[:2], ids), {}, "topk_weights"),
        ((x, w13, w2, weights, ids.float()), {}, "topk_ids dtype"),
        ((x, w13, w2, weights, ids), {"activation": "gelu"}, "activation"),
        ((x, q13, q2, weights, ids), {"w13_scale": s13}, "together"),
        ((x, w13, w2, weights, ids), {"w13_scale": s13, "w2_scale": s2}, "w13 dtype"),
        ((x, q13, q2, weights, ids), {"w13_scale": s13[:, :-1], "w2_scale": s2}, "w13_scale"),
        ((x, w13, w2, weights, ids), {"out": torch.empty(3, HID + 1)}, "out shape"),
    ]
    for args, kw, match in bad:
        with pytest.raises(ValueError, match=match):
            impl(*args, **kw)
    with pytest.raises(ValueError, match="top_k"):
        ref.moe_route(torch.randn(3, 4), 5, True)


def qwen3_moe_experts(g: torch.Generator, fp8: bool):
    """Qwen3-30B-A3B's experts (E 128, H 2048, I 768) on CUDA: bf16, or FP8 codes and their
    scales; (w13, w2, scales as fused_moe's keywords)."""
    e, h, inter = 128, 2048, 768
    w13 = torch.randn(e, 2 * inter, h, device="cuda", generator=g) * h**-0.5
    w2 = torch.randn(e, h, inter, device="cuda", generator=g) * inter**-0.5
    if not fp8:
        return w13.bfloat16(), w2.bfloat16(), {}
    (w13, s13), (w2, s2) = quantize_experts(w13), quantize_experts(w2)
    return w13, w2, {"w13_scale": s13, "w2_scale": s2}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="model sizes: CUDA")
@pytest.mark.parametrize("t", [1, 64, 1024])
@pytest.mark.parametrize("fp8", [False, True])
def test_cuda_qwen3_moe_shape(t, fp8):
    """Qwen3-30B-A3B's experts (H 2048, I 768, E 128, top-8) in bf16 at decode and prefill."""
    g = torch.Generator(device="cuda").manual_seed(t)
    e, k, h = 128, 8, 2048
    w13, w2, scales = qwen3_moe_experts(g, fp8)
    x = torch.randn(t, h, device="cuda", generator=g).bfloat16()
    weights, ids = ref.moe_route(torch.randn(t, e, device="cuda", generator=g), k, True)
    got = fm.fused_moe(x, w13, w2, weights, ids, **scales)
    check_close(got, ref.fused_moe(x, w13, w2, weights, ids, **scales), torch.bfloat16)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs")
@pytest.mark.parametrize("t", [4, 600])  # the one-program alignment, then the torch one
def test_cuda_graph_replays_new_routings(t):
    """No host sync and a grid of shapes only: a captured call replays right for routings it
    was not captured with (the executor captures decode steps)."""
    w13, w2 = experts(16, torch.bfloat16, device="cuda")
    x, weights, ids = batch(t, 16, 2, torch.bfloat16, device="cuda")
    out = torch.empty_like(x)
    ws = torch.empty(fm.workspace_size(t, 2, HID, INTER), dtype=x.dtype, device="cuda")
    fm.fused_moe(x, w13, w2, weights, ids, out=out, workspace=ws)  # compile outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fm.fused_moe(x, w13, w2, weights, ids, out=out, workspace=ws)
    for seed in (5, 6):
        x2, w2_, ids2 = batch(t, 16, 2, torch.bfloat16, seed=seed, device="cuda")
        ids2[: t // 2] = 3  # one expert crowded, others empty
        x.copy_(x2)
        weights.copy_(w2_)
        ids.copy_(ids2)
        graph.replay()
        check_close(out, ref.fused_moe(x, w13, w2, weights, ids), torch.bfloat16)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="model sizes: CUDA")
@pytest.mark.parametrize("t", [1, 4])
@pytest.mark.parametrize("fp8", [False, True])
def test_cuda_decode_gemvs_at_qwen3_moe_shape(t, fp8):
    """moe_decode at Qwen3-30B-A3B's shapes in bf16 against the grouped GEMMs, and replayed
    from a CUDA graph for routings it was not captured with."""
    g = torch.Generator(device="cuda").manual_seed(t)
    e, k, h = 128, 8, 2048
    w13, w2, scales = qwen3_moe_experts(g, fp8)
    x = torch.randn(t, h, device="cuda", generator=g).bfloat16()
    logits = torch.randn(t, e, device="cuda", generator=g).bfloat16()
    check_close(fm.moe_decode(x, logits, k, True, w13, w2, **scales),
                ref.routed_moe(x, logits, k, True, w13, w2, **scales), torch.bfloat16)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fm.moe_decode(x, logits, k, True, w13, w2, **scales)
    for _ in range(2):
        logits.copy_(torch.randn(t, e, device="cuda", generator=g))
        x.copy_(torch.randn(t, h, device="cuda", generator=g))
        graph.replay()
        check_close(out, ref.routed_moe(x, logits, k, True, w13, w2, **scales), torch.bfloat16)
