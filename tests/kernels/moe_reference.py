"""Plain-torch fp32 references for the kernel tests, written from the MoECompute contract's docstrings."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from moe_rl_eks.kernels.bench import Spec  # noqa: F401  the duck-typed RoutingSpec the tests build specs with


def route(logits, spec, bias=None):
    logits = logits.float()
    scores = logits.softmax(-1) if spec.scoring == "softmax" else logits.sigmoid()
    select = scores.detach() + (bias if bias is not None else 0)
    T, E = logits.shape
    if spec.n_group > 1:
        grouped = select.view(T, spec.n_group, E // spec.n_group)
        group_score = grouped.topk(min(2, E // spec.n_group), dim=-1).values.sum(-1)
        keep = torch.zeros(T, spec.n_group).scatter_(1, group_score.topk(spec.topk_group, dim=-1).indices, 1.0)
        select = select.masked_fill(keep.repeat_interleave(E // spec.n_group, dim=1) == 0, float("-inf"))
    ids = select.topk(spec.top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if spec.renormalize:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * spec.scaling, ids


def permute(x, ids, num_experts):
    order = torch.argsort(ids.reshape(-1), stable=True)
    return x[order // ids.shape[1]], torch.bincount(ids.reshape(-1), minlength=num_experts), order


def unpermute(y_sorted, weights, order):
    T, k = weights.shape
    out = torch.zeros(T, y_sorted.shape[1], dtype=torch.float32)
    contrib = y_sorted.float() * weights.reshape(-1)[order, None].float()
    return out.index_add(0, order // k, contrib)


def experts(x_sorted, counts, w13, w2):
    outs, start = [], 0
    width = w2.shape[2]
    for e, n in enumerate(counts.tolist()):
        x_e = x_sorted[start:start + n].float()
        gate_up = x_e @ w13[e].float().t()
        outs.append((F.silu(gate_up[:, :width]) * gate_up[:, width:]) @ w2[e].float().t())
        start += n
    return torch.cat(outs)
