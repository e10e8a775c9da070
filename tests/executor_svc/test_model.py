"""The paged model against HF transformers on small random-weight configs (fp32, CPU)."""

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import pagedserve.kernels.reference as ops
from pagedserve.executor.config import ModelConfig
from pagedserve.executor.loader import build_model
from pagedserve.executor.model import AttentionMetadata

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=256, max_position_embeddings=512)
CONFIGS = {
    "llama": dict(model_type="llama", **TINY),
    "llama-tied-gqa4": dict(model_type="llama", tie_word_embeddings=True,
                            **{**TINY, "num_key_value_heads": 1}),
    "llama3-rope": dict(model_type="llama", rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64}, **TINY),
    "qwen2-bias": dict(model_type="qwen2", **TINY),
    "mistral": dict(model_type="mistral", **TINY),
}


@pytest.fixture(params=sorted(CONFIGS))
def hf_and_ours(request, tmp_path):
    torch.manual_seed(0)
    d = dict(CONFIGS[request.param])
    hf = AutoModelForCausalLM.from_config(AutoConfig.for_model(d.pop("model_type"), **d),
                                          dtype=torch.float32).eval()
    hf.save_pretrained(tmp_path)
    cfg = ModelConfig.from_pretrained(tmp_path)
    ours = build_model(cfg, ops, torch.float32, torch.device("cpu"), 512, tmp_path)
    return hf, ours, cfg


def run_paged(model, cfg, seqs, chunks, block_size=4, device="cpu", dtype=torch.float32):
    """Feed each sequence in `chunks` steps (token counts per step, all sequences batched
    together) and return the last-position logits of every step, per sequence."""
    per_seq = -(-max(len(s) for s in seqs) // block_size)
    shape = (per_seq * len(seqs), block_size, cfg.num_kv_heads, cfg.head_dim)
    kv = [(torch.full(shape, float("nan"), dtype=dtype, device=device),
           torch.full(shape, float("nan"), dtype=dtype, device=device))
          for _ in range(cfg.num_layers)]
    tables = [list(range(i * per_seq, (i + 1) * per_seq))[::-1]  # scattered, not in order
              for i in range(len(seqs))]
    done = [0] * len(seqs)
    outs = [[] for _ in seqs]
    for step in chunks:
        ids, pos, slots, lens, cu, rows = [], [], [], [], [0], []
        for b, n in enumerate(step):
            s, e = done[b], done[b] + n
            ids += seqs[b][s:e]
            pos += range(s, e)
            slots += [tables[b][p // block_size] * block_size + p % block_size for p in range(s, e)]
            lens.append(e)
            cu.append(cu[-1] + n)
            rows.append(cu[-1] - 1)
            done[b] = e
        def t(x, dt=torch.int64):
            return torch.tensor(x, dtype=dt, device=device)

        meta = AttentionMetadata(t(slots), t(tables, torch.int32), t(lens, torch.int32),
                                 t(cu, torch.int32), max(step), max(lens))
        logits = model(t(ids), t(pos), kv, meta, t(rows))
        for b in range(len(seqs)):
            outs[b].append(logits[b])
    return outs


def test_matches_hf_across_chunked_prefill_and_decode(hf_and_ours):
    hf, ours, cfg = hf_and_ours
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, 256, (20,), generator=g).tolist(),
            torch.randint(0, 256, (13,), generator=g).tolist()]
    # step 1: 7 + 5 tokens (prefill chunks), step 2: 10 + 5, then single-token decode steps
    chunks = [(7, 5), (10, 5), (1, 1), (1, 1), (1, 1)]
    assert_paged_equals_hf(hf, run_paged(ours, cfg, seqs, chunks), seqs, chunks)


def test_the_triton_kernels_match_hf_through_the_layers(tmp_path):
    """The model on the Triton ops (interpreted on the CPU, compiled on a GPU): the attention
    layer's one launch that rotates q and k and stores k and v in the cache, then attention,
    give HF's logits across chunked prefill and decode."""
    from pagedserve.kernels import get_ops

    torch.manual_seed(0)
    d = dict(CONFIGS["llama"])
    hf = AutoModelForCausalLM.from_config(AutoConfig.for_model(d.pop("model_type"), **d),
                                          dtype=torch.float32).eval()
    hf.save_pretrained(tmp_path)
    cfg = ModelConfig.from_pretrained(tmp_path)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    ours = build_model(cfg, get_ops("triton"), torch.float32, torch.device(device), 512,
                       tmp_path)
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (20, 13)]
    chunks = [(7, 5), (12, 7), (1, 1)]
    outs = run_paged(ours, cfg, seqs, chunks, device=device)
    assert_paged_equals_hf(hf, [[o.cpu() for o in per] for per in outs], seqs, chunks)


def assert_paged_equals_hf(hf, outs, seqs, chunks, tol=1e-4):
    """run_paged's logits at the end of every step equal HF's over the whole sequence."""
    for b, seq in enumerate(seqs):
        with torch.no_grad():
            ref = hf(torch.tensor([seq])).logits[0]
        ends = [sum(c[b] for c in chunks[: i + 1]) for i in range(len(chunks))]
        for got, end in zip(outs[b], ends, strict=True):
            torch.testing.assert_close(got, ref[end - 1], rtol=tol, atol=tol)


def test_rejects_checkpoint_with_missing_weights(tmp_path):
    from safetensors.torch import save_file

    d = dict(CONFIGS["llama"])
    hf = AutoModelForCausalLM.from_config(AutoConfig.for_model(d.pop("model_type"), **d))
    hf.config.save_pretrained(tmp_path)
    state = {k: v for k, v in hf.state_dict().items() if "layers.1.mlp.up_proj" not in k}
    save_file(state, tmp_path / "model.safetensors")
    cfg = ModelConfig.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match="filled"):
        build_model(cfg, ops, torch.float32, torch.device("cpu"), 512, tmp_path)


def test_unsupported_architecture_is_refused():
    with pytest.raises(ValueError, match="unsupported model_type"):
        ModelConfig.from_dict({"model_type": "gpt2"})


def test_the_gemv_block_switch_takes_powers_of_two_or_nothing():
    from pagedserve.executor.layers import gemv_block

    assert (gemv_block(None), gemv_block(""), gemv_block("4x1024")) == (None, None, (4, 1024))
    for bad in ("3x1024", "4", "ax2", "0x4"):
        with pytest.raises(ValueError, match="NxK, powers of two"):
            gemv_block(bad)
