"""The mixture-of-experts MLP: a softmax router picks top_k experts per token, the fused-MoE
op runs them (kernels: moe_route, fused_moe), Qwen2-MoE adds a gated shared expert.

    gate               [E, hidden]          the router (replicated on every rank)
    w13                [E, 2 * I, hidden]   each expert's gate rows then up rows
    w2                 [E, hidden, I]       each expert's down projection
    shared_expert      a dense MLP          Qwen2-MoE: out += sigmoid(shared_expert_gate(x)) * it

With tensor parallelism every rank holds every expert's slice of the width I (gate, up and
down alike, as a dense MLP splits), and one all_reduce sums the experts and the shared expert.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedserve.executor import tp_layers as tp
from pagedserve.executor.config import ModelConfig
from pagedserve.executor.layers import MLP, Ops


class SparseMoe(nn.Module):
    def __init__(self, cfg: ModelConfig, ops: Ops) -> None:
        super().__init__()
        moe = cfg.moe
        assert moe is not None
        e, i, h = moe.num_experts, moe.intermediate_size, cfg.hidden_size
        self.gate = nn.Linear(h, e, bias=False)
        self.w13 = nn.Parameter(torch.empty(e, 2 * i, h))
        self.w2 = nn.Parameter(torch.empty(e, h, i))
        self.shared_expert = self.shared_expert_gate = None
        if moe.shared_intermediate_size:
            self.shared_expert = MLP(cfg, ops, width=moe.shared_intermediate_size)
            self.shared_expert_gate = nn.Linear(h, 1, bias=False)
        self.top_k, self.renormalize = moe.top_k, moe.renormalize
        self.ops, self.cfg = ops, cfg

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden]
        logits = self.gate(x)
        weights, ids = self.ops.moe_route(logits, self.top_k, self.renormalize)
        # HF combines the experts with the weights in the activations' dtype
        y = self.ops.fused_moe(x, self.w13, self.w2, weights.to(x.dtype), ids)
        if self.shared_expert is not None:
            y = y + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x, reduce=False)
        return tp.all_reduce(y, self.cfg)
