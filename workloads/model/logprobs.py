"""Token log-probabilities and entropies straight from the final hidden states, without ever holding the
float32 `[tokens, vocabulary]` logits: the lm_head, log-softmax, target gather and entropy run over chunks of
tokens, and the backward recomputes each chunk's logits instead of keeping them. At Qwen3's vocabulary (151,936)
the plain computation keeps several float32 copies of the logits (the log-softmax, its exp, the entropy product)
per token; this keeps three float32 numbers per token plus one chunk's logits at a time.

Gradients, per token with z = logits / temperature, p = softmax(z), H = -sum p log p:
  d log p[target] / dz = onehot(target) - p,     dH / dz = -p (log p + H)
so one recomputed chunk of p gives both."""
from __future__ import annotations

from typing import Callable

import torch

# A chunk's logits are at most this many elements. On a GPU (one Triton pass each way, in place over the bf16
# logits) a chunk is 2 GiB: every chunk's weight-gradient product is added into the float32 [V, h] gradient, a
# read-modify-write of the whole lm_head gradient (1.2 GB at Qwen3's shape), so fewer, larger chunks save that
# traffic (at 2^28 elements it was ~40 ms of a 65k-token step). Elsewhere the plain computation keeps several
# float32 copies of a chunk: 1 GiB each.
CHUNK_ELEMENTS = {"cuda": 2**30}
DEFAULT_CHUNK_ELEMENTS = 2**28


def default_chunk_tokens(vocab_size: int, device: str = "cpu") -> int:
    return max(1, CHUNK_ELEMENTS.get(device, DEFAULT_CHUNK_ELEMENTS) // vocab_size)


def inverse_temperatures(temperature: float | torch.Tensor, rows: int, device: torch.device) -> torch.Tensor:
    """1 / temperature per row, float32 [rows], from one temperature or one per row: computed on the device in
    float32 the same way for every caller, so the trainer's one temperature and the engine's per-row ones scale
    a row's logits by the same bits."""
    if not isinstance(temperature, torch.Tensor):
        temperature = torch.full((rows,), temperature, dtype=torch.float32, device=device)
    return torch.reciprocal(temperature.to(device, torch.float32))


def softmax_stats(logits: torch.Tensor, targets: torch.Tensor, temperature: float | torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits [n, V] -> (log p[target], entropy, log-sum-exp) of softmax(logits / temperature), float32 [n];
    temperature: one, or one per row [n]. Row by row in a fixed order whatever the other rows (the trainer's
    scoring and the rollout sampler's reported logprobs both come from here). On GPUs one Triton pass
    (moe_rl_eks.kernels.logprobs); elsewhere in torch, scaled as the kernel scales (by the same inverse)."""
    inv_t = inverse_temperatures(temperature, logits.shape[0], logits.device)
    if logits.is_cuda:
        from moe_rl_eks.kernels.logprobs import softmax_stats as fused

        return fused(logits, targets, inv_t)
    z = logits.float() * inv_t[:, None]
    lse = torch.logsumexp(z, dim=-1)
    entropy = lse - (torch.exp(z - lse[:, None]) * z).sum(dim=-1)
    return z.gather(1, targets[:, None]).squeeze(1) - lse, entropy, lse


def logit_grads_(logits: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor, entropy: torch.Tensor,
                 g_logp: torch.Tensor, g_ent: torch.Tensor, temperature: float) -> torch.Tensor:
    """The gradient wrt logits [n, V] of sum(g_logp * log p[target] + g_ent * entropy), in the logits' dtype;
    it may reuse (overwrite) the logits' storage."""
    if logits.is_cuda:
        from moe_rl_eks.kernels.logprobs import logit_grads_ as fused

        return fused(logits, targets, lse, entropy, g_logp, g_ent, temperature)
    logp = logits.float().div_(temperature).sub_(lse[:, None])
    p = logp.exp()
    dz = logp.add_(entropy[:, None]).mul_(p).mul_(-g_ent[:, None]).sub_(p.mul_(g_logp[:, None]))
    dz.scatter_add_(1, targets[:, None], g_logp[:, None])
    return dz.div_(temperature).to(logits.dtype)


@torch.no_grad()  # values only: _ChunkedLogProbs' backward makes the gradient
def chunked_softmax_stats(hidden: torch.Tensor, head: Callable[[torch.Tensor], torch.Tensor], targets: torch.Tensor,
                          temperature: float, chunk: int) -> torch.Tensor:
    """hidden [n, h] -> float32 [3, n]: (log p[target], entropy, lse) per row, as softmax_stats of head(hidden)
    (the logits [rows, V] of rows of hidden), `chunk` rows of logits at a time, never all n. Where `head` is a row-wise
    product (a row's logits independent of the other rows, as the exact backend's invariant matmul), a row's numbers
    are the same bits whatever the chunking: softmax_stats is row-wise too."""
    n = hidden.shape[0]
    stats = hidden.new_empty(3, n, dtype=torch.float32)
    for start in range(0, n, chunk):
        end = min(start + chunk, n)
        logits = head(hidden[start:end])
        for row, value in zip(stats, softmax_stats(logits, targets[start:end], temperature)):
            row[start:end] = value
        del logits
    return stats


class _ChunkedLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, chunk, compute_dtype, head):
        w = weight.to(compute_dtype)
        logp, entropy, lse = chunked_softmax_stats(hidden, head or (lambda rows: rows.to(compute_dtype) @ w.t()),
                                                   targets, temperature, chunk)
        ctx.save_for_backward(hidden, weight, targets, lse, entropy)
        ctx.temperature, ctx.chunk, ctx.compute_dtype = temperature, chunk, compute_dtype
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        hidden, weight, targets, lse, entropy = ctx.saved_tensors
        chunk, dtype = ctx.chunk, ctx.compute_dtype
        w = weight.to(dtype)
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if ctx.needs_input_grad[1] else None
        g_logp = grad_logp if grad_logp is not None else torch.zeros_like(lse)
        g_ent = grad_entropy if grad_entropy is not None else torch.zeros_like(lse)
        for start in range(0, hidden.shape[0], chunk):
            end = min(start + chunk, hidden.shape[0])
            h = hidden[start:end].to(dtype)
            # the chunk's logits again (recomputed, never kept), overwritten by their gradient
            dlogits = logit_grads_(h @ w.t(), targets[start:end], lse[start:end], entropy[start:end],
                                   g_logp[start:end], g_ent[start:end], ctx.temperature)
            if grad_hidden is not None:
                grad_hidden[start:end] = dlogits @ w
            if grad_weight is not None:
                # Rounded to the compute dtype per chunk, as nn.Linear's weight gradient is under autocast.
                grad_weight.add_(dlogits.t() @ h)
            del dlogits
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None, None


def token_logprobs_and_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                               temperature: float = 1.0, chunk_tokens: int | None = None,
                               head: Callable[[torch.Tensor], torch.Tensor] | None = None
                               ) -> tuple[torch.Tensor, torch.Tensor]:
    """hidden [..., h] (the final normed hidden states), weight [V, h] (the lm_head), targets [...] ->
    (log p(target) [...], entropy [...]) in float32, of softmax(hidden @ weight.T / temperature).

    The products run in the autocast dtype when autocast is on (as `nn.Linear` would), else in the weight's dtype;
    the softmax and everything after it in float32. Gradients flow to `hidden` and `weight`. `head`: the forward's
    logits of a chunk of rows of hidden instead (a row-wise product with weight: the exact backend's, so that the
    values are the rollout engine's bits); the backward recomputes them with the torch product above, the standard
    formula (the exact mode's differentiable trainer forward, trainer/numerics.py)."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, not {temperature}")
    shape = targets.shape
    if hidden.shape[:-1] != shape:
        raise ValueError(f"hidden {tuple(hidden.shape)} and targets {tuple(shape)} disagree on the token dims")
    device = hidden.device.type
    compute = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else weight.dtype
    chunk = chunk_tokens or default_chunk_tokens(weight.shape[0], device)
    with torch.autocast(device, enabled=False):
        logp, entropy = _ChunkedLogProbs.apply(hidden.reshape(-1, hidden.shape[-1]), weight,
                                               targets.reshape(-1), float(temperature), chunk, compute, head)
    return logp.view(shape), entropy.view(shape)
