"""The RL algorithm, chosen once from the run configuration and asked, never branched on: `make_algorithm(rl)`
returns an object that says what the trainer must compute (values, reference logprobs, entropy), turns scored
groups into sequence advantages (orchestrator side) and sequence scores into per-token advantages (trainer
side), normalizes and computes the loss, and says how many epochs x mini-batches each batch is trained for.

  grpo     group-normalised advantages (std scaling per `scale_by_std`), token-mean loss (DAPO's aggregation)
  dr_grpo  Dr. GRPO: centred advantages, loss divided by a constant (sequences x max_tokens)
  gspo     GRPO's advantages, sequence-level importance ratio and clip, sequence-mean loss
  ppo      a critic: GAE over each completion, whitened over the batch's valid tokens, token-mean loss

The functions below the classes are the small pure pieces they are made of."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from moe_rl_eks.core.rl_config import AlgorithmConfig, RLConfig

from .losses import (PolicyBatch, Totals, constant_weights, policy_objective, sequence_mean_weights,
                     token_mean_weights, value_objective)

# Sums a float64 tensor over the trainer's ranks in place (torch.distributed.all_reduce); None = one rank.
AllReduce = Callable[[torch.Tensor], object]


@dataclass
class SequenceScores:
    """What the trainer has of each sample before the forward pass. [B] and [B, T] (mask 1 on completion
    tokens)."""

    rewards: torch.Tensor
    advantages: torch.Tensor  # the orchestrator's sequence advantages
    mask: torch.Tensor


class Algorithm:
    """GRPO; the other algorithms override what differs."""

    name = "grpo"
    needs_values = False

    def __init__(self, cfg: AlgorithmConfig, max_tokens: int) -> None:
        self.cfg, self.max_tokens = cfg, max_tokens

    @property
    def needs_reference(self) -> bool:
        return self.cfg.kl_coef > 0

    @property
    def needs_entropy(self) -> bool:
        return self.cfg.entropy_coef > 0

    @property
    def epochs(self) -> int:
        """Passes over each batch; each pass is `mini_batches` optimizer steps."""
        return self.cfg.epochs_per_batch

    @property
    def mini_batches(self) -> int:
        return self.cfg.mini_batches

    def sequence_advantages(self, rewards: torch.Tensor) -> torch.Tensor:
        """rewards [G, n] (n completions of each of G prompts) -> advantages [G, n]."""
        return grpo_advantages(rewards, scale_by_std=self.cfg.scale_by_std)

    def token_advantages(self, scores: SequenceScores, values: torch.Tensor | None = None,
                         all_reduce: AllReduce | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """-> (advantages [B, T], returns [B, T] or None): the sequence advantage on each completion token."""
        return scores.advantages[:, None] * scores.mask, None

    def normalizer(self, mask: torch.Tensor, totals: Totals) -> torch.Tensor:
        """Per-token weights [B, T] of the loss, zero off the mask; `totals` are the global batch's counts."""
        return token_mean_weights(mask, totals)

    def loss(self, batch: PolicyBatch, totals: Totals) -> tuple[torch.Tensor, dict[str, float]]:
        return policy_objective(batch, self.cfg, self.normalizer(batch.mask.to(batch.logprobs.dtype), totals), totals)


class DrGRPO(Algorithm):
    """Dr. GRPO (Liu et al., 2025): no std division (it favours prompts that are nearly all right or all wrong)
    and no length normalisation (it favours short wrong answers over long ones)."""

    name = "dr_grpo"

    def sequence_advantages(self, rewards: torch.Tensor) -> torch.Tensor:
        return grpo_advantages(rewards, scale_by_std=False)

    def normalizer(self, mask: torch.Tensor, totals: Totals) -> torch.Tensor:
        return constant_weights(mask, totals, self.max_tokens)


class GSPO(Algorithm):
    """GSPO (Zheng et al., 2025): the importance ratio and its clip are per sequence, which MoE routing noise
    perturbs far less than per-token ratios; aggregated as a sequence mean."""

    name = "gspo"

    def normalizer(self, mask: torch.Tensor, totals: Totals) -> torch.Tensor:
        return sequence_mean_weights(mask, totals)

    def loss(self, batch: PolicyBatch, totals: Totals) -> tuple[torch.Tensor, dict[str, float]]:
        weights = self.normalizer(batch.mask.to(batch.logprobs.dtype), totals)
        return policy_objective(batch, self.cfg, weights, totals, sequence_ratio=True)


class PPO(Algorithm):
    name = "ppo"
    needs_values = True

    def sequence_advantages(self, rewards: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(rewards)  # the critic makes them, per token, in the trainer

    def token_advantages(self, scores: SequenceScores, values: torch.Tensor | None = None,
                         all_reduce: AllReduce | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """GAE on the rewards placed on each completion's last token, then whitened over the valid tokens of the
        whole batch (all ranks through `all_reduce`), as verl does; returns are the unwhitened advantages plus
        the values (the critic's regression target)."""
        if values is None:
            raise ValueError("ppo: token_advantages needs the critic's values")
        advantages, returns = gae(terminal_rewards(scores.rewards, scores.mask), values, scores.mask,
                                  gamma=self.cfg.gamma, lam=self.cfg.gae_lambda)
        return whiten(advantages, scores.mask, all_reduce), returns

    def critic_loss(self, values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
                    totals: Totals) -> tuple[torch.Tensor, dict[str, float]]:
        """The critic's objective alone (its warm-up, its extra epochs): the value term of `loss`, under the same
        normalizer."""
        return value_objective(values, old_values, returns, mask, self.cfg,
                               self.normalizer(mask.to(values.dtype), totals), totals)


ALGORITHMS: dict[str, type[Algorithm]] = {cls.name: cls for cls in (Algorithm, DrGRPO, GSPO, PPO)}


def make_algorithm(rl: RLConfig) -> Algorithm:
    """The run's algorithm (`rl.algorithm.name`); Dr. GRPO's constant is the generation budget
    `rl.sampling.max_tokens`."""
    return ALGORITHMS[rl.algorithm.name](rl.algorithm, rl.sampling.max_tokens)


def grpo_advantages(rewards: torch.Tensor, *, scale_by_std: bool, eps: float = 1e-6) -> torch.Tensor:
    """rewards [G, n] -> advantages [G, n]: centred on the group mean; divided by the group's (unbiased) std
    when `scale_by_std`."""
    centred = rewards - rewards.mean(dim=1, keepdim=True)
    if not scale_by_std:
        return centred
    return centred / (rewards.std(dim=1, keepdim=True) + eps)


def varied_groups(rewards: torch.Tensor) -> torch.Tensor:
    """Dynamic sampling: bool [G], true where a group's rewards are not all equal (else every advantage is 0)."""
    return rewards.amax(dim=1) > rewards.amin(dim=1)


def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, *, gamma: float,
        lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over token sequences. rewards, values, mask [B, T] (mask 1 on completion
    tokens, right-padded). Returns (advantages, returns) [B, T], zero outside the mask; the value after the last
    completion token is 0 (the episode ends)."""
    advantages = torch.zeros_like(values)
    # Sized from B alone: a trainer rank with no samples has [0, 0] and no position to index.
    next_value = values.new_zeros(values.shape[0])
    running = values.new_zeros(values.shape[0])
    for t in reversed(range(values.shape[1])):
        m = mask[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        running = (delta + gamma * lam * running) * m
        advantages[:, t] = running
        # Padding after the last token must not leak a bootstrap value into it.
        next_value = values[:, t] * m
    return advantages, (advantages + values) * mask


def whiten(x: torch.Tensor, mask: torch.Tensor, all_reduce: AllReduce | None = None,
           eps: float = 1e-8) -> torch.Tensor:
    """(x - mean) / std over the masked entries (of every rank when `all_reduce` is given; unbiased variance),
    zero off the mask."""
    m = mask.to(torch.float64)
    xd = x.detach().to(torch.float64)
    sums = torch.stack([m.sum(), (xd * m).sum(), (xd * xd * m).sum()])
    if all_reduce is not None:
        all_reduce(sums)
    n, s, sq = sums.tolist()
    mean = s / max(n, 1.0)
    var = max(sq - n * mean * mean, 0.0) / max(n - 1.0, 1.0)
    return ((x - mean) / (var + eps) ** 0.5) * mask


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
                       all_reduce: AllReduce | None = None) -> float:
    """1 - Var(returns - values) / Var(returns) over the masked entries (of every rank with `all_reduce`): 1 for
    a critic that predicts every return, 0 for one no better than the batch's mean return, negative for a worse
    one; nan when the returns do not vary."""
    m = mask.to(torch.float64)
    r, e = returns.detach().to(torch.float64), (returns - values).detach().to(torch.float64)
    sums = torch.stack([m.sum(), (r * m).sum(), (r * r * m).sum(), (e * m).sum(), (e * e * m).sum()])
    if all_reduce is not None:
        all_reduce(sums)
    n, r1, r2, e1, e2 = sums.tolist()
    n = max(n, 1.0)
    var_returns = r2 / n - (r1 / n) ** 2
    if var_returns <= 1e-12:
        return float("nan")
    return 1.0 - max(e2 / n - (e1 / n) ** 2, 0.0) / var_returns


def terminal_rewards(sequence_rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Place each sequence's scalar reward [B] on its last completion token -> [B, T] (PPO's token rewards)."""
    last = (mask.cumsum(dim=1) == mask.sum(dim=1, keepdim=True)) & (mask > 0)
    return last.to(sequence_rewards.dtype) * sequence_rewards[:, None]
