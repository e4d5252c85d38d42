"""The `triton` and `exact` compute backends: the MoECompute contract of moe_rl_eks.workloads.moe.compute and the ForwardKernels
contract of moe_rl_eks.workloads.model.forward_kernels, on the kernels of this package. kernels never imports
workloads; `spec` is any object with RoutingSpec's attributes, a norm any object with `weight` and `eps`."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .decode_attention import decode_attention
from .expert_decode import DECODE_MAX_TOKENS, decode_experts, layout_free, supports
from .gemv import decode_linear
from .grouped_gemm import swiglu_experts
from .invariant_attention import invariant_decode_attention, invariant_prefill_attention
from .invariant_matmul import invariant_matmul
from .kv_write import write_kv
from .norm_training import rms_norm_training
from .permute import PermuteHandle, permute, unpermute
from .prefill_attention import prefill_attention, prefill_tiles
from .rmsnorm import add_rms_norm_project, rms_norm
from .routing import route

# Up to this many tokens the router product is fused into the norm before it (its few rows per program spread
# over the GPU); more tokens amortise one GEMM. (The MoE decode kernels have their own cut-over, DECODE_MAX_TOKENS.)
FUSED_ROUTER_TOKENS = 16


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

    def linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.linear(x, weight)  # cuBLAS (the shared experts' products: their rows are many)

    exact = False  # the decode kernels' products: row sums (or the exact mode's tensor-core tiles)

    def decode(self, x: torch.Tensor, router: torch.Tensor, spec, bias: torch.Tensor | None, w13: torch.Tensor,
               w2: torch.Tensor, logits: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """A decode step's whole MoE layer on one rank, without autograd: router weight [E, h] -> (out [T, h],
        expert ids [T, k], router logits [T, E] (`logits` when given)), or None where the grouped path is faster
        (more than DECODE_MAX_TOKENS tokens) or the routing is not supported."""
        if x.shape[0] > DECODE_MAX_TOKENS or not supports(spec, bias) or (self.exact and not layout_free(spec, bias)):
            return None
        if logits is None:
            logits = invariant_matmul(x, router) if self.exact else decode_linear(x, router)
        out, _, ids = decode_experts(x, logits, spec, bias, w13, w2, exact=self.exact)
        return out, ids, logits

    # Beyond the MoE contract (the model uses it when a backend has it): RMSNorm, or q/k RMSNorm followed by the
    # rotary embedding, forward and backward one kernel each, for mixed-precision training.
    def norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float, out_dtype: torch.dtype,
             rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        return rms_norm_training(x, weight, eps, out_dtype, rope)


class TritonForwardKernels:
    """The rollout engine's paged forward on this package's kernels: norms with the residual add and the rotary
    embedding fused in, attention read through the block tables (only the positions each token sees: static shapes,
    so CUDA graphs replay a decode step), and products at a few rows where they beat cuBLAS."""

    def add_norm(self, norm, h: torch.Tensor, delta: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        if delta is None:
            return rms_norm(h, norm.weight, norm.eps), h
        return rms_norm(delta, norm.weight, norm.eps, residual=h)

    def add_norm_router(self, norm, router: torch.Tensor, h: torch.Tensor, delta: torch.Tensor
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        # at the few tokens of a decode step, one kernel for all three; else the norm alone (the MoE block routes)
        if h.numel() // h.shape[-1] <= FUSED_ROUTER_TOKENS and router.dtype == h.dtype:
            return add_rms_norm_project(delta, h, norm.weight, norm.eps, router)
        return (*self.add_norm(norm, h, delta), None)

    def norm_rope(self, norm, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, norm.weight, norm.eps, rope=(cos, sin))

    def qk_norm_rope(self, q_norm, k_norm, weights: torch.Tensor, qk: torch.Tensor, heads: int,
                     cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if q_norm.eps != k_norm.eps:  # one launch takes one eps
            return self.norm_rope(q_norm, qk[..., :heads, :], cos, sin), self.norm_rope(k_norm, qk[..., heads:, :],
                                                                                        cos, sin)
        qk = rms_norm(qk, weights, q_norm.eps, rope=(cos, sin), second_weight_from=heads)
        return qk[..., :heads, :], qk[..., heads:, :]

    def linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return decode_linear(x, weight)

    def prefill_tiles(self, segments: list[tuple[int, int]], device: torch.device) -> torch.Tensor:
        return prefill_tiles(segments, device)

    # A decode step's attention (one token per row): split over positions, flash-decoding
    decode_attention = staticmethod(decode_attention)
    # A prefill's: a program per tile of a row's tokens, one walk over its keys
    prefill_attention = staticmethod(prefill_attention)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
               block: torch.Tensor, offset: torch.Tensor, tables: torch.Tensor, slot: torch.Tensor,
               positions: torch.Tensor, key_len: int, tiles: torch.Tensor | None, seen: torch.Tensor) -> torch.Tensor:
        write_kv(keys, values, k, v, block, offset)
        if tiles is not None:
            return self.prefill_attention(q, keys, values, tables, slot, positions, tiles)
        return self.decode_attention(q, keys, values, tables, slot, seen)


class ExactCompute(TritonCompute):
    """The exact numerics mode's MoE compute: the experts' forward on the grouped GEMM's exact tiles, and a decode
    step's few tokens through the decode kernels' exact form, whose tensor-core products give a token the grouped
    GEMM's bits (expert_decode.py), so a decoded token's layer output is a prefill's or a trainer's forward's; a
    routing whose fused form is not the route kernel's bits (not `layout_free`) decodes through the grouped path."""

    exact = True

    def experts(self, x_sorted: torch.Tensor, counts: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
        return swiglu_experts(x_sorted, counts, w13, w2, exact=True)

    def linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return invariant_matmul(x, weight)  # a shared expert's row: the same bits in a decode step and a prefill


class ExactForwardKernels(TritonForwardKernels):
    """The paged forward of the exact numerics mode: every product (q/k/v, o, the router, the LM head) through
    invariant_matmul and attention through the prefill kernel in fixed chunks of positions, so a token's logits
    are the same bits whether it was prefilled or decoded, and whatever rows shared its step. The norms are the
    triton backend's (batch-invariant already), without the router product fused into the norm at a few rows."""

    def add_norm_router(self, norm, router: torch.Tensor, h: torch.Tensor, delta: torch.Tensor
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x, h = self.add_norm(norm, h, delta)
        return x, h, invariant_matmul(x, router)

    # decode rows as one-token tiles of the prefill kernel, their keys in the chunks and order a prefill takes
    decode_attention = staticmethod(invariant_decode_attention)
    prefill_attention = staticmethod(invariant_prefill_attention)

    def linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return invariant_matmul(x, weight)
