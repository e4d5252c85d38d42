"""PPO's critic: V(prefix), the expected final reward of an answer from each of its positions on.

What it reads: the policy's final normed hidden states, detached, and the answer's progress, the completion tokens
generated before the position over rl.sampling.max_tokens. The hidden states already say what the prefix holds (a
slip in a countdown, a wrong digit); the progress says how much of the budget is left to slip in or to run out of,
which a causal trunk with rotary positions carries only implicitly. Both are functions of the prefix alone, as a
value must be.

Why a head and not a second model (verl and OpenRLHF train a critic model of the policy's size): a second MoE trunk
doubles the trainer's weights, optimizer state and compute, and needs its own expert and FSDP layout and checkpoint
keys; the policy's hidden states are features of the same prefix, already computed for the log-probabilities. Why
detached: the value loss then cannot reshape the policy's representation (no value_coef trade-off against the
policy's objective), and the critic can be trained alone during its warm-up without a backward through the trunk.
Why a hidden layer: a linear read-out of features trained for next-token prediction did not fit the returns of a
task rewarded only at its end (tests/rl/test_critic.py measures the explained variance).

Replicated on every trainer rank, under FSDP too (at Qwen3-30B's width, 2048, it is 4.2 M parameters: 17 MB and
34 MB of AdamW moments, nothing beside the trunk's shards); its gradient is summed in the expert-parallel all-reduce
of the replicated weights, so every rank steps it identically."""
from __future__ import annotations

import torch
from torch import nn


class Critic(nn.Module):
    def __init__(self, hidden_size: int, max_tokens: int) -> None:
        super().__init__()
        self.max_tokens = max_tokens
        self.net = nn.Sequential(nn.Linear(hidden_size + 1, hidden_size), nn.GELU(), nn.Linear(hidden_size, 1))
        # The read-out starts at zero: an untrained critic predicts 0 rather than inventing advantages.
        nn.init.zeros_(self.net[2].weight)
        nn.init.zeros_(self.net[2].bias)

    def forward(self, hidden: torch.Tensor, generated: torch.Tensor) -> torch.Tensor:
        """hidden [N, h] (float32), generated [N] (completion tokens before each position) -> values [N]."""
        progress = (generated.to(hidden.dtype) / self.max_tokens).unsqueeze(-1)
        return self.net(torch.cat([hidden, progress], dim=-1)).squeeze(-1)
