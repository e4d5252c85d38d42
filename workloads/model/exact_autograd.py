"""The paged forward made differentiable over a pool of packed sequences (paged_forward.sequence_hidden): a
ForwardKernels whose every op is an autograd Function. Its forward is the wrapped backend's own call (on the
`exact` backend the engine's kernels, so the engine's bits); its backward is the standard gradient of that op at
the forward's inputs, in PyTorch:
- products (`linear`): the exact backend's invariant_matmul has its own (kernels/invariant_matmul.py: gx = gy @ W
  and gW = gy^T @ x, torch matmuls in the operands' dtype, as nn.Linear's under autocast), which the MoE layer's
  shared experts take through ExactCompute.linear too;
- norms, the q/k norms with the rotary embedding, the norm with the router product: recomputed at the saved inputs
  through the trainer's fused training norm (kernels/norm_training.py, one kernel each way, float32 inside: what
  the fast forward's norms run under autocast) and differentiated;
- attention (`attend`, which also writes the new keys and values into the pool, so that they are its inputs):
  causal attention recomputed per sequence with PyTorch's SDPA (transformer.packed_attention, flash kernels on
  GPUs) and differentiated: one attention forward per layer more than the fast path, whose backward reads the
  forward's log-sum-exp (the exact kernel keeps none).
The gradient is thus the standard formula's at the exact forward's activations, not the derivative of the exact
kernels' rounding: what a fast forward's backward computes, at its own activations. An op over no tokens (an
expert-parallel rank without any, which still runs the backward for its all-to-alls) has zero gradients."""
from __future__ import annotations

from typing import Callable

import torch

from moe_rl_eks.kernels.norm_training import rms_norm_training

from .forward_kernels import ForwardKernels
from .transformer import packed_attention


class _Recomputed(torch.autograd.Function):
    """forward: `exact(*inputs)`; backward: the vector-Jacobian product of `reference(*inputs)` (the same function
    in PyTorch, outputs in the order of exact's) at the saved inputs."""

    @staticmethod
    def forward(ctx, exact: Callable, reference: Callable, *inputs: torch.Tensor):
        ctx.reference = reference
        ctx.save_for_backward(*inputs)
        return exact(*inputs)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        wanted = ctx.needs_input_grad[2:]
        saved = ctx.saved_tensors
        if saved[0].numel() == 0:
            return None, None, *(torch.zeros_like(t) if w else None for t, w in zip(saved, wanted))
        inputs = [t.detach().requires_grad_(w) for t, w in zip(saved, wanted)]
        with torch.enable_grad():
            outputs = ctx.reference(*inputs)
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        found = iter(torch.autograd.grad(outputs, [t for t in inputs if t.requires_grad],
                                         [g.to(o.dtype) for o, g in zip(outputs, grads)], allow_unused=True))
        return None, None, *(next(found) if w else None for w in wanted)


def reference_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
                   rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """weight * RMSNorm(x) in x's dtype (then rotary(., cos, sin) with `rope`), with the fused training backward."""
    return rms_norm_training(x, weight, eps, x.dtype, rope)


def reference_add_norm(h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(h + delta), h + delta): the residual's gradient is the sum of both outputs'."""
    h = h + delta
    return reference_norm(h, weight, eps), h


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """q [N, H, D], k and v [N, H_kv, D] of sequences of `lengths` packed back to back -> [N, H, D]: causal
    attention within each sequence, the trainer's fast forward's."""
    out = packed_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], lengths,
                           q.shape[1] != k.shape[1])
    return out[0]


class DifferentiableKernels:
    """`exact`'s ops with the gradients above, for a forward over a SequencePool of sequences of
    `sequence_lengths` (the attention's backward knows the sequences by them)."""

    def __init__(self, exact: ForwardKernels, sequence_lengths: list[int]) -> None:
        self.exact, self.lengths = exact, list(sequence_lengths)

    def add_norm(self, norm, h: torch.Tensor, delta: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        if delta is None:
            return _Recomputed.apply(lambda h, w: self.exact.add_norm(norm, h, None)[0],
                                     lambda h, w: reference_norm(h, w, norm.eps), h, norm.weight), h
        return _Recomputed.apply(lambda h, d, w: self.exact.add_norm(norm, h, d),
                                 lambda h, d, w: reference_add_norm(h, d, w, norm.eps), h, delta, norm.weight)

    def add_norm_router(self, norm, router: torch.Tensor, h: torch.Tensor, delta: torch.Tensor
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        def reference(h, d, w, r):
            x, h = reference_add_norm(h, d, w, norm.eps)
            return x, h, x @ r.t()

        return _Recomputed.apply(lambda h, d, w, r: self.exact.add_norm_router(norm, r, h, d), reference,
                                 h, delta, norm.weight, router)

    def norm_rope(self, norm, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return _Recomputed.apply(lambda x, w: self.exact.norm_rope(norm, x, cos, sin),
                                 lambda x, w: reference_norm(x, w, norm.eps, (cos, sin)), x, norm.weight)

    def qk_norm_rope(self, q_norm, k_norm, weights: torch.Tensor, qk: torch.Tensor, heads: int,
                     cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        def reference(qk, w):
            return (reference_norm(qk[..., :heads, :], w[0], q_norm.eps, (cos, sin)),
                    reference_norm(qk[..., heads:, :], w[1], k_norm.eps, (cos, sin)))

        return _Recomputed.apply(lambda qk, w: self.exact.qk_norm_rope(q_norm, k_norm, w, qk, heads, cos, sin),
                                 reference, qk, weights)

    def linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return self.exact.linear(x, weight)  # invariant_matmul: differentiable itself

    def prefill_tiles(self, segments: list[tuple[int, int]], device: torch.device) -> torch.Tensor | None:
        return self.exact.prefill_tiles(segments, device)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
               block: torch.Tensor, offset: torch.Tensor, tables: torch.Tensor, slot: torch.Tensor,
               positions: torch.Tensor, key_len: int, tiles: torch.Tensor | None, seen: torch.Tensor) -> torch.Tensor:
        def exact(q, k, v):
            return self.exact.attend(q, k, v, keys, values, block, offset, tables, slot, positions, key_len, tiles,
                                     seen)

        return _Recomputed.apply(exact, lambda q, k, v: reference_attention(q, k, v, self.lengths), q, k, v)
