"""Losses: pure functions of small dataclasses of per-token tensors, returning the loss and its metrics.

Aggregation is by per-token weights that the algorithm's normalizer computes from counts over the WHOLE
optimizer step's batch (every rank, every micro-batch): the loss is `sum(weights * per_token_loss)`, so
summing the ranks' and micro-batches' gradients gives exactly the gradient of the global batch's loss, whichever
normalizer (token mean, Dr. GRPO's constant, sequence mean) is in use. Metrics are token means over the same
global batch, so summing them over ranks gives the global value."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from moe_rl_eks.core.rl_config import AlgorithmConfig

KL_LOG_RATIO_LIMIT = 20.0  # |log q/p| beyond this is clamped (exp(20) ~ 5e8 already)
KL_ESTIMATE_LIMIT = 10.0  # and the per-token estimate too, as verl's low-variance KL does


@dataclass
class PolicyBatch:
    """All [B, T], aligned on completion tokens; `mask` is 1 on tokens that count."""

    logprobs: torch.Tensor  # current policy (with grad)
    proximal_logprobs: torch.Tensor  # the policy before this optimizer step (no grad)
    behaviour_logprobs: torch.Tensor  # what the rollout server sampled with (possibly older weights)
    advantages: torch.Tensor
    mask: torch.Tensor
    reference_logprobs: torch.Tensor | None = None  # frozen reference, for the KL term
    entropy: torch.Tensor | None = None  # per-token entropy of the current policy, for the bonus
    values: torch.Tensor | None = None  # PPO: the critic's current values (with grad)
    old_values: torch.Tensor | None = None  # PPO: the values the advantages were computed from
    returns: torch.Tensor | None = None  # PPO: GAE returns


@dataclass(frozen=True)
class Totals:
    """Counts over the global batch of one optimizer step; the trainer sums `local(mask)` over its micro-batches
    and ranks (one all-reduce of two numbers) and builds this from the sum."""

    tokens: float
    sequences: float

    @staticmethod
    def local(mask: torch.Tensor) -> torch.Tensor:
        """float64 [tokens, sequences with at least one token] of this rank's micro-batch."""
        m = mask.detach()
        return torch.stack([m.sum(), (m.sum(dim=1) > 0).sum()]).to(torch.float64)

    @classmethod
    def of(cls, summed: torch.Tensor) -> "Totals":
        tokens, sequences = (float(x) for x in summed.tolist())
        return cls(max(tokens, 1.0), max(sequences, 1.0))


def token_mean_weights(mask: torch.Tensor, totals: Totals) -> torch.Tensor:
    """Every valid token of the batch weighs the same (DAPO's token-level mean)."""
    return mask / totals.tokens


def constant_weights(mask: torch.Tensor, totals: Totals, max_tokens: int) -> torch.Tensor:
    """Dr. GRPO: divide by a constant, sequences x the generation budget, so neither a sequence's length nor the
    batch's token count rescales a token's gradient (a token mean favours short wrong answers over long ones)."""
    return mask / (totals.sequences * max_tokens)


def sequence_mean_weights(mask: torch.Tensor, totals: Totals) -> torch.Tensor:
    """Each sequence's token mean, averaged over sequences (GSPO's and the original GRPO's aggregation)."""
    lengths = mask.sum(dim=1, keepdim=True).clamp_min(1.0)
    return mask / (lengths * totals.sequences)


def kl_estimate(logprobs: torch.Tensor, reference_logprobs: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from samples of the policy (Schulman's estimators).

    k1 = log p - log q (unbiased, can be negative). k3 = q/p - 1 - log(q/p) (unbiased, >= 0) with the log-ratio
    clamped to +-20 and the estimate to <= 10, as verl does: unclamped, log p = -20 against log q = -1 gives 1.8e8
    and one token's gradient swamps the batch. "k3+" has k3's value and the gradient of k2 = (log p - log q)^2 / 2,
    whose expected gradient is KL's own (k3's gradient is biased), with log p - log q clamped to +-20."""
    log_ratio = reference_logprobs - logprobs
    if estimator == "k1":
        return -log_ratio
    if estimator not in ("k3", "k3+"):
        raise ValueError(f"kl_estimator {estimator!r} is not allowed; allowed: 'k1', 'k3', 'k3+'")
    clamped = log_ratio.clamp(-KL_LOG_RATIO_LIMIT, KL_LOG_RATIO_LIMIT)
    k3 = (torch.exp(clamped) - 1 - clamped).clamp(max=KL_ESTIMATE_LIMIT)
    if estimator == "k3":
        return k3
    # d k2 / d log p = log p - log q; written with the clamped ratio as a constant factor, so the pull toward the
    # reference stays (at most 20 per token) where the clamp would zero a plain k2's gradient.
    k2_grad = -clamped.detach() * logprobs
    return k3.detach() + (k2_grad - k2_grad.detach())


def clipped_surrogate(ratio: torch.Tensor, advantages: torch.Tensor, clip_low: float,
                      clip_high: float) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's pessimistic surrogate min(r A, clip(r, 1 - lo, 1 + hi) A) and where the clip bit (bool)."""
    unclipped = ratio * advantages
    clipped = ratio.clamp(1 - clip_low, 1 + clip_high) * advantages
    return torch.minimum(unclipped, clipped), clipped < unclipped


def value_loss_per_token(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor,
                         clip: float) -> torch.Tensor:
    """PPO's clipped value loss: 0.5 * max((v - R)^2, (v_old + clip(v - v_old, -c, c) - R)^2), per token."""
    clipped = old_values + (values - old_values).clamp(-clip, clip)
    return 0.5 * torch.maximum((values - returns) ** 2, (clipped - returns) ** 2)


def importance_weights(raw: torch.Tensor, cfg: "AlgorithmConfig") -> tuple[torch.Tensor, torch.Tensor]:
    """(the off-policy weights the surrogate is multiplied by, where the cap bit) from the raw proximal/behaviour
    ratios: rl.algorithm.importance_correction `truncated` caps them at importance_cap; `none` is 1 everywhere, so
    the objective is the on-policy one bit for bit (x * 1 is x)."""
    if cfg.importance_correction == "none":
        return torch.ones_like(raw), torch.zeros_like(raw, dtype=torch.bool)
    return raw.clamp(max=cfg.importance_cap), raw > cfg.importance_cap


def sequence_log_ratio(logprobs: torch.Tensor, base: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B, 1]: the mean per-token log-ratio of each sequence: log of GSPO's length-normalised sequence ratio."""
    lengths = mask.sum(dim=1, keepdim=True).clamp_min(1.0)
    return ((logprobs - base) * mask).sum(dim=1, keepdim=True) / lengths


def policy_objective(batch: PolicyBatch, cfg: "AlgorithmConfig", weights: torch.Tensor, totals: Totals, *,
                     sequence_ratio: bool = False) -> tuple[torch.Tensor, dict[str, float]]:
    """Decoupled PPO objective (AReaL) with clip-higher (DAPO) and truncated importance weights, aggregated by
    `weights` (the algorithm's normalizer):

      per token: -w * min(r * A, clip(r, 1 - clip_low, 1 + clip_high) * A)
        r = pi / pi_proximal (the trust region is around the policy before this step, not the stale rollout one)
        w = min(pi_proximal / pi_behaviour, importance_cap) (corrects for off-policy samples, truncated), or 1
          with importance_correction: none
      plus kl_coef * KL(pi || pi_ref), minus entropy_coef * entropy, plus value_coef * the clipped value loss
      when the batch carries values (PPO).

    `sequence_ratio` (GSPO): r and w are per sequence, the exponentiated mean token log-ratio, and the gradient
    reaches each token as r * grad log pi (GSPO-token's stop-gradient form). Metrics are token means over the
    global batch."""
    mask = batch.mask.to(batch.logprobs.dtype)

    def token_mean(x: torch.Tensor) -> float:
        return float((x.detach() * mask).sum() / totals.tokens)

    if sequence_ratio:
        log_r = sequence_log_ratio(batch.logprobs, batch.proximal_logprobs, mask)
        # value exp(mean log-ratio), gradient r * d(log pi) per token
        ratio = torch.exp(log_r.detach()) * torch.exp(batch.logprobs - batch.logprobs.detach())
        log_w = sequence_log_ratio(batch.proximal_logprobs, batch.behaviour_logprobs, mask).detach()
    else:
        ratio = torch.exp(batch.logprobs - batch.proximal_logprobs)
        log_w = (batch.proximal_logprobs - batch.behaviour_logprobs).detach()
    raw_weight = torch.exp(log_w).expand_as(mask)
    weight, truncated = importance_weights(raw_weight, cfg)
    surrogate, clipped = clipped_surrogate(ratio, batch.advantages, *cfg.ratio_clip())
    loss = -(weights * weight * surrogate).sum()
    metrics = {"clip_fraction": token_mean(clipped.to(mask.dtype)),
               "importance_weight_mean": token_mean(raw_weight),  # the mismatch, corrected or not
               "importance_truncated_fraction": token_mean(truncated.to(mask.dtype))}
    if cfg.kl_coef > 0:
        if batch.reference_logprobs is None:
            raise ValueError("kl_coef > 0 needs reference_logprobs")
        kl = kl_estimate(batch.logprobs, batch.reference_logprobs, cfg.kl_estimator)
        loss = loss + cfg.kl_coef * (weights * kl).sum()
        metrics["kl"] = token_mean(kl)
    if cfg.entropy_coef > 0:
        if batch.entropy is None:
            raise ValueError("entropy_coef > 0 needs entropy")
        loss = loss - cfg.entropy_coef * (weights * batch.entropy).sum()
        metrics["entropy"] = token_mean(batch.entropy)
    if batch.values is not None:
        v_loss, v_metrics = value_objective(batch.values, batch.old_values, batch.returns, batch.mask, cfg, weights,
                                            totals)
        loss = loss + v_loss
        metrics.update(v_metrics)
    return loss, metrics


def value_objective(values: torch.Tensor | None, old_values: torch.Tensor | None, returns: torch.Tensor | None,
                    mask: torch.Tensor, cfg: "AlgorithmConfig", weights: torch.Tensor,
                    totals: Totals) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO's critic term: value_coef x the clipped value loss, aggregated by `weights`; alone, it is what the
    critic's warm-up and its extra epochs (critic_epochs) train. Metric: `value_loss`, a token mean over the global
    batch."""
    if values is None or old_values is None or returns is None:
        raise ValueError("the value loss needs values, old_values and returns")
    v_loss = value_loss_per_token(values, old_values, returns, cfg.value_clip)
    mask = mask.to(v_loss.dtype)
    return cfg.value_coef * (weights * v_loss).sum(), {"value_loss": float((v_loss.detach() * mask).sum() / totals.tokens)}