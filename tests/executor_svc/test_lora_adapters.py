"""LoRA in the executor: PEFT checkpoints (written here as PEFT writes them: adapter_config.json
and adapter_model.safetensors) applied per request, adapters and the base mixed in one batch,
equal HF transformers on the merged weights (W + scale * B @ A); bad adapters refused with the
reason."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM

from pagedserve.core.lora import LoraConfig
from pagedserve.executor.config import ModelConfig
from pagedserve.executor.cuda_graphs import DecodeGraphs
from pagedserve.executor.loader import build_model
from pagedserve.executor.lora import LoraError, build, load_adapter
from pagedserve.executor.worker import ExecutorConfig, Worker
from pagedserve.kernels import get_ops
from pagedserve.protos.internal.v1 import executor_pb2 as pb
from tests.executor_svc.test_model import TINY, assert_paged_equals_hf, run_paged

_PLACE = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn",
          "o_proj": "self_attn", "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def write_adapter(out: Path, base, seed: int, rank: int, targets: list[str], alpha: float,
                  rslora: bool = False, std: float = 0.05) -> Path:
    """A seeded random PEFT LoRA adapter of the HF model `base` (B nonzero, unlike PEFT's
    initialisation, so that it changes the outputs), on each target of every layer that has
    it (a mixture-of-experts layer's MLP has no gate/up/down of its own)."""
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for i, layer in enumerate(base.model.layers):
        for m in targets:
            if not hasattr(getattr(layer, _PLACE[m]), m):
                continue
            w = getattr(getattr(layer, _PLACE[m]), m).weight  # [out, in]
            key = f"base_model.model.model.layers.{i}.{_PLACE[m]}.{m}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, w.shape[1], generator=g) * std
            tensors[f"{key}.lora_B.weight"] = torch.randn(w.shape[0], rank, generator=g) * std
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, out / "adapter_model.safetensors")
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": targets,
        "use_rslora": rslora, "bias": "none", "lora_dropout": 0.0, "task_type": "CAUSAL_LM",
        "base_model_name_or_path": "base"}))
    return out


def merged(base, adapter: Path):
    """A copy of the HF model with the adapter merged into its weights."""
    conf = json.loads((adapter / "adapter_config.json").read_text())
    r = conf["r"]
    scale = conf["lora_alpha"] / (math.sqrt(r) if conf.get("use_rslora") else r)
    w = load_file(adapter / "adapter_model.safetensors")
    model = type(base)(base.config).eval()
    state = base.state_dict()
    for key in w:
        if key.endswith("lora_A.weight"):
            name = key.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
            b = w[key.replace("lora_A", "lora_B")]
            state[f"{name}.weight"] = state[f"{name}.weight"] + scale * b @ w[key]
    model.load_state_dict(state)
    return model


@pytest.fixture
def tiny(tmp_path):
    torch.manual_seed(0)
    d = dict(TINY)
    hf = AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **d),
                                          dtype=torch.float32).eval()
    hf.save_pretrained(tmp_path / "base")
    return hf, ModelConfig.from_pretrained(tmp_path / "base")


def runtime(cfg, tmp_path, modules, max_loras=1, max_cpu_loras=0):
    """Our model of the tiny checkpoint with LoRA (rank 8) over these (name, path) adapters."""
    ops = get_ops("torch")
    ours = build_model(cfg, ops, torch.float32, torch.device("cpu"), 512, tmp_path / "base")
    lora = build(ours, cfg, LoraConfig(tuple((n, str(p)) for n, p in modules), max_loras, 8,
                                       max_cpu_loras), torch.float32, torch.device("cpu"), ops)
    return ours, lora


class WithSlots:
    """The model with each sequence of a step run under its slot (0: the base)."""

    def __init__(self, model, step, slots: list[int]) -> None:
        self.model, self.step, self.slots = model, step, np.array(slots, np.int64)

    def __call__(self, ids, pos, kv, meta, rows):
        self.step.begin(meta.cu_seqlens_q.numpy().astype(np.int64), self.slots)
        try:
            return self.model(ids, pos, kv, meta, rows)
        finally:
            self.step.end()


@pytest.mark.parametrize("max_cpu_loras", [0, 1], ids=["all-on-host", "one-on-host"])
def test_adapters_and_the_base_in_one_batch_equal_hf_on_merged_weights(tiny, tmp_path,
                                                                       max_cpu_loras):
    """Four sequences in chunked steps, under the base, adapter 1, adapter 2 and adapter 1
    again; adapter 2 (rank 4, rsLoRA, every module) in a slot of rank 8, loaded over a slot
    that held adapter 1 before. One-on-host: host memory keeps one adapter, the other is read
    again from its directory when a slot needs it."""
    hf, cfg = tiny
    one = write_adapter(tmp_path / "one", hf, 1, 8, ["q_proj", "v_proj", "down_proj"], 16)
    two = write_adapter(tmp_path / "two", hf, 2, 4, list(_PLACE), 8, rslora=True)
    ours, lora = runtime(cfg, tmp_path, [("one", one), ("two", two)], 2, max_cpu_loras)
    assert lora.host.held() == ([2] if max_cpu_loras else [1, 2])
    lora.load(2, 1)
    lora.load(1, 1)
    lora.load(2, 2)  # slot 2: adapter one's weights replaced whole
    g = torch.Generator().manual_seed(3)
    seqs = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (9, 12, 7, 10)]
    chunks = [[4, 5, 3, 6], [5, 7, 4, 4]]
    outs = run_paged(WithSlots(ours, lora.step, [0, 1, 2, 1]), cfg, seqs, chunks)
    for b, ref in enumerate((hf, merged(hf, one), merged(hf, two), merged(hf, one))):
        assert_paged_equals_hf(ref, [outs[b]], [seqs[b]], [[c[b]] for c in chunks])
    with torch.no_grad():  # and the adapters do change the outputs
        ids = torch.tensor([seqs[1]])
        assert not torch.allclose(hf(ids).logits, merged(hf, one)(ids).logits, atol=1e-3)


def refusal(tiny, tmp_path, **edit) -> str:
    hf, cfg = tiny
    path = write_adapter(tmp_path / "bad", hf, 1, edit.pop("rank", 4),
                         edit.pop("targets", ["q_proj"]), 8)
    for name, change in edit.items():
        change(path / name)
    with pytest.raises(LoraError) as e:
        load_adapter("bad", path, cfg, 8)
    return str(e.value)


def _json(update):
    def change(f: Path) -> None:
        f.write_text(json.dumps({**json.loads(f.read_text()), **update}))
    return change


@pytest.mark.parametrize("case, edit, says", [
    ("rank", {"rank": 16}, "rank 16 is more than --max-lora-rank 8"),
    ("target", {"adapter_config.json": _json({"target_modules": ["q_proj", "lm_head"]})},
     "unknown target modules lm_head"),
    ("dora", {"adapter_config.json": _json({"use_dora": True})}, "DoRA is not supported"),
    ("corrupt", {"adapter_model.safetensors": lambda f: f.write_bytes(f.read_bytes()[:40])},
     "adapter_model.safetensors:"),
    ("no config", {"adapter_config.json": lambda f: f.unlink()}, "no adapter_config.json"),
    ("bad json", {"adapter_config.json": lambda f: f.write_text("{")}, "adapter_config.json:"),
])
def test_a_bad_adapter_is_refused_with_the_reason(tiny, tmp_path, case, edit, says):
    assert says in refusal(tiny, tmp_path, **edit)


def test_an_adapter_of_another_model_is_refused(tiny, tmp_path):
    hf, cfg = tiny
    torch.manual_seed(1)
    other = AutoModelForCausalLM.from_config(AutoConfig.for_model(
        "llama", **{**TINY, "hidden_size": 32})).eval()
    path = write_adapter(tmp_path / "other", other, 1, 4, ["q_proj"], 8)
    with pytest.raises(LoraError, match=r"q_proj.lora_A.weight is \[4, 32\], the base model "
                                        r"takes \[4, 64\]: not an adapter of this model"):
        load_adapter("other", path, cfg, 8)


def test_slots_and_adapter_ids_out_of_range_are_refused(tiny, tmp_path):
    hf, cfg = tiny
    one = write_adapter(tmp_path / "one", hf, 1, 4, ["q_proj"], 8)
    _, lora = runtime(cfg, tmp_path, [("one", one)])
    with pytest.raises(ValueError, match="LoRA slot 2 is not one of 1..1"):
        lora.load(2, 1)
    with pytest.raises(ValueError, match="LoRA adapter id 2 is not loaded"):
        lora.load(1, 2)
    with pytest.raises(ValueError, match="LoRA slot 1 holds no adapter"):
        lora.check_slot(1)
    lora.load(1, 1)
    lora.check_slot(1)


def greedy_run(run, prompts: list[list[int]], slots: list[int], steps: int) -> list[list[int]]:
    """Greedy tokens of each prompt under its slot: one prefill step, then decode steps."""
    plan = pb.StepPlan(step_id=1)
    plan.lora_loads.add(slot=1, adapter_id=1)
    plan.lora_loads.add(slot=2, adapter_id=2)
    for i, (p, slot) in enumerate(zip(prompts, slots, strict=True)):
        plan.new_requests.add(req_id=i + 1, token_ids=p, block_ids=[2 * i, 2 * i + 1],
                              sampling=pb.Sampling(temperature=0.0), lora_slot=slot)
        plan.new_num_scheduled_tokens.append(len(p))
    out = [[] for _ in prompts]
    for rid, tok in zip(*run.execute(plan), strict=True):
        out[rid - 1].append(tok)
    for step in range(2, steps + 1):
        ids = list(range(1, len(prompts) + 1))
        plan = pb.StepPlan(step_id=step, cached_req_ids=ids,
                           cached_num_computed_tokens=[len(p) + step - 2 for p in prompts],
                           cached_num_scheduled_tokens=[1] * len(ids),
                           cached_num_new_blocks=[0] * len(ids))
        for rid, tok in zip(*run.execute(plan), strict=True):
            out[rid - 1].append(tok)
    return out


def test_decode_steps_through_the_lora_graphs_keep_the_eager_tokens(tiny, tmp_path):
    """The runner's decode steps replay the graphs captured with the adapters (an eager
    stand-in here: the same static buffers and segments; the captured ones run on the GPU),
    rows of two adapters and the base mixed: the eager path's tokens, which equal HF's."""
    hf, _ = tiny
    one = write_adapter(tmp_path / "one", hf, 1, 8, ["q_proj", "o_proj", "up_proj"], 16)
    two = write_adapter(tmp_path / "two", hf, 2, 4, list(_PLACE), 8)
    lora = LoraConfig((("one", str(one)), ("two", str(two))), 2, 8)

    def worker():
        return Worker(ExecutorConfig(model=str(tmp_path / "base"), device="cpu",
                                     num_kv_blocks=16, block_size=16, lora=lora))

    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (5, 9, 6, 7)]
    slots = [1, 0, 2, 1]
    eager = greedy_run(worker().runner, prompts, slots, 8)
    run = worker().runner
    graphs = DecodeGraphs(run.model, run.kv_caches, 8, 64, 16, torch.device("cpu"),
                          run.lora.step, 2)
    replays = []
    for bs in graphs.sizes:
        graphs.graphs[bs] = SimpleNamespace(replay=lambda bs=bs: replays.append("base") or
                                            graphs.forward(bs))
        graphs.lora_graphs[bs] = SimpleNamespace(replay=lambda bs=bs: replays.append("lora") or
                                                 graphs.forward(bs, True))
    run.graphs = graphs
    assert greedy_run(run, prompts, slots, 8) == eager
    assert replays == ["lora"] * 7
    for p, slot, got in zip(prompts, slots, eager, strict=True):
        ref = hf if not slot else merged(hf, (one, two)[slot - 1])
        want = ref.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False,
                            pad_token_id=0)[0, len(p):].tolist()
        assert got == want


def test_adapters_are_added_and_removed_at_run_time(tiny, tmp_path):
    hf, cfg = tiny
    one = write_adapter(tmp_path / "one", hf, 1, 4, ["q_proj"], 8)
    big = write_adapter(tmp_path / "big", hf, 2, 16, ["q_proj"], 8)
    _, lora = runtime(cfg, tmp_path, [])
    lora.add(5, "one", str(one))
    lora.load(1, 5)
    lora.check_slot(1)
    with pytest.raises(LoraError, match="rank 16 is more than --max-lora-rank 8"):
        lora.add(6, "big", str(big))
    with pytest.raises(LoraError, match="id 5 is in use"):
        lora.add(5, "again", str(one))
    lora.remove(5)
    with pytest.raises(ValueError, match="LoRA slot 1 holds no adapter"):
        lora.check_slot(1)
    with pytest.raises(ValueError, match="LoRA adapter id 5 is not loaded"):
        lora.load(1, 5)


def test_a_slot_holding_another_adapter_is_refused_and_a_new_session_forgets_added_ones(
        tiny, tmp_path):
    hf, cfg = tiny
    one = write_adapter(tmp_path / "one", hf, 1, 4, ["q_proj"], 8)
    _, lora = runtime(cfg, tmp_path, [("one", one)])
    lora.add(2, "two", str(one))
    lora.load(1, 2)
    with pytest.raises(ValueError, match="LoRA slot 1 holds adapter 2, not 1"):
        lora.check_slot(1, 1)
    with pytest.raises(ValueError, match="id 3 is not loaded"):
        lora.load(1, 3)  # a failed load leaves the slot empty, not holding adapter 2
    with pytest.raises(ValueError, match="LoRA slot 1 holds no adapter"):
        lora.check_slot(1, 2)
    lora.reset()  # a new scheduler session: its own ids for adapters added at run time
    assert sorted(lora.host.sources) == [1]


def test_host_memory_keeps_the_most_recent_adapters_and_reads_the_others_again(tiny,
                                                                              tmp_path):
    hf, cfg = tiny
    from pagedserve.executor.lora_host import HostCache

    paths = [write_adapter(tmp_path / n, hf, i, 4, ["q_proj"], 8) for i, n in enumerate("ab")]
    host = HostCache(cfg, 8, capacity=1)
    host.add(1, "a", str(paths[0]))
    host.add(2, "b", str(paths[1]))
    assert host.held() == [2]
    first = host.get(1).weights[0, "q_proj"][0]  # read again from its directory
    assert host.held() == [1] and torch.equal(first, load_adapter(
        "a", paths[0], cfg, 8).weights[0, "q_proj"][0])
    (paths[1] / "adapter_model.safetensors").unlink()
    with pytest.raises(LoraError, match="no adapter_model.safetensors"):
        host.get(2)


# ---- quantized base weights: the delta is added to the quantized layer's output

def test_adapters_on_an_awq_base_equal_hf_on_its_dequantized_weights_merged(tmp_path):
    """An AWQ checkpoint (int4, group 32): the adapters ride on the 4-bit layers and the
    output equals HF on the dequantized weights with the adapter merged."""
    from pagedserve.executor.quantization import resolve_quantization
    from tests.executor_svc.test_quant_formats import _quantized_tiny

    hf, qdir = _quantized_tiny(tmp_path, "awq", 32)  # hf: the dequantized weights
    one = write_adapter(tmp_path / "one", hf, 1, 8, list(_PLACE), 16)
    cfg, ops = ModelConfig.from_pretrained(qdir), get_ops("torch")
    ours = build_model(cfg, ops, torch.float32, torch.device("cpu"), 512, qdir,
                       quant=resolve_quantization(qdir))
    lora = build(ours, cfg, LoraConfig((("one", str(one)),), 1, 8), torch.float32,
                 torch.device("cpu"), ops)
    assert {type(m.base).__name__ for m in ours.modules()
            if type(m).__name__ == "LoraLinear"} == {"W4Linear"}
    lora.load(1, 1)
    g = torch.Generator().manual_seed(5)
    seqs = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (9, 11)]
    chunks = [[5, 6], [4, 5]]
    outs = run_paged(WithSlots(ours, lora.step, [1, 0]), cfg, seqs, chunks)
    assert_paged_equals_hf(merged(hf, one), [outs[0]], [seqs[0]], [[c[0]] for c in chunks])
    assert_paged_equals_hf(hf, [outs[1]], [seqs[1]], [[c[1]] for c in chunks])


def test_adapters_on_an_fp8_base_add_their_delta_to_each_fp8_layer(tiny, tmp_path):
    """--quantization fp8 (weights e4m3 per channel, activations per token): in a real forward
    of a batch mixing an adapter and the base, every wrapped FP8 layer's output is the FP8
    layer's own plus the adapter's float delta on that layer's input (none for the base's
    rows), and the adapter changes the logits."""
    from pagedserve.executor.quantization import resolve_quantization

    hf, cfg = tiny
    one = write_adapter(tmp_path / "one", hf, 1, 8, list(_PLACE), 16, std=0.2)
    ops = get_ops("torch")
    ours = build_model(cfg, ops, torch.float32, torch.device("cpu"), 512, tmp_path / "base",
                       quant=resolve_quantization(tmp_path / "base", "fp8"))
    lora = build(ours, cfg, LoraConfig((("one", str(one)),), 1, 8), torch.float32,
                 torch.device("cpu"), ops)
    lora.load(1, 1)
    adapter = lora.host.get(1)
    seen = []

    def check(layer, x, y) -> None:
        with torch.no_grad():
            plain = layer.base(x)
        delta = torch.zeros_like(plain)
        for module, (projection, _, start) in lora.slots.place.items():
            if projection == layer.projection:
                a, b = adapter.weights[layer.layer, module]
                delta[:5, start:start + b.shape[0]] = x[:5] @ a.T @ b.T  # sequence 0's rows
        torch.testing.assert_close(y, plain + delta, rtol=1e-5, atol=1e-5)
        seen.append(type(layer.base).__name__)

    hooks = [m.register_forward_hook(lambda m, args, y: check(m, args[0], y))
             for m in ours.modules() if type(m).__name__ == "LoraLinear"]
    run_paged(WithSlots(ours, lora.step, [1, 0]), cfg, [[3, 1, 4, 1, 5], [9, 2, 6]], [[5, 3]])
    for h in hooks:
        h.remove()
    assert seen == ["Fp8Linear"] * 4 * cfg.num_layers
    prompt = [7, 7, 1, 200, 31, 9]
    with_adapter = run_paged(WithSlots(ours, lora.step, [1]), cfg, [prompt], [[6]])[0][-1]
    without = run_paged(WithSlots(ours, lora.step, [0]), cfg, [prompt], [[6]])[0][-1]
    assert not torch.allclose(with_adapter, without, atol=1e-2)


def test_the_warm_up_runs_every_projections_kernels_at_each_tile_height(tiny, tmp_path,
                                                                       monkeypatch):
    """warm_up launches each projection's shrink and expand at 16- and 32-row tiles (what
    Triton compiles variants by; 64 needs more tokens than this step bound), changing no
    slot."""
    from pagedserve.executor import lora as lora_mod
    from pagedserve.kernels import lora as kl

    hf, cfg = tiny
    one = write_adapter(tmp_path / "one", hf, 1, 8, ["q_proj"], 16)
    _, lora = runtime(cfg, tmp_path, [("one", one)])
    lora.load(1, 1)
    before = {p: (a.clone(), lora.slots.b[p].clone()) for p, a in lora.slots.a.items()}
    calls = []
    ops = lora.wrapped[0].ops  # shared by every projection
    for name in ("lora_shrink", "lora_expand"):
        real = getattr(ops, name)
        monkeypatch.setattr(ops, name, lambda *a, real=real, name=name: calls.append(
            (name, a[0].shape[0], a[2].shape[0] - 1)) or real(*a))
    assert lora_mod.warm_up(lora, 64) == 4 * 2 * 2
    assert sorted(p.projection for p in lora.wrapped) == ["down", "gate_up", "o", "qkv"]
    assert {kl.block_m_for(t, g) for name, t, g in calls if name == "lora_shrink"} == {16, 32}
    assert all(torch.equal(a, lora.slots.a[p]) and torch.equal(b, lora.slots.b[p])
               for p, (a, b) in before.items())


def test_adapters_on_a_mixture_of_experts_model_adapt_attention_and_dense_layers(tmp_path):
    """A Qwen2-MoE base (a shared expert; layer 1 a dense MLP): an adapter of the attention
    projections and of the dense layer's MLP, beside the base in one batch, equals HF on the
    merged weights; one of a layer's experts, or of a sparse layer's gate_proj, is refused."""
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(AutoConfig.for_model(
        "qwen2_moe", **{**TINY, "intermediate_size": 96}, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32, shared_expert_intermediate_size=48, mlp_only_layers=[1]),
        dtype=torch.float32).eval()
    hf.save_pretrained(tmp_path / "base")
    cfg = ModelConfig.from_pretrained(tmp_path / "base")
    assert cfg.moe.sparse_layers == (True, False)
    # attention on both layers, the MLP on the dense one (layer 1) only
    one = write_adapter(tmp_path / "one", hf, 1, 8,
                        ["q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"], 16)
    assert sum("mlp" in k for k in load_file(one / "adapter_model.safetensors")) == 4
    ours, lora = runtime(cfg, tmp_path, [("one", one)])
    lora.load(1, 1)
    g = torch.Generator().manual_seed(3)
    seqs = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (9, 12)]
    chunks = [[4, 5], [5, 7]]
    outs = run_paged(WithSlots(ours, lora.step, [1, 0]), cfg, seqs, chunks)
    assert_paged_equals_hf(merged(hf, one), [outs[0]], [seqs[0]], [[c[0]] for c in chunks])
    assert_paged_equals_hf(hf, [outs[1]], [seqs[1]], [[c[1]] for c in chunks])
    for key, says in [("model.layers.0.mlp.gate_proj", "layer 0's MLP is a mixture of experts"),
                      ("model.layers.1.mlp.experts.0.up_proj", "adapts a mixture-of-experts "
                                                               "layer's experts")]:
        save_file({f"base_model.model.{key}.lora_A.weight": torch.zeros(8, 64),
                   f"base_model.model.{key}.lora_B.weight": torch.zeros(96, 8)},
                  tmp_path / "one" / "adapter_model.safetensors")
        with pytest.raises(LoraError, match=says):
            load_adapter("bad", tmp_path / "one", cfg, 8)


def test_q_and_k_adapters_of_a_partial_rotary_model_are_refused(tmp_path):
    """Its q and k heads are served permuted (layers.rotary_order): an adapter's rows on
    them would land on other dimensions."""
    cfg = ModelConfig.from_dict({**TINY, "model_type": "phi3", "pad_token_id": 0,
                                 "partial_rotary_factor": 0.75})
    assert cfg.rotary_dim == 12
    same = AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **TINY)).eval()
    path = write_adapter(tmp_path / "a", same, 1, 4, ["k_proj", "o_proj"], 8)
    with pytest.raises(LoraError, match="k_proj.lora_A.weight: the base model's q and k heads "
                                        "are served in another order"):
        load_adapter("a", path, cfg, 8)


def test_mlp_adapters_of_an_ungated_mlp_are_refused(tmp_path):
    """Jais 2's MLP is down(relu(up(x))^2), which the LoRA layers do not wrap: an adapter of
    it would load and never apply."""
    cfg = ModelConfig.from_dict({**TINY, "model_type": "jais2"})
    assert not cfg.mlp_gated
    same = AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **TINY)).eval()
    path = write_adapter(tmp_path / "a", same, 1, 4, ["o_proj", "up_proj"], 8)
    with pytest.raises(LoraError, match="up_proj.lora_A.weight: the base model's MLP is "
                                        "ungated"):
        load_adapter("a", path, cfg, 8)
    load_adapter("b", write_adapter(tmp_path / "b", same, 1, 4, ["o_proj"], 8), cfg, 8)


def test_lora_on_latent_attention_is_refused_at_start():
    from pagedserve.executor.lora_host import check_model

    with pytest.raises(LoraError, match="deepseek_v2: LoRA on latent attention"):
        check_model(ModelConfig.from_pretrained("benchmarks/models/deepseek-v2-lite"))
