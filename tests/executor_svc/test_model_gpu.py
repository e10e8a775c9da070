"""The whole model on the Triton kernels against HF transformers, on CUDA (skipped without)."""

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from pagedserve.executor.config import ModelConfig
from pagedserve.executor.loader import build_model
from pagedserve.executor.worker import ExecutorConfig, Worker
from pagedserve.kernels import get_ops
from pagedserve.protos.internal.v1 import executor_pb2 as pb
from tests.executor_svc.test_model import run_paged

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

# Llama-shaped, small enough to build in seconds; head sizes 64 and 128
CONFIGS = {
    "d64": dict(hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
                num_attention_heads=8, num_key_value_heads=2, vocab_size=4096),
    "d128": dict(hidden_size=1024, intermediate_size=2048, num_hidden_layers=4,
                 num_attention_heads=8, num_key_value_heads=2, vocab_size=4096),
}


def save_random_llama(path, name, init=0.02):
    torch.manual_seed(0)
    cfg = AutoConfig.for_model("llama", max_position_embeddings=2048, initializer_range=init,
                               **CONFIGS[name])
    hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    hf.save_pretrained(path)
    return hf


def hf_greedy_tokens(hf, new_tokens=16):
    """Three random prompts (40, 200, 9 tokens) and HF's greedy continuation of each."""
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 4096, (n,), generator=g).tolist() for n in (40, 200, 9)]
    want = []
    for p in prompts:
        with torch.no_grad():
            out = hf.generate(torch.tensor([p], device="cuda"), max_new_tokens=new_tokens,
                              do_sample=False, pad_token_id=0, eos_token_id=None)
        want.append(out[0, len(p):].tolist())
    return prompts, want


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("block_size", [16, 32])
def test_bf16_logits_match_hf(tmp_path, name, block_size):
    hf = save_random_llama(tmp_path, name).cuda()
    cfg = ModelConfig.from_pretrained(tmp_path)
    ours = build_model(cfg, get_ops("triton"), torch.bfloat16, torch.device("cuda"), 2048,
                       tmp_path)
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, 4096, (n,), generator=g).tolist() for n in (300, 48, 133, 10)]
    # prefill chunks, chunks beside single-token rows, then a pure decode-shaped step
    chunks = [(100, 45, 64, 7), (150, 1, 66, 1), (49, 1, 2, 1), (1, 1, 1, 1)]
    outs = run_paged(ours, cfg, seqs, chunks, block_size=block_size, device="cuda",
                     dtype=torch.bfloat16)
    for b, seq in enumerate(seqs):
        with torch.no_grad():
            ref = hf(torch.tensor([seq], device="cuda")).logits[0].float()
        ends = [sum(c[b] for c in chunks[: i + 1]) for i in range(len(chunks))]
        for got, end in zip(outs[b], ends, strict=True):
            err = (got.float() - ref[end - 1]).norm() / ref[end - 1].norm()
            assert err < 2e-2, f"seq {b} pos {end}: relative error {err:.2e}"


def test_fp32_greedy_tokens_match_hf_generate(tmp_path):
    # larger init: peaked logits, so tf32-level differences cannot flip a near-tie
    hf = save_random_llama(tmp_path, "d128", init=0.1).cuda()
    worker = Worker(ExecutorConfig(model=str(tmp_path), device="cuda", dtype="float32",
                                   attention_backend="triton", num_kv_blocks=64))
    prompts, want = hf_greedy_tokens(hf)
    plan = pb.StepPlan(step_id=1)
    for i, p in enumerate(prompts):
        plan.new_requests.add(req_id=i, token_ids=p, block_ids=list(range(i * 20, i * 20 + 20)))
        plan.new_num_scheduled_tokens.append(len(p))
    got = {i: [] for i in range(len(prompts))}
    for step in range(16):
        for rid, tok in zip(*worker.runner.execute(plan), strict=True):
            got[rid].append(tok)
        plan = pb.StepPlan(step_id=step + 2, cached_req_ids=list(got),
                           cached_num_computed_tokens=[len(prompts[i]) + step for i in got],
                           cached_num_scheduled_tokens=[1] * len(got),
                           cached_num_new_blocks=[0] * len(got))
    assert [got[i] for i in range(len(prompts))] == want
