"""Scored samples -> per-token advantages. Small pure functions: the trainer knows nothing of the algorithm
beyond the advantages and masks these return."""
from __future__ import annotations

import torch


def grpo_advantages(rewards: torch.Tensor, *, scale_by_std: bool, eps: float = 1e-6) -> torch.Tensor:
    """rewards [G, n] (n completions of each of G prompts) -> advantages [G, n].

    Centred on the group mean; divided by the group's (unbiased) std when `scale_by_std` (GRPO). Dr. GRPO turns
    the division off: it up-weights groups that are nearly all right or all wrong, a bias toward easy prompts."""
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
    next_value = torch.zeros_like(values[:, 0])
    running = torch.zeros_like(values[:, 0])
    for t in reversed(range(values.shape[1])):
        m = mask[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        running = (delta + gamma * lam * running) * m
        advantages[:, t] = running
        # Padding after the last token must not leak a bootstrap value into it.
        next_value = values[:, t] * m
    return advantages, (advantages + values) * mask


def terminal_rewards(sequence_rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Place each sequence's scalar reward [B] on its last completion token -> [B, T] (PPO's token rewards)."""
    last = (mask.cumsum(dim=1) == mask.sum(dim=1, keepdim=True)) & (mask > 0)
    return last.to(sequence_rewards.dtype) * sequence_rewards[:, None]


def staleness(trainer_version: int, sample_version: int) -> int:
    """How many optimizer steps behind the trainer a sample's weights are."""
    return trainer_version - sample_version


def within_staleness(trainer_version: int, sample_version: int, max_staleness: int) -> bool:
    """The bounded-staleness rule: a sample generated with `sample_version` may train version `trainer_version`
    + 1 only if it lags by at most `max_staleness` (0 = strictly on-policy)."""
    return staleness(trainer_version, sample_version) <= max_staleness
