"""EAGLE and EAGLE-3 heads in the executor (executor_svc/eagle.py): random heads written in the
public checkpoint layouts propose, step after step, exactly what a dense reference of the head
drafts from HF's own hidden states of the target (through chunked prefill, two requests in one
batch, and drafts partly accepted); verification keeps HF's greedy tokens; heads that do not fit
the method or the target are refused with one line."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from pagedserve.executor.cuda_graphs import DecodeGraphs
from pagedserve.executor.draft import DraftModelError
from pagedserve.executor.eagle import HeadGraphs
from pagedserve.executor.worker import ExecutorConfig, Worker
from pagedserve.protos.internal.v1 import executor_pb2 as pb

VOCAB, HIDDEN, LAYERS, HEADS, KV_HEADS, INTER = 96, 64, 8, 4, 2, 128
DRAFT_VOCAB = 40  # the EAGLE-3 head's own vocabulary, mapped into the target's by d2t
BLOCK = 4


def llama_config(**kw):
    base = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTER,
                num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                num_key_value_heads=KV_HEADS, max_position_embeddings=128,
                initializer_range=0.1, tie_word_embeddings=False, rope_theta=10000.0)
    base.update(kw)
    return AutoConfig.for_model("llama", **base)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    path = tmp_path_factory.mktemp("target")
    torch.manual_seed(5)
    hf = AutoModelForCausalLM.from_config(llama_config(), dtype=torch.float32).eval()
    hf.save_pretrained(path)
    return path, hf


def head_tensors(version, seed, embed=False, cfg=None, draft_vocab=DRAFT_VOCAB):
    """A random head's tensors for a target of config `cfg` (the tiny one by default), under
    the names the public checkpoints use."""
    cfg = cfg or llama_config()
    g = torch.Generator().manual_seed(seed)
    hid, inter, vocab = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    d = getattr(cfg, "head_dim", None) or hid // heads

    def w(*shape, std=0.15):
        return torch.randn(*shape, generator=g) * std

    pre = "layers.0." if version == 1 else "midlayer."
    inp = hid if version == 1 else 2 * hid
    t = {f"{pre}self_attn.q_proj.weight": w(heads * d, inp),
         f"{pre}self_attn.k_proj.weight": w(kv * d, inp),
         f"{pre}self_attn.v_proj.weight": w(kv * d, inp),
         f"{pre}self_attn.o_proj.weight": w(hid, heads * d),
         f"{pre}mlp.gate_proj.weight": w(inter, hid),
         f"{pre}mlp.up_proj.weight": w(inter, hid),
         f"{pre}mlp.down_proj.weight": w(hid, inter),
         f"{pre}post_attention_layernorm.weight": 1 + w(hid, std=0.1)}
    if version == 1:
        t["fc.weight"], t["fc.bias"] = w(hid, 2 * hid), w(hid)
        t["layers.0.input_layernorm.weight"] = torch.ones(hid)  # saved, never applied
    else:
        t["fc.weight"] = w(hid, 3 * hid)
        t[f"{pre}input_layernorm.weight"] = 1 + w(hid, std=0.1)
        t[f"{pre}hidden_norm.weight"] = 1 + w(hid, std=0.1)
        t["norm.weight"] = 1 + w(hid, std=0.1)
        t["lm_head.weight"] = w(draft_vocab, hid, std=0.5)
        ids = torch.randperm(vocab, generator=g)[:draft_vocab].sort().values
        t["d2t"] = ids - torch.arange(draft_vocab)  # target id = d + d2t[d]
        t["t2d"] = torch.zeros(vocab, dtype=torch.bool).index_fill_(0, ids, True)
    if embed:
        t["embed_tokens.weight"] = w(vocab, hid, std=0.5)
    return t


def write_head(path, version, tensors, cfg=None, draft_vocab=DRAFT_VOCAB,
               speculators=False):
    """The head's config.json (the target's dimensions, one layer) and its safetensors;
    speculators: an EAGLE-3 head as the speculators library writes it (the layer's config
    nested, norm_before_residual left to its default, true)."""
    path.mkdir(parents=True, exist_ok=True)
    d = {**(cfg or llama_config()).to_dict(), "num_hidden_layers": 1}
    cfg = AutoConfig.for_model(d.pop("model_type"), **d)
    if speculators:
        (path / "config.json").write_text(json.dumps({
            "architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
            "transformer_layer_config": cfg.to_dict(), "draft_vocab_size": draft_vocab,
            "speculators_config": {"proposal_methods": [{"speculative_tokens": 3}]}}))
    elif version == 3:
        cfg.architectures = ["LlamaForCausalLMEagle3"]
        cfg.draft_vocab_size = draft_vocab
    if not speculators:
        cfg.save_pretrained(path)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
    return path


class DenseHead:
    """The head as a few lines of dense torch, over every entry so far: entry i is (the token
    after position i, the state there), at position i."""

    def __init__(self, version, t, hf, norm_before_residual=False):
        self.v, self.t, self.hf, self.nbr = version, t, hf, norm_before_residual
        self.pre = "layers.0." if version == 1 else "midlayer."
        self.rope = LlamaRotaryEmbedding(llama_config())
        self.embed = t.get("embed_tokens.weight", hf.model.embed_tokens.weight)
        if version == 3:
            self.taps = (2, LAYERS // 2, LAYERS - 3)

    def norm(self, x, name):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.t[name]

    def states(self, tokens):
        """The target's states at every position (HF's hidden_states: [i] enters layer i, [L]
        is the final norm's output), as this head reads them."""
        hs = self.hf(torch.tensor([tokens]), output_hidden_states=True).hidden_states
        if self.v == 1:
            return hs[LAYERS][0]
        return torch.cat([hs[i][0] for i in self.taps], -1) @ self.t["fc.weight"].T

    def forward(self, toks, hs):
        p, t = self.pre, self.t
        e = self.embed[torch.tensor(toks)]
        h = torch.stack(hs)
        if self.v == 1:
            x = torch.cat([e, h], -1) @ t["fc.weight"].T + t["fc.bias"]
            res, inp = x, x
        else:
            hn = self.norm(h, p + "hidden_norm.weight")
            res = hn if self.nbr else h
            inp = torch.cat([self.norm(e, p + "input_layernorm.weight"), hn], -1)
        n, d = len(toks), HIDDEN // HEADS
        q = (inp @ t[p + "self_attn.q_proj.weight"].T).view(1, n, HEADS, d).transpose(1, 2)
        k = (inp @ t[p + "self_attn.k_proj.weight"].T).view(1, n, KV_HEADS, d).transpose(1, 2)
        v = (inp @ t[p + "self_attn.v_proj.weight"].T).view(1, n, KV_HEADS, d).transpose(1, 2)
        cos, sin = self.rope(v, torch.arange(n)[None])
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        k, v = (z.repeat_interleave(HEADS // KV_HEADS, 1) for z in (k, v))
        a = torch.softmax((q @ k.transpose(-1, -2)) / math.sqrt(d)
                          + torch.full((n, n), float("-inf")).triu(1), -1) @ v
        x = a.transpose(1, 2).reshape(n, HEADS * d) @ t[p + "self_attn.o_proj.weight"].T
        res = res + x
        x = self.norm(res, p + "post_attention_layernorm.weight")
        gate, up = x @ t[p + "mlp.gate_proj.weight"].T, x @ t[p + "mlp.up_proj.weight"].T
        return res + (torch.nn.functional.silu(gate) * up) @ t[p + "mlp.down_proj.weight"].T

    def greedy(self, x):
        if self.v == 1:
            return int((x @ self.hf.lm_head.weight.T).argmax())
        d = int((self.norm(x, "norm.weight") @ self.t["lm_head.weight"].T).argmax())
        return d + int(self.t["d2t"][d])

    @torch.no_grad()
    def drafts(self, tokens, k):
        """The head's k greedy drafts after `tokens` (the last one just sampled)."""
        states = list(self.states(tokens)[:-1])
        toks = list(tokens[1:])
        out = []
        for _ in range(k):
            x = self.forward(toks, states)[-1]
            out.append(self.greedy(x))
            toks.append(out[-1])
            states.append(x)
        return out


def hf_greedy(hf, prompt, n):
    return hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                       pad_token_id=0)[0, len(prompt):].tolist()


def greedy():
    return pb.Sampling(temperature=0.0, top_p=1.0)


def eagle_runner(target_path, head_path, method, blocks=32):
    return Worker(ExecutorConfig(model=str(target_path), device="cpu", num_kv_blocks=blocks,
                                 block_size=BLOCK, draft_model=str(head_path),
                                 draft_method=method)).runner


class EagerReplays:
    """Graphs on the CPU: each 'graph' replays eagerly what capture() records, counted."""

    def stand_in(self):
        self.replays = 0
        for bs in self.sizes:
            self.graphs[bs] = SimpleNamespace(replay=lambda bs=bs: self.replay(bs))

    def replay(self, bs):
        self.replays += 1
        self.forward(bs)


class EagerDecodeGraphs(EagerReplays, DecodeGraphs):
    """The target's states reach the head through the graphs' static buffer."""

    def __init__(self, model, kv_caches):
        super().__init__(model, kv_caches, 8, 64, BLOCK, torch.device("cpu"))
        self.stand_in()


class EagerHeadGraphs(EagerReplays, HeadGraphs):
    """The proposal passes run over the static buffers, padding and rows sitting a pass out
    too."""

    def __init__(self, draft):
        super().__init__(draft.head, draft.kv_caches, 8, BLOCK, torch.device("cpu"))
        self.stand_in()


@pytest.mark.parametrize("graphed", [False, True], ids=["eager", "graphed"])
@pytest.mark.parametrize("version, speculators", [(1, False), (3, False), (3, True)],
                         ids=["eagle", "eagle3", "eagle3-speculators"])
def test_the_head_proposes_what_a_dense_reference_drafts_from_hf_states(target, tmp_path,
                                                                       version, speculators,
                                                                       graphed):
    """Two requests: A prefills in two chunks beside B's decode steps; every step's
    proposals equal the dense head's on HF's states of the tokens so far. The plans draft
    the head's proposals, or two of the target's own tokens and a wrong one (accepted 2),
    so the head's cache is rolled past rejected drafts; the tokens stay HF's greedy ones.
    Graphed: the verification steps replay (eager stand-ins of) the decode graphs, and the
    head's proposal passes (eager stand-ins of) its own.
    Speculators: the library's config layout, its residual taken after hidden_norm."""
    path, hf = target
    tensors = head_tensors(version, seed=11)
    head = write_head(tmp_path / "head", version, tensors, speculators=speculators)
    run = eagle_runner(path, head, "eagle" if version == 1 else "eagle3")
    if graphed:
        run.graphs = EagerDecodeGraphs(run.model, run.kv_caches)
        run.eagle.graphs = EagerHeadGraphs(run.eagle)
    assert run.model.taps == ((LAYERS,) if version == 1 else (2, 4, 5))
    ref, k, n_out = DenseHead(version, tensors, hf, speculators), 3, 14
    prompts = {1: list(range(3, 24)), 2: [7, 1, 9, 30, 2, 55, 4]}
    want = {r: hf_greedy(hf, p, n_out + k + 1) for r, p in prompts.items()}
    got = {1: [], 2: []}
    blocks = {1: list(range(0, 12)), 2: list(range(12, 22))}

    # step 1: B whole, A's first chunk (13 of 21 tokens: the head catches up to 13 with A's
    # 14th prompt token); step 2: A's last 8 tokens beside B's first decode
    plan = pb.StepPlan(step_id=1, num_lookahead_tokens=k)
    plan.new_requests.add(req_id=2, token_ids=prompts[2], block_ids=blocks[2],
                          sampling=greedy())
    plan.new_requests.add(req_id=1, token_ids=prompts[1], block_ids=blocks[1],
                          sampling=greedy())
    plan.new_num_scheduled_tokens.extend([len(prompts[2]), 13])
    launched = run.launch(plan)
    rids, toks = run.finish(launched)
    assert rids == [2]
    got[2] += toks
    proposals = dict(zip(launched.proposals[0], np.split(
        np.array(launched.proposals[2]), np.cumsum(launched.proposals[1])[:-1]), strict=True))
    assert proposals[2].tolist() == ref.drafts(prompts[2] + got[2], k)

    step = 2
    while min(len(v) for v in got.values()) < n_out:
        plan = pb.StepPlan(step_id=step, num_lookahead_tokens=k)
        for rid in (1, 2):
            computed = len(prompts[rid]) + len(got[rid]) - 1 if got[rid] else 13
            if not got[rid]:  # A's last chunk
                n, drafts = len(prompts[rid]) - 13, []
            else:
                truth = want[rid][len(got[rid]):]
                drafts = proposals[rid].tolist() if step % 2 else truth[:2] + [
                    (truth[2] + 1) % VOCAB]
                n = 1 + len(drafts)
            plan.cached_req_ids.append(rid)
            plan.cached_num_computed_tokens.append(computed)
            plan.cached_num_scheduled_tokens.append(n)
            plan.cached_num_new_blocks.append(0)
            plan.cached_num_spec_tokens.append(len(drafts))
            plan.cached_spec_token_ids.extend(drafts)
        launched = run.launch(plan)
        rids, toks = run.finish(launched)
        for rid, tok in zip(rids, toks, strict=True):
            got[rid].append(tok)
        rids, counts, flat = launched.proposals
        proposals = dict(zip(rids, np.split(np.array(flat), np.cumsum(counts)[:-1]),
                             strict=True))
        assert sorted(proposals) == [1, 2]
        for rid in (1, 2):
            assert got[rid] == want[rid][:len(got[rid])]
            assert proposals[rid].tolist() == ref.drafts(prompts[rid] + got[rid], k), (step,
                                                                                       rid)
        step += 1
    assert run.eagle.proposed_tokens == k * (2 * step - 3)
    assert not graphed or run.graphs.replays == step - 3  # all but the two prefill steps
    assert not graphed or run.eagle.graphs.replays == k * (step - 1)  # k passes a step


@pytest.mark.parametrize("version", [1, 3], ids=["eagle", "eagle3"])
def test_graphed_passes_draft_and_write_what_eager_passes_do(target, tmp_path, version):
    """The head's graph passes (eager stand-ins) against its eager passes on the same cache:
    rows drafting 2, 0 and 3 tokens (padded to 4 rows, after 4 rows whose last drafts to the
    last pass) give the same drafts and write the same KV slots: none for a padding row or a
    row sitting a pass out."""
    path, _ = target
    head = write_head(tmp_path / "head", version, head_tensors(version, seed=3))
    run = eagle_runner(path, head, "eagle" if version == 1 else "eagle3")
    draft = run.eagle
    g = torch.Generator().manual_seed(8)
    for k, v in draft.kv_caches:
        k.copy_(torch.randn(k.shape, generator=g))
        v.copy_(torch.randn(v.shape, generator=g))
    width = len(run.model.taps) * HIDDEN
    table = np.arange(32, dtype=np.int32).reshape(4, 8)[:, ::-1].copy()  # not contiguous
    calls = [(np.array([0, 1, 2, 3]), np.array([6, 3, 9, 1]), np.array([1, 3, 2, 3])),
             (np.array([2, 0, 3]), np.array([12, 17, 4]), np.array([2, 0, 3]))]
    inputs = [(torch.randint(0, VOCAB, (len(rows),), generator=g).numpy(),
               torch.randn((len(rows), width), generator=g)) for rows, _, _ in calls]
    start = [(k.clone(), v.clone()) for k, v in draft.kv_caches]
    runs = []
    for graphs in (None, EagerHeadGraphs(draft)):
        for (k, v), (k0, v0) in zip(draft.kv_caches, start, strict=True):
            k.copy_(k0)
            v.copy_(v0)
        draft.graphs = graphs
        drafts = [draft.propose(tokens, tapped, positions, table, rows, ks)
                  for (rows, positions, ks), (tokens, tapped) in zip(calls, inputs, strict=True)]
        runs.append((drafts, [(k.clone(), v.clone()) for k, v in draft.kv_caches]))
    (eager, eager_kv), (graphed, graphed_kv) = runs
    assert [[len(d) for d in c] for c in graphed] == [[1, 3, 2, 3], [2, 0, 3]]
    assert graphed == eager
    assert draft.graphs.replays == 3 + 3
    for (ke, ve), (kg, vg) in zip(eager_kv, graphed_kv, strict=True):  # (rows batched apart)
        torch.testing.assert_close(kg, ke, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(vg, ve, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("version, tensors, method, error", [
    (1, lambda: head_tensors(1, 0), "eagle3",
     r"fc.weight is \[64, 128\], where method 'eagle3' reads \[64, 192\]"),
    (3, lambda: head_tensors(3, 0), "eagle",
     r"fc.weight is \[64, 192\], where method 'eagle' reads \[64, 128\]"),
    (3, lambda: {k: v for k, v in head_tensors(3, 0).items() if k != "d2t"}, "eagle3",
     "drafts over 40 tokens, the target has 96, and it has no d2t to map them"),
    (1, lambda: {k: v for k, v in head_tensors(1, 0).items()
                 if k != "layers.0.mlp.up_proj.weight"}, "eagle",
     "the head has no layers.0.mlp.up_proj.weight"),
    (1, lambda: {**head_tensors(1, 0), "layers.0.self_attn.rotary.weight": torch.ones(2)},
     "eagle", "unexpected tensor layers.0.self_attn.rotary.weight for an EAGLE head"),
    (1, lambda: {**head_tensors(1, 0), "embed_tokens.weight": torch.ones(VOCAB - 1, HIDDEN)},
     "eagle", "embeds 95 tokens, the target has 96"),
])
def test_a_head_that_does_not_fit_is_refused_with_one_line(target, tmp_path, version, tensors,
                                                           method, error):
    path, _ = target
    head = write_head(tmp_path / "head", version, tensors())
    with pytest.raises(DraftModelError, match="^--speculative-config: .*" + error):
        eagle_runner(path, head, method)


def test_a_corrupt_head_file_is_refused_with_one_line(target, tmp_path):
    path, _ = target
    head = write_head(tmp_path / "head", 1, head_tensors(1, 0))
    data = (head / "model.safetensors").read_bytes()
    (head / "model.safetensors").write_bytes(data[:len(data) // 2])
    with pytest.raises(DraftModelError, match="cannot be read"):
        eagle_runner(path, head, "eagle")


def test_a_random_head_needs_only_its_config(target, tmp_path):
    """--load-format random (benchmarks): the head is drawn from its config.json alone, and
    drafts over its own vocabulary."""
    path, _ = target
    head = tmp_path / "head"
    write_head(head, 3, head_tensors(3, 0))
    (head / "model.safetensors").unlink()
    run = Worker(ExecutorConfig(model=str(path), device="cpu", num_kv_blocks=8,
                                block_size=BLOCK, load_format="random", draft_model=str(head),
                                draft_method="eagle3")).runner
    assert run.eagle.head.lm_head.weight.shape == (DRAFT_VOCAB, HIDDEN)
    plan = pb.StepPlan(step_id=1, num_lookahead_tokens=2)
    plan.new_requests.add(req_id=1, token_ids=[5, 6, 7], block_ids=[0, 1], sampling=greedy())
    plan.new_num_scheduled_tokens.append(3)
    launched = run.launch(plan)
    run.finish(launched)
    assert launched.proposals[:2] == ([1], [2])
    assert all(0 <= t < DRAFT_VOCAB for t in launched.proposals[2])  # d2t of random heads: 0


def test_an_eagle3_head_narrower_than_its_target_needs_its_own_embeddings(target, tmp_path):
    path, _ = target
    narrow = llama_config(hidden_size=32, intermediate_size=64, num_attention_heads=2,
                          num_key_value_heads=1)
    tensors = {**head_tensors(3, 0, cfg=narrow), "fc.weight": torch.zeros(32, 3 * HIDDEN)}
    head = write_head(tmp_path / "head", 3, tensors, narrow)
    with pytest.raises(DraftModelError, match="has hidden size 32, the target 64, and no "
                                              "embed_tokens of its own"):
        eagle_runner(path, head, "eagle3")
    (tmp_path / "head" / "model.safetensors").unlink()  # with its own, it serves
    write_head(tmp_path / "head", 3, {**tensors, "embed_tokens.weight": torch.zeros(VOCAB, 32)},
               narrow)
    assert eagle_runner(path, head, "eagle3").eagle.head.lay.own_embed


def test_a_prefix_cache_hit_reuses_the_heads_cache_in_those_blocks(target, tmp_path):
    """A second request of the same prompt starts past its first 5 blocks (the scheduler's
    prefix-cache hit): the head's entries in them, written for the first, are its own, so its
    proposals are the dense head's on the whole prompt."""
    path, hf = target
    tensors = head_tensors(3, seed=4)
    run = eagle_runner(path, write_head(tmp_path / "head", 3, tensors), "eagle3")
    ref, prompt = DenseHead(3, tensors, hf), list(range(40, 61))
    plans = []
    for rid, computed, blocks in ((1, 0, list(range(6))), (2, 20, [0, 1, 2, 3, 4, 9])):
        plan = pb.StepPlan(step_id=rid, num_lookahead_tokens=3)
        plan.new_requests.add(req_id=rid, token_ids=prompt, block_ids=blocks,
                              num_computed_tokens=computed, sampling=greedy())
        plan.new_num_scheduled_tokens.append(len(prompt) - computed)
        launched = run.launch(plan)
        tokens = run.finish(launched)[1]
        plans.append((tokens, launched.proposals))
    assert plans[0][0] == plans[1][0] == hf_greedy(hf, prompt, 1)
    want = ref.drafts(prompt + plans[0][0], 3)
    assert plans[0][1] == ([1], [3], want) and plans[1][1] == ([2], [3], want)

