"""`pagedserve serve --kv-cache-dtype fp8` on the default model, against the FP8 reference path
run in this process: our model on the torch reference ops over an FP8 cache, one prompt alone.

Why not HF transformers reading K/V through e4m3 (tests/executor_svc/test_kv_cache_fp8.py
does that, exactly, on a small model)? On this 30-layer model the rounding is chaotic: e4m3
turns a 1e-7 relative change of a K element near a rounding midpoint into a 1/16 step, and the
steps compound over the layers: a 1e-7 relative jitter of HF's own embeddings moves its
FP8-KV logits by up to 0.33 (by 5e-5 with a float cache). Two fp32 computations of K that
differ in summation order therefore take different branches at near ties. The same holds for
our CPU path: a request decoded alone and in a batch (decode attention pads to the batch's
longest context, which changes its summation order) differ by up to 0.46 logits.

So: one request at a time (chunked prefill, decode, prefix-cache hits), where the service
computes exactly what the reference path does, must give its greedy tokens exactly. The
reference keeps a prefix cache as the service does: a prompt whose first full blocks an earlier
prompt computed (the chat prompts share their system prompt's first block) starts from those
blocks, as the service's prefill does, not from position 0 (a CPU's flash attention and small
GEMMs sum a row in an order that depends on the step's length, so the two differ in the last
bit, and the FP8 chaos above makes that a different token on some CPUs); concurrent
runs under swap preemption must give tokens that the reference path, fed the same tokens
(teacher forcing), ranks within NEAR_TIE logits of its top one at every position: a swapped
block coming back wrong would leave some token far from the top."""

from __future__ import annotations

import pytest
import torch

import pagedserve.kernels.reference as ops
from pagedserve.executor.config import ModelConfig
from pagedserve.executor.loader import build_model
from pagedserve.executor.model import AttentionMetadata
from tests.integration.conftest import BUDGET, MAX_TOKENS, PROMPTS, TIGHT, _serving, prompt_ids
from tests.integration.test_generation import check_against_hf, run_all

FP8 = torch.float8_e4m3fn
NEAR_TIE = 1.0  # logits: twice the 0.46 a batch moves them, far below a wrong context's
BS = 16


class Fp8Reference:
    """The executor's model and ops over an FP8 cache, one sequence at a time; greedy() keeps
    the full blocks of each prompt it runs and starts a later prompt from those it shares, as
    the service's prefix cache does."""

    def __init__(self, model_dir) -> None:
        self.cfg = ModelConfig.from_pretrained(model_dir)
        self.model = build_model(self.cfg, ops, torch.float32, torch.device("cpu"), 2048,
                                 model_dir)
        self.blocks: dict[tuple[int, ...], list[tuple[torch.Tensor, torch.Tensor]]] = {}

    def _run(self, tokens: list[int], steps: list[int], greedy: bool, kv=None, done: int = 0):
        """Feed tokens from position `done` (kv: a cache holding the ones before) in steps of
        the given sizes (a greedy step appends its argmax when the list runs out); yields each
        step's last-position logits."""
        kv = kv or self._cache(-(-(len(tokens) + len(steps)) // BS))
        table = torch.arange(kv[0][0].shape[0], dtype=torch.int32)[None]
        for n in steps:
            ids = torch.tensor(tokens[done:done + n])
            pos = torch.arange(done, done + n)
            i32 = torch.int32
            meta = AttentionMetadata(pos.clone(), table, torch.tensor([done + n], dtype=i32),
                                     torch.tensor([0, n], dtype=i32), n, done + n)
            logits = self.model(ids, pos, kv, meta, torch.tensor([n - 1]))[0]
            done += n
            if greedy and done == len(tokens):  # (a prompt's chunk before its last: not yet)
                tokens.append(int(logits.argmax()))
            yield logits

    def _cache(self, num_blocks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        c = self.cfg
        shape = (num_blocks, BS, c.num_kv_heads, c.head_dim)
        return [(torch.zeros(shape, dtype=FP8), torch.zeros(shape, dtype=FP8))
                for _ in range(c.num_layers)]

    def greedy(self, prompt: list[int], eos: int, max_tokens: int = MAX_TOKENS) -> list[int]:
        """The service's greedy tokens for the prompt sent alone, after the prompts before it:
        the full blocks an earlier prompt computed are hit (never the prompt's last token,
        which the step must compute), the rest prefilled from there in chunks of BUDGET."""
        tokens = list(prompt)
        kv = self._cache(-(-(len(prompt) + max_tokens) // BS))
        hit = 0
        while hit + BS < len(prompt) and tuple(prompt[:hit + BS]) in self.blocks:
            for (k, v), (bk, bv) in zip(kv, self.blocks[tuple(prompt[:hit + BS])], strict=True):
                k[hit // BS], v[hit // BS] = bk, bv
            hit += BS
        # the prefill in the service's chunks of BUDGET tokens, then one token a step
        left = len(prompt) - hit
        steps = [BUDGET] * ((left - 1) // BUDGET) + [left - (left - 1) // BUDGET * BUDGET]
        steps += [1] * (max_tokens - 1)
        for _ in self._run(tokens, steps, greedy=True, kv=kv, done=hit):
            if tokens[-1] == eos:
                break
        for end in range(BS, len(prompt) + 1, BS):  # the first copy of a block is the one kept
            self.blocks.setdefault(tuple(prompt[:end]),
                                   [(k[end // BS - 1].clone(), v[end // BS - 1].clone())
                                    for k, v in kv])
        return tokens[len(prompt):]

    def gaps(self, prompt: list[int], out: list[int]) -> list[float]:
        """Teacher forcing: how far below the top logit each token of `out` ranks."""
        seq = prompt + out
        steps = [len(prompt)] + [1] * (len(out) - 1)
        return [float(lg.max() - lg[tok])
                for lg, tok in zip(self._run(seq, steps, greedy=False), out, strict=True)]


@pytest.fixture(scope="module")
def fp8_ref(model_dir):
    return Fp8Reference(model_dir)


@pytest.fixture(scope="module")
def fp8_greedy(fp8_ref, tokenizer, hf_greedy):
    """The service's tokens for PROMPTS sent one at a time, a first time."""
    outs = [fp8_ref.greedy(prompt_ids(tokenizer, *p), eos=2) for p in PROMPTS]
    # e4m3's rounding shows in these tokens: the checks below tell an FP8 cache from fp32's
    assert sum(want != ref for want, ref in zip(outs, hf_greedy, strict=True)) >= 4
    return outs


@pytest.fixture(scope="module")
def fp8_greedy_again(fp8_ref, fp8_greedy, tokenizer):
    """The same a second time: every prompt hits its own full blocks."""
    return [fp8_ref.greedy(prompt_ids(tokenizer, *p), eos=2) for p in PROMPTS]


@pytest.fixture(scope="module")
def fp8_service(tmp_path_factory, model_dir):
    yield from _serving(tmp_path_factory, "fp8", "--kv-cache-dtype", "fp8",
                        "--max-num-batched-tokens", str(BUDGET), "--max-num-seqs", "16",
                        "--kv-cache-gib", "0.25")


@pytest.fixture(scope="module")
def fp8_first_run(fp8_service):
    """Each prompt alone, once: the results; every prompt's full blocks are cached after."""
    return run_all(fp8_service, concurrently=False)


@pytest.fixture(scope="module")
def fp8_swap_service(tmp_path_factory, model_dir):
    yield from _serving(tmp_path_factory, "fp8_swap", "--kv-cache-dtype", "fp8", *TIGHT,
                        "--preemption-mode", "swap", "--swap-space-gib", "0.25")


def test_fp8_service_matches_the_fp8_reference_path(fp8_service, fp8_first_run, fp8_greedy,
                                                    tokenizer):
    info = fp8_service.client.model_info()
    assert (info.kv_cache_dtype, info.dtype) == ("float8_e4m3fn", "float32")
    # SmolLM2-135M: (K, V) x 30 layers x 3 KV heads x 64 = 11,520 values a token; 0.25 GiB of
    # 16-token blocks is 364 blocks in float32, 1,456 in FP8
    assert info.num_kv_blocks == (1 << 28) // (16 * 11_520) == 1456
    check_against_hf(fp8_first_run, fp8_greedy, tokenizer)
    m = fp8_service.wait_idle()
    assert m["pagedserve_num_free_kv_blocks"] == m["pagedserve_num_kv_blocks"] == 1456
    series = [k for k in m if k.startswith("pagedserve_cache_config_info{")]
    assert len(series) == 1 and 'cache_dtype="float8_e4m3fn"' in series[0], series


def test_fp8_prefix_cache_hits_keep_outputs_identical(fp8_service, fp8_first_run,
                                                      fp8_greedy_again, tokenizer):
    before = fp8_service.metrics()
    check_against_hf(run_all(fp8_service, concurrently=False), fp8_greedy_again, tokenizer)
    hits = "pagedserve_prefix_cache_hits_total"
    expected = sum((len(prompt_ids(tokenizer, *p)) - 1) // 16 * 16 for p in PROMPTS)
    assert fp8_service.metrics()[hits] - before[hits] == expected


def test_fp8_swap_preemption_keeps_tokens_at_the_top(fp8_swap_service, fp8_ref, tokenizer):
    key = 'pagedserve_num_preemptions_total{mode="swap"}'
    for _ in range(3):  # whether a round preempts depends on how the requests arrive
        results = run_all(fp8_swap_service, concurrently=True)
        m = fp8_swap_service.wait_idle()
        if m[key] > 0:
            break
    assert m[key] > 0
    assert m["pagedserve_num_free_kv_blocks"] == m["pagedserve_num_kv_blocks"] == 10
    for (ids, _, last), prompt in zip(results, PROMPTS, strict=True):
        assert last.usage.completion_tokens == len(ids) > 0
        gaps = fp8_ref.gaps(prompt_ids(tokenizer, *prompt), ids)
        assert max(gaps) < NEAR_TIE, (prompt[1][:40], gaps)
