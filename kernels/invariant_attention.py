"""Attention in which a query's reduction over its keys takes one order whatever else the batch holds: the exact
numerics mode's attention for a decode step over the paged KV cache, a prefill over it, and the trainer's packed
causal forward alike, so the three give a query the same output bitwise.

All three run prefill_attention.py's kernel. A program takes a tile of up to BLOCK_M tokens of one row (a decode
step: one token per tile), and walks the row's keys from position 0 in BLOCK_N steps with tiles of one shape (BLOCK_M
tokens x the kv head's G query heads, against BLOCK_N keys): a query's scores and running softmax are the same
instructions over the same key tiles in every case. The key tiles past its own position that a longer tile-mate
reads are masked out for it entirely, and change nothing (its running max stays, its weights there are 0). The fast
decode kernel (decode_attention.py) instead splits a row's keys over a number of programs chosen from the batch
size and the GPU, and merges their partial softmaxes: a different order.

The trainer's packed sequences are a pool of blocks of one position, through tables that map each sequence's
positions to its tokens (workloads/model/paged_forward.py's SequencePool): the block size only moves addresses.
"""
from __future__ import annotations

import torch

from .prefill_attention import prefill_attention


def invariant_decode_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, tables: torch.Tensor,
                               slots: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """decode_attention's contract (q [B, H, D] of each row's token at position lengths[b] - 1, over its first
    lengths[b] positions) on the prefill kernel, each row its own tile of one token."""
    rows = q.shape[0]
    tiles = torch.stack([torch.arange(rows, device=q.device, dtype=torch.int32),
                         torch.ones(rows, device=q.device, dtype=torch.int32)], 1)
    return prefill_attention(q, keys, values, tables, slots, lengths - 1, tiles)
