"""Activation checkpointing for the exact numerics mode's differentiable forward (numerics.ExactScorer.forward),
where the policy checkpoints its layers: each layer's forward runs on the exact kernels for the values and keeps
only its input; the backward recomputes the policy's own layer (the fast kernels, bf16 autocast over the float32
masters, flash attention) from that input, with the exact forward's routing replayed, and differentiates it. That
is the standard step's backward, at the exact forward's activations: the exact forward replaces the standard
step's first forward and nothing more, and the layers' gradients land on the policy's masters directly (the
copy's embedding, final norm and LM head hand theirs over, numerics.hand_gradients_to). Under save_attention the
recomputation runs the layer's attention too: the exact kernel's output is no use to flash attention's backward,
which needs its own log-sum-exp.

A layer's input is the exact forward's residual pair (h, delta), whose sum the layer's first norm takes; every
consumer of its output pair adds the two first, so both carry one gradient, the recomputed layer's output's."""
from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from ..model import MoETransformer
from ..model.rotary import rotary
from ..model.transformer import DecoderLayer
from ..moe.layer import MoEOutput


class _PolicyLayer(torch.autograd.Function):
    """forward: exact(h, delta) -> (h, delta, MoEOutput), of which (h, delta, balance loss) are its outputs;
    backward: fast(h + delta, the routed expert ids) -> (output, balance loss) recomputed and differentiated."""

    @staticmethod
    def forward(ctx, exact: Callable, fast: Callable, h: torch.Tensor, delta: torch.Tensor | None):
        h_out, delta_out, moe = exact(h, delta)
        ctx.fast, ctx.ids = fast, moe.ids
        ctx.save_for_backward(h, delta)
        return h_out, delta_out, moe.aux_loss

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor, _grad_delta: torch.Tensor, grad_aux: torch.Tensor):
        h, delta = ctx.saved_tensors
        # the exact norm's residual add, rounded alike (a float32 add rounded to h's dtype)
        x = (h if delta is None else h + delta).detach().requires_grad_()
        with torch.enable_grad():
            out, aux = ctx.fast(x, ctx.ids)
        pairs = [(t, g.to(t.dtype)) for t, g in ((out, grad_out), (aux, grad_aux)) if t.requires_grad]
        torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])
        grad = x.grad if x.grad is not None else torch.zeros_like(x)  # no tokens on this rank: nothing reached x
        return None, None, grad, None if delta is None else grad


def policy_recompute(policy: MoETransformer, sequence_lengths: list[int], autocast: bool
                     ) -> Callable[[Callable, int, torch.Tensor, torch.Tensor | None],
                                   tuple[torch.Tensor, torch.Tensor, MoEOutput]]:
    """paged_hidden's `run_layer` for a micro-batch of sequences of `sequence_lengths` packed back to back: layer
    i's values from the exact forward, its backward the policy's layer i (under bf16 autocast where `autocast`)."""
    lengths = [int(n) for n in sequence_lengths]
    device = next(policy.parameters()).device
    counts = torch.tensor(lengths, dtype=torch.long)
    positions = torch.arange(sum(lengths)) - torch.repeat_interleave(torch.cumsum(counts, 0) - counts, counts)
    cos, sin = rotary(positions.to(device)[None], policy.config.head_dim, policy.config.rope_theta, torch.float32)

    def fast(i: int, x: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            # the class's forward: the layer's own checkpointing wrapper would recompute it once more
            out, _, aux, _ = DecoderLayer.forward(policy.model.layers[i], x.float()[None], cos, sin, None, ids,
                                                  lengths)
        return out[0], aux

    def run_layer(exact: Callable, i: int, h: torch.Tensor, delta: torch.Tensor | None
                  ) -> tuple[torch.Tensor, torch.Tensor, MoEOutput]:
        outputs: list[MoEOutput] = []

        def exact_layer(h: torch.Tensor, delta: torch.Tensor | None) -> tuple:
            h, delta, moe = exact(i, h, delta)
            outputs.append(moe)
            return h, delta, moe

        h, delta, aux = _PolicyLayer.apply(exact_layer, lambda x, ids: fast(i, x, ids), h, delta)
        return h, delta, dataclasses.replace(outputs[0], aux_loss=aux)

    return run_layer
