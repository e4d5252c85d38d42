"""PPO's critic: V(prefix), the expected final reward of an answer from each of its positions on.

What it reads: the policy's final normed hidden states, detached, and three numbers about the prefix: its progress
(the completion tokens before the position over rl.sampling.max_tokens), the sum of the log-probabilities the policy
gives those tokens (over max_tokens) and the lowest of them. All are functions of the prefix alone, as a value must
be. The hidden states say what the prefix holds; the log-probabilities say whether the answer has taken a turn the
policy itself finds unlikely, which is where a slip that decides the final reward shows: on the countdown task
rewarded only at its end, a critic fitted to the hidden states and the progress alone predicted held-out returns no
better than their mean (explained variance -0.03 after 400 full-batch steps, a 64-wide policy warmed up on traces
that slip), and with the two log-probability features 0.43 (CPU experiment, 2026-12; tests/rl/test_critic.py
holds the trainer's own critic to >= 0.3).

Why a head and not a second model (verl and OpenRLHF train a critic model of the policy's size): a second MoE trunk
doubles the trainer's weights, optimizer state and compute, and needs its own expert and FSDP layout and checkpoint
keys; the policy's hidden states are features of the same prefix, already computed for the log-probabilities. Why
detached: the value loss then cannot reshape the policy's representation (no value_coef trade-off against the
policy's objective), and the critic can be trained alone during its warm-up without a backward through the trunk.
Replicated on every trainer rank, under FSDP too (at Qwen3-30B's width, 2048, it is 4.2 M parameters: 17 MB and
34 MB of AdamW moments, nothing beside the trunk's shards); its gradient is summed in the expert-parallel all-reduce
of the replicated weights, so every rank steps it identically."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn


WORST_LOGPROB = -20.0  # the lowest log-probability feature is clamped here and scaled by it, into [0, 1]
PREFIX_FEATURES = 3


def prefix_features(logprobs: torch.Tensor, mask: torch.Tensor, max_tokens: int) -> torch.Tensor:
    """[B, S] log-probabilities of the targets and completion mask -> [B, S, 3]: at each position, of the completion
    tokens before it: their count / max_tokens, their log-probabilities' sum / max_tokens, their lowest
    log-probability / WORST_LOGPROB (clamped; 0 with none)."""
    logp = logprobs.detach() * mask
    before = mask.cumsum(dim=1) - mask
    total = logp.cumsum(dim=1) - logp
    shifted = F.pad(logp, (1, 0))[:, :logp.shape[1]]  # 0 where nothing precedes (an empty micro-batch: [B, 0])
    worst = torch.cummin(shifted, dim=1).values.clamp(min=WORST_LOGPROB) / WORST_LOGPROB
    return torch.stack([before / max_tokens, total / max_tokens, worst], dim=-1)


class Critic(nn.Module):
    def __init__(self, hidden_size: int, max_tokens: int) -> None:
        super().__init__()
        self.max_tokens = max_tokens
        self.net = nn.Sequential(nn.Linear(hidden_size + PREFIX_FEATURES, hidden_size), nn.GELU(),
                                 nn.Linear(hidden_size, 1))
        # The read-out starts at zero: an untrained critic predicts 0 rather than inventing advantages.
        nn.init.zeros_(self.net[2].weight)
        nn.init.zeros_(self.net[2].bias)

    def forward(self, hidden: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """hidden [N, h] (float32), features [N, 3] (prefix_features, packed) -> values [N]."""
        return self.net(torch.cat([hidden, features.to(hidden.dtype)], dim=-1)).squeeze(-1)


@dataclass
class CriticInputs:
    """What the critic read in one micro-batch's forward: the policy's detached final hidden states [N, h] (float32)
    and the prefix features [N, 3] of this rank's tokens (its context-parallel slice), `tokens` long before the
    slicing. Kept for rl.algorithm.critic_epochs, they cost tokens x (h + 3) x 4 bytes a batch (8 GB for 1 M tokens
    at Qwen3-30B's width) and spare the trunk's forward: the critic is detached from it, so its inputs stay valid
    while it alone steps."""

    hidden: torch.Tensor
    features: torch.Tensor
    tokens: int


def fit_on_stored(step: Callable[[int, Any], dict], stored: list[tuple[int, Any]], epochs: int) -> list[dict]:
    """rl.algorithm.critic_epochs: `epochs` passes over a batch's mini-batches (`stored`: each one's index and what
    its step needs, the trainer's micro-batches and their kept CriticInputs), one optimizer step of the critic alone
    each (`step`); every step's metrics. The
    same steps on every rank (each keeps the mini-batches the batch stepped on, by their global token counts), as
    expert parallelism's gradient all-reduce needs."""
    return [step(m, inputs) for _ in range(epochs) for m, inputs in stored]
