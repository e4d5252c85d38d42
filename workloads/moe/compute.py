"""The contract between the MoE layer and whoever computes its hot path (the `torch` backend here, the `triton`
backend in moe_rl_eks.kernels). Shapes: T tokens, h hidden, E experts (local experts for `experts`), k top-k,
I expert width. Every op supports autograd where its inputs require grad, takes and returns tensors on the same
device, and never synchronises with the host.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Literal, Protocol

import torch


@dataclass(frozen=True)
class RoutingSpec:
    """How router logits become (weights, expert ids). Group-limited selection (DeepSeek-V3) picks the best
    `topk_group` of `n_group` contiguous expert groups, scoring a group by the sum of its best two (biased)
    scores, then the top-k experts inside them. The bias (sigmoid router) steers selection only."""

    top_k: int
    scoring: Literal["softmax", "sigmoid"]
    n_group: int = 1
    topk_group: int = 1
    renormalize: bool = True
    scaling: float = 1.0


class MoECompute(Protocol):
    def route(self, logits: torch.Tensor, spec: RoutingSpec, bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """logits [T, E] -> (weights [T, k] float32, expert ids [T, k] int64)."""

    def permute(self, x: torch.Tensor, ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """x [T, h], ids [T, k] -> (x_sorted [T*k, h] grouped by expert id ascending, stable in (token, slot)
        order; counts [num_experts] int64; handle for unpermute)."""

    def unpermute(self, y_sorted: torch.Tensor, weights: torch.Tensor, handle: Any) -> torch.Tensor:
        """y_sorted [T*k, h], weights [T, k] -> out [T, h] = sum_j weights[t, j] * y of (t, j); computed in
        float32, returned in y_sorted's dtype."""

    def experts(self, x_sorted: torch.Tensor, counts: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
        """SwiGLU experts over an expert-sorted batch. x_sorted [N, h]; counts [E] (sum = N, zeros allowed);
        w13 [E, 2I, h] (rows 0..I-1 gate_proj, I..2I-1 up_proj, nn.Linear layout); w2 [E, h, I] (down_proj).
        Returns [N, h]: row r of expert e is down_e(silu(gate_e(x_r)) * up_e(x_r))."""

    def linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """x [..., in] -> x @ weight.T [..., out] (weight [out, in], nn.Linear's layout): the shared experts'
        dense products, row-invariant where the backend's numerics need them to be."""

    # The backend's fused training RMSNorm (forward and backward one kernel each, the model's numerics; optionally
    # followed by the rotary embedding), or None where the model's own ops compute it:
    # norm(x, weight, eps, out_dtype, rope=(cos, sin) | None) -> x normed, in out_dtype.
    norm: Callable[..., torch.Tensor] | None

    def decode(self, x: torch.Tensor, router: torch.Tensor, spec: RoutingSpec, bias: torch.Tensor | None,
               w13: torch.Tensor, w2: torch.Tensor, logits: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """A decode step's whole MoE layer on one rank, without autograd: router weight [E, h] -> (out [T, h],
        expert ids [T, k], router logits [T, E] (`logits` when given)), or None where the backend has no faster
        path for these tokens (the MoE block then routes, permutes and computes the experts)."""
