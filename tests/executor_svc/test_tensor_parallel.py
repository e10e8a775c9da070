"""Tensor parallelism on the CPU: a real 2-rank gloo group (this process is rank 0, the group
spawns rank 1 as the executor does) against one rank, on small random-weight Llama, Mistral and
Qwen2 configs and an AWQ checkpoint. The same step plans run through both executors: chunked
prefill, decode, a request preempted by swap and resumed, and a request reusing another's
cached prefix blocks; the greedy tokens must be equal (fp32)."""

from __future__ import annotations

import argparse

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from pagedserve.executor import flags
from pagedserve.executor.config import ModelConfig
from pagedserve.executor.distributed import Group
from pagedserve.executor.worker import Worker, executor_config
from pagedserve.protos.internal.v1 import executor_pb2 as pb

BS = 4  # tokens per block
GREEDY = pb.Sampling(temperature=0.0, top_p=1.0)
# request 1 also scores its prompt (two chunks: the HIDDEN pass, then LOGITS per slice)
SCORING = pb.Sampling(temperature=0.0, top_p=1.0, prompt_logprobs=3)
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=255, max_position_embeddings=256)
CONFIGS = {  # vocab 255: the last rank's vocabulary slice is padded
    "llama": dict(model_type="llama", **TINY),
    "mistral": dict(model_type="mistral", **TINY),
    "qwen2-bias": dict(model_type="qwen2", **TINY),
    # o_proj's bias added by rank 0 alone (row-parallel)
    "llama-bias": dict(model_type="llama", attention_bias=True, **TINY),
    # one KV head for two ranks: each holds a copy; tied embeddings share the vocabulary slice
    "llama-gqa1-tied": dict(model_type="llama", tie_word_embeddings=True,
                            **{**TINY, "num_key_value_heads": 1}),
    # experts split along their width, the shared expert along its own; q/k norms per head
    # (Qwen3) and over the whole split projection (OLMo 2)
    "qwen2-moe-shared": dict(model_type="qwen2_moe", num_experts=4, num_experts_per_tok=2,
                             moe_intermediate_size=32, shared_expert_intermediate_size=48,
                             **TINY),
    "qwen3-moe": dict(model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=32, norm_topk_prob=True, **TINY),
    "olmo2": dict(model_type="olmo2", **TINY),
    # each q and k head permuted for partial rotary embeddings, then cut by heads
    "phi3-partial": dict(model_type="phi3", partial_rotary_factor=0.75, pad_token_id=0,
                         **TINY),
    # interleaved pairs of half of each head, qkv biases, four norms a layer
    "glm4": dict(model_type="glm4", pad_token_id=0, **{**TINY, "head_dim": 16}),
    # a sigmoid router over grouped experts (whole on each rank), an unscaled shared expert
    "glm4-moe": dict(model_type="glm4_moe", n_routed_experts=8, num_experts_per_tok=2,
                     moe_intermediate_size=32, n_shared_experts=1, first_k_dense_replace=1,
                     n_group=2, topk_group=1, routed_scaling_factor=2.5, use_qk_norm=True,
                     pad_token_id=0, **TINY),
    # a norm over the whole split q and k, half of each head rotated, a sigmoid router with
    # its choice bias whole on each rank
    "minimax-m2": dict(model_type="minimax_m2", num_local_experts=4, num_experts_per_tok=2,
                       rotary_dim=8, **{**TINY, "head_dim": 16}),
    # latent attention: q, kv_b_proj and o_proj cut by heads, the latent whole on each rank
    # (the cache's one KV head a copy on each), interleaved rope rows, o_proj's bias
    "deepseek-v3": dict(model_type="deepseek_v3", q_lora_rank=16, kv_lora_rank=16,
                        qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12,
                        n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                        n_group=2, topk_group=1, first_k_dense_replace=1, attention_bias=True,
                        pad_token_id=0,
                        **{**TINY, "num_key_value_heads": 4}),
    # DeepSeek V2's softmax top k (greedy) whole on each rank, q straight from the hidden
    "deepseek-v2": dict(model_type="deepseek_v2", q_lora_rank=None, kv_lora_rank=16,
                        qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
                        n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                        n_shared_experts=1, first_k_dense_replace=1, pad_token_id=0,
                        **{**TINY, "num_key_value_heads": 4}),
    # Granite's fused shared MLP (shared_mlp.input_linear) split, then cut by its own width
    "granitemoe-shared": dict(model_type="granitemoeshared", num_local_experts=4,
                              num_experts_per_tok=2, shared_intermediate_size=48,
                              embedding_multiplier=2.0, residual_multiplier=0.5,
                              attention_multiplier=0.2, logits_scaling=4.0, pad_token_id=0,
                              **TINY),
    # a float32 router whole on each rank, the MLP beside the experts cut as a dense one
    "hunyuan-moe": dict(model_type="hunyuan_v1_moe", num_experts=4, moe_topk=2,
                        **{**TINY, "head_dim": 16, "intermediate_size": 32}),
    # the attention's output gate cut by query heads as q, sandwich norms, NoPE global layers
    "afmoe": dict(model_type="afmoe", num_experts=4, num_experts_per_tok=2,
                  moe_intermediate_size=32, num_shared_experts=1, global_attn_every_n_layers=2,
                  sliding_window=4, **{**TINY, "head_dim": 16}),
    # an ungated MLP's up_proj and its bias cut by rows, down_proj's bias added by rank 0
    "jais2": dict(model_type="jais2", **{**TINY, "head_dim": 16}),
    # xIELU's learned scalars whole on each rank
    "apertus": dict(model_type="apertus", **{**TINY, "head_dim": 16}),
    # the LM head's bias cut by the vocabulary as its rows, LayerNorm biases whole
    "phimoe": dict(model_type="phimoe", num_local_experts=4, num_experts_per_tok=2,
                   lm_head_bias=True, attention_bias=True, **TINY),
    # weightless norms filled on every rank, the reversed rotation
    "nanochat": dict(model_type="nanochat", **{**TINY, "head_dim": 16}),
    # sinks cut by query heads, expert biases (the down bias added by rank 0 alone), a biased
    # router whole on each rank
    "gpt-oss": dict(model_type="gpt_oss", num_local_experts=4, num_experts_per_tok=2,
                    sliding_window=4, **{**TINY, "head_dim": 16}),
}


def executor_args(model_dir, tp: int, *extra: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--model")
    flags.add_args(p)
    return p.parse_args(["--model", str(model_dir), "--device", "cpu", "--block-size", str(BS),
                         "--num-kv-blocks", "48", "--swap-space-gib", "0.001",
                         "--tensor-parallel-size", str(tp), *extra])


class Plans:
    """Step plans as the scheduler would send them, for a script of greedy requests; keeps each
    request's tokens, computed count and blocks as the scheduler's mirror does."""

    def __init__(self, runner) -> None:
        self.runner, self.step_id = runner, 0
        self.free = list(range(47, -1, -1))
        self.host_free = list(range(8))
        self.reqs: dict[int, dict] = {}
        self.prompt_logprobs: list[tuple[list[int], list[float]]] = []

    def _blocks(self, r: dict, upto: int) -> list[int]:
        new = []
        while len(r["blocks"]) * BS < upto:
            new.append(self.free.pop())
            r["blocks"].append(new[-1])
        return new

    def step(self, new=(), cached=(), swap_out=(), swap_in=()) -> None:
        """new: (rid, prompt, tokens to schedule, prefix blocks of another request to reuse);
        cached: (rid, tokens to schedule); swap_out: rids preempted to host; swap_in: rids
        resumed from host (sent again as new requests, one token scheduled)."""
        plan = pb.StepPlan(step_id=self.step_id)
        self.step_id += 1
        for rid in swap_out:
            r = self.reqs[rid]
            r["host"] = [self.host_free.pop() for _ in r["blocks"]]
            plan.swap_out_src.extend(r["blocks"])
            plan.swap_out_dst.extend(r["host"])
            plan.preempted_req_ids.append(rid)
            self.free += r["blocks"]
            r["blocks"] = []
        for rid in swap_in:
            r = self.reqs[rid]
            self._blocks(r, len(r["tokens"]))
            plan.swap_in_src.extend(r["host"])
            plan.swap_in_dst.extend(r["blocks"][:len(r["host"])])
            self.host_free += r["host"]
            plan.new_requests.add(req_id=rid, token_ids=r["tokens"],
                                  num_computed_tokens=r["computed"], block_ids=r["blocks"],
                                  sampling=GREEDY, num_prompt_tokens=r["prompt"])
            plan.new_num_scheduled_tokens.append(1)
            r["sched"] = 1
        for rid, prompt, n, prefix_of in new:
            shared = self.reqs[prefix_of]["blocks"][:2] if prefix_of is not None else []
            r = self.reqs[rid] = dict(tokens=list(prompt), computed=len(shared) * BS,
                                      blocks=list(shared), prompt=len(prompt), out=[], sched=n)
            self._blocks(r, r["computed"] + n)
            plan.new_requests.add(req_id=rid, token_ids=prompt, num_computed_tokens=r["computed"],
                                  block_ids=r["blocks"],
                                  sampling=SCORING if rid == 1 else GREEDY)
            plan.new_num_scheduled_tokens.append(n)
        for rid, n in cached:
            r = self.reqs[rid]
            added = self._blocks(r, r["computed"] + n)
            plan.cached_req_ids.append(rid)
            plan.cached_num_computed_tokens.append(r["computed"])
            plan.cached_num_scheduled_tokens.append(n)
            plan.cached_num_new_blocks.append(len(added))
            plan.cached_new_block_ids.extend(added)
            r["sched"] = n
        for r in self.reqs.values():
            r["computed"] += r.pop("sched", 0)
        launched = self.runner.launch(plan)
        if launched is None:
            return
        for rid, tok in zip(*self.runner.finish(launched), strict=True):
            self.reqs[rid]["tokens"].append(tok)
            self.reqs[rid]["out"].append(tok)
        if launched.prompt_read is not None:
            self.prompt_logprobs.append(launched.prompt_read)


def script(runner) -> tuple[dict[int, list[int]], list]:
    g = torch.Generator().manual_seed(3)
    p1, p2 = (torch.randint(0, 255, (n,), generator=g).tolist() for n in (13, 9))
    p3 = p1[:8] + torch.randint(0, 255, (6,), generator=g).tolist()  # shares 2 blocks of p1
    s = Plans(runner)
    s.step(new=[(1, p1, 8, None), (2, p2, 9, None)])  # 1: a prefill chunk; 2: whole
    s.step(cached=[(1, 5), (2, 1)])
    for _ in range(4):
        s.step(cached=[(1, 1), (2, 1)])
    s.step(cached=[(1, 1)], swap_out=[2])
    s.step(new=[(3, p3, 6, 1)], cached=[(1, 1)])  # 3: prefix-cache hit on 1's blocks
    s.step(cached=[(1, 1), (3, 1)], swap_in=[2])
    for _ in range(6):
        s.step(cached=[(1, 1), (2, 1), (3, 1)])
    return {rid: r["out"] for rid, r in s.reqs.items()}, s.prompt_logprobs


def tensor_parallel_tokens(model_dir, *extra: str, prepare=None
                           ) -> tuple[dict[int, list[int]], list]:
    """script's tokens on two ranks; prepare(runner) may return a runner to run it through."""
    args = executor_args(model_dir, 2, *extra)
    threads = torch.get_num_threads()
    group = Group(args, 2)
    try:
        worker = Worker(executor_config(args, 0, 2, "cpu"))
        group.lead(worker)
        worker.warm_up()
        return script(prepare(worker.runner) if prepare else worker.runner)
    finally:
        group.stop()
        torch.set_num_threads(threads)


def single_rank_tokens(model_dir, *extra: str, prepare=None
                       ) -> tuple[dict[int, list[int]], list]:
    worker = Worker(executor_config(executor_args(model_dir, 1, *extra), 0, 1, "cpu"))
    worker.warm_up()
    return script(prepare(worker.runner) if prepare else worker.runner)


def save_random(path, name: str):
    """The HF model of CONFIGS[name], random, saved to path (and returned)."""
    torch.manual_seed(0)
    d = dict(CONFIGS[name])
    # a wider spread than HF's 0.02 init: logits far enough apart that summation order
    # (the all-reduce's) cannot flip a greedy choice
    hf = AutoModelForCausalLM.from_config(
        AutoConfig.for_model(d.pop("model_type"), initializer_range=0.2, **d),
        dtype=torch.float32)
    with torch.no_grad():  # biases initialise to 0: move them (gpt-oss's sinks too)
        for name, p in hf.named_parameters():
            if name.endswith(("bias", ".sinks")):
                p.normal_(0.0, 0.2)
    hf.save_pretrained(path)
    return hf


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_two_ranks_give_the_tokens_of_one(tmp_path, name):
    save_random(tmp_path, name)
    want, want_scores = single_rank_tokens(tmp_path)
    assert [len(v) for v in want.values()] == [14, 13, 8]
    got, scores = tensor_parallel_tokens(tmp_path)
    assert got == want
    # prompt tokens 1..12 of request 1, over its two chunks: ranks and alternatives' ids
    # exact, logprobs within the all-reduce's reordering
    assert [len(ints) for ints, _ in scores] == [len(ints) for ints, _ in want_scores] \
        == [8 * 4, 4 * 4]
    for (ints, floats), (want_ints, want_floats) in zip(scores, want_scores, strict=True):
        assert ints == want_ints
        assert floats == pytest.approx(want_floats, abs=1e-4)


def test_latent_prompts_through_expanded_keys_on_two_ranks(tmp_path, monkeypatch):
    """Prompt chunks of latent attention through keys and values expanded from the cached
    latents (LATENT_EXPAND_ROWS 2), each rank its heads' share of kv_b_proj; rank 1, whose
    metadata comes without the host's lengths, copies them from the device: the tokens of
    one rank, and of the absorbed path."""
    from pagedserve.executor import layers
    from tests.executor_svc.test_families import spy_expanded

    save_random(tmp_path, "deepseek-v3")
    absorbed = single_rank_tokens(tmp_path)[0]
    monkeypatch.setattr(layers, "LATENT_EXPAND_ROWS", 2)
    monkeypatch.setenv("PAGEDSERVE_LATENT_EXPAND_ROWS", "2")  # rank 1's process reads it
    expanded = spy_expanded(monkeypatch)
    want = single_rank_tokens(tmp_path)[0]
    assert expanded and want == absorbed
    assert tensor_parallel_tokens(tmp_path)[0] == want


def test_awq_checkpoint_on_two_ranks(tmp_path):
    from tests.executor_svc.test_quant_formats import _quantized_tiny

    _, qdir = _quantized_tiny(tmp_path, "awq", 32)
    assert tensor_parallel_tokens(qdir)[0] == single_rank_tokens(qdir)[0]


def test_4bit_moe_checkpoint_on_two_ranks(tmp_path):
    """Experts dequantized at load and cut by width, the shared expert's 4-bit parts by its
    own width."""
    from tests.executor_svc.test_quant_formats import MOE, hub_4bit_moe

    hub_4bit_moe({**MOE["qwen2_moe"], "shared_expert_intermediate_size": 64,
                  "initializer_range": 0.2}, "gptq", tmp_path)
    assert tensor_parallel_tokens(tmp_path)[0] == single_rank_tokens(tmp_path)[0]


def split_input_fp8(self, x):
    """A row-parallel FP8 layer as two ranks compute it: each quantizes its half of the input
    per token (its own scales: finer than one scale over the whole row, and no collective), and
    the halves' products are summed (the all-reduce)."""
    if self.weight.shape[0] != TINY["hidden_size"]:  # not o_proj or down_proj
        return self.ops.fp8_gemm(x, self.weight, self.weight_scale, self.input_scale, self.bias)
    h = x.shape[1] // 2
    return sum(self.ops.fp8_gemm(x[:, i * h:(i + 1) * h], self.weight[:, i * h:(i + 1) * h],
                                 self.weight_scale) for i in (0, 1))


def test_fp8_quantized_at_load_on_two_ranks(tmp_path, monkeypatch):
    from pagedserve.executor.quantization import Fp8Linear

    save_random(tmp_path, "qwen2-bias")  # column layers with biases
    plain = single_rank_tokens(tmp_path, "--quantization", "fp8")[0]
    with monkeypatch.context() as m:
        m.setattr(Fp8Linear, "forward", split_input_fp8)
        want = single_rank_tokens(tmp_path, "--quantization", "fp8")[0]
    assert want != single_rank_tokens(tmp_path)[0]  # FP8 changed the model's choices
    assert want != plain  # the per-half activation scales changed some
    assert tensor_parallel_tokens(tmp_path, "--quantization", "fp8")[0] == want


def test_fp8_checkpoint_with_static_scales_on_two_ranks(tmp_path):
    from tests.executor_svc.test_quant_fp8 import float_model, linears, write_fp8

    hf = float_model(tmp_path)
    scales = {n: 0.01 + 0.001 * i for i, n in enumerate(linears(hf))}
    write_fp8(hf, tmp_path, {"quant_method": "fp8", "activation_scheme": "static"},
              per_tensor=True, input_scales=scales)
    assert tensor_parallel_tokens(tmp_path)[0] == single_rank_tokens(tmp_path)[0]


def test_shares_of_heads_and_refusals():
    cfg = ModelConfig.from_dict(dict(model_type="llama", hidden_size=576, num_attention_heads=9,
                                     num_key_value_heads=3, intermediate_size=1536,
                                     vocab_size=49152))
    # SmolLM2-135M: 3 KV heads over 2 ranks, each with its 3 query heads
    shares = [cfg.for_rank(r, 2) for r in (0, 1)]
    assert [(c.head_start, c.num_heads, c.kv_head_start, c.num_kv_heads) for c in shares] == \
        [(0, 6, 0, 2), (6, 3, 2, 1)]
    assert [c.intermediate_size for c in shares] == [768, 768]
    with pytest.raises(ValueError, match="3 KV heads / 9 heads cannot be split over 6 ranks"):
        cfg.for_rank(0, 6)
    with pytest.raises(ValueError, match="intermediate_size 1536 is not divisible by tensor "
                                         "parallel size 5"):
        cfg.for_rank(0, 5)


class WithAdapters:
    """The runner with LoRA: an adapter read at run time as `POST /v1/load_lora_adapter` has
    the executor do (every rank begins its read, rank 0 reads, then holds it; with tensor
    parallelism each follower then holds its own read), and one whose read rank 0 refuses
    (dropped everywhere); the slots loaded in the first plan, requests under their slots."""

    def __init__(self, runner, path, assign: dict[int, tuple[int, int]]) -> None:
        self.runner, self.assign, self.loads = runner, assign, sorted(set(assign.values()))
        lora = runner.lora
        lora.begin_read(4, "missing", str(path.parent / "missing"))
        lora.remove(4)
        lora.begin_read(3, "three", str(path))
        lora.add(3, "three", str(path), lora.read("three", str(path)))

    def launch(self, plan):
        for slot, adapter_id in self.loads:
            plan.lora_loads.add(slot=slot, adapter_id=adapter_id)
        self.loads = []
        for new in plan.new_requests:
            new.lora_slot, new.lora_adapter = self.assign.get(new.req_id, (0, 0))
        return self.runner.launch(plan)

    def finish(self, launched):
        return self.runner.finish(launched)


@pytest.mark.parametrize("name", ["llama", "llama-gqa1-tied"])
def test_lora_adapters_on_two_ranks(tmp_path, name):
    """Adapters sharded with their layers (column layers' B rows, row layers' A columns; one KV
    head copied on both ranks): request 1 under an adapter on every module, 3 under one read
    at run time (q, v, down), 2 the base, through prefill chunks, decode, swap and a prefix hit;
    two ranks give one rank's tokens, and the adapters change them."""
    from tests.executor_svc.test_lora_adapters import _PLACE, write_adapter

    hf = save_random(tmp_path / "base", name)
    one = write_adapter(tmp_path / "one", hf, 1, 8, list(_PLACE), 16, std=0.2)
    three = write_adapter(tmp_path / "three", hf, 3, 4, ["q_proj", "v_proj", "down_proj"], 8,
                          std=0.3)
    flags = ("--enable-lora", "--lora-modules", f"one={one}", "--max-loras", "2",
             "--max-lora-rank", "8")

    def prepare(runner):
        return WithAdapters(runner, three, {1: (1, 1), 3: (2, 3)})
    want = single_rank_tokens(tmp_path / "base", *flags, prepare=prepare)[0]
    base = single_rank_tokens(tmp_path / "base")[0]
    assert want[2] == base[2] and want[1] != base[1] and want[3] != base[3]
    assert tensor_parallel_tokens(tmp_path / "base", *flags, prepare=prepare)[0] == want


def test_a_draft_model_proposes_on_rank_0_of_two(tmp_path):
    """--speculative-config draft_model with two ranks: rank 0 alone holds the draft, whole
    (its vocabulary and heads unsharded, no collective of its own), mirrors each step and
    proposes. With the target as its own draft every draft is kept and the tokens are HF's."""
    import json

    from tests.executor_svc.test_cuda_graphs import spec_greedy_run

    hf = save_random(tmp_path, "llama")
    spec = json.dumps({"method": "draft_model", "model": str(tmp_path),
                       "num_speculative_tokens": 3})
    args = executor_args(tmp_path, 2, "--num-kv-blocks", "64", "--speculative-config", spec)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, TINY["vocab_size"], (n,), generator=g).tolist() for n in (9, 17)]
    want = [hf.generate(torch.tensor([p]), max_new_tokens=10, do_sample=False, pad_token_id=0,
                        eos_token_id=None)[0, len(p):].tolist() for p in prompts]
    threads = torch.get_num_threads()
    group = Group(args, 2)
    try:
        worker = Worker(executor_config(args, 0, 2, "cpu"))
        assert worker.draft_cfg.tp_size == 1 and worker.model_cfg.tp_size == 2
        group.lead(worker)
        worker.warm_up()
        got, _, drafted, kept = spec_greedy_run(worker, prompts, 10)
    finally:
        group.stop()
        torch.set_num_threads(threads)
    assert [got[0], got[1]] == want
    assert kept == drafted > 0


def spec_run_with_proposals(worker, prompts, n):
    """spec_greedy_run, and every step's proposals."""
    from tests.executor_svc.test_cuda_graphs import spec_greedy_run

    seen, launch = [], worker.runner.launch
    worker.runner.launch = lambda plan, *rest: seen.append(launch(plan, *rest)) or seen[-1]
    got, _, drafted, _ = spec_greedy_run(worker, prompts, n)
    return got, [launched.proposals for launched in seen], drafted


@pytest.mark.parametrize("version", [1, 3], ids=["eagle", "eagle3"])
def test_an_eagle_head_proposes_on_rank_0_as_on_one_rank(tmp_path, version):
    """An EAGLE head beside a 2-rank target: rank 0 holds it whole, lent the target's whole
    embeddings (and EAGLE-1 its lm_head) from the checkpoint, where rank 0 keeps a slice of
    each; it reads rank 0's states, which are whole. Tokens and every step's proposals equal
    one rank's."""
    import json

    from tests.executor_svc.test_eagle import head_tensors, write_head

    save_random(tmp_path / "target", "llama")
    cfg = AutoConfig.from_pretrained(tmp_path / "target")
    cfg.eagle_aux_hidden_state_layer_ids = [0, 1, 1]  # (of 2 layers; the head's config)
    head = write_head(tmp_path / "head", version, head_tensors(version, 3, cfg=cfg,
                                                               draft_vocab=100), cfg, 100)
    spec = json.dumps({"method": "eagle" if version == 1 else "eagle3", "model": str(head),
                       "num_speculative_tokens": 3})
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, TINY["vocab_size"], (n,), generator=g).tolist() for n in (9, 17)]
    runs = []
    for tp in (1, 2):
        args = executor_args(tmp_path / "target", tp, "--num-kv-blocks", "64",
                             "--speculative-config", spec)
        threads = torch.get_num_threads()
        group = Group(args, 2) if tp == 2 else None
        try:
            worker = Worker(executor_config(args, 0, tp, "cpu"))
            if group is not None:
                assert worker.model_cfg.tp_size == 2 and worker.runner.eagle.head.lay.own_embed
                group.lead(worker)
            worker.warm_up()
            runs.append(spec_run_with_proposals(worker, prompts, 10))
        finally:
            if group is not None:
                group.stop()
            torch.set_num_threads(threads)
    assert runs[0][2] > 0 and runs[1] == runs[0]
