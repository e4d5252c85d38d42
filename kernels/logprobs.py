"""The elementwise half of token log-probabilities and entropies over a chunk of logits, in one pass each way
(the matmuls stay with cuBLAS; moe_rl_eks.workloads.model.logprobs drives the chunks).

Per row, z = logits * inv_temperature (read in the logits' dtype, computed in float32):
  softmax_stats: one online pass over the vocabulary -> lse = log sum exp z, entropy H = lse - sum p z, and
                 log p[target] = z[target] - lse. Reads the logits once; writes three floats per row.
  logit_grads_:  d(g_logp . log p[target] + g_ent . H) / d logits, written over the logits in place:
                 (g_logp (onehot - p) - g_ent p (log p + H)) / temperature. Reads and writes the logits once.
The plain torch computation makes about ten float32 passes over the chunk for the same numbers."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._triton import INTERPRET, check_device

BLOCK_V = 256 if INTERPRET else 4096


@triton.jit
def _stats_kernel(logits, stride, targets, logp_out, entropy_out, lse_out, vocab, inv_temperature,
                  BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = logits + row * stride
    inv_t = tl.load(inv_temperature + row)
    offs = tl.arange(0, BLOCK)
    m = tl.full([BLOCK], float("-inf"), tl.float32)  # per-lane running max, sum of exp, sum of exp * z
    s = tl.zeros([BLOCK], tl.float32)
    w = tl.zeros([BLOCK], tl.float32)
    for start in range(0, vocab, BLOCK):
        cols = start + offs
        z = tl.load(base + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32) * inv_t
        m_new = tl.maximum(m, z)
        # lanes that have seen only -inf padding keep m_new = -inf: guard the exp of (-inf) - (-inf)
        scale = tl.where(m_new == float("-inf"), 0.0, tl.exp(m - m_new))
        e = tl.where(cols < vocab, tl.exp(z - m_new), 0.0)
        s = s * scale + e
        w = w * scale + e * tl.where(cols < vocab, z, 0.0)
        m = m_new
    m_row = tl.max(m, 0)
    lane = tl.where(m == float("-inf"), 0.0, tl.exp(m - m_row))
    total = tl.sum(s * lane, 0)
    lse = m_row + tl.log(total)
    entropy = lse - tl.sum(w * lane, 0) / total
    target = tl.load(targets + row)
    z_target = tl.load(base + target).to(tl.float32) * inv_t
    tl.store(logp_out + row, z_target - lse)
    tl.store(entropy_out + row, entropy)
    tl.store(lse_out + row, lse)


@triton.jit
def _grads_kernel(logits, stride, targets, lse, entropy, g_logp, g_ent, vocab, inv_t, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ptr = logits + row * stride + cols
    inside = cols < vocab
    logp = tl.load(ptr, mask=inside, other=0.0).to(tl.float32) * inv_t - tl.load(lse + row)
    p = tl.exp(logp)
    gl, ge = tl.load(g_logp + row), tl.load(g_ent + row)
    dz = -gl * p - ge * p * (logp + tl.load(entropy + row))
    dz += tl.where(cols == tl.load(targets + row), gl, 0.0)
    tl.store(ptr, (dz * inv_t).to(logits.dtype.element_ty), mask=inside)


def softmax_stats(logits: torch.Tensor, targets: torch.Tensor, inv_temperature: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits [n, V] (rows contiguous), targets [n], 1 / temperature per row float32 [n] (moe_rl_eks.workloads.
    model.logprobs.inverse_temperatures) -> (log p[target], entropy, lse), float32 [n] each. One program per row, the vocabulary in BLOCK_V steps from 0: a row's numbers do not
    depend on the other rows (the exact numerics mode's sampler and trainer share it)."""
    check_device("logits", logits)
    n, vocab = logits.shape
    out = torch.empty(3, n, device=logits.device, dtype=torch.float32)
    if n:
        _stats_kernel[(n,)](logits, logits.stride(0), targets, out[0], out[1], out[2], vocab,
                            inv_temperature, BLOCK=BLOCK_V)
    return out[0], out[1], out[2]


def logit_grads_(logits: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor, entropy: torch.Tensor,
                 g_logp: torch.Tensor, g_ent: torch.Tensor, temperature: float) -> torch.Tensor:
    """Overwrite logits [n, V] with the gradient of sum(g_logp * log p[target] + g_ent * entropy) wrt them."""
    check_device("logits", logits)
    n, vocab = logits.shape
    if n:
        _grads_kernel[(n, triton.cdiv(vocab, BLOCK_V))](logits, logits.stride(0), targets, lse, entropy,
                                                        g_logp.contiguous(), g_ent.contiguous(), vocab,
                                                        1.0 / temperature, BLOCK=BLOCK_V)
    return logits
