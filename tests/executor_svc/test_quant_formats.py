"""AWQ/GPTQ checkpoints: packing against AutoAWQ's and AutoGPTQ's packers (re-implemented here
from their code), loading into the fused model vs HF with dequantized weights, refusals."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM

from pagedserve.executor.checkpoint import iter_checkpoint
from pagedserve.executor.config import ModelConfig
from pagedserve.executor.loader import build_model
from pagedserve.executor.quantization import (
    QuantConfig,
    QuantizationError,
    convert_checkpoint,
    resolve_quantization,
)
from pagedserve.executor.quantization.algorithms import gptq, rtn
from pagedserve.executor.quantization.config import IntWeights, dequantized_int
from pagedserve.executor.quantization.formats import from_awq, from_gptq, to_awq, to_gptq
from pagedserve.executor.quantization.pipeline import (
    QuantizeOptions,
    quantization_config,
    save_checkpoint,
)
from pagedserve.kernels import get_ops
from pagedserve.kernels.w4a16_reference import dequantize

OPS = get_ops("torch")
SEQ = torch.randint(0, 256, (12,), generator=torch.Generator().manual_seed(1)).tolist()


def served_logits(path, quant=None, chunks=((12,),)) -> torch.Tensor:
    """SEQ's last logits from our model of the checkpoint in `path`, in `chunks` (fp32, CPU)."""
    from tests.executor_svc.test_model import run_paged

    cfg = ModelConfig.from_pretrained(path)
    model = build_model(cfg, OPS, torch.float32, torch.device("cpu"), 128, path, quant=quant)
    return run_paged(model, cfg, [SEQ], list(chunks))[0][-1]


def hf_logits(hf) -> torch.Tensor:
    """SEQ's last logits from the HF model `hf`."""
    with torch.no_grad():
        return hf(torch.tensor([SEQ])).logits[0, -1]


def autoawq_pack(intweight):  # AutoAWQ WQLinear_GEMM.from_linear, intweight [in, out]
    order_map = [0, 2, 4, 6, 1, 3, 5, 7]
    qweight = torch.zeros((intweight.shape[0], intweight.shape[1] // 8), dtype=torch.int32)
    for col in range(intweight.shape[1] // 8):
        for i in range(8):
            qweight[:, col] |= intweight[:, col * 8 + order_map[i]].int() << (i * 4)
    return qweight


def autogptq_pack_zeros(zeros):  # [groups, out], stored minus one (v1)
    qz = torch.zeros((zeros.shape[0], zeros.shape[1] // 8), dtype=torch.int64)
    for col in range(qz.shape[1]):
        for j in range(8):
            qz[:, col] |= ((zeros[:, col * 8 + j].long() - 1) & 0xF) << (4 * j)
    return _int32(qz)


def _int32(x):
    return (x - (x >= 2**31).long() * 2**32).to(torch.int32)


def test_awq_unpacks_autoawq_layout():
    k, n, g = 64, 16, 32
    q, z = torch.randint(0, 16, (k, n)), torch.randint(0, 16, (k // g, n))
    s = torch.rand(k // g, n).half()
    out = from_awq("m", autoawq_pack(q), autoawq_pack(z), s, g)
    w = dequantize(out["qweight"], out["scales"], out["zeros"], g, torch.float32)
    expect = (q - z.repeat_interleave(g, 0)).float() * s.float().repeat_interleave(g, 0)
    assert torch.equal(w, expect)


@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_unpacks_autogptq_layout_with_zero_plus_one(act_order):
    k, n, g = 128, 16, 32
    q, z = torch.randint(0, 16, (k, n)), torch.randint(1, 17, (k // g, n))  # v1: zeros 1..16
    s = torch.rand(k // g, n).half()
    g_idx = torch.arange(k) // g
    if act_order:
        g_idx = g_idx[torch.randperm(k, generator=torch.Generator().manual_seed(0))]
    qw = torch.zeros((k // 8, n), dtype=torch.int64)
    for j in range(8):
        qw |= q[j::8].long() << (4 * j)
    out = from_gptq("m", _int32(qw), autogptq_pack_zeros(z), s, g_idx.int(), g, 1, act_order)
    w = dequantize(out["qweight"], out["scales"], out["zeros"], g, torch.float32)
    expect = (q - z[g_idx]).float() * s.float()[g_idx]  # row k uses group g_idx[k]
    assert torch.equal(w, expect[out["perm"]] if act_order else expect)
    # an expert's projection comes out dequantized, in input-channel order, [out, in]
    expert = "model.layers.0.mlp.experts.3.down_proj"
    parts = {"qweight": _int32(qw), "qzeros": autogptq_pack_zeros(z), "scales": s,
             "g_idx": g_idx.int()}
    quant = QuantConfig("gptq", g, act_order=act_order, zero_offset=1)
    converted = dict(convert_checkpoint([(f"{expert}.{k}", v) for k, v in parts.items()], quant))
    assert list(converted) == [f"{expert}.weight"]
    assert torch.equal(converted[f"{expert}.weight"], expect.t())


TINY = dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
            max_position_embeddings=128)


def _quantized_tiny(tmp_path, method, group, sym=False, act_order=True):
    """A random tiny model quantized by our pipeline (no calibration needed for rtn; gptq and
    awq get random activations), written as a checkpoint."""
    from pagedserve.executor.quantization.pipeline import quantize_model

    torch.manual_seed(0)
    d = dict(TINY)
    hf = AutoModelForCausalLM.from_config(AutoConfig.for_model(d.pop("model_type"), **d),
                                          dtype=torch.float32).eval()
    src = tmp_path / "src"
    hf.save_pretrained(src)
    opt = QuantizeOptions(method, group, sym, act_order)
    quantized = quantize_model(hf, torch.randint(0, 256, (4, 32)), opt)
    save_checkpoint(hf, quantized, src, tmp_path / "q", opt)
    return hf, tmp_path / "q"  # hf now holds the dequantized weights


@pytest.mark.parametrize("method,group,sym,act_order", [
    ("awq", 32, False, False), ("gptq", 64, True, True), ("gptq", 32, False, False),
    ("rtn", 128, False, False),
])
def test_checkpoint_loads_fused_and_matches_dequantized_hf(tmp_path, method, group, sym,
                                                          act_order):
    hf, qdir = _quantized_tiny(tmp_path, method, group, sym, act_order)
    quant = resolve_quantization(qdir)
    assert quant.method == ("awq" if method == "awq" else "gptq")
    assert quant.act_order == (act_order and method == "gptq")
    torch.testing.assert_close(served_logits(qdir, quant), hf_logits(hf), rtol=1e-4, atol=1e-4)


def _write_config(tmp_path, qc):
    cfg = dict(TINY, quantization_config=qc)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return tmp_path


@pytest.mark.parametrize("qc,requested,match", [
    ({"quant_method": "awq", "bits": 8, "group_size": 128}, "auto", "only 4-bit"),
    ({"quant_method": "gptq", "bits": 3, "group_size": 128}, "auto", "3-bit weights"),
    ({"quant_method": "gptq", "bits": 8, "group_size": 0}, "auto", "group_size 0"),
    ({"quant_method": "awq", "bits": 4, "group_size": 256}, "auto", "group_size 256"),
    ({"quant_method": "awq", "bits": 4, "group_size": -1}, "auto", "per-channel"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, "auto", "gemv"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": False}, "auto",
     "zero_point"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128}, "awq", "says 'gptq'"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128}, "none", "--quantization gptq"),
    ({"quant_method": "hqq"}, "auto", "not supported"),
    ({"quant_method": "bitsandbytes"}, "auto", "neither load_in_4bit nor load_in_8bit"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True,
      "bnb_4bit_quant_storage": "bfloat16"}, "auto", "quant_storage 'bfloat16'"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128,
      "modules_to_not_convert": ["mlp.down_proj"]}, "auto", "modules_to_not_convert"),
])
def test_refused_with_reason(tmp_path, qc, requested, match):
    with pytest.raises(QuantizationError, match=match):
        resolve_quantization(_write_config(tmp_path, qc), requested)


def test_float_checkpoint_and_explicit_method(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    assert resolve_quantization(tmp_path) is None
    with pytest.raises(QuantizationError, match="no quantization_config"):
        resolve_quantization(tmp_path, "gptq")


def test_random_weights_of_a_float_config_take_an_explicit_method(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    assert resolve_quantization(tmp_path, "auto", random=True) is None
    quant = resolve_quantization(tmp_path, "awq", random=True)
    assert (quant.method, quant.group_size, quant.act_order) == ("awq", 128, False)
    cfg = ModelConfig.from_pretrained(tmp_path)
    fp = build_model(cfg, OPS, torch.float32, torch.device("cpu"), 64, None)
    q = build_model(cfg, OPS, torch.float32, torch.device("cpu"), 64, None, quant=quant)
    lin = q.layers[0].mlp.down_proj
    assert (lin.zeros == 8.0).all()
    nibbles = torch.stack([(lin.qweight >> (4 * j)) & 0xF for j in range(8)])
    assert set(nibbles.unique().tolist()) == set(range(16))  # every 4-bit value drawn
    w = dequantize(lin.qweight, lin.scales, lin.zeros, quant.group_size)
    assert 0.015 < w.std().item() < 0.025  # the spread of the N(0, 0.02) float weights
    float_bytes = sum(p.numel() * p.element_size() for p in fp.layers.parameters())
    quant_bytes = sum(p.numel() * p.element_size() for p in q.layers.parameters())
    assert quant_bytes < 0.3 * float_bytes  # 4-bit words plus a scale and a zero per 128
    from tests.executor_svc.test_model import run_paged

    logits = run_paged(q, cfg, [[1, 2, 3, 4]], [(4,)])[0][-1]
    assert logits.shape == (256,) and torch.isfinite(logits).all()


def test_mismatched_g_idx_in_fused_qkv_is_refused(tmp_path):
    hf, qdir = _quantized_tiny(tmp_path, "gptq", 32, act_order=True)
    tensors = dict(iter_checkpoint(qdir))
    name = "model.layers.0.self_attn.k_proj.g_idx"
    tensors[name] = tensors[name].flip(0).contiguous()  # still valid alone, differs from q's
    save_file(tensors, qdir / "model.safetensors")
    quant = resolve_quantization(qdir)
    with pytest.raises(QuantizationError, match="g_idx differs"):
        build_model(ModelConfig.from_pretrained(qdir), OPS, torch.float32, torch.device("cpu"),
                    128, qdir, quant=quant)


def test_permuted_g_idx_without_desc_act_is_refused(tmp_path):
    hf, qdir = _quantized_tiny(tmp_path, "gptq", 32, act_order=True)
    config = json.loads((qdir / "config.json").read_text())
    config["quantization_config"]["desc_act"] = False
    (qdir / "config.json").write_text(json.dumps(config))
    with pytest.raises(QuantizationError, match="desc_act is false"):
        list(convert_checkpoint(iter_checkpoint(qdir), resolve_quantization(qdir)))


def test_writers_match_quantization_config_keys():
    assert quantization_config(QuantizeOptions("awq"))["version"] == "gemm"
    qc = quantization_config(QuantizeOptions("gptq", 64, sym=True))
    assert (qc["desc_act"], qc["sym"], qc["checkpoint_format"]) == (True, True, "gptq")


def test_algorithms_zero_range_for_gptq_v1():
    w = torch.rand(8, 64)  # all positive: min/max rounding would pick zero 0
    assert rtn(w, 32).zeros.min() == 0
    assert rtn(w, 32, min_zero=1).zeros.min() >= 1
    h = torch.eye(64)
    assert gptq(w, h, 32, min_zero=1).zeros.min() >= 1


def compressed_int4(tmp_path, sym: bool, group: int = 32):
    """A tiny Llama written by compressed-tensors itself as pack-quantized int4 (W4A16, or
    W4A16_ASYM), each group's scale and zero point set by rounding to nearest here."""
    return compressed_int(tmp_path, 4, "group", sym, group)


def compressed_int(tmp_path, bits: int, strategy: str, sym: bool, group: int = 32,
                   fmt: str = "pack-quantized", int8_activations: bool = False):
    """A tiny Llama written by compressed-tensors itself with `bits`-bit integer weights, a
    scale (and zero point) per group, channel or tensor set by rounding to nearest here."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        apply_quantization_config,
    )

    torch.manual_seed(0)
    d = dict(TINY)
    hf = AutoModelForCausalLM.from_config(AutoConfig.for_model(d.pop("model_type"), **d),
                                          dtype=torch.float32).eval()
    args = QuantizationArgs(num_bits=bits, type="int", symmetric=sym, strategy=strategy,
                            group_size=group if strategy == "group" else None)
    acts = QuantizationArgs(num_bits=8, type="int", strategy="token", dynamic=True) \
        if int8_activations else None
    apply_quantization_config(hf, QuantizationConfig(
        config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=args,
                                                     input_activations=acts)},
        ignore=["lm_head"]))
    half = 1 << (bits - 1)
    for m in hf.modules():
        if hasattr(m, "weight_scale"):
            w = m.weight.data
            g = {"group": w.reshape(w.shape[0], -1, group), "channel": w[:, None],
                 "tensor": w.reshape(1, 1, -1)}[strategy]
            shape = m.weight_scale.shape
            if sym:
                m.weight_scale.data.copy_((g.abs().amax(-1) / (half - 0.5)).reshape(shape))
            else:
                lo, hi = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
                scale = (hi - lo) / (2 * half - 1)
                m.weight_scale.data.copy_(scale.reshape(shape))
                m.weight_zero_point.data.copy_((torch.round(-lo / scale) - half)
                                               .clamp(-half, half - 1).reshape(shape))
    compressor = ModelCompressor.from_pretrained_model(hf, quantization_format=fmt)
    compressor.compress_model(hf)
    hf.save_pretrained(tmp_path)
    compressor.update_config(tmp_path)
    return tmp_path


def _hf_dequantized_logits(qdir):
    from transformers import CompressedTensorsConfig

    return hf_logits(AutoModelForCausalLM.from_pretrained(
        qdir, dtype=torch.float32, quantization_config=CompressedTensorsConfig(dequantize=True)))


@pytest.mark.parametrize("bits,strategy,sym,fmt,a8", [
    (8, "channel", True, "int-quantized", True),  # W8A8
    (8, "group", False, "pack-quantized", False),  # W8A16, asymmetric groups
    (8, "tensor", True, "naive-quantized", False),
    (4, "channel", False, "pack-quantized", False),  # W4A16 with a scale per channel
])
def test_compressed_tensors_ints_are_served_dequantized(tmp_path, bits, strategy, sym, fmt,
                                                        a8):
    """What the 4-bit kernels do not take is dequantized at load: logits equal HF's own load
    of the checkpoint, dequantized by compressed-tensors; --quantization fp8 quantizes the
    values again per output channel."""
    qdir = compressed_int(tmp_path, bits, strategy, sym, fmt=fmt, int8_activations=a8)
    assert resolve_quantization(qdir) is None
    torch.testing.assert_close(served_logits(qdir), _hf_dequantized_logits(qdir), rtol=1e-4,
                               atol=1e-4)
    cfg = ModelConfig.from_pretrained(qdir)
    fp8 = resolve_quantization(qdir, "fp8")
    assert (fp8.method, fp8.fp8_serialized) == ("fp8", False)
    model = build_model(cfg, OPS, torch.float32, torch.device("cpu"), 128, qdir, quant=fp8)
    assert type(model.layers[0].self_attn.qkv_proj).__name__ == "Fp8Linear"
    with pytest.raises(QuantizationError, match=f"compressed-tensors int{bits} weights, served "
                                                "dequantized at load"):
        resolve_quantization(qdir, "gptq")


@pytest.mark.parametrize("sym", [True, False])
def test_compressed_tensors_int4_matches_its_dequantized_hf(tmp_path, sym):
    """compressed-tensors' W4A16 checkpoints (as llm-compressor releases them) serve as GPTQ:
    logits equal HF's own load of the same checkpoint, dequantized by compressed-tensors."""
    qdir = compressed_int4(tmp_path, sym)
    quant = resolve_quantization(qdir)
    assert (quant.method, quant.group_size, quant.sym, quant.packing) == (
        "gptq", 32, sym, "pack-quantized")
    assert resolve_quantization(qdir, "gptq") == quant
    torch.testing.assert_close(served_logits(qdir, quant), _hf_dequantized_logits(qdir),
                               rtol=1e-4, atol=1e-4)


def test_compressed_tensors_int4_with_group_activation_order():
    """weight_g_idx (actorder "group", as checkpoints before compressed-tensors 0.20 hold it):
    input channel k takes group g_idx[k]'s scale and zero point; packed by compressed-tensors'
    own packer."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    from pagedserve.executor.quantization.formats import from_pack_quantized

    n, k, g = 16, 64, 32
    gen = torch.Generator().manual_seed(0)
    q = torch.randint(-8, 8, (n, k), generator=gen, dtype=torch.int8)
    zp = torch.randint(-8, 8, (n, k // g), generator=gen, dtype=torch.int8)
    s = torch.rand(n, k // g, generator=gen) + 0.5
    g_idx = (torch.randperm(k, generator=gen) // g).to(torch.int32)
    out = from_pack_quantized("m", pack_to_int32(q, 4), s, torch.tensor([n, k]),
                              pack_to_int32(zp, 4, packed_dim=0), g_idx, g, act_order=True)
    w = (q.float() - zp.float()[:, g_idx.long()]) * s[:, g_idx.long()]  # [N, K]
    x = torch.randn(3, k, generator=gen)
    got = OPS.w4a16_gemm(x, out["qweight"], out["scales"], out["zeros"], g, None, out["perm"])
    torch.testing.assert_close(got, x @ w.t(), rtol=1e-5, atol=1e-5)


def _ct(weights, acts=None, **top):
    group = {"targets": ["Linear"], "weights": weights, "input_activations": acts}
    return {"quant_method": "compressed-tensors", "format": "pack-quantized",
            "config_groups": {"group_0": group}, **top}


INT4 = {"type": "int", "num_bits": 4, "strategy": "group", "group_size": 128,
        "symmetric": True}


@pytest.mark.parametrize("qc,match", [
    (_ct({**INT4, "num_bits": 3}), "int weights of 3 bits are not supported"),
    (_ct({**INT4, "num_bits": 4}, format="int-quantized"), "int weights of 4 bits"),
    (_ct({**INT4, "strategy": "block"}), "strategy 'block'"),
    (_ct({**INT4, "dynamic": True}), "dynamic int weights"),
    (_ct(INT4, format="marlin-24"), "not supported"),
])
def test_compressed_tensors_int4_refused_with_reason(tmp_path, qc, match):
    with pytest.raises(QuantizationError, match=match):
        resolve_quantization(_write_config(tmp_path, qc))


def test_int4_with_float_decoder_layers_is_dequantized_whole(tmp_path):
    """The 4-bit kernels need every decoder linear 4-bit: a checkpoint that keeps one float
    is served dequantized, its float layers as they are."""
    qc = _ct(INT4, ignore=["lm_head", "re:.*layers.0.mlp.down_proj"])
    assert resolve_quantization(_write_config(tmp_path, qc)) is None
    assert dequantized_int(qc) == IntWeights(4, 128, True, False)
    gptq = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": True,
            "modules_to_not_convert": ["lm_head", "mlp.gate", "model.layers.0.mlp.down_proj"]}
    assert dequantized_int(gptq) == IntWeights(4, 128, True, True, "gptq", 1)
    assert dequantized_int({**gptq, "modules_to_not_convert": ["lm_head", "mlp.gate"]}) is None


MOE = {"qwen2_moe": dict(model_type="qwen2_moe", num_experts=4, num_experts_per_tok=2,
                         moe_intermediate_size=32, shared_expert_intermediate_size=48,
                         mlp_only_layers=[1]),
       "mixtral": dict(model_type="mixtral", num_local_experts=4, num_experts_per_tok=2)}


def hub_4bit_moe(d: dict, method: str, path):
    """A tiny mixture-of-experts model written as hub 4-bit checkpoints are (AutoGPTQ's,
    AutoAWQ's): every linear of the decoder in 4 bits, each expert's projection a module of its
    own (Mixtral's block_sparse_moe.experts.N.w1/w3/w2), the routers in float. Returns the HF
    model holding the values the checkpoint holds."""
    torch.manual_seed(0)
    d = {**TINY, **d}
    hf = AutoModelForCausalLM.from_config(AutoConfig.for_model(d.pop("model_type"), **d),
                                          dtype=torch.float32).eval()
    mixtral = hf.config.model_type == "mixtral"
    tensors = {}

    def quantized(module: str, w: torch.Tensor) -> torch.Tensor:
        qt = rtn(w, 32, min_zero=0 if method == "awq" else 1)
        parts = (to_awq(qt.q, qt.scales, qt.zeros) if method == "awq"
                 else to_gptq(qt.q, qt.scales, qt.zeros, qt.g_idx))
        tensors.update({f"{module}.{k}": v for k, v in parts.items()})
        return qt.dequantize()

    with torch.no_grad():
        for name, p in hf.state_dict().items():
            module, _, leaf = name.rpartition(".")
            if leaf == "gate_up_proj":  # [E, 2I, H]: each expert's gate and up
                i = p.shape[1] // 2
                for e in range(p.shape[0]):
                    for rows, proj in ((slice(0, i), "w1" if mixtral else "gate_proj"),
                                       (slice(i, 2 * i), "w3" if mixtral else "up_proj")):
                        p[e, rows] = quantized(_hub(f"{module}.{e}.{proj}", mixtral),
                                               p[e, rows])
            elif leaf == "down_proj" and module.endswith("experts"):  # [E, H, I]
                for e in range(p.shape[0]):
                    p[e] = quantized(_hub(f"{module}.{e}.{'w2' if mixtral else 'down_proj'}",
                                          mixtral), p[e])
            elif ".layers." in name and leaf == "weight" and p.dim() == 2 \
                    and not module.endswith(("mlp.gate", "shared_expert_gate")):
                p.copy_(quantized(module, p))
            else:
                tensors[_hub(name, mixtral)] = p.clone()
    hf.save_pretrained(path)
    for f in path.glob("*.safetensors"):
        f.unlink()
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    opt = QuantizeOptions(method, 32, act_order=False)
    config["quantization_config"] = quantization_config(opt)
    if method == "awq":  # as AutoAWQ writes Mixtral's
        config["quantization_config"]["modules_to_not_convert"] = ["gate"]
    (path / "config.json").write_text(json.dumps(config))
    return hf


def _hub(name: str, mixtral: bool) -> str:
    return name.replace(".mlp.", ".block_sparse_moe.") if mixtral else name


@pytest.mark.parametrize("family,method", [("qwen2_moe", "gptq"), ("mixtral", "awq")])
def test_a_4bit_moe_checkpoint_serves_its_experts_dequantized(tmp_path, family, method):
    """The experts dequantized at load (float here), the other linears (Qwen2-MoE's shared
    expert and dense layer included) 4-bit, the routers float: logits equal HF over the values
    the checkpoint holds, across chunked prefill and decode."""
    from tests.executor_svc.test_model import assert_paged_equals_hf, run_paged

    hf = hub_4bit_moe(MOE[family], method, tmp_path)
    quant = resolve_quantization(tmp_path)
    cfg = ModelConfig.from_pretrained(tmp_path)
    ours = build_model(cfg, OPS, torch.float32, torch.device("cpu"), 128, tmp_path, quant=quant)
    kinds = {type(m).__name__ for m in ours.modules()}
    assert {"W4Linear", "SparseMoe"} <= kinds
    assert all(not getattr(m, "fp8", False) for m in ours.modules())
    seqs, chunks = [list(range(3, 23)), list(range(40, 53))], [(7, 5), (10, 5), (1, 1), (1, 1)]
    # the experts' sums run in another order than HF's loop over experts: 1e-4 is at the edge
    assert_paged_equals_hf(hf, run_paged(ours, cfg, seqs, chunks), seqs, chunks, tol=3e-4)


def test_dequantized_ints_follow_g_idx_and_packed_zero_points():
    """8-bit weights with activation order "group" and asymmetric zero points, packed by
    compressed-tensors' own packer, dequantize to (q - z[g_idx]) * s[g_idx]."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    from pagedserve.executor.quantization.config import IntWeights
    from pagedserve.executor.quantization.dequantized import dequantize_int

    n, k, g = 8, 64, 16
    gen = torch.Generator().manual_seed(0)
    q = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
    zp = torch.randint(-128, 128, (n, k // g), generator=gen, dtype=torch.int8)
    s = torch.rand(n, k // g, generator=gen) + 0.5
    g_idx = (torch.randperm(k, generator=gen) // g).to(torch.int32)
    m = "model.layers.0.mlp.down_proj"
    parts = {"weight_packed": pack_to_int32(q, 8), "weight_shape": torch.tensor([n, k]),
             "weight_scale": s, "weight_zero_point": pack_to_int32(zp, 8, packed_dim=0),
             "weight_g_idx": g_idx, "input_scale": torch.tensor(1.0)}
    out = dict(dequantize_int([(f"{m}.{p}", t) for p, t in reversed(parts.items())],
                              IntWeights(8, g, sym=False, act_order=True)))
    assert list(out) == [f"{m}.weight"]
    gi = g_idx.long()
    assert torch.equal(out[f"{m}.weight"], (q.float() - zp.float()[:, gi]) * s[:, gi])


def autogptq_pack(intweight: torch.Tensor, zeros: torch.Tensor, bits: int):
    """AutoGPTQ's QuantLinear.pack for 2, 4 and 8 bits (re-implemented from its code):
    intweight [K, N], zeros [G, N] -> qweight [K * bits / 32, N], qzeros [G, N * bits / 32]
    holding zero - 1."""
    per = 32 // bits
    qweight = torch.zeros((intweight.shape[0] // per, intweight.shape[1]), dtype=torch.int64)
    for row in range(qweight.shape[0]):
        for j in range(per):
            qweight[row] |= intweight[row * per + j].long() << (bits * j)
    z = (zeros.long() - 1) & ((1 << bits) - 1)
    qzeros = torch.zeros((z.shape[0], z.shape[1] // per), dtype=torch.int64)
    for col in range(qzeros.shape[1]):
        for j in range(per):
            qzeros[:, col] |= z[:, col * per + j] << (bits * j)
    return _int32(qweight), _int32(qzeros)


@pytest.mark.parametrize("bits,group", [(8, 32), (8, -1), (4, -1), (2, 16)])
def test_gptq_the_kernels_do_not_take_is_served_dequantized(tmp_path, bits, group):
    """GPTQ 8-bit (Qwen's GPTQ-Int8 releases), per-channel (-1) and 2-bit checkpoints, packed
    as AutoGPTQ packs them: logits equal HF holding the values they hold."""

    torch.manual_seed(0)
    d = dict(TINY)
    hf = AutoModelForCausalLM.from_config(AutoConfig.for_model(d.pop("model_type"), **d),
                                          dtype=torch.float32).eval()
    top = (1 << bits) - 1
    tensors = {}
    with torch.no_grad():
        for name, p in hf.state_dict().items():
            module = name.rpartition(".")[0]
            if ".layers." not in name or p.dim() != 2:
                tensors[name] = p.clone()
                continue
            n, k = p.shape
            g = k if group == -1 else group
            w = p.reshape(n, k // g, g)
            lo, hi = w.amin(-1).clamp(max=0), w.amax(-1).clamp(min=0)
            scale = ((hi - lo) / top).clamp(min=1e-8)  # [N, G]
            zero = torch.round(-lo / scale).clamp(1, top)
            q = (torch.round(w / scale[..., None]) + zero[..., None]).clamp(0, top)
            qweight, qzeros = autogptq_pack(q.reshape(n, k).t().contiguous(),
                                            zero.t().contiguous(), bits)
            tensors.update({f"{module}.qweight": qweight, f"{module}.qzeros": qzeros,
                            f"{module}.scales": scale.t().contiguous().half().float(),
                            f"{module}.g_idx": (torch.arange(k) // g).int()})
            p.copy_(((q - zero[..., None]) * scale.half().float()[..., None]).reshape(n, k))
    hf.save_pretrained(tmp_path)
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": bits, "group_size": group,
                                     "desc_act": False, "sym": False,
                                     "checkpoint_format": "gptq"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert resolve_quantization(tmp_path) is None
    torch.testing.assert_close(served_logits(tmp_path), hf_logits(hf), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind", ["nf4", "nf4-double", "fp4", "int8"])
def test_bitsandbytes_checkpoints_are_served_dequantized(tmp_path, kind):
    """A model loaded by transformers with bitsandbytes (4-bit NF4 or FP4, double quantization,
    8-bit) and saved: logits equal the float model holding what bitsandbytes' own
    dequantization makes of its weights (its CPU matmuls round further: not the reference)."""
    bnb = pytest.importorskip("bitsandbytes")
    from transformers import BitsAndBytesConfig


    torch.manual_seed(0)
    d = dict(TINY)
    AutoModelForCausalLM.from_config(AutoConfig.for_model(d.pop("model_type"), **d),
                                     dtype=torch.float32).save_pretrained(tmp_path / "float")
    qc = (BitsAndBytesConfig(load_in_8bit=True) if kind == "int8" else BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type=kind[:3], bnb_4bit_compute_dtype=torch.float32,
        bnb_4bit_use_double_quant=kind.endswith("double")))
    quantized = AutoModelForCausalLM.from_pretrained(tmp_path / "float", quantization_config=qc,
                                                     dtype=torch.float32)
    qdir = tmp_path / "q"
    quantized.save_pretrained(qdir)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "float", dtype=torch.float32).eval()
    with torch.no_grad():
        for name, m in quantized.named_modules():
            w = getattr(m, "weight", None)
            if getattr(w, "quant_state", None) is not None:
                hf.get_submodule(name).weight.copy_(bnb.functional.dequantize_4bit(
                    w.data, w.quant_state))
            elif getattr(w, "SCB", None) is not None:
                hf.get_submodule(name).weight.copy_(bnb.functional.int8_vectorwise_dequant(
                    w.data, w.SCB))
    assert resolve_quantization(qdir) is None
    torch.testing.assert_close(served_logits(qdir), hf_logits(hf), rtol=1e-4, atol=1e-4)


def test_a_fused_4bit_qkv_with_partial_rotary_embeddings(tmp_path):
    """Phi-4-mini's shape in GPTQ: the fused qkv_proj's q and k columns are each permuted
    for the partial rotation, its v columns not; logits equal HF holding the values."""

    torch.manual_seed(0)
    d = {**TINY, "model_type": "phi3", "partial_rotary_factor": 0.75, "pad_token_id": 0}
    hf = AutoModelForCausalLM.from_config(AutoConfig.for_model(d.pop("model_type"), **d),
                                          dtype=torch.float32).eval()
    tensors = {}
    with torch.no_grad():
        for name, p in hf.state_dict().items():
            module = name.rpartition(".")[0]
            if ".layers." in name and p.dim() == 2:
                qt = rtn(p, 32, min_zero=1)
                tensors.update({f"{module}.{k}": v for k, v in
                                to_gptq(qt.q, qt.scales, qt.zeros, qt.g_idx).items()})
                p.copy_(qt.dequantize())
            else:
                tensors[name] = p.clone()
    hf.save_pretrained(tmp_path)
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = quantization_config(QuantizeOptions("rtn", 32))
    (tmp_path / "config.json").write_text(json.dumps(config))
    cfg = ModelConfig.from_pretrained(tmp_path)
    assert (cfg.rotary_dim, cfg.head_dim) == (12, 16)
    logits = served_logits(tmp_path, resolve_quantization(tmp_path), chunks=((8,), (4,)))
    torch.testing.assert_close(logits, hf_logits(hf), rtol=1e-4, atol=1e-4)
