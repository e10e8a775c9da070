"""4-bit group quantization of one linear weight W [N, K] (nn.Linear's layout):
round-to-nearest, AWQ's activation-aware scale search and clipping, GPTQ's error correction.
Everything is float32 on the CPU; integer results are in input-channel order."""

from __future__ import annotations

from dataclasses import dataclass

import torch

MAXQ = 15


@dataclass(slots=True)
class Quantized:
    q: torch.Tensor  # [K, N] int32 0..15, row k = input channel k
    scales: torch.Tensor  # [groups, N] float32
    zeros: torch.Tensor  # [groups, N] int32
    g_idx: torch.Tensor  # [K] int64: group of input channel k

    def dequantize(self) -> torch.Tensor:  # [N, K] float32, like the weight it replaces
        s, z = self.scales[self.g_idx], self.zeros[self.g_idx].float()
        return ((self.q.float() - z) * s).t().contiguous()


def group_params(w: torch.Tensor, sym: bool, min_zero: int = 0) -> tuple[torch.Tensor, ...]:
    """w [N, g] -> scale [N], zero [N] for one group. Asymmetric: min/max (AWQ, RTN);
    symmetric: zero 8 (GPTQ's sym)."""
    if sym:
        scale = (w.abs().amax(1) * 2 / MAXQ).clamp(min=1e-8)
        return scale, torch.full_like(scale, (MAXQ + 1) // 2).int()
    lo, hi = w.amin(1), w.amax(1)
    scale = ((hi - lo) / MAXQ).clamp(min=1e-8)
    zero = torch.round(-lo / scale).clamp(min_zero, MAXQ).int()
    return scale, zero


def quantize_cols(w, scale, zero):
    """w [N, c] with per-row scale/zero -> q [N, c] int32 and its dequantized value."""
    q = torch.clamp(torch.round(w / scale[:, None]) + zero[:, None], 0, MAXQ)
    return q.int(), (q - zero[:, None]) * scale[:, None]


def _grouped(w: torch.Tensor, group_size: int) -> torch.Tensor:
    """[N, K] -> [N * groups, G]; a partial last group is padded with copies of its first
    column, so its min/max stay its own."""
    n, k = w.shape
    groups = -(-k // group_size)
    pad = groups * group_size - k
    if pad:
        w = torch.cat((w, w[:, (groups - 1) * group_size:][:, :1].expand(n, pad)), 1)
    return w.reshape(n * groups, group_size)


def rtn(w: torch.Tensor, group_size: int, sym: bool = False, min_zero: int = 0) -> Quantized:
    n, k = w.shape
    wg = _grouped(w, group_size)
    scale, zero = group_params(wg, sym, min_zero)
    q = quantize_cols(wg, scale, zero)[0].view(n, -1)[:, :k]
    g_idx = torch.arange(k) // group_size
    return Quantized(q.t().contiguous(), scale.view(n, -1).t().contiguous(),
                     zero.view(n, -1).t().contiguous(), g_idx)


def fake_quant(w: torch.Tensor, group_size: int) -> torch.Tensor:
    """Round-to-nearest then dequantize: [N, K] -> [N, K]."""
    wg = _grouped(w, group_size)
    scale, zero = group_params(wg, False)
    return quantize_cols(wg, scale, zero)[1].view(w.shape[0], -1)[:, : w.shape[1]]


def awq_scale_search(ws: list[torch.Tensor], x: torch.Tensor, group_size: int,
                     n_grid: int = 20, max_tokens: int = 512) -> torch.Tensor:
    """AWQ (Lin et al. 2023, sec. 3.2): s = mean|x|^alpha per input channel, alpha on a grid,
    minimising ||Q(W diag(s)) (diag(s)^-1 x) - W x|| over the linears sharing input x [T, K]
    (the loss on at most `max_tokens` evenly spaced tokens: the CPU budget)."""
    x_mean = x.abs().mean(0)
    x = x[:: max(1, x.shape[0] // max_tokens)]
    w = torch.cat(ws)
    ref = x @ w.t()
    best, best_s = float("inf"), torch.ones_like(x_mean)
    for i in range(n_grid):
        s = x_mean.pow(i / n_grid).clamp(min=1e-4)
        s = s / (s.max() * s.min()).sqrt()
        err = (x @ (fake_quant(w * s, group_size) / s).t() - ref).pow(2).mean().item()
        if err < best:
            best, best_s = err, s
    return best_s


def awq_clip(w: torch.Tensor, x: torch.Tensor, group_size: int, n_grid: int = 20,
             max_shrink: float = 0.5) -> torch.Tensor:
    """AWQ's clipping search: per (output channel, group), shrink the range to (1 - i/n_grid)
    of the max |w| where that lowers the output error. The error is weighted by E[x_k^2]
    (the diagonal of the input's second moment) instead of AutoAWQ's per-token replay."""
    n, k = w.shape
    x2 = x.pow(2).mean(0)  # [K]
    groups = -(-k // group_size)
    pad = groups * group_size - k

    def grouped(t):  # [N, K] -> [N, groups, G]
        return torch.nn.functional.pad(t, (0, pad)).view(n, groups, group_size)

    wg, x2g = grouped(w), grouped(x2[None].expand(n, k))
    limit = wg.abs().amax(-1, keepdim=True)
    best_err = torch.full((n, groups), float("inf"))
    best = w.clone()
    for i in range(int(max_shrink * n_grid)):
        bound = limit * (1 - i / n_grid)
        clipped = torch.maximum(torch.minimum(wg, bound), -bound).view(n, -1)[:, :k]
        dq = fake_quant(clipped, group_size)
        err = (grouped(dq - w).pow(2) * x2g).sum(-1)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        mask = better[:, :, None].expand(n, groups, group_size).reshape(n, -1)[:, :k]
        best = torch.where(mask, clipped, best)
    return best


def gptq(w: torch.Tensor, hessian: torch.Tensor, group_size: int, sym: bool = False,
         act_order: bool = True, block: int = 128, damp: float = 0.01,
         min_zero: int = 0) -> Quantized:
    """GPTQ (Frantar et al. 2022): quantize columns in order (act-order: by decreasing Hessian
    diagonal), spreading each column's error over the columns not yet quantized through the
    Cholesky factor of H^-1, with lazy block updates. Group parameters are taken at each
    group's first column, in the processing order (so act-order groups are contiguous there)."""
    if block % group_size:
        raise ValueError(f"block {block} must be a multiple of group_size {group_size}")
    w = w.clone().float()
    h = hessian.clone().double()
    n, k = w.shape
    dead = torch.diag(h) == 0
    h[dead, dead] = 1
    w[:, dead] = 0
    perm = torch.argsort(torch.diag(h), descending=True) if act_order else torch.arange(k)
    w, h = w[:, perm], h[perm][:, perm]
    h += damp * torch.diag(h).mean() * torch.eye(k, dtype=h.dtype)
    hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    hinv = hinv.float()
    q = torch.empty((n, k), dtype=torch.int32)
    scales, zeros = [], []
    for i1 in range(0, k, block):
        i2 = min(i1 + block, k)
        w1, hinv1 = w[:, i1:i2].clone(), hinv[i1:i2, i1:i2]
        err1 = torch.zeros_like(w1)
        for i in range(i2 - i1):
            if (i1 + i) % group_size == 0:
                scale, zero = group_params(w1[:, i:i + group_size], sym, min_zero)
                scales.append(scale)
                zeros.append(zero)
            col = w1[:, i]
            qi, dq = quantize_cols(col[:, None], scale, zero)
            q[:, i1 + i] = qi[:, 0]
            e = (col - dq[:, 0]) / hinv1[i, i]
            w1[:, i:] -= e[:, None] * hinv1[i, i:][None, :]
            err1[:, i] = e
        w[:, i2:] -= err1 @ hinv[i1:i2, i2:]
    inv = torch.argsort(perm)
    g_idx = (torch.arange(k) // group_size)[inv]
    return Quantized(q[:, inv].t().contiguous(), torch.stack(scales), torch.stack(zeros), g_idx)
