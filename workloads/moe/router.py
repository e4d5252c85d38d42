"""Routing as small pure functions: router logits -> (weights, expert ids), the node limit, replayed weights,
the load-balancing loss and expert-load counts. The `torch` compute backend's `route` is `select_experts`."""
from __future__ import annotations

import math

import torch

from .compute import RoutingSpec


def expert_scores(logits: torch.Tensor, spec: RoutingSpec) -> torch.Tensor:
    """[T, E] router logits -> [T, E] float32 affinities (softmax over experts, or per-expert sigmoid)."""
    logits = logits.float()
    return logits.softmax(-1) if spec.scoring == "softmax" else logits.sigmoid()


def limit_to_groups(choice: torch.Tensor, groups: int, keep: int, per_group_top: int) -> torch.Tensor:
    """Mask (-inf) every expert outside the `keep` best of `groups` contiguous expert ranges; a range scores the
    sum of its `per_group_top` best entries. -inf rather than DeepSeek-V3's 0.0, so a negative biased score in a
    kept group can never lose to an expert of a dropped group."""
    t, e = choice.shape
    grouped = choice.view(t, groups, e // groups)
    group_score = grouped.topk(min(per_group_top, e // groups), dim=-1).values.sum(-1)
    kept = torch.zeros(t, groups, dtype=torch.bool, device=choice.device)
    kept.scatter_(1, group_score.topk(keep, dim=-1).indices, True)
    return grouped.masked_fill(~kept.unsqueeze(-1), float("-inf")).view(t, e)


def node_limit_bias(logits: torch.Tensor, spec: RoutingSpec, bias: torch.Tensor | None, node_groups: int,
                    max_nodes: int) -> torch.Tensor:
    """Node-limited routing as a per-token selection bias [T, E]: 0 on the experts of the token's `max_nodes`
    best nodes (contiguous expert ranges, scored by the sum of their top ceil(k / max_nodes) selection scores as
    in DeepSeek-V3), -inf elsewhere, plus the router's own bias. Like that bias it steers selection only."""
    choice = expert_scores(logits, spec)
    if bias is not None:
        choice = choice + bias
    limited = limit_to_groups(choice, node_groups, max_nodes, math.ceil(spec.top_k / max_nodes))
    node_bias = torch.where(torch.isinf(limited), float("-inf"), 0.0)
    return node_bias if bias is None else node_bias + bias


def weights_for(scores: torch.Tensor, ids: torch.Tensor, spec: RoutingSpec) -> torch.Tensor:
    """Routing weights of the chosen experts: gathered unbiased scores, renormalised, times the scaling factor.
    Used both after selection and for replayed expert ids (the weights keep their gradient to the router)."""
    weights = scores.gather(1, ids)
    if spec.renormalize:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * spec.scaling


def select_experts(logits: torch.Tensor, spec: RoutingSpec, bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] -> (weights [T, k] float32, ids [T, k] int64). `bias` ([E], or [T, E] with -inf for
    forbidden experts) is added for selection only; groups are contiguous ranges when spec.n_group > 1."""
    scores = expert_scores(logits, spec)
    choice = scores if bias is None else scores + bias
    if spec.n_group > 1:
        choice = limit_to_groups(choice, spec.n_group, spec.topk_group, per_group_top=2)
    ids = choice.topk(spec.top_k, dim=-1).indices
    return weights_for(scores, ids, spec), ids


def expert_load(ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """[T, k] expert ids -> [E] float32 count of (token, slot) pairs per expert, without a host sync."""
    flat = ids.reshape(-1)
    return torch.zeros(num_experts, device=ids.device).scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.float32))


def load_balancing_loss(scores: torch.Tensor, ids: torch.Tensor, spec: RoutingSpec) -> torch.Tensor:
    """Switch-Transformer balance loss E * sum_e f_e * P_e: f_e the share of (token, slot) pairs sent to expert
    e, P_e the mean normalised affinity (softmax probabilities; sigmoid scores divided by their sum, as in
    DeepSeek-V3's sequence-wise loss). 1.0 when perfectly balanced."""
    num_experts = scores.shape[-1]
    if scores.shape[0] == 0:
        return scores.sum() * 0.0
    f = expert_load(ids, num_experts) / ids.numel()
    probs = scores if spec.scoring == "softmax" else scores / scores.sum(-1, keepdim=True)
    return num_experts * (f * probs.mean(0)).sum()


def balance_bias_step(bias: torch.Tensor, load: torch.Tensor, rate: float) -> torch.Tensor:
    """DeepSeek-V3's auxiliary-loss-free balancing: raise the selection bias of experts loaded below the mean
    by `rate`, lower those above it. `load` [E] must count the whole batch (all EP ranks' tokens)."""
    return bias + rate * torch.sign(load.float().mean() - load.float())
