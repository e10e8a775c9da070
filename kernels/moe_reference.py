"""Mixture-of-experts in torch: top-k routing, the experts as a loop with index_add, and the
vLLM alignment of (token, slot) pairs by expert (the CPU path and the test oracle of
kernels/fused_moe.py).

Layout (HF transformers 5's MixtralExperts, vLLM's FusedMoE; a TP rank passes its own slices,
I = its share of the intermediate size):

    x            [T, H]      activations (fp32/bf16/fp16)
    w13          [E, 2I, H]  w13[e] = cat(gate_proj.weight, up_proj.weight): gate rows first
    w2           [E, H, I]   w2[e] = down_proj.weight (nn.Linear's [out, in])
    topk_weights [T, k]      float; topk_ids [T, k] int32/int64, each in [0, E)
    w13_scale    [E, 2I], w2_scale [E, H]  float32, with float8_e4m3fn weights: W = codes * scale
                             per output channel (weight-only FP8; activations stay as they are)
    w13_bias     [E, 2I], w2_bias [E, H]  x's dtype, optional (gpt-oss): added to each
                             expert's projections before the activation / the routing weight

    out[t] = sum_j topk_weights[t, j] * w2[e] @ act(gate[e] @ x[t], up[e] @ x[t]),
             e = topk_ids[t, j]

act: "silu", silu(gate) * up; or "swiglu_oai" (gpt-oss's, with alpha and limit): gate
clamped to <= limit and up to [-limit, limit], then (up + 1) * gate * sigmoid(alpha * gate).

Roundings follow the Triton path: the gate/up projection and the activation in x's dtype, each
expert's weighted down projection rounded to x's dtype, the k contributions summed in float32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedserve.kernels._checks import FLOAT_DTYPES, check_out, check_tensor
from pagedserve.kernels.fp8_reference import FP8
from pagedserve.kernels.reference import silu_and_mul

ACTIVATIONS = ("silu", "swiglu_oai")


def swiglu_oai(x: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:  # [T, 2I] -> [T, I]
    """gpt-oss's gated activation over [gate | up] halves (HF's GptOssExperts._apply_gate once
    its interleaved columns are split), in x's dtype as HF computes it."""
    gate, up = x.chunk(2, dim=-1)
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def moe_route(
    router_logits: torch.Tensor,  # [T, E] float
    top_k: int,
    renormalize: bool,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:  # ([T, k] dtype, [T, k] int32)
    """Softmax over the experts in float32, the top k (torch.topk: its order and ties), then,
    if asked, the k weights divided by their sum: HF's Mixtral (always), Qwen2-MoE and
    Qwen3-MoE (config.norm_topk_prob) routers, and vLLM's fused_topk. HF's Qwen routers then
    round the weights to the logits' dtype; these are float32 (vLLM keeps them so) unless
    dtype asks for the rounding."""
    check_tensor("router_logits", router_logits, 2, FLOAT_DTYPES)
    num_experts = router_logits.shape[1]
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k {top_k} must be in 1..{num_experts} (the experts)")
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(dtype), ids.to(torch.int32)


def routed_moe(x: torch.Tensor, router_logits: torch.Tensor, top_k: int, renormalize: bool,
               w13: torch.Tensor, w2: torch.Tensor, **kwargs) -> torch.Tensor:
    """The experts of x routed by router_logits: moe_route (weights in x's dtype, as HF's
    routers round them), then fused_moe."""
    weights, ids = moe_route(router_logits, top_k, renormalize, x.dtype)
    return fused_moe(x, w13, w2, weights, ids, **kwargs)


def check_moe_args(x, w13, w2, topk_weights, topk_ids, activation, w13_scale, w2_scale,
                   out, w13_bias=None, w2_bias=None) -> tuple[int, int, int, int, int]:
    """(T, H, E, I, k) of a valid call; anything else raises ValueError."""
    check_tensor("x", x, 2, FLOAT_DTYPES)
    dev, (t, h) = x.device, x.shape
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation {activation!r} not in {ACTIVATIONS}")
    fp8 = w13_scale is not None
    if (w2_scale is not None) != fp8:
        raise ValueError("w13_scale and w2_scale come together (FP8 weights) or not at all")
    wdt = (FP8,) if fp8 else (x.dtype,)
    check_tensor("w13", w13, 3, wdt, dev)
    check_tensor("w2", w2, 3, wdt, dev)
    e, two_i, _ = w13.shape
    if two_i % 2 or tuple(w13.shape) != (e, two_i, h) or tuple(w2.shape) != (e, h, two_i // 2):
        raise ValueError(f"w13 {tuple(w13.shape)} and w2 {tuple(w2.shape)} must be [E, 2I, H] "
                         f"and [E, H, I] with H = {h} (x's last dim)")
    check_tensor("topk_weights", topk_weights, 2, FLOAT_DTYPES, dev)
    check_tensor("topk_ids", topk_ids, 2, (torch.int32, torch.int64), dev)
    k = topk_ids.shape[1]
    if topk_ids.shape[0] != t or tuple(topk_weights.shape) != tuple(topk_ids.shape) or k < 1:
        raise ValueError(f"topk_weights {tuple(topk_weights.shape)} and topk_ids "
                         f"{tuple(topk_ids.shape)} must both be [{t}, k], k >= 1")
    if fp8:
        check_tensor("w13_scale", w13_scale, 2, (torch.float32,), dev)
        check_tensor("w2_scale", w2_scale, 2, (torch.float32,), dev)
        if tuple(w13_scale.shape) != (e, two_i) or tuple(w2_scale.shape) != (e, h):
            raise ValueError(f"w13_scale {tuple(w13_scale.shape)} and w2_scale "
                             f"{tuple(w2_scale.shape)} must be [{e}, {two_i}] and [{e}, {h}]")
    for name, b, width in (("w13_bias", w13_bias, two_i), ("w2_bias", w2_bias, h)):
        if b is not None:
            check_tensor(name, b, 2, (x.dtype,), dev)
            if tuple(b.shape) != (e, width) or not b.is_contiguous():
                raise ValueError(f"{name} {tuple(b.shape)} must be a contiguous [{e}, {width}]")
    if out is not None:
        check_out("out", out, (t, h), x.dtype, dev)
    return t, h, e, two_i // 2, k


def _linear(a: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """a @ w.T in float32: FP8 codes (exact in a float32 matmul) times their channel scales."""
    if scale is None:
        return F.linear(a, w).float()
    return F.linear(a.float(), w.float()) * scale


def fused_moe(
    x: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2I, H]
    w2: torch.Tensor,  # [E, H, I]
    topk_weights: torch.Tensor,  # [T, k]
    topk_ids: torch.Tensor,  # [T, k]
    *,
    activation: str = "silu",
    w13_scale: torch.Tensor | None = None,  # [E, 2I] float32, FP8 w13
    w2_scale: torch.Tensor | None = None,  # [E, H] float32, FP8 w2
    w13_bias: torch.Tensor | None = None,  # [E, 2I] x.dtype
    w2_bias: torch.Tensor | None = None,  # [E, H] x.dtype
    alpha: float = 1.702,  # swiglu_oai's
    limit: float = 7.0,
    out: torch.Tensor | None = None,  # [T, H] x.dtype
) -> torch.Tensor:  # [T, H] x.dtype
    t, h, e, _, k = check_moe_args(x, w13, w2, topk_weights, topk_ids, activation, w13_scale,
                                   w2_scale, out, w13_bias, w2_bias)
    acc = torch.zeros((t, h), dtype=torch.float32, device=x.device)
    flat_ids = topk_ids.reshape(-1).long()
    flat_w = topk_weights.reshape(-1).float()
    order = torch.argsort(flat_ids, stable=True)  # pairs grouped by expert
    counts = torch.bincount(flat_ids, minlength=e).tolist()
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        pairs = order[start:start + count]
        start += count
        tokens = pairs // k
        s13 = None if w13_scale is None else w13_scale[expert]
        s2 = None if w2_scale is None else w2_scale[expert]
        gate_up = _linear(x[tokens], w13[expert], s13)
        if w13_bias is not None:
            gate_up = gate_up + w13_bias[expert].float()
        gate_up = gate_up.to(x.dtype)
        act = silu_and_mul(gate_up) if activation == "silu" \
            else swiglu_oai(gate_up, alpha, limit)
        y = _linear(act, w2[expert], s2)
        if w2_bias is not None:
            y = y + w2_bias[expert].float()
        y = y * flat_w[pairs, None]
        acc.index_add_(0, tokens, y.to(x.dtype).float())
    if out is None:
        return acc.to(x.dtype)
    return out.copy_(acc)


def align_block_size_capacity(numel: int, block_m: int, num_experts: int) -> int:
    """Length of sorted_token_ids, a multiple of block_m: the worst case of the padded total
    (each expert hit adds at most block_m - 1 padding slots; at most min(E, numel) are hit), so
    the launch grid depends on shapes only, never on where the tokens went (CUDA graphs)."""
    worst = numel + min(num_experts, numel) * (block_m - 1)
    return -(-worst // block_m) * block_m


def moe_align_block_size(
    topk_ids: torch.Tensor,  # [T, k] int, each in [0, E)
    block_m: int,
    num_experts: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """vLLM's alignment in torch ops (no host sync). The T*k pairs p = t*k + j, sorted by
    expert (stable: by p within one), each expert's run padded to a multiple of block_m:

        sorted_token_ids [C] int32    pair ids; padding slots hold T*k   (C: the capacity)
        expert_ids       [C/block_m]  int32, the expert of each block (blocks past the end:
                                      clamped to E-1; the GEMM skips them)
        num_tokens_post_padded [1]    int32, the padded total
    """
    dev = topk_ids.device
    flat = topk_ids.reshape(-1).long()
    numel = flat.numel()
    cap = align_block_size_capacity(numel, block_m, num_experts)
    counts = torch.zeros(num_experts, dtype=torch.long, device=dev)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0)
    order = torch.argsort(flat, stable=True)
    # sorted position p goes to p + (its expert's padded start - its unpadded start)
    delta = ends - padded - (counts.cumsum(0) - counts)
    dest = torch.arange(numel, device=dev) + delta[flat[order]]
    sorted_ids = torch.full((cap,), numel, dtype=torch.int32, device=dev)
    sorted_ids.scatter_(0, dest, order.to(torch.int32))
    starts = torch.arange(0, cap, block_m, device=dev)
    expert_ids = torch.searchsorted(ends, starts, right=True).clamp_(max=num_experts - 1)
    return sorted_ids, expert_ids.to(torch.int32), ends[-1:].to(torch.int32)
