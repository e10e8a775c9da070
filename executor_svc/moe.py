"""The mixture-of-experts MLP: a router picks top_k experts per token, the fused-MoE op runs
them (kernels: routed_moe, that is moe_route then fused_moe, for a softmax router; GLM-4.5's
grouped sigmoid router and ERNIE 4.5's biased softmax in torch, then fused_moe), Qwen2-MoE
adds a gated shared expert, GLM-4.5 and ERNIE 4.5 ungated ones.

    gate               [E, hidden]          the router (replicated on every rank); a biased
                                            router's in float32 with e_score_correction_bias [E]
    w13                [E, 2 * I, hidden]   each expert's gate rows then up rows
    w2                 [E, hidden, I]       each expert's down projection
    shared_expert      a dense MLP          Qwen2-MoE: out += sigmoid(shared_expert_gate(x)) * it
    w13_bias, w2_bias  [E, 2I], [E, hidden] gpt-oss: added to the experts' projections (its
                                            router has a bias too, and its activation is
                                            "swiglu_oai": moe.activation)

With tensor parallelism every rank holds every expert's slice of the width I (gate, up and
down alike, as a dense MLP splits), and one all_reduce sums the experts and the shared expert.

FP8 (--quantization fp8 of a float checkpoint): w13 and w2 hold e4m3 codes with a float32
scale per output channel (w13_scale [E, 2I], w2_scale [E, hidden]), quantized at load as the
dense FP8 layers are; the fused-MoE op widens each weight tile and applies the scales in its
epilogue (weight-only: the activations stay in the model's dtype).
"""

from __future__ import annotations

import torch
from torch import nn

from pagedserve.executor import tp_layers as tp
from pagedserve.executor.config import ModelConfig
from pagedserve.executor.families import Moe
from pagedserve.executor.layers import MLP, Linear, Ops
from pagedserve.executor.quantization import QuantConfig
from pagedserve.kernels.fp8_reference import FP8, quantize_weight


class SparseMoe(nn.Module):
    def __init__(self, cfg: ModelConfig, ops: Ops, quant: QuantConfig | None = None) -> None:
        super().__init__()
        moe = cfg.moe
        assert moe is not None
        e, i, h = moe.num_experts, moe.intermediate_size, cfg.hidden_size
        # 4-bit checkpoints: the experts arrive dequantized (quantization.convert_checkpoint)
        # and are served in float, the shared expert 4-bit; FP8 ones arrive as the float
        # weights their codes hold (quantization.fp8.convert_fp8), quantized again in place
        self.fp8 = quant is not None and quant.method == "fp8"
        self.gate = Linear(h, e, bias=moe.biases)
        codes = {"dtype": FP8} if self.fp8 else {}
        self.w13 = nn.Parameter(torch.empty(e, 2 * i, h, **codes), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(e, h, i, **codes), requires_grad=False)
        self.w13_scale = self.w2_scale = None
        if self.fp8:
            self.w13_scale = nn.Parameter(torch.ones(e, 2 * i), requires_grad=False)
            self.w2_scale = nn.Parameter(torch.ones(e, h), requires_grad=False)
            self.fixed_dtypes = ("w13", "w2", "w13_scale", "w2_scale")  # loader._cast
        # gpt-oss: biases on each expert's projections, in the activations' dtype (as HF's);
        # with tensor parallelism w2_bias is rank 0's alone (the all_reduce adds the ranks)
        self.w13_bias = self.w2_bias = None
        if moe.biases:
            self.w13_bias = nn.Parameter(torch.empty(e, 2 * i), requires_grad=False)
            self.w2_bias = nn.Parameter(torch.empty(e, h), requires_grad=False)
        self.shared_expert = self.shared_expert_gate = None
        if moe.shared_intermediate_size:
            self.shared_expert = MLP(cfg, ops, quant, width=moe.shared_intermediate_size)
            if moe.shared_gated:
                self.shared_expert_gate = Linear(h, 1, bias=False)
        if moe.router_float32:  # Hunyuan's: weight and logits in float32, whatever the model's
            self.gate.fixed_dtypes = ("weight",)
        if moe.scoring in ("sigmoid", "softmax_bias"):  # biased, in float32 as HF keeps it
            self.gate.e_score_correction_bias = nn.Parameter(torch.zeros(e),
                                                             requires_grad=False)
            self.gate.fixed_dtypes = ("weight", "e_score_correction_bias")
        self.top_k, self.renormalize, self.moe = moe.top_k, moe.renormalize, moe
        self.ops, self.cfg = ops, cfg

    def biased_route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] in x's dtype, expert ids [T, k]) of a router that chooses with a
        correction bias: DeepSeek-V3's as GLM-4.5 has it (sigmoid scores; the experts chosen
        by score + bias within the topk_group groups whose two best sum highest) or ERNIE
        4.5's (softmax scores, chosen by score + bias); weighted by the plain scores,
        renormalized where the model does, times routed_scaling."""
        moe, gate = self.moe, self.gate
        logits = torch.nn.functional.linear(x.float(), gate.weight.float())
        scores = logits.sigmoid() if moe.scoring == "sigmoid" else logits.softmax(-1)
        choice = scores + gate.e_score_correction_bias.float()
        if moe.n_group > 1:
            choice = choice.masked_fill(_outside_groups(choice, moe, True), float("-inf"))
        ids = choice.topk(moe.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, ids)
        if moe.renormalize:
            total = weights.sum(-1, keepdim=True)
            weights = weights / (total.clamp(min=moe.norm_min) if moe.norm_min else total + 1e-20)
        return (weights * moe.routed_scaling).to(x.dtype), ids

    def grouped_route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """DeepSeek V2's router as HF's DeepseekV2TopkRouter: softmax scores in float32, the
        top k of them (within the topk_group groups of the best single score where n_group >
        1: "group_limited_greedy"; "greedy" is one group), not renormalized, times
        routed_scaling; Mistral 4's ("softmax_groups_top2") ranks the groups by their best
        two scores' sum and renormalizes where the config says. (weights [T, k] in x's
        dtype, expert ids [T, k])."""
        moe = self.moe
        scores = torch.nn.functional.linear(x.float(), self.gate.weight.float()).softmax(-1)
        if moe.n_group > 1:
            scores = scores.masked_fill(
                _outside_groups(scores, moe, moe.scoring == "softmax_groups_top2"), 0.0)
        weights, ids = scores.topk(moe.top_k, dim=-1, sorted=False)
        if moe.renormalize:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return (weights * moe.routed_scaling).to(x.dtype), ids

    def place(self, which: str, expert: int, rows: tuple[int, int] | None,
              weight: torch.Tensor) -> None:
        """Store one expert's float weight ([out, in]: `rows` of w13, or all of w2),
        quantizing it per output channel when the experts are FP8."""
        dst = getattr(self, which).data[expert]
        scale = None if not self.fp8 else getattr(self, f"{which}_scale").data[expert]
        if rows is not None:
            dst = dst.narrow(0, *rows)
            scale = None if scale is None else scale.narrow(0, *rows)
        if dst.shape != weight.shape:
            raise ValueError(f"expert {expert} {which}: shape {tuple(weight.shape)} != "
                             f"{tuple(dst.shape)}")
        if scale is None:
            dst.copy_(weight)
            return
        q, s = quantize_weight(weight.to(dst.device))
        dst.copy_(q)
        scale.copy_(s)

    def fill_random(self, gen: torch.Generator) -> None:
        """N(0, 0.02) float experts, quantized as at load (benchmarks' random weights)."""
        for which in ("w13", "w2"):
            w = getattr(self, which)
            for e in range(w.shape[0]):
                f = torch.empty(w.shape[1:], dtype=torch.bfloat16, device=w.device)
                self.place(which, e, None, f.normal_(0.0, 0.02, generator=gen))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden]
        # HF combines the experts with the weights in the activations' dtype: the router
        # stores them so (a cast launch a layer less)
        extra = {"w13_scale": self.w13_scale, "w2_scale": self.w2_scale} if self.fp8 else {}
        if self.w13_bias is not None:
            extra.update(w13_bias=self.w13_bias, w2_bias=self.w2_bias)
        if self.moe.activation != "silu":
            extra.update(activation=self.moe.activation, alpha=self.moe.swiglu_alpha,
                         limit=self.moe.swiglu_limit)
        if self.moe.scoring != "softmax":  # routed here, then the experts
            weights, ids = (sparsemixer(self.gate(x), self.moe.jitter_eps)
                            if self.moe.scoring == "sparsemixer"
                            else self.grouped_route(x)
                            if self.moe.scoring.startswith("softmax_groups")
                            else self.biased_route(x))
            y = self.ops.fused_moe(x, self.w13, self.w2, weights, ids, **extra)
        else:
            logits = (torch.nn.functional.linear(x.float(), self.gate.weight)
                      if self.moe.router_float32 else self.gate(x))
            y = self.ops.routed_moe(x, logits, self.top_k, self.renormalize, self.w13,
                                    self.w2, **extra)
        if self.shared_expert is not None:
            shared = self.shared_expert(x, reduce=False)
            y = y + (shared if self.shared_expert_gate is None
                     else torch.sigmoid(self.shared_expert_gate(x)) * shared)
        return tp.all_reduce(y, self.cfg)


def _outside_groups(scores: torch.Tensor, moe: Moe, best_two: bool) -> torch.Tensor:
    """[T, E] bool: the experts outside the topk_group of n_group groups that rank highest by
    their best two scores' sum (DeepSeek V3's, Mistral 4's) or their best one (DeepSeek
    V2's group_limited_greedy)."""
    grouped = scores.view(-1, moe.n_group, moe.num_experts // moe.n_group)
    rank = grouped.topk(2, dim=-1)[0].sum(-1) if best_two else grouped.amax(-1)  # [T, groups]
    keep = torch.zeros_like(rank).scatter_(
        1, rank.topk(moe.topk_group, dim=-1, sorted=False)[1], 1.0)
    return (keep[:, :, None].expand_as(grouped) == 0).reshape_as(scores)


def sparsemixer(logits: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Phi-3.5-MoE's top-2 router as HF evaluates it (no sampling): the best expert, weighted
    by the softmax over the experts within 2 eps (relative) of its logit; then the best of the
    others, weighted alike over those within 2 eps of it (the first excluded). Weights in the
    logits' dtype, ids int32."""
    ids, weights = [], []
    masked = logits
    for _ in range(2):
        best, idx = masked.max(dim=-1, keepdim=True)
        far = (best - logits) / logits.abs().clamp(min=best) > 2 * eps
        weights.append(masked.masked_fill(far, float("-inf")).softmax(-1).gather(-1, idx))
        ids.append(idx)
        masked = masked.scatter(-1, idx, float("-inf"))
    return torch.cat(weights, -1), torch.cat(ids, -1).to(torch.int32)
