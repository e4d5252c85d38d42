"""The `triton` MoE compute backend: the MoECompute contract of moe_rl_eks.workloads.moe.compute, on the kernels of
this package. kernels never imports workloads; `spec` is any object with RoutingSpec's attributes."""
from __future__ import annotations

import torch

from .expert_decode import DECODE_MAX_TOKENS, decode_experts, supports
from .gemv import decode_linear
from .grouped_gemm import swiglu_experts
from .norm_training import rms_norm_training
from .permute import PermuteHandle, permute, unpermute
from .routing import route


class TritonCompute:
    """Routing, permutation and SwiGLU experts as Triton kernels with autograd; no host synchronisation."""

    def route(self, logits: torch.Tensor, spec, bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        return route(logits, spec, bias)

    def permute(self, x: torch.Tensor, ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, PermuteHandle]:
        return permute(x, ids, num_experts)

    def unpermute(self, y_sorted: torch.Tensor, weights: torch.Tensor, handle: PermuteHandle) -> torch.Tensor:
        return unpermute(y_sorted, weights, handle)

    def experts(self, x_sorted: torch.Tensor, counts: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
        return swiglu_experts(x_sorted, counts, w13, w2)

    def decode(self, x: torch.Tensor, router: torch.Tensor, spec, bias: torch.Tensor | None, w13: torch.Tensor,
               w2: torch.Tensor, logits: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """A decode step's whole MoE layer on one rank, without autograd: router weight [E, h] -> (out [T, h],
        expert ids [T, k], router logits [T, E] (`logits` when given)), or None where the grouped path is faster
        (more than DECODE_MAX_TOKENS tokens) or the routing is not supported."""
        if x.shape[0] > DECODE_MAX_TOKENS or not supports(spec, bias):
            return None
        logits = decode_linear(x, router) if logits is None else logits
        out, _, ids = decode_experts(x, logits, spec, bias, w13, w2)
        return out, ids, logits

    # Beyond the MoE contract (the model uses it when a backend has it): RMSNorm, or q/k RMSNorm followed by the
    # rotary embedding, forward and backward one kernel each, for mixed-precision training.
    def norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float, out_dtype: torch.dtype,
             rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        return rms_norm_training(x, weight, eps, out_dtype, rope)
