"""The sampler: a token per row from its logits and its own sampling parameters, with no host synchronisation,
and the counter-based randomness it draws from (Philox4x32-10 of (seed, row, step)), so a row's draws do not depend
on which rows shared its steps."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..model.logprobs import softmax_stats
from .engine_api import SamplingParams

# ---- counter-based randomness ----------------------------------------------------------------------------
_MASK32 = 0xFFFFFFFF
_PHILOX_M = (0xD2511F53, 0xCD9E8D57)
_PHILOX_W = (0x9E3779B9, 0xBB67AE85)


def philox4x32(counter: tuple[torch.Tensor, ...], key: tuple[torch.Tensor, torch.Tensor], rounds: int = 10
               ) -> tuple[torch.Tensor, ...]:
    """Philox4x32-10 (Salmon et al., Random123) on int64 tensors (or numpy uint64 arrays) holding 32-bit words. The
    32 x 32-bit products wrap modulo 2**64, which keeps both of their 32-bit halves exact."""
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for r in range(rounds):
        if r:
            k0, k1 = (k0 + _PHILOX_W[0]) & _MASK32, (k1 + _PHILOX_W[1]) & _MASK32
        p0, p1 = c0 * _PHILOX_M[0], c2 * _PHILOX_M[1]
        c0, c1, c2, c3 = ((p1 >> 32) & _MASK32) ^ c1 ^ k0, p1 & _MASK32, ((p0 >> 32) & _MASK32) ^ c3 ^ k1, p0 & _MASK32
    return c0, c1, c2, c3


def row_uniform(key_lo: torch.Tensor, key_hi: torch.Tensor, row: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """One uniform in [0, 1) per row from (seed, row, step): the seed's two 32-bit words are the key. On a CPU the
    same function runs on numpy's uint64 arrays (one vectorised op per word instead of a tensor op's overhead); on
    a GPU in one Triton kernel (kernels/philox.py; tested bitwise against this path)."""
    if key_lo.is_cuda:
        from moe_rl_eks.kernels.philox import row_uniform as philox_kernel

        return philox_kernel(key_lo, key_hi, row, step)
    import numpy as np

    lo, hi, r, t = (x.numpy().astype(np.uint64) for x in (key_lo, key_hi, row, step))
    word = philox4x32((t & _MASK32, r & _MASK32, t >> 32, np.zeros_like(r)), (lo, hi))[0]
    return torch.from_numpy((word >> 8).astype(np.float32) * np.float32(1.0 / (1 << 24)))


# ---- sampling ------------------------------------------------------------------------------------------------
@dataclass
class Sampled:
    tokens: torch.Tensor  # [B] int64
    logprobs: torch.Tensor  # [B] float32
    top_ids: torch.Tensor | None  # [B, K] int64
    top_logprobs: torch.Tensor | None  # [B, K] float32


@dataclass
class SamplingRows:
    """Per-row sampling parameters as device tensors [B], plus host flags that let the sampler skip work no row
    asked for."""

    temperature: torch.Tensor
    top_p: torch.Tensor
    top_k: torch.Tensor  # int64, 0 = off
    min_p: torch.Tensor
    raw: torch.Tensor  # bool: logprob_mode == "raw"
    key_lo: torch.Tensor  # int64 words of the seed
    key_hi: torch.Tensor
    row: torch.Tensor  # int64
    step: torch.Tensor  # int64: index of the token being sampled in the completion
    filtered: bool  # some row has top-k, top-p < 1 or min-p > 0
    any_raw: bool
    top_n: int  # the largest top_logprobs asked for


def sample(logits: torch.Tensor, rows: SamplingRows) -> Sampled:
    """logits [B, V] -> a token per row and its logprob, with no host synchronisation. A row samples from
    softmax(logits / temperature) cut by top-k, then top-p (of what top-k kept), then min-p, renormalised
    (inverse CDF of its own counter-based uniform); temperature 0 takes the argmax. Its logprob is under that
    processed distribution (temperature 0 counting as 1), or under softmax(logits) for logprob_mode "raw".
    A row whose reported distribution is the unfiltered softmax at a temperature (every RL row) has its logprob
    from the trainer's own row-wise log-softmax (model/logprobs.softmax_stats), so that in the exact numerics mode,
    where the logits agree bitwise, the logprobs do too."""
    scored = logits
    logits = logits.float()
    vocab = logits.shape[-1]
    greedy = rows.temperature == 0
    scaled = logits / torch.where(greedy, 1.0, rows.temperature)[:, None]
    logp = torch.log_softmax(scaled, -1)
    if rows.filtered:
        sorted_logp, order = logp.sort(dim=-1, descending=True, stable=True)
        rank = torch.arange(vocab, device=logits.device)
        keep = rank[None, :] < torch.where(rows.top_k > 0, rows.top_k, vocab)[:, None]
        p = sorted_logp.exp() * keep
        p = p / p.sum(-1, keepdim=True)
        keep &= (p.cumsum(-1) - p < rows.top_p[:, None]) | (rows.top_p[:, None] >= 1)
        keep &= sorted_logp >= sorted_logp[:, :1] + torch.log(rows.min_p)[:, None]  # p >= min_p * p_max
        kept = torch.zeros_like(keep).scatter(-1, order, keep)  # back to vocabulary order
        logp = torch.log_softmax(scaled.masked_fill(~kept, float("-inf")), -1)
    cdf = logp.exp().cumsum(-1)
    u = row_uniform(rows.key_lo, rows.key_hi, rows.row, rows.step)
    drawn = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).clamp(max=vocab - 1)[:, 0]
    tokens = torch.where(greedy, logits.argmax(-1), drawn)
    logprobs = softmax_stats(scored, tokens, torch.where(greedy | rows.raw, 1.0, rows.temperature))[0]
    if rows.filtered:  # rows whose filters cut the distribution report under what they kept
        cut = ((rows.top_k > 0) | (rows.top_p < 1) | (rows.min_p > 0)) & ~rows.raw
        logprobs = torch.where(cut, logp.gather(-1, tokens[:, None])[:, 0], logprobs)
    top_ids = top_lps = None
    if rows.top_n:
        reported = logp
        if rows.any_raw:
            reported = torch.where(rows.raw[:, None], torch.log_softmax(logits, -1), logp)
        top_lps, top_ids = reported.topk(rows.top_n, -1)
    return Sampled(tokens, logprobs, top_ids, top_lps)


@dataclass(frozen=True)
class SamplerFlags:
    """What the rows of a step ask of the sampler beyond plain sampling (it skips the work no row asked for)."""

    filtered: bool  # some row has top-k, top-p < 1 or min-p > 0
    any_raw: bool
    top_n: int  # the largest top_logprobs asked for

    @classmethod
    def of(cls, params: list[SamplingParams]) -> "SamplerFlags":
        return cls(any(p.top_k or p.top_p < 1 or p.min_p > 0 for p in params),
                   any(p.logprob_mode == "raw" for p in params), max(p.top_logprobs for p in params))
