"""Decode CUDA graphs and the start-up memory profile (CUDA parts skip without a GPU)."""

import gc
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from pagedserve.executor.cuda_graphs import capture_sizes
from pagedserve.executor.worker import ExecutorConfig, Worker
from pagedserve.protos.internal.v1 import executor_pb2 as pb
from tests.executor_svc.test_model_gpu import hf_greedy_tokens, save_random_llama

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_capture_sizes():
    assert capture_sizes(1) == [1]
    assert capture_sizes(6) == [1, 2, 4, 6]
    assert capture_sizes(8) == [1, 2, 4, 8]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes(32) == [1, 2, 4, 8, 16, 24, 32]


def test_max_model_len_past_the_cache_is_refused(tmp_path):
    save_random_llama(tmp_path, "d64")
    with pytest.raises(RuntimeError, match="max_model_len 100 does not fit in the KV cache: "
                                           "4 blocks hold 64 tokens"):
        Worker(ExecutorConfig(model=str(tmp_path), device="cpu", num_kv_blocks=4,
                              max_model_len=100))
    # the model's own limit (2048) is capped to what the cache holds, with a warning
    assert Worker(ExecutorConfig(model=str(tmp_path), device="cpu",
                                 num_kv_blocks=4)).max_model_len == 64


def greedy_run(worker, prompts, steps, finish_at=None):
    """Prefill all prompts, then decode; request 0 finishes after `finish_at` steps."""
    plan = pb.StepPlan(step_id=1)
    for i, p in enumerate(prompts):
        plan.new_requests.add(req_id=i, token_ids=p, block_ids=list(range(i * 20, i * 20 + 20)))
        plan.new_num_scheduled_tokens.append(len(p))
    got, graphed = {i: [] for i in range(len(prompts))}, 0
    for step in range(steps):
        for rid, tok in zip(*worker.runner.execute(plan), strict=True):
            got[rid].append(tok)
        graphed += worker.runner.last_step_graphed
        live = [r for r in got if not (r == 0 and finish_at is not None and step >= finish_at)]
        plan = pb.StepPlan(step_id=step + 2, cached_req_ids=live,
                           cached_num_computed_tokens=[len(prompts[r]) + step for r in live],
                           cached_num_scheduled_tokens=[1] * len(live),
                           cached_num_new_blocks=[0] * len(live),
                           finished_req_ids=[0] if finish_at == step else [])
    return got, graphed


@cuda
def test_graph_replay_gives_hf_greedy_tokens(tmp_path):
    hf = save_random_llama(tmp_path, "d128", init=0.1).cuda()
    worker = Worker(ExecutorConfig(model=str(tmp_path), device="cuda", dtype="float32",
                                   num_kv_blocks=64, max_num_seqs=8))
    worker.warm_up()  # captures graphs for 1, 2, 4, 8
    assert sorted(worker.graphs.graphs) == [1, 2, 4, 8]
    prompts, want = hf_greedy_tokens(hf)
    # 3 requests pad to the graph of 4; after request 0 finishes, 2 run the graph of 2
    got, graphed = greedy_run(worker, prompts, 16, finish_at=5)
    assert graphed == 15  # every step but the prefill
    assert got[0] == want[0][:6]
    assert [got[1], got[2]] == [want[1], want[2]]


@cuda
def test_graph_and_eager_agree_in_bf16(tmp_path):
    save_random_llama(tmp_path, "d64", init=0.1)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 4096, (n,), generator=g).tolist() for n in (17, 64, 5, 33, 90)]
    runs = []
    for eager in (True, False):
        worker = Worker(ExecutorConfig(model=str(tmp_path), device="cuda", num_kv_blocks=128,
                                       max_num_seqs=16, enforce_eager=eager))
        worker.warm_up()
        runs.append(greedy_run(worker, prompts, 12))
    assert runs[0][1] == 0 and runs[1][1] == 11
    assert runs[0][0] == runs[1][0]


@cuda
def test_memory_profile_keeps_within_the_utilization(tmp_path):
    save_random_llama(tmp_path, "d128")
    gc.collect()
    torch.cuda.empty_cache()
    free0, total = torch.cuda.mem_get_info()
    util = (total - free0) / total + 0.1  # 10 % of the card on top of what is in use now
    worker = Worker(ExecutorConfig(model=str(tmp_path), device="cuda", max_num_seqs=64,
                                   max_num_batched_tokens=4096, gpu_memory_utilization=util))
    worker.warm_up()
    cap = worker.capacity
    assert (cap.max_num_batched_tokens, cap.max_num_seqs) == (4096, 64)
    per_block = 16 * 2 * 4 * 2 * 128 * 2  # block x (k, v) x layers x kv heads x head dim x bf16
    kv_bytes = cap.num_kv_blocks * per_block
    assert kv_bytes > 0.8 * 0.1 * total  # the KV cache got most of the 10 %
    # the largest steps the scheduler may plan: a 4096-token prefill over 64 sampled rows...
    plan = pb.StepPlan(step_id=1)
    for i in range(64):
        plan.new_requests.add(req_id=i, token_ids=[7] * 64, block_ids=[5 * i + j for j in range(5)],
                              sampling=pb.Sampling(temperature=1.0, top_k=50, top_p=0.9))
        plan.new_num_scheduled_tokens.append(64)
    worker.runner.execute(plan)
    # ...and graphed decodes of all 64
    worker.runner.execute(pb.StepPlan(step_id=2, cached_req_ids=list(range(64)),
                                      cached_num_computed_tokens=[64] * 64,
                                      cached_num_scheduled_tokens=[1] * 64,
                                      cached_num_new_blocks=[0] * 64))
    assert worker.runner.last_step_graphed
    torch.cuda.synchronize()
    used = total - torch.cuda.mem_get_info()[0]
    assert used <= util * total + (64 << 20), f"{used / 2**30:.2f} GiB used, {util:.3f} allowed"


def test_launching_the_next_step_before_reading_tokens_changes_nothing(tmp_path):
    """Async scheduling: step N+1 is launched while N's tokens are still on the device (its
    decode rows read them there); the tokens equal those of one step at a time. On CUDA the
    graph path's input patching is covered too."""
    save_random_llama(tmp_path, "d64", init=0.1)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 4096, (n,), generator=g).tolist() for n in (12, 40, 7)]
    runs = []
    for pipelined in (False, True):
        worker = Worker(ExecutorConfig(model=str(tmp_path), device=device, dtype="float32",
                                       num_kv_blocks=64, max_num_seqs=8))
        worker.warm_up()
        runner = worker.runner
        plan = pb.StepPlan(step_id=1)
        for i, p in enumerate(prompts):
            plan.new_requests.add(req_id=i, token_ids=p, block_ids=list(range(i * 20, i * 20 + 20)),
                                  sampling=pb.Sampling(temperature=0.0, top_p=1.0))
            plan.new_num_scheduled_tokens.append(len(p))
        got = {i: [] for i in range(len(prompts))}
        launched = None
        for step in range(10):
            nxt = runner.launch(plan)
            if not pipelined:
                launched, nxt = nxt, None
            if launched is not None:
                for rid, tok in zip(*runner.finish(launched), strict=True):
                    got[rid].append(tok)
            launched = nxt
            plan = pb.StepPlan(step_id=step + 2, cached_req_ids=[0, 1, 2],
                               cached_num_computed_tokens=[len(p) + step for p in prompts],
                               cached_num_scheduled_tokens=[1, 1, 1],
                               cached_num_new_blocks=[0, 0, 0])
        if launched is not None:
            for rid, tok in zip(*runner.finish(launched), strict=True):
                got[rid].append(tok)
        runs.append(got)
    assert runs[0] == runs[1]
    assert all(len(t) == 10 for t in runs[0].values())


def spec_greedy_run(worker, prompts, new_tokens, k=3):
    """Greedy decoding with the worker's draft model proposing k drafts a step (its own
    proposals fed back as the next step's drafts); tokens per request, and the steps that
    replayed a graph, that drafted, and the drafts and kept drafts."""
    run = worker.runner
    plan = pb.StepPlan(step_id=1, num_lookahead_tokens=k)
    for i, p in enumerate(prompts):
        plan.new_requests.add(req_id=i, token_ids=p, block_ids=list(range(i * 20, i * 20 + 20)))
        plan.new_num_scheduled_tokens.append(len(p))
    got = {i: [] for i in range(len(prompts))}
    graphed = drafted = kept = 0
    for step in range(2, 4 * new_tokens):
        launched = run.launch(plan)
        before = {r: len(t) for r, t in got.items()}
        for rid, tok in zip(*run.finish(launched), strict=True):
            got[rid].append(tok)
        graphed += run.last_step_graphed
        kept += sum(len(got[r]) - before[r] - 1 for r in got)
        live = [r for r in got if len(got[r]) < new_tokens]
        if not live:
            break
        rids, counts, flat = launched.proposals
        ends = np.cumsum(counts)
        drafts = {r: flat[e - n:e][:new_tokens - len(got[r]) - 1]
                  for r, n, e in zip(rids, counts, ends.tolist(), strict=True)}
        assert set(live) <= set(drafts)
        drafted += sum(len(drafts[r]) for r in live)
        plan = pb.StepPlan(
            step_id=step, cached_req_ids=live,
            cached_num_computed_tokens=[len(prompts[r]) + len(got[r]) - 1 for r in live],
            cached_num_scheduled_tokens=[1 + len(drafts[r]) for r in live],
            cached_num_new_blocks=[0] * len(live),
            cached_num_spec_tokens=[len(drafts[r]) for r in live],
            cached_spec_token_ids=[t for r in live for t in drafts[r]], num_lookahead_tokens=k)
    return got, graphed, drafted, kept


@cuda
def test_verification_steps_replay_graphs_and_keep_the_targets_tokens(tmp_path):
    """The target as its own draft (fp32): verification steps of 1 + 3 tokens a request replay
    the decode graphs one row per token, every draft is kept, and the tokens are HF's. The
    draft's mirror of those steps and its proposal passes replay its own graphs."""
    hf = save_random_llama(tmp_path, "d128", init=0.1).cuda()
    worker = Worker(ExecutorConfig(model=str(tmp_path), device="cuda", dtype="float32",
                                   num_kv_blocks=64, max_num_seqs=16, draft_model=str(tmp_path)))
    worker.warm_up()
    draft_graphs = worker.runner.draft.graphs
    assert draft_graphs is not None and sorted(draft_graphs.graphs) == draft_graphs.sizes
    rows, chains, replay, chain = [], [], draft_graphs.run, draft_graphs.greedy_chain
    draft_graphs.run = lambda ids, *rest: rows.append(len(ids)) or replay(ids, *rest)
    draft_graphs.greedy_chain = lambda tokens, pos, *rest: chains.append(pos.shape) or chain(
        tokens, pos, *rest)
    prompts, want = hf_greedy_tokens(hf)
    got, graphed, drafted, kept = spec_greedy_run(worker, prompts, len(want[0]))
    assert [got[i] for i in range(len(prompts))] == [w[:len(want[0])] for w in want]
    assert kept == drafted > 0 and graphed > 0
    # mirrors of verification steps (a row per token), and proposals of 3 passes for them all
    assert max(rows) > len(prompts) and (3, len(prompts)) in chains


@cuda
def test_lora_decode_steps_replay_their_graphs_and_keep_the_eager_tokens(tmp_path):
    """LoRA: each size captured with the adapters' kernels too; decode steps mixing two
    adapters and the base replay those graphs and give the eager run's tokens (float32)."""
    from pagedserve.core.lora import LoraConfig
    from tests.executor_svc.test_lora_adapters import _PLACE, write_adapter
    from tests.executor_svc.test_lora_adapters import greedy_run as lora_greedy_run

    hf = save_random_llama(tmp_path / "base", "d64", init=0.1)
    one = write_adapter(tmp_path / "one", hf, 1, 8, ["q_proj", "o_proj", "up_proj"], 16)
    two = write_adapter(tmp_path / "two", hf, 2, 16, list(_PLACE), 8)
    lora = LoraConfig((("one", str(one)), ("two", str(two))), 2, 16)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 4096, (n,), generator=g).tolist() for n in (5, 9, 6, 7, 12)]
    slots = [1, 0, 2, 1, 0]
    runs, replays = [], []
    for eager in (True, False):
        worker = Worker(ExecutorConfig(model=str(tmp_path / "base"), device="cuda",
                                       dtype="float32", num_kv_blocks=32, block_size=16,
                                       max_num_seqs=8, enforce_eager=eager, lora=lora))
        worker.warm_up()
        if not eager:
            graphs = worker.graphs.lora_graphs
            assert sorted(graphs) == sorted(worker.graphs.graphs)
            for bs, graph in list(graphs.items()):
                graphs[bs] = SimpleNamespace(replay=lambda graph=graph: replays.append(1)
                                             or graph.replay())
        runs.append(lora_greedy_run(worker.runner, prompts, slots, 10))
    assert runs[0] == runs[1] and len(replays) == 9


@cuda
def test_an_eagle_head_drafts_alike_from_graphed_and_eager_steps(tmp_path):
    """An EAGLE-3 head (fp32): the target's decode and verification steps replay the graphs,
    whose static buffer hands the head the tapped states; its proposals, step after step, and
    the tokens (HF's) equal those of the same run without graphs."""
    from transformers import AutoConfig

    from tests.executor_svc.test_eagle import head_tensors, write_head

    hf = save_random_llama(tmp_path / "target", "d128", init=0.1).cuda()
    cfg = AutoConfig.from_pretrained(tmp_path / "target")
    head = write_head(tmp_path / "head", 3, head_tensors(3, 7, cfg=cfg, draft_vocab=1000), cfg,
                      1000)
    prompts, want = hf_greedy_tokens(hf)
    runs = []
    for eager in (False, True):
        worker = Worker(ExecutorConfig(model=str(tmp_path / "target"), device="cuda",
                                       dtype="float32", num_kv_blocks=64, max_num_seqs=16,
                                       enforce_eager=eager, draft_model=str(head),
                                       draft_method="eagle3"))
        worker.warm_up()
        assert (worker.graphs is None) == eager
        proposals, launch = [], worker.runner.launch

        def recorded(plan, *rest, launch=launch, proposals=proposals):
            launched = launch(plan, *rest)
            proposals.append(launched)
            return launched
        worker.runner.launch = recorded
        got, graphed, drafted, _ = spec_greedy_run(worker, prompts, len(want[0]))
        assert [got[i] for i in range(len(prompts))] == [w[:len(want[0])] for w in want]
        assert drafted > 0 and (graphed > 0) != eager
        runs.append([p.proposals for p in proposals])
    assert runs[0] == runs[1]


@cuda
def test_an_eagle_head_fits_the_memory_profile_with_and_without_graphs(tmp_path):
    """The KV cache sized by the memory profile (no --num-kv-blocks) with an EAGLE-3 head,
    graphed and --enforce-eager (the head is not a CausalLM: it was once profiled as one)."""
    from transformers import AutoConfig

    from tests.executor_svc.test_eagle import head_tensors, write_head

    save_random_llama(tmp_path / "target", "d128", init=0.1)
    cfg = AutoConfig.from_pretrained(tmp_path / "target")
    head = write_head(tmp_path / "head", 3, head_tensors(3, 7, cfg=cfg, draft_vocab=1000), cfg,
                      1000)
    for eager in (False, True):
        worker = Worker(ExecutorConfig(model=str(tmp_path / "target"), device="cuda",
                                       dtype="float32", max_num_seqs=8,
                                       max_num_batched_tokens=512, gpu_memory_utilization=0.5,
                                       enforce_eager=eager, draft_model=str(head),
                                       draft_method="eagle3"))
        assert worker.num_blocks > 0 and (worker._graph_estimate > 0) != eager
        del worker
        gc.collect()
        torch.cuda.empty_cache()
