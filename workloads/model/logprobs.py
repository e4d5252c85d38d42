"""Token log-probabilities and entropies straight from the final hidden states, without ever holding the
float32 `[tokens, vocabulary]` logits: the lm_head, log-softmax, target gather and entropy run over chunks of
tokens, and the backward recomputes each chunk's logits instead of keeping them. At Qwen3's vocabulary (151,936)
the plain computation keeps several float32 copies of the logits (the log-softmax, its exp, the entropy product)
per token; this keeps three float32 numbers per token plus one chunk's logits at a time.

Gradients, per token with z = logits / temperature, p = softmax(z), H = -sum p log p:
  d log p[target] / dz = onehot(target) - p,     dH / dz = -p (log p + H)
so one recomputed chunk of p gives both."""
from __future__ import annotations

import torch

# A chunk's float32 logits are at most this many elements (1 GiB); the backward holds about three such buffers.
CHUNK_ELEMENTS = 2**28


def default_chunk_tokens(vocab_size: int) -> int:
    return max(1, CHUNK_ELEMENTS // vocab_size)


def _chunk_logits(hidden: torch.Tensor, weight: torch.Tensor, temperature: float) -> torch.Tensor:
    """[n, h] x [V, h] -> float32 [n, V] logits / temperature, the product in the operands' (compute) dtype."""
    return (hidden @ weight.t()).float().div_(temperature)


class _ChunkedLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, chunk, compute_dtype):
        n = hidden.shape[0]
        w = weight.to(compute_dtype)
        logp = hidden.new_empty(n, dtype=torch.float32)
        entropy = hidden.new_empty(n, dtype=torch.float32)
        lse = hidden.new_empty(n, dtype=torch.float32)
        for start in range(0, n, chunk):
            end = min(start + chunk, n)
            z = _chunk_logits(hidden[start:end].to(compute_dtype), w, temperature)
            chunk_lse = torch.logsumexp(z, dim=-1)
            lse[start:end] = chunk_lse
            logp[start:end] = z.gather(1, targets[start:end, None]).squeeze(1) - chunk_lse
            p = torch.exp(z - chunk_lse[:, None])
            entropy[start:end] = chunk_lse - (p * z).sum(dim=-1)
            del z, p
        ctx.save_for_backward(hidden, weight, targets, lse, entropy)
        ctx.temperature, ctx.chunk, ctx.compute_dtype = temperature, chunk, compute_dtype
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        hidden, weight, targets, lse, entropy = ctx.saved_tensors
        t, chunk, dtype = ctx.temperature, ctx.chunk, ctx.compute_dtype
        n = hidden.shape[0]
        w = weight.to(dtype)
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if ctx.needs_input_grad[1] else None
        g_logp = grad_logp if grad_logp is not None else torch.zeros_like(lse)
        g_ent = grad_entropy if grad_entropy is not None else torch.zeros_like(lse)
        for start in range(0, n, chunk):
            end = min(start + chunk, n)
            h = hidden[start:end].to(dtype)
            z = _chunk_logits(h, w, t)
            logp_all = z.sub_(lse[start:end, None])  # log p, in place of z
            p = logp_all.exp()
            # dz = g_logp (onehot - p) - g_ent p (log p + H), built in place over log p
            ent = entropy[start:end, None]
            dz = logp_all.add_(ent).mul_(p).mul_(-g_ent[start:end, None])
            dz.sub_(p.mul_(g_logp[start:end, None]))
            dz.scatter_add_(1, targets[start:end, None], g_logp[start:end, None].to(dz.dtype))
            del p
            dlogits = dz.div_(t).to(dtype)
            if grad_hidden is not None:
                grad_hidden[start:end] = (dlogits @ w).to(hidden.dtype)
            if grad_weight is not None:
                # Rounded to the compute dtype per chunk, as nn.Linear's weight gradient is under autocast.
                grad_weight.add_(dlogits.t() @ h)
            del dz, dlogits, z
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None


def token_logprobs_and_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                               temperature: float = 1.0, chunk_tokens: int | None = None
                               ) -> tuple[torch.Tensor, torch.Tensor]:
    """hidden [..., h] (the final normed hidden states), weight [V, h] (the lm_head), targets [...] ->
    (log p(target) [...], entropy [...]) in float32, of softmax(hidden @ weight.T / temperature).

    The products run in the autocast dtype when autocast is on (as `nn.Linear` would), else in the weight's dtype;
    the softmax and everything after it in float32. Gradients flow to `hidden` and `weight`."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, not {temperature}")
    shape = targets.shape
    if hidden.shape[:-1] != shape:
        raise ValueError(f"hidden {tuple(hidden.shape)} and targets {tuple(shape)} disagree on the token dims")
    device = hidden.device.type
    compute = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else weight.dtype
    chunk = chunk_tokens or default_chunk_tokens(weight.shape[0])
    with torch.autocast(device, enabled=False):
        logp, entropy = _ChunkedLogProbs.apply(hidden.reshape(-1, hidden.shape[-1]), weight,
                                               targets.reshape(-1), float(temperature), chunk, compute)
    return logp.view(shape), entropy.view(shape)
