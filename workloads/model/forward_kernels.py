"""The contract between the rollout engine's paged forward (its model runner) and the kernels it computes with, and
its PyTorch implementation. The norms are the model's RMSNorm modules (anything with `weight`, `eps` and a forward),
so the torch ops are the model's own and a fused kernel computes the same arithmetic. Shapes: N tokens, H query and
H_kv key/value heads of D, a KV pool of blocks [blocks + 1, block_size, H_kv, D] found through block tables
[slots + 1, max_blocks]."""
from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

from .rotary import apply_rotary


class ForwardKernels(Protocol):
    def add_norm(self, norm, h: torch.Tensor, delta: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(h + delta), h + delta); no add when delta is None."""

    def add_norm_router(self, norm, router: torch.Tensor, h: torch.Tensor, delta: torch.Tensor
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(norm(h + delta), h + delta, the router's logits [N, E] or None where the MoE block is to compute them)."""

    def norm_rope(self, norm, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [..., heads, D] -> rotary(norm(x)) with each token's cos, sin [..., D]."""

    def qk_norm_rope(self, q_norm, k_norm, weights: torch.Tensor, qk: torch.Tensor, heads: int,
                     cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """qk [..., H + H_kv, D] (`heads` queries, then keys) -> (rotary(q_norm(q)), rotary(k_norm(k))); `weights`
        [2, D] holds the two norms' weights packed (the runner's copy)."""

    def linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """x @ weight.T at a step's few rows."""

    def prefill_tiles(self, segments: list[tuple[int, int]], device: torch.device) -> torch.Tensor | None:
        """What `attend` needs to know of a prefill's packed prompts, (start, length) each; None if nothing."""

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
               block: torch.Tensor, offset: torch.Tensor, tables: torch.Tensor, slot: torch.Tensor,
               positions: torch.Tensor, key_len: int, tiles: torch.Tensor | None, seen: torch.Tensor) -> torch.Tensor:
        """Store each token's k, v [N, H_kv, D] at its (block, offset) of one layer's pool `keys`, `values`, then
        attend: q [N, H, D] of tokens at `positions` [N] of slots `slot` [N] -> [N, H, D], causal over each slot's
        cached positions. tiles: a prefill's (prefill_tiles), None for a decode step (one token per row);
        seen = positions + 1; key_len > every position. One op, so that a differentiable form (the exact mode's
        trainer forward, model/exact_autograd.py) sees the new keys and values as its inputs."""


class TorchForwardKernels:
    """PyTorch ops: the model's own modules and PyTorch's attention over the positions each token's slot holds."""

    def add_norm(self, norm, h: torch.Tensor, delta: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        h = h if delta is None else h + delta
        return norm(h), h

    def add_norm_router(self, norm, router: torch.Tensor, h: torch.Tensor, delta: torch.Tensor
                        ) -> tuple[torch.Tensor, torch.Tensor, None]:
        return (*self.add_norm(norm, h, delta), None)

    def norm_rope(self, norm, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return apply_rotary(norm(x), cos.unsqueeze(-2), sin.unsqueeze(-2))

    def qk_norm_rope(self, q_norm, k_norm, weights: torch.Tensor, qk: torch.Tensor, heads: int,
                     cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return (self.norm_rope(q_norm, qk[..., :heads, :], cos, sin),
                self.norm_rope(k_norm, qk[..., heads:, :], cos, sin))

    def linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.linear(x, weight)

    def prefill_tiles(self, segments: list[tuple[int, int]], device: torch.device) -> None:
        return None

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
               block: torch.Tensor, offset: torch.Tensor, tables: torch.Tensor, slot: torch.Tensor,
               positions: torch.Tensor, key_len: int, tiles: torch.Tensor | None, seen: torch.Tensor) -> torch.Tensor:
        keys[block, offset] = k
        values[block, offset] = v
        # The first `key_len` positions of each token's slot, gathered, with a causal mask.
        n = q.shape[0]
        blocks = tables[slot, :-(-key_len // keys.shape[1])].long()  # [N, blocks]
        k = keys[blocks].flatten(1, 2)[:, :key_len].transpose(1, 2)  # [N, H_kv, key_len, D]
        v = values[blocks].flatten(1, 2)[:, :key_len].transpose(1, 2)
        mask = torch.arange(key_len, device=q.device)[None, :] <= positions[:, None]
        out = F.scaled_dot_product_attention(q[:, :, None], k, v, attn_mask=mask[:, None, None],
                                             enable_gqa=q.shape[1] != k.shape[1])
        return out.view(n, q.shape[1], q.shape[2])
