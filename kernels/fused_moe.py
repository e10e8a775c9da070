"""Fused mixture-of-experts, vLLM's way (layout and math: kernels/moe_reference.py).

    moe_route              softmax, top-k and renormalisation of the router logits in one
                           program per token (moe_reference.moe_route's result)
    moe_align_block_size   the T*k (token, slot) pairs sorted by expert, each expert's run
                           padded to a multiple of BLOCK_M; one Triton program up to
                           ALIGN_ONE_PROGRAM pairs (decode), torch ops beyond (prefill)
    routed_moe             the two above and the experts from the router's logits
                           (FUSE_ROUTE: routing and alignment in one program up to
                           ROUTE_ALIGN_TOKENS tokens, a launch a layer less at decode;
                           up to DECODE_TOKENS tokens moe_decode instead, below)
    GEMM 1 (_moe_gemm)     cache1[p] = w13[e] @ x[p // k]                 [T*k, 2I]
    silu_and_mul           cache2 = silu(gate) * up (kernels/fused.py)    [T*k, I]
                           (FUSE_SILU_TOKENS: GEMM 1 GATED writes cache2 itself, each program the
                           same BLOCK_N columns of gate and of up, rounded to x's dtype as
                           cache1 held them, then silu_and_mul's math)
    GEMM 2 (_moe_gemm)     cache3[p] = topk_weights[p] * (w2[e] @ cache2[p])   [T*k, H]
    _moe_sum               out[t] = sum_j cache3[t*k + j], in float32     [T, H]

moe_decode, a few tokens in two launches: GEMV 1 routes each token in its own programs and
writes silu(gate) * up per (token, slot) pair; GEMV 2 computes each token's down rows and sums
its top k. No alignment, no M tile padded to 16 rows.

One GEMM program per (M-block, N-block): the M-block's rows are gathered through
sorted_token_ids and all belong to one expert, whose weight tile is loaded once per K step.
The grid is the worst-case padded size (moe_reference.align_block_size_capacity), a function of
shapes only, so CUDA graphs capture a step; programs past num_tokens_post_padded (a device
value) exit at once. No host sync on the way. FP8 (e4m3) weights are widened to the
activation dtype in the K loop and their per-channel scales applied in the epilogue
(weight-only: activations are not quantized). Tiles per shape come from moe_configs.json
(benchmarks/kernels/bench_moe.py --tune writes it), else from default_config.
"""

from __future__ import annotations

import functools
import json
import math
import os
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import triton
import triton.language as tl

from pagedserve.kernels._checks import FLOAT_DTYPES, check_tensor
from pagedserve.kernels.fused import silu_and_mul
from pagedserve.kernels.gemv import tiles as gemv_tiles
from pagedserve.kernels.moe_reference import align_block_size_capacity, check_moe_args
from pagedserve.kernels.moe_reference import moe_align_block_size as moe_align_torch

ALIGN_ONE_PROGRAM = 4096  # pairs the one-program alignment sorts in registers (T*k, decode)
CHUNK_TOKENS = 16 * 1024  # tokens per pass (vLLM's VLLM_FUSED_MOE_CHUNK_SIZE): caches stay bounded
CONFIG_FILE = Path(__file__).with_name("moe_configs.json")
# Triton's CPU interpreter (3.9) multiplies bf16 tiles as their raw 16-bit patterns in tl.dot
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
# PAGEDSERVE_MOE_FUSE_SILU: GEMM 1 applies silu_and_mul in its epilogue (GATED) on passes of at
# most FUSE_SILU_TOKENS tokens: "auto" (the default) up to 64, decode sizes (timed at one
# token); "1" every size, "0" never. PAGEDSERVE_MOE_FUSE_ROUTE (default "1"): routed_moe routes
# and aligns up to ROUTE_ALIGN_TOKENS tokens in one program (_route_align_kernel). Both on, on
# an H100 (3a391ed, Qwen3-30B-A3B single stream, three pairs alternated): 240 / 240 / 241 out
# tok/s against 234 / 234 / 234 without (docs/performance.md); their GPU tests pass there.
SILU_AUTO_TOKENS = 64


def silu_tokens(value: str | None) -> int:
    """PAGEDSERVE_MOE_FUSE_SILU's value as the most tokens a pass fuses SiLU for."""
    tokens = {None: SILU_AUTO_TOKENS, "auto": SILU_AUTO_TOKENS, "0": 0, "1": 1 << 62}
    if value not in tokens:
        raise ValueError(f"PAGEDSERVE_MOE_FUSE_SILU={value!r}: auto, 0 or 1")
    return tokens[value]


def route_fused(value: str | None) -> bool:
    """PAGEDSERVE_MOE_FUSE_ROUTE's value: unset or "1" on, "0" off; anything else is refused
    (a typo must not turn the fused routing off unseen)."""
    fused = {None: True, "1": True, "0": False}
    if value not in fused:
        raise ValueError(f"PAGEDSERVE_MOE_FUSE_ROUTE={value!r}: 0 or 1")
    return fused[value]


FUSE_SILU_TOKENS = silu_tokens(os.environ.get("PAGEDSERVE_MOE_FUSE_SILU"))
FUSE_ROUTE = route_fused(os.environ.get("PAGEDSERVE_MOE_FUSE_ROUTE"))
ROUTE_ALIGN_TOKENS = 64  # tokens one program routes ([tokens, experts] in registers)
# PAGEDSERVE_MOE_DECODE_TOKENS=N: routed_moe runs up to N tokens as moe_decode's two GEMV
# launches (routing inside the first, the top-k sum inside the second). 0 (off) by default:
# its GPU tests pass, and on an H100 it times equal to the grouped path (cd268e7, docs/kernels.md)
DECODE_TOKENS = int(os.environ.get("PAGEDSERVE_MOE_DECODE_TOKENS", "0"))


@dataclass(frozen=True)
class MoeConfig:
    block_m: int
    block_n: int
    block_k: int
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3

    @classmethod
    def from_json(cls, d: dict) -> MoeConfig:
        return cls(d["BLOCK_M"], d["BLOCK_N"], d["BLOCK_K"], d["GROUP_M"], d["num_warps"],
                   d["num_stages"])

    def to_json(self) -> dict:
        return {"BLOCK_M": self.block_m, "BLOCK_N": self.block_n, "BLOCK_K": self.block_k,
                "GROUP_M": self.group_m, "num_warps": self.num_warps,
                "num_stages": self.num_stages}


def config_key(num_experts: int, n: int, k: int, dtype: torch.dtype, weight_dtype: torch.dtype,
               device: torch.device) -> str:
    """moe_configs.json's key of one GEMM: [E, N, K] weights, activation and weight dtypes,
    the device's name (spaces as underscores, as vLLM names its files)."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    dt, wdt = (str(d).removeprefix("torch.") for d in (dtype, weight_dtype))
    weight = "" if wdt == dt else f",weight={wdt}"
    return f"E={num_experts},N={n},K={k},dtype={dt}{weight},device={name.replace(' ', '_')}"


@functools.cache
def load_configs(path: Path = CONFIG_FILE) -> dict[str, dict[int, MoeConfig]]:
    """{key: {tokens: config}}; keys starting with '_' are comments."""
    raw = json.loads(path.read_text()) if path.exists() else {}
    return {key: {int(t): MoeConfig.from_json(c) for t, c in buckets.items()}
            for key, buckets in raw.items() if not key.startswith("_")}


def default_config(tokens: int, top_k: int, num_experts: int, n: int, k: int) -> MoeConfig:
    """Tiles by the rows an expert gets on average: decode gives an expert a few rows, so a
    16-row M-block and wide K steps over the weight (the read is the work); prefill fills
    64-128-row blocks (vLLM's default_config and its H200 tables go the same way)."""
    rows = tokens * top_k / num_experts
    if rows <= 16:
        cfg = MoeConfig(16, 64, 128, 1, 4, 4)
    elif rows <= 64:
        cfg = MoeConfig(32, 64, 64, 8, 4, 3)
    elif rows <= 256:
        cfg = MoeConfig(64, 128, 64, 8, 4, 3)
    else:
        cfg = MoeConfig(128, 128, 64, 8, 8, 3)
    # tl.dot takes 16 and up; no wider than the (power-of-two) size itself
    return MoeConfig(cfg.block_m, max(16, min(cfg.block_n, triton.next_power_of_2(n))),
                     max(16, min(cfg.block_k, triton.next_power_of_2(k))), cfg.group_m,
                     cfg.num_warps, cfg.num_stages)


def pick_config(tokens: int, top_k: int, w: torch.Tensor, dtype: torch.dtype) -> MoeConfig:
    """The tuned entry nearest in log2(tokens) for this GEMM's weight w [E, N, K], if within a
    factor of 4 (a table tuned at decode sizes only says nothing of prefill), else the
    default."""
    e, n, k = w.shape
    table = load_configs().get(config_key(e, n, k, dtype, w.dtype, w.device))
    if table:
        near = min(table, key=lambda t: abs(math.log2(t / max(tokens, 1))))
        if abs(math.log2(near / max(tokens, 1))) <= 2:
            return table[near]
    return default_config(tokens, top_k, e, n, k)


@triton.jit
def _top_k_of_row(logits_ptr, row, num_experts, stride_l, TOP_K: tl.constexpr,
                  K_PAD: tl.constexpr, RENORMALIZE: tl.constexpr, E_PAD: tl.constexpr):
    """(weights [K_PAD] float32, ids [K_PAD] int32, slots) of one token: the float32 softmax
    over its experts, the top k by repeated argmax (ties to the lower expert id, as torch.topk
    orders them), each weight over their sum if asked; lanes from TOP_K on are 0."""
    offs = tl.arange(0, E_PAD)
    ok = offs < num_experts
    x = tl.load(logits_ptr + row * stride_l + offs, mask=ok, other=-float("inf"))
    x = x.to(tl.float32)
    e = tl.exp(x - tl.max(x, 0))
    e = tl.where(ok, e, 0.0)
    p = tl.where(ok, e / tl.sum(e, 0), -1.0)  # lanes past the experts are never picked
    slots = tl.arange(0, K_PAD)
    weights = tl.zeros((K_PAD,), dtype=tl.float32)
    ids = tl.zeros((K_PAD,), dtype=tl.int32)
    for j in tl.static_range(TOP_K):
        best = tl.max(p, 0)
        pick = tl.min(tl.where(p == best, offs, E_PAD), 0)
        weights = tl.where(slots == j, best, weights)
        ids = tl.where(slots == j, pick, ids)
        p = tl.where(offs == pick, -1.0, p)
    if RENORMALIZE:
        weights = weights / tl.sum(weights, 0)
    return weights, ids, slots


@triton.jit
def _route_kernel(logits_ptr, weights_ptr, ids_ptr, num_experts, stride_l,
                  TOP_K: tl.constexpr, K_PAD: tl.constexpr, RENORMALIZE: tl.constexpr,
                  E_PAD: tl.constexpr):
    """_top_k_of_row of one token (a program each)."""
    row = tl.program_id(0).to(tl.int64)
    weights, ids, slots = _top_k_of_row(logits_ptr, row, num_experts, stride_l, TOP_K, K_PAD,
                                        RENORMALIZE, E_PAD)
    keep = slots < TOP_K
    tl.store(weights_ptr + row * TOP_K + slots,
             weights.to(weights_ptr.dtype.element_ty), mask=keep)
    tl.store(ids_ptr + row * TOP_K + slots, ids, mask=keep)


def _route_args(router_logits: torch.Tensor, top_k: int, dtype: torch.dtype) -> torch.Tensor:
    """The logits with unit stride over the experts; ValueError for a bad call."""
    check_tensor("router_logits", router_logits, 2, FLOAT_DTYPES)
    num_experts = router_logits.shape[1]
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k {top_k} must be in 1..{num_experts} (the experts)")
    if dtype not in FLOAT_DTYPES:
        raise ValueError(f"dtype must be one of {FLOAT_DTYPES}, got {dtype}")
    return router_logits if router_logits.stride(1) == 1 else router_logits.contiguous()


def moe_route(router_logits: torch.Tensor, top_k: int, renormalize: bool,
              dtype: torch.dtype = torch.float32
              ) -> tuple[torch.Tensor, torch.Tensor]:  # ([T, k] dtype, [T, k] int32)
    """moe_reference.moe_route in one launch (it takes five: softmax, topk, sum, divide,
    cast), a token per program; the weights stored in dtype (rounded from float32 as
    .to(dtype) rounds them: no cast launch after it)."""
    logits = _route_args(router_logits, top_k, dtype)
    t, num_experts = logits.shape
    # the interpreter's float32 -> bfloat16 store truncates where the GPU's (and .to) round to
    # nearest even: interpreted, the kernel stores float32 and torch rounds
    store = torch.float32 if INTERPRETED else dtype
    weights = torch.empty((t, top_k), dtype=store, device=logits.device)
    ids = torch.empty((t, top_k), dtype=torch.int32, device=logits.device)
    if t:
        e_pad = triton.next_power_of_2(num_experts)
        _route_kernel[(t,)](logits, weights, ids, num_experts, logits.stride(0), TOP_K=top_k,
                            K_PAD=triton.next_power_of_2(top_k), RENORMALIZE=renormalize,
                            E_PAD=e_pad, num_warps=1 if e_pad <= 256 else 4)
    return weights.to(dtype), ids


@triton.jit
def _align_pairs(e, valid, pair, numel, sorted_ptr, expert_ids_ptr, post_pad_ptr, num_blocks,
                 NUM_EXPERTS: tl.constexpr, BLOCK_M: tl.constexpr, N_PAD: tl.constexpr,
                 E_PAD: tl.constexpr, CHUNK: tl.constexpr):
    """moe_reference.moe_align_block_size over N_PAD lanes, numel of them `valid` pairs (id
    `pair`, expert `e`; the others expert 0): a histogram, the padded prefix sums, one
    register sort of key (expert, pair), sorted position p stored at p + the expert's padding
    before it."""
    i = tl.arange(0, N_PAD)
    experts = tl.arange(0, E_PAD)
    # the N_PAD - numel lanes past the pairs count as expert 0 (histogram's mask is newer
    # than 3.6)
    counts = tl.histogram(e, E_PAD) - tl.where(experts == 0, N_PAD - numel, 0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, 0)
    tl.store(post_pad_ptr, tl.sum(padded, 0))
    delta = ends - padded - (tl.cumsum(counts, 0) - counts)
    key = tl.sort(tl.where(valid, e, E_PAD) * N_PAD + pair)  # lanes past the pairs sort last
    dest = i + tl.gather(delta, tl.minimum(key // N_PAD, E_PAD - 1), 0)
    offs = tl.arange(0, CHUNK)
    for p in range(0, num_blocks * BLOCK_M, CHUNK):
        tl.store(sorted_ptr + p + offs, numel, mask=p + offs < num_blocks * BLOCK_M)
    for b in range(0, num_blocks, CHUNK // E_PAD):
        blk = b + tl.arange(0, CHUNK // E_PAD)
        eid = tl.sum((ends[None, :] <= blk[:, None] * BLOCK_M).to(tl.int32), 1)
        tl.store(expert_ids_ptr + blk, tl.minimum(eid, NUM_EXPERTS - 1), mask=blk < num_blocks)
    tl.debug_barrier()  # the padding fill lands before the pairs overwrite it
    tl.store(sorted_ptr + dest, key % N_PAD, mask=i < numel)


@triton.jit(do_not_specialize=["numel", "num_blocks"])
def _align_kernel(ids_ptr, sorted_ptr, expert_ids_ptr, post_pad_ptr, numel, num_blocks,
                  NUM_EXPERTS: tl.constexpr, BLOCK_M: tl.constexpr, N_PAD: tl.constexpr,
                  E_PAD: tl.constexpr, CHUNK: tl.constexpr):
    """_align_pairs of the numel pairs in ids_ptr, in one program."""
    i = tl.arange(0, N_PAD)
    ok = i < numel
    e = tl.load(ids_ptr + i, mask=ok, other=0).to(tl.int32)
    _align_pairs(e, ok, i, numel, sorted_ptr, expert_ids_ptr, post_pad_ptr, num_blocks,
                 NUM_EXPERTS, BLOCK_M, N_PAD, E_PAD, CHUNK)


def _align_buffers(numel: int, block_m: int, num_experts: int, dev: torch.device
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sorted_token_ids, expert_ids, num_tokens_post_padded) to fill, at their worst-case
    sizes."""
    cap = align_block_size_capacity(numel, block_m, num_experts)
    return (torch.empty(cap, dtype=torch.int32, device=dev),
            torch.empty(cap // block_m, dtype=torch.int32, device=dev),
            torch.empty(1, dtype=torch.int32, device=dev))


def moe_align_block_size(topk_ids: torch.Tensor, block_m: int, num_experts: int
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sorted_token_ids, expert_ids, num_tokens_post_padded), equal to the torch version's."""
    numel = topk_ids.numel()
    if numel > ALIGN_ONE_PROGRAM or numel == 0 or num_experts > 1024:
        return moe_align_torch(topk_ids, block_m, num_experts)
    sorted_ids, expert_ids, post_pad = _align_buffers(numel, block_m, num_experts,
                                                      topk_ids.device)
    e_pad = triton.next_power_of_2(num_experts)
    _align_kernel[(1,)](topk_ids.contiguous(), sorted_ids, expert_ids, post_pad, numel,
                        expert_ids.numel(), NUM_EXPERTS=num_experts, BLOCK_M=block_m,
                        N_PAD=max(16, triton.next_power_of_2(numel)), E_PAD=e_pad,
                        CHUNK=max(1024, e_pad), num_warps=4)
    return sorted_ids, expert_ids, post_pad


@triton.jit(do_not_specialize=["T", "num_blocks"])
def _route_align_kernel(logits_ptr, weights_ptr, ids_ptr, sorted_ptr, expert_ids_ptr,
                        post_pad_ptr, T, num_experts, stride_l, num_blocks, TOP_K: tl.constexpr,
                        K_PAD: tl.constexpr, RENORMALIZE: tl.constexpr, E_PAD: tl.constexpr,
                        T_PAD: tl.constexpr, N_PAD: tl.constexpr, NUM_EXPERTS: tl.constexpr,
                        BLOCK_M: tl.constexpr, CHUNK: tl.constexpr):
    """_route_kernel for T tokens at once ([T_PAD, E_PAD] in registers), then _align_pairs
    over their pairs p = t * TOP_K + j: the same outputs, one launch."""
    rows = tl.arange(0, T_PAD)
    offs = tl.arange(0, E_PAD)
    row_ok = rows < T
    ok = row_ok[:, None] & (offs < num_experts)[None, :]
    x = tl.load(logits_ptr + rows.to(tl.int64)[:, None] * stride_l + offs[None, :], mask=ok,
                other=-float("inf")).to(tl.float32)
    m = tl.where(row_ok, tl.max(x, 1), 0.0)  # (rows past T: all -inf)
    e = tl.where(ok, tl.exp(x - m[:, None]), 0.0)
    total = tl.where(row_ok, tl.sum(e, 1), 1.0)
    p = tl.where(ok, e / total[:, None], -1.0)  # lanes past the experts are never picked
    slots = tl.arange(0, K_PAD)
    weights = tl.zeros((T_PAD, K_PAD), dtype=tl.float32)
    ids = tl.zeros((T_PAD, K_PAD), dtype=tl.int32)
    for j in tl.static_range(TOP_K):
        best = tl.max(p, 1)
        pick = tl.min(tl.where(p == best[:, None], offs[None, :], E_PAD), 1)
        weights = tl.where(slots[None, :] == j, best[:, None], weights)
        ids = tl.where(slots[None, :] == j, pick[:, None], ids)
        p = tl.where(offs[None, :] == pick[:, None], -1.0, p)
    if RENORMALIZE:
        weights = weights / tl.sum(weights, 1)[:, None]
    keep = row_ok[:, None] & (slots < TOP_K)[None, :]
    pair = rows[:, None] * TOP_K + slots[None, :]
    tl.store(weights_ptr + pair, weights.to(weights_ptr.dtype.element_ty), mask=keep)
    tl.store(ids_ptr + pair, ids, mask=keep)
    # the alignment over N_PAD = T_PAD * K_PAD lanes, those past the pairs expert 0
    _align_pairs(tl.reshape(tl.where(keep, ids, 0), (N_PAD,)), tl.reshape(keep, (N_PAD,)),
                 tl.reshape(pair, (N_PAD,)), T * TOP_K, sorted_ptr, expert_ids_ptr,
                 post_pad_ptr, num_blocks, NUM_EXPERTS, BLOCK_M, N_PAD, E_PAD, CHUNK)


def moe_route_align(router_logits: torch.Tensor, top_k: int, renormalize: bool,
                    dtype: torch.dtype, block_m: int
                    ) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...]]:
    """(weights, ids) = moe_route(...) and moe_align_block_size(ids, block_m, E) in one
    launch, for T <= ROUTE_ALIGN_TOKENS tokens of E <= 1024 experts; beyond, the two calls."""
    logits = _route_args(router_logits, top_k, dtype)
    t, num_experts = logits.shape
    if not 1 <= t <= ROUTE_ALIGN_TOKENS or num_experts > 1024:
        weights, ids = moe_route(logits, top_k, renormalize, dtype)
        return weights, ids, moe_align_block_size(ids, block_m, num_experts)
    dev = logits.device
    store = torch.float32 if INTERPRETED else dtype  # (as moe_route: the interpreter truncates)
    weights = torch.empty((t, top_k), dtype=store, device=dev)
    ids = torch.empty((t, top_k), dtype=torch.int32, device=dev)
    sorted_ids, expert_ids, post_pad = _align_buffers(t * top_k, block_m, num_experts, dev)
    e_pad, k_pad = triton.next_power_of_2(num_experts), triton.next_power_of_2(top_k)
    t_pad = max(16 // k_pad, 2, triton.next_power_of_2(t))  # (>= 16 lanes to sort, as align)
    _route_align_kernel[(1,)](
        logits, weights, ids, sorted_ids, expert_ids, post_pad, t, num_experts,
        logits.stride(0), expert_ids.numel(), TOP_K=top_k, K_PAD=k_pad, RENORMALIZE=renormalize,
        E_PAD=e_pad, T_PAD=t_pad, N_PAD=t_pad * k_pad, NUM_EXPERTS=num_experts,
        BLOCK_M=block_m, CHUNK=max(1024, e_pad), num_warps=4)
    return weights.to(dtype), ids, (sorted_ids, expert_ids, post_pad)


@triton.jit(do_not_specialize=["EM", "num_valid"])
def _moe_gemm_kernel(
    a_ptr, b_ptr, c_ptr, scale_ptr, weight_ptr, sorted_ptr, expert_ids_ptr, post_pad_ptr,
    bias_ptr, N, K, EM, num_valid, stride_am, stride_be, stride_bn, stride_cm, stride_se,
    stride_bias, alpha, limit,
    TOP_K: tl.constexpr, MUL_ROUTED_WEIGHT: tl.constexpr, HAS_SCALE: tl.constexpr,
    PRECISION: tl.constexpr, DOT_FP32: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    GATED: tl.constexpr, HAS_BIAS: tl.constexpr, OAI: tl.constexpr,
):
    """c[p] = a[p // TOP_K] @ b[e].T (+ bias[e]) for the pairs p of one M-block (expert e);
    b [E, N, K]. GATED: b is [E, 2N, K] (gate rows, then up rows) and c[p] = silu(gate) * up,
    N wide (OAI: gpt-oss's clamped (up + 1) * gate * sigmoid(alpha * gate))."""
    pid = tl.program_id(0)
    num_pid_m = EM // BLOCK_M
    num_pid_n = tl.cdiv(N, BLOCK_N)
    group = pid // (GROUP_M * num_pid_n)  # GROUP_M M-blocks share each weight tile in L2
    first_m = group * GROUP_M
    group_m = min(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * num_pid_n)) % group_m
    pid_n = (pid % (GROUP_M * num_pid_n)) // group_m
    if pid_m * BLOCK_M >= tl.load(post_pad_ptr):
        return
    pairs = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_ok = pairs < num_valid
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + (pairs // TOP_K).to(tl.int64)[:, None] * stride_am + offs_k[None, :]
    b_ptrs = b_ptr + expert * stride_be + offs_n[None, :] * stride_bn + offs_k[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = offs_k < K - k0
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        b = b.to(a.dtype)
        if GATED:
            bu = tl.load(b_ptrs + N * stride_bn, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            bu = bu.to(a.dtype)
        if DOT_FP32:  # exact products summed in fp32: what the bf16 MMA computes
            a = a.to(tl.float32)
            b = b.to(tl.float32)
            if GATED:
                bu = bu.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
        if GATED:
            up = tl.dot(a, bu, up, input_precision=PRECISION)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    if HAS_SCALE:
        acc *= tl.load(scale_ptr + expert * stride_se + offs_n, mask=n_ok, other=0.0)[None, :]
        if GATED:
            up *= tl.load(scale_ptr + expert * stride_se + N + offs_n, mask=n_ok,
                          other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + expert * stride_bias + offs_n, mask=n_ok,
                       other=0.0).to(tl.float32)[None, :]
        if GATED:
            up += tl.load(bias_ptr + expert * stride_bias + N + offs_n, mask=n_ok,
                          other=0.0).to(tl.float32)[None, :]
    if GATED:  # as cache1 held gate and up (c's dtype), then silu_and_mul's own math
        act = c_ptr.dtype.element_ty
        g = acc.to(act).to(tl.float32)
        u = up.to(act).to(tl.float32)
        if OAI:  # gpt-oss: clamped, sigmoid(alpha * gate), (up + 1)
            g = tl.minimum(g, limit)
            u = tl.minimum(tl.maximum(u, -limit), limit)
            acc = (g / (1.0 + tl.exp(-alpha * g))).to(act).to(tl.float32) * (u + 1.0)
        else:
            acc = (g / (1.0 + tl.exp(-g))).to(act).to(tl.float32) * u
    if MUL_ROUTED_WEIGHT:
        acc *= tl.load(weight_ptr + pairs, mask=row_ok, other=0.0).to(tl.float32)[:, None]
    tl.store(c_ptr + pairs.to(tl.int64)[:, None] * stride_cm + offs_n[None, :],
             acc.to(c_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


def moe_gemm(a, w, c, align, top_k: int, cfg: MoeConfig, *, scale=None, routed_weights=None,
             gated: bool = False, bias=None, activation: str = "silu", alpha: float = 1.702,
             limit: float = 7.0):
    """c [P, N] rows p = a [., K] row p // top_k times w[expert of p] [N, K]^T (* scale [E, N])
    (+ bias [E, N]) (* routed_weights [P]), for every pair p of align =
    moe_align_block_size(...). gated: w is [E, 2N, K] (gate, then up) and c [P, N] =
    activation(gate, up) (silu(gate) * up, or swiglu_oai with alpha and limit)."""
    sorted_ids, expert_ids, post_pad = align
    e, n, k = w.shape
    if gated:
        n //= 2
    grid = (expert_ids.numel() * triton.cdiv(n, cfg.block_n),)
    _moe_gemm_kernel[grid](
        a, w, c, scale if scale is not None else c, routed_weights if routed_weights is not None
        else c, sorted_ids, expert_ids, post_pad, bias if bias is not None else c,
        n, k, sorted_ids.numel(), c.shape[0],
        a.stride(0), w.stride(0), w.stride(1), c.stride(0),
        scale.stride(0) if scale is not None else 0,
        bias.stride(0) if bias is not None else 0, float(alpha), float(limit),
        HAS_BIAS=bias is not None, OAI=activation == "swiglu_oai",
        TOP_K=top_k, MUL_ROUTED_WEIGHT=routed_weights is not None, HAS_SCALE=scale is not None,
        PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        DOT_FP32=INTERPRETED and a.dtype == torch.bfloat16, BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, GATED=gated,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)


@triton.jit(do_not_specialize=["T"])
def _moe_sum_kernel(c_ptr, out_ptr, T, H, stride_ot, TOP_K: tl.constexpr, BLOCK_T: tl.constexpr,
                    BLOCK_H: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = (rows < T)[:, None] & (offs < H)[None, :]
    acc = tl.zeros((BLOCK_T, BLOCK_H), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        c = c_ptr + (rows * TOP_K + j).to(tl.int64)[:, None] * H + offs[None, :]
        acc += tl.load(c, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * stride_ot + offs[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=mask)


def moe_sum(cache3: torch.Tensor, out: torch.Tensor, top_k: int) -> torch.Tensor:
    """out [T, H] = cache3 [T*k, H] (contiguous) summed over each token's k rows."""
    t, h = out.shape
    block_h = min(1024, triton.next_power_of_2(h))
    block_t = max(1, 2048 // block_h)
    _moe_sum_kernel[(triton.cdiv(t, block_t), triton.cdiv(h, block_h))](
        cache3, out, t, h, out.stride(0), TOP_K=top_k, BLOCK_T=block_t, BLOCK_H=block_h,
        num_warps=4)
    return out


@triton.jit
def _decode_gated_kernel(x_ptr, logits_ptr, w_ptr, scale_ptr, c_ptr, weights_ptr, ids_ptr,
                         bias_ptr, num_experts, stride_xt, stride_l, stride_we, stride_wn,
                         stride_se, stride_bias, alpha, limit,
                         N: tl.constexpr, K: tl.constexpr, TOP_K: tl.constexpr,
                         K_PAD: tl.constexpr, RENORMALIZE: tl.constexpr, E_PAD: tl.constexpr,
                         HAS_SCALE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         HAS_BIAS: tl.constexpr, OAI: tl.constexpr):
    """Pair p = t * TOP_K + j (axis 0) routes token t itself (_top_k_of_row: every program of
    the pair alike), then c[p, n-block] = silu(gate) * up of its j-th expert over x[t] (OAI:
    _moe_gemm_kernel's gpt-oss activation; HAS_BIAS: its biases): a GEMV, no M tile to fill,
    no alignment. The n-block-0 program stores the pair's weight and expert for the down
    GEMV."""
    pair = tl.program_id(0)
    t = (pair // TOP_K).to(tl.int64)
    j = pair % TOP_K
    weights, ids, slots = _top_k_of_row(logits_ptr, t, num_experts, stride_l, TOP_K, K_PAD,
                                        RENORMALIZE, E_PAD)
    expert = tl.sum(tl.where(slots == j, ids, 0), 0)
    if tl.program_id(1) == 0:
        weight = tl.sum(tl.where(slots == j, weights, 0.0), 0)
        tl.store(weights_ptr + pair, weight.to(weights_ptr.dtype.element_ty))
        tl.store(ids_ptr + pair, expert)
    act = c_ptr.dtype.element_ty
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    rows = w_ptr + expert.to(tl.int64) * stride_we + offs_n[:, None] * stride_wn
    gate = tl.zeros((BLOCK_N,), dtype=tl.float32)
    up = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in tl.static_range(0, K, BLOCK_K):  # unrolled: every tile's load may issue at once
        k_ok = offs_k < K - k0
        a = tl.load(x_ptr + t * stride_xt + k0 + offs_k, mask=k_ok, other=0.0).to(tl.float32)
        m = n_ok[:, None] & k_ok[None, :]
        bg = tl.load(rows + k0 + offs_k[None, :], mask=m, other=0.0).to(act).to(tl.float32)
        bu = tl.load(rows + N * stride_wn + k0 + offs_k[None, :], mask=m, other=0.0)
        gate += tl.sum(bg * a[None, :], 1)
        up += tl.sum(bu.to(act).to(tl.float32) * a[None, :], 1)
    if HAS_SCALE:
        scales = scale_ptr + expert.to(tl.int64) * stride_se + offs_n
        gate *= tl.load(scales, mask=n_ok, other=0.0)
        up *= tl.load(scales + N, mask=n_ok, other=0.0)
    if HAS_BIAS:
        biases = bias_ptr + expert.to(tl.int64) * stride_bias + offs_n
        gate += tl.load(biases, mask=n_ok, other=0.0).to(tl.float32)
        up += tl.load(biases + N, mask=n_ok, other=0.0).to(tl.float32)
    # as cache1 held gate and up (x's dtype), then silu_and_mul's own math
    g = gate.to(act).to(tl.float32)
    u = up.to(act).to(tl.float32)
    if OAI:
        g = tl.minimum(g, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
        out = (g / (1.0 + tl.exp(-alpha * g))).to(act).to(tl.float32) * (u + 1.0)
    else:
        out = (g / (1.0 + tl.exp(-g))).to(act).to(tl.float32) * u
    tl.store(c_ptr + pair.to(tl.int64) * N + offs_n, out.to(act), mask=n_ok)


@triton.jit
def _decode_down_kernel(c_ptr, w_ptr, scale_ptr, weights_ptr, ids_ptr, out_ptr, bias_ptr,
                        stride_we, stride_wn, stride_se, stride_ot, stride_bias,
                        N: tl.constexpr, K: tl.constexpr,
                        TOP_K: tl.constexpr, K_PAD: tl.constexpr, HAS_SCALE: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr):
    """out[t, n-block] = sum over j of round(weights[t, j] * (w2[ids[t, j]] @ c[t*TOP_K + j])):
    the down GEMV of each of token t's pairs and their top-k sum (moe_sum's float32 sum of the
    rounded rows) in one program."""
    t = tl.program_id(0).to(tl.int64)
    act = out_ptr.dtype.element_ty
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    slots = tl.arange(0, K_PAD)
    ids = tl.load(ids_ptr + t * TOP_K + slots, mask=slots < TOP_K, other=0)
    wts = tl.load(weights_ptr + t * TOP_K + slots, mask=slots < TOP_K, other=0.0)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for j in tl.static_range(TOP_K):  # unrolled with the K steps: no load waits on another
        expert = tl.sum(tl.where(slots == j, ids, 0), 0).to(tl.int64)
        rows = w_ptr + expert * stride_we + offs_n[:, None] * stride_wn
        dot = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for k0 in tl.static_range(0, K, BLOCK_K):
            k_ok = offs_k < K - k0
            a = tl.load(c_ptr + (t * TOP_K + j) * K + k0 + offs_k, mask=k_ok, other=0.0)
            b = tl.load(rows + k0 + offs_k[None, :], mask=n_ok[:, None] & k_ok[None, :],
                        other=0.0)
            dot += tl.sum(b.to(act).to(tl.float32) * a.to(tl.float32)[None, :], 1)
        if HAS_SCALE:
            dot *= tl.load(scale_ptr + expert * stride_se + offs_n, mask=n_ok, other=0.0)
        if HAS_BIAS:
            dot += tl.load(bias_ptr + expert * stride_bias + offs_n, mask=n_ok,
                           other=0.0).to(tl.float32)
        weight = tl.sum(tl.where(slots == j, wts, 0.0), 0).to(tl.float32)
        acc += (dot * weight).to(act).to(tl.float32)
    tl.store(out_ptr + t * stride_ot + offs_n, acc.to(act), mask=n_ok)


@dataclass(frozen=True)
class DecodeTiles:
    """The GEMV tiles of moe_decode: BLOCK_N output rows of a weight by BLOCK_K of its inputs."""
    block_n: int
    block_k: int
    num_warps: int = 4


def decode_tiles(n: int, k: int) -> DecodeTiles:
    """The dense GEMV's tiles (kernels/gemv.tiles: 4,096 weights, at most 1,024 columns wide):
    at one token, many programs, each with all its loads in flight at once. Not yet tuned on a
    GPU (bench_moe.py --decode sweeps others)."""
    return DecodeTiles(*gemv_tiles(n, k))


def moe_decode(x: torch.Tensor, router_logits: torch.Tensor, top_k: int, renormalize: bool,
               w13: torch.Tensor, w2: torch.Tensor, *, w13_scale=None, w2_scale=None,
               w13_bias=None, w2_bias=None, activation: str = "silu", alpha: float = 1.702,
               limit: float = 7.0,
               tiles: tuple[DecodeTiles, DecodeTiles] | None = None) -> torch.Tensor:
    """routed_moe for a few tokens in two launches where it takes five to seven: GEMV 1
    routes each token in its own programs and writes silu(gate) * up of every (token, slot)
    pair, GEMV 2 runs the down projections and sums each token's top k. The same math and
    roundings as moe_route, the two grouped GEMMs and moe_sum; each weight is read once per
    pair (tokens that share an expert read it twice), so it serves decode steps of a few
    tokens (DECODE_TOKENS)."""
    logits = _route_args(router_logits, top_k, x.dtype)
    for name, w in (("x", x), ("w13", w13), ("w2", w2)):
        if w.stride(-1) != 1:
            raise ValueError(f"{name} must have unit stride in its last dim, got {w.stride()}")
    t, num_experts = logits.shape
    weights = torch.empty((t, top_k), dtype=torch.float32 if INTERPRETED else x.dtype,
                          device=x.device)
    ids = torch.empty((t, top_k), dtype=torch.int32, device=x.device)
    check_moe_args(x, w13, w2, weights, ids, activation, w13_scale, w2_scale, None, w13_bias,
                   w2_bias)
    _, two_i, h = w13.shape
    inter = two_i // 2
    out = torch.empty((t, h), dtype=x.dtype, device=x.device)
    if t == 0:
        return out
    cache = torch.empty((t * top_k, inter), dtype=x.dtype, device=x.device)
    up, down = tiles or (decode_tiles(inter, h), decode_tiles(h, inter))
    e_pad = triton.next_power_of_2(num_experts)
    k_pad = triton.next_power_of_2(top_k)
    fp8 = w13_scale is not None
    _decode_gated_kernel[(t * top_k, triton.cdiv(inter, up.block_n))](
        x, logits, w13, w13_scale if fp8 else x, cache, weights, ids,
        w13_bias if w13_bias is not None else x, num_experts, x.stride(0),
        logits.stride(0), w13.stride(0), w13.stride(1), w13_scale.stride(0) if fp8 else 0,
        w13_bias.stride(0) if w13_bias is not None else 0, float(alpha), float(limit),
        N=inter, K=h, TOP_K=top_k, K_PAD=k_pad, RENORMALIZE=renormalize, E_PAD=e_pad,
        HAS_SCALE=fp8, BLOCK_N=up.block_n, BLOCK_K=up.block_k, HAS_BIAS=w13_bias is not None,
        OAI=activation == "swiglu_oai", num_warps=up.num_warps)
    _decode_down_kernel[(t, triton.cdiv(h, down.block_n))](
        cache, w2, w2_scale if fp8 else x, weights, ids, out,
        w2_bias if w2_bias is not None else x, w2.stride(0), w2.stride(1),
        w2_scale.stride(0) if fp8 else 0, out.stride(0),
        w2_bias.stride(0) if w2_bias is not None else 0, N=h, K=inter, TOP_K=top_k,
        K_PAD=k_pad, HAS_SCALE=fp8, BLOCK_N=down.block_n, BLOCK_K=down.block_k,
        HAS_BIAS=w2_bias is not None, num_warps=down.num_warps)
    return out


def workspace_size(num_tokens: int, top_k: int, hidden: int, inter: int) -> int:
    """Elements (x's dtype) of the caches of one pass: cache1 (unfused GEMM 1 only) and cache3
    share a region (cache1 is dead once silu_and_mul has read it), cache2 its own."""
    pairs = min(num_tokens, CHUNK_TOKENS) * top_k
    return pairs * (max(2 * inter, hidden) + inter)


def fused_moe(
    x: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2I, H] (a TP rank's slice: I = its share)
    w2: torch.Tensor,  # [E, H, I]
    topk_weights: torch.Tensor,  # [T, k] float
    topk_ids: torch.Tensor,  # [T, k] int32/int64, each in [0, E)
    *,
    activation: str = "silu",  # or "swiglu_oai" (gpt-oss: alpha, limit)
    w13_scale: torch.Tensor | None = None,  # [E, 2I] float32, FP8 w13
    w2_scale: torch.Tensor | None = None,  # [E, H] float32, FP8 w2
    w13_bias: torch.Tensor | None = None,  # [E, 2I] x.dtype
    w2_bias: torch.Tensor | None = None,  # [E, H] x.dtype
    alpha: float = 1.702,
    limit: float = 7.0,
    out: torch.Tensor | None = None,  # [T, H] x.dtype
    workspace: torch.Tensor | None = None,  # >= workspace_size(...) elements of x.dtype
    align: tuple[tuple[torch.Tensor, ...], int] | None = None,  # (topk_ids aligned, its block_m)
) -> torch.Tensor:  # [T, H]
    t, h, _, inter, k = check_moe_args(x, w13, w2, topk_weights, topk_ids, activation,
                                       w13_scale, w2_scale, out, w13_bias, w2_bias)
    for name, w in (("x", x), ("w13", w13), ("w2", w2)):
        if w.stride(-1) != 1:
            raise ValueError(f"{name} must have unit stride in its last dim, got {w.stride()}")
    if out is None:
        out = torch.empty((t, h), dtype=x.dtype, device=x.device)
    need = workspace_size(t, k, h, inter)
    if workspace is None:
        workspace = torch.empty(need, dtype=x.dtype, device=x.device)
    elif workspace.dtype != x.dtype or workspace.numel() < need or not workspace.is_contiguous():
        raise ValueError(f"workspace must be a contiguous {x.dtype} buffer of >= {need} elements")
    weights = topk_weights.contiguous()
    ids = topk_ids.contiguous()
    for s in range(0, t, CHUNK_TOKENS):
        e = min(t, s + CHUNK_TOKENS)
        _fused_pass(x[s:e], w13, w2, weights[s:e], ids[s:e], w13_scale, w2_scale, out[s:e],
                    workspace, align if t <= CHUNK_TOKENS else None,
                    Epilogue(w13_bias, w2_bias, activation, alpha, limit))
    return out


def routed_moe(x: torch.Tensor, router_logits: torch.Tensor, top_k: int, renormalize: bool,
               w13: torch.Tensor, w2: torch.Tensor, **kwargs) -> torch.Tensor:
    """fused_moe(x, w13, w2, *moe_route(router_logits, top_k, renormalize, x.dtype),
    **kwargs); up to DECODE_TOKENS tokens moe_decode's two launches, else with FUSE_ROUTE a
    decode step's routing and alignment in one launch."""
    t = x.shape[0]
    plain = all(kwargs.get(name) is None for name in ("out", "workspace"))
    if 1 <= t <= DECODE_TOKENS and plain and w13.shape[0] <= 1024:
        return moe_decode(x, router_logits, top_k, renormalize, w13, w2,
                          **{k: v for k, v in kwargs.items() if k not in ("out", "workspace")})
    if FUSE_ROUTE and 1 <= t <= ROUTE_ALIGN_TOKENS and w13.shape[0] <= 1024:
        block_m = pick_config(t, top_k, w13, x.dtype).block_m
        weights, ids, align = moe_route_align(router_logits, top_k, renormalize, x.dtype,
                                              block_m)
        return fused_moe(x, w13, w2, weights, ids, align=(align, block_m), **kwargs)
    weights, ids = moe_route(router_logits, top_k, renormalize, x.dtype)
    return fused_moe(x, w13, w2, weights, ids, **kwargs)


@dataclass(frozen=True)
class Epilogue:
    """What the GEMMs add to their products besides scales (fused_moe's arguments)."""

    w13_bias: torch.Tensor | None = None
    w2_bias: torch.Tensor | None = None
    activation: str = "silu"
    alpha: float = 1.702
    limit: float = 7.0


def _fused_pass(x, w13, w2, weights, ids, w13_scale, w2_scale, out, workspace,
                given=None, ep: Epilogue = Epilogue()) -> None:
    t, k = ids.shape
    num_experts, two_i, h = w13.shape
    pairs = t * k
    shared = max(two_i, h) * pairs
    cache1 = workspace[:pairs * two_i].view(pairs, two_i)
    cache2 = workspace[shared:shared + pairs * two_i // 2].view(pairs, two_i // 2)
    cache3 = workspace[:pairs * h].view(pairs, h)
    cfg1 = pick_config(t, k, w13, x.dtype)
    cfg2 = pick_config(t, k, w2, x.dtype)
    if given is not None and given[1] == cfg1.block_m:
        align = given[0]  # (routed_moe's, made with the routing)
    else:
        align = moe_align_block_size(ids, cfg1.block_m, num_experts)
    if t <= FUSE_SILU_TOKENS or ep.activation != "silu":
        # gate and up tiles of half the tuned width: the tuned tile's bytes, shared memory and
        # program count, and the activation in the epilogue (gpt-oss's always: it has no
        # kernel of its own)
        half = replace(cfg1, block_n=max(16, cfg1.block_n // 2))
        moe_gemm(x, w13, cache2, align, k, half, scale=w13_scale, gated=True, bias=ep.w13_bias,
                 activation=ep.activation, alpha=ep.alpha, limit=ep.limit)
    else:
        moe_gemm(x, w13, cache1, align, k, cfg1, scale=w13_scale, bias=ep.w13_bias)
        silu_and_mul(cache1, out=cache2)
    if cfg2.block_m != cfg1.block_m:
        align = moe_align_block_size(ids, cfg2.block_m, num_experts)
    moe_gemm(cache2, w2, cache3, align, 1, cfg2, scale=w2_scale,
             routed_weights=weights.view(-1), bias=ep.w2_bias)
    moe_sum(cache3, out, k)
