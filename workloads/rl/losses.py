"""Losses: pure functions of small dataclasses of per-token tensors, returning the loss and its metrics.

Token-level aggregation: every loss is a sum over valid tokens divided by `num_tokens`, the number of valid
tokens in the whole global batch (all data-parallel ranks), so long completions weigh per token, not per
sequence, and summing the ranks' gradients gives exactly the gradient of the global batch's loss."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_rl_eks.core.rl_config import AlgorithmConfig


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


def kl_estimate(logprobs: torch.Tensor, reference_logprobs: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from samples of the policy (Schulman's k1 and k3).
    k1 = log p - log q is unbiased but can be negative; k3 = q/p - 1 - log(q/p) is unbiased and >= 0."""
    log_ratio = reference_logprobs - logprobs
    if estimator == "k1":
        return -log_ratio
    if estimator == "k3":
        return torch.exp(log_ratio) - 1 - log_ratio
    raise ValueError(f"kl_estimator {estimator!r} is not allowed; allowed: 'k1', 'k3'")


def masked_sum(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum()


def policy_loss(batch: PolicyBatch, cfg: AlgorithmConfig, num_tokens: float | None = None
                ) -> tuple[torch.Tensor, dict[str, float]]:
    """Decoupled PPO objective (AReaL) with clip-higher (DAPO) and truncated importance weights.

    per token: -w * min(r * A, clip(r, 1 - clip_low, 1 + clip_high) * A)
      r = pi / pi_proximal (the trust region is around the policy before this step, not the stale rollout one)
      w = min(pi_proximal / pi_behaviour, importance_cap) (corrects for off-policy samples, truncated)
    plus kl_coef * KL(pi || pi_ref) and minus entropy_coef * entropy, all aggregated per token."""
    mask = batch.mask.to(batch.logprobs.dtype)
    n = float(mask.sum()) if num_tokens is None else float(num_tokens)
    n = max(n, 1.0)
    ratio = torch.exp(batch.logprobs - batch.proximal_logprobs)
    raw_weight = torch.exp(batch.proximal_logprobs - batch.behaviour_logprobs).detach()
    weight = raw_weight.clamp(max=cfg.importance_cap)
    adv = batch.advantages
    unclipped = ratio * adv
    clipped = ratio.clamp(1 - cfg.clip_low, 1 + cfg.clip_high) * adv
    surrogate = torch.minimum(unclipped, clipped)
    loss = -masked_sum(weight * surrogate, mask) / n
    metrics = {
        "clip_fraction": float(masked_sum((clipped < unclipped).to(mask.dtype), mask) / n),
        "importance_weight_mean": float(masked_sum(raw_weight, mask) / n),
        "importance_truncated_fraction": float(masked_sum((raw_weight > cfg.importance_cap).to(mask.dtype), mask) / n),
    }
    if cfg.kl_coef > 0:
        if batch.reference_logprobs is None:
            raise ValueError("kl_coef > 0 needs reference_logprobs")
        kl = masked_sum(kl_estimate(batch.logprobs, batch.reference_logprobs, cfg.kl_estimator), mask) / n
        loss = loss + cfg.kl_coef * kl
        metrics["kl"] = float(kl.detach())
    if cfg.entropy_coef > 0:
        if batch.entropy is None:
            raise ValueError("entropy_coef > 0 needs entropy")
        entropy = masked_sum(batch.entropy, mask) / n
        loss = loss - cfg.entropy_coef * entropy
        metrics["entropy"] = float(entropy.detach())
    return loss, metrics


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
               clip: float, num_tokens: float | None = None) -> torch.Tensor:
    """PPO's clipped value loss: 0.5 * max((v - R)^2, (v_old + clip(v - v_old, -c, c) - R)^2), per token."""
    mask = mask.to(values.dtype)
    n = max(float(mask.sum()) if num_tokens is None else float(num_tokens), 1.0)
    clipped = old_values + (values - old_values).clamp(-clip, clip)
    per_token = 0.5 * torch.maximum((values - returns) ** 2, (clipped - returns) ** 2)
    return masked_sum(per_token, mask) / n


def token_logprobs_and_entropy(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, T, V], targets [B, T] -> (log p(target) [B, T], entropy [B, T]), in float32."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    chosen = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp.exp() * logp).sum(dim=-1)
    return chosen, entropy
