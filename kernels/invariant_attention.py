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

The trainer's tokens are not in a paged cache: its keys and values are read in place as blocks of one position,
through a table that maps each sequence's positions to its tokens. The block size only moves addresses.
"""
from __future__ import annotations

import torch

from .prefill_attention import prefill_attention, prefill_tiles


def invariant_decode_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, tables: torch.Tensor,
                               slots: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """decode_attention's contract (q [B, H, D] of each row's token at position lengths[b] - 1, over its first
    lengths[b] positions) on the prefill kernel, each row its own tile of one token."""
    rows = q.shape[0]
    tiles = torch.stack([torch.arange(rows, device=q.device, dtype=torch.int32),
                         torch.ones(rows, device=q.device, dtype=torch.int32)], 1)
    return prefill_attention(q, keys, values, tables, slots, lengths - 1, tiles)


def packed_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sequence_lengths: list[int]
                            ) -> torch.Tensor:
    """q [N, H, D], k and v [N, H_kv, D] of sequences packed back to back (their lengths sum to N) -> [N, H, D]:
    each token attends causally within its own sequence, its positions counted from 0."""
    lengths = [int(n) for n in sequence_lengths]
    if not lengths or sum(lengths) != q.shape[0] or min(lengths) < 1 or k.shape != v.shape or k.shape[0] != q.shape[0]:
        raise ValueError(f"packed_causal_attention needs sequence_lengths (each >= 1) summing to q's {q.shape[0]} "
                         f"tokens and k = v [N, H_kv, D]; got lengths {lengths}, q {tuple(q.shape)}, k "
                         f"{tuple(k.shape)}, v {tuple(v.shape)}")
    device = q.device
    counts = torch.tensor(lengths, device=device)
    starts = torch.cumsum(counts, 0) - counts
    sequence = torch.repeat_interleave(torch.arange(len(lengths), device=device), counts)
    positions = torch.arange(q.shape[0], device=device) - starts[sequence]
    # position p of sequence s is token starts[s] + p: a block of one position each (the rows' unused tail
    # entries are never read, since no token sees past its own sequence)
    tables = (starts[:, None] + torch.arange(max(lengths), device=device)).clamp(max=q.shape[0] - 1).to(torch.int32)
    segments = [(int(s), n) for s, n in zip(starts.tolist(), lengths)]
    return prefill_attention(q, k.unsqueeze(1), v.unsqueeze(1), tables, sequence, positions,
                             prefill_tiles(segments, device))
