"""Attention in which a query's reduction over its keys takes one order whatever else the batch holds: the exact
numerics mode's attention for a decode step over the paged KV cache, a prefill over it, and the trainer's packed
causal forward alike, so the three give a query the same output bitwise.

All three run prefill_attention.py's kernel. A program takes a tile of up to BLOCK_M tokens of one row (a decode
step: one token per tile), and walks the row's keys from position 0 in BLOCK_N steps with tiles of one shape (BLOCK_M
tokens x the kv head's G query heads, against BLOCK_N keys; a decode step's tile at most halved onto half the warps,
each warp's rows the same: prefill_attention.decode_tile): a query's scores and running softmax are the same
instructions over the same key tiles in every case. The key tiles past its own position that a longer tile-mate
reads are masked out for it entirely, and change nothing (its running max stays, its weights there are 0).

The order is fixed by position alone: the keys in chunks of CHUNK positions, each chunk's running softmax from
scratch, the chunks' partial softmaxes merged in order (prefill_attention.merge_partials). A prefill or the
trainer's forward walks the chunks in one program; a decode step at a few rows, whose one program per row and kv
head would leave most of the GPU idle over a long row, gives each chunk a program and merges the chunks in a second
launch with the same formula: the same bits, spread over CHUNK-long pieces of the row. The fast decode kernel
(decode_attention.py) instead splits a row's keys by a count chosen from the batch size and the GPU, another order.

The trainer's packed sequences are a pool of blocks of one position, through tables that map each sequence's
positions to its tokens (workloads/model/paged_forward.py's SequencePool): the block size only moves addresses.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._triton import INTERPRET, multiprocessors, next_pow2
from .decode_attention import check_paged
from .prefill_attention import BLOCK_N, launch, merge_partials, prefill_attention

# Positions per chunk: a multiple of the walk's BLOCK_N (4 steps on a GPU; 2 under the interpreter, so the CPU tests'
# short rows cross chunks).
CHUNK = 2 * BLOCK_N if INTERPRET else 4 * BLOCK_N
# Chunk programs' partial softmaxes are float32 [rows, H, chunks, D + 2]; above this many bytes a step walks instead
# (a CUDA graph keeps the buffer for each batch size it holds).
PARTIALS_MAX_BYTES = 32 << 20


@triton.jit
def _merge_chunks_kernel(part_ptr, ml_ptr, len_ptr, o_ptr, stride_on, stride_oh, chunks,
                         G: tl.constexpr, D: tl.constexpr, BLOCK_G: tl.constexpr, CHUNK: tl.constexpr):
    """Program (row b, kv head): the row's chunks' partial softmaxes (part [B, H, chunks, D], ml [B, H, chunks, 2])
    merged in order, as the walk merges them, into its G heads' output."""
    b, kvh = tl.program_id(0), tl.program_id(1)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, D)
    ok = g < G
    heads = kvh * G + g
    mx = tl.full((BLOCK_G,), float("-inf"), tl.float32)
    s_sum = tl.zeros((BLOCK_G,), tl.float32)
    acc = tl.zeros((BLOCK_G, D), tl.float32)
    for c in range(0, tl.cdiv(tl.load(len_ptr + b), CHUNK)):
        at = (b * G * tl.num_programs(1) + heads) * chunks + c
        cm = tl.load(ml_ptr + at * 2, mask=ok, other=0.0)
        cs = tl.load(ml_ptr + at * 2 + 1, mask=ok, other=0.0)
        cacc = tl.load(part_ptr + at[:, None] * D + d[None, :], mask=ok[:, None], other=0.0)
        mx, s_sum, acc = merge_partials(mx, s_sum, acc, cm, cs, cacc)
    out = acc / s_sum[:, None]
    tl.store(o_ptr + b * stride_on + heads[:, None] * stride_oh + d[None, :], out.to(o_ptr.dtype.element_ty),
             mask=ok[:, None])


def chunk_programs(rows: int, heads: int, kv_heads: int, dim: int, max_len: int, device: torch.device) -> bool:
    """Whether a decode step gives each chunk its own program: where a row spans several chunks, one program per
    row and kv head would not fill the multiprocessors, and the partial softmaxes stay small."""
    chunks = -(-max_len // CHUNK)
    sms = 3 if INTERPRET else multiprocessors(device.index or 0)
    return chunks > 1 and rows * kv_heads < sms and rows * heads * chunks * (dim + 2) * 4 <= PARTIALS_MAX_BYTES


def invariant_prefill_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, tables: torch.Tensor,
                                slots: torch.Tensor, positions: torch.Tensor, tiles: torch.Tensor) -> torch.Tensor:
    """prefill_attention in the exact mode's order (its keys in CHUNK-position chunks merged in order)."""
    return prefill_attention(q, keys, values, tables, slots, positions, tiles, chunk=CHUNK)


def invariant_decode_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, tables: torch.Tensor,
                               slots: torch.Tensor, lengths: torch.Tensor, split: bool | None = None) -> torch.Tensor:
    """decode_attention's contract (q [B, H, D] of each row's token at position lengths[b] - 1, over its first
    lengths[b] positions) in the exact mode's order, each row its own tile of one token. `split`: a program per
    chunk and a merge launch (True) or the walk (False); default `chunk_programs`' choice. Under a CUDA graph the
    choice is the graph's, fixed by its rows and the tables' width."""
    q, rows, heads, dim, page, kv_heads = check_paged("invariant_decode_attention", "[B, H, D]", q, keys, values,
                                                      tables)
    max_len = tables.shape[1] * page
    if split is None:
        split = chunk_programs(rows, heads, kv_heads, dim, max_len, q.device)
    out = torch.empty(rows, heads, dim, device=q.device, dtype=q.dtype)
    if not split:
        launch(q, keys, values, tables, slots, lengths, None, out, chunk=CHUNK)
        return out
    chunks = -(-max_len // CHUNK)
    part = torch.empty(rows, heads, chunks, dim, device=q.device, dtype=torch.float32)
    ml = torch.empty(rows, heads, chunks, 2, device=q.device, dtype=torch.float32)
    launch(q, keys, values, tables, slots, lengths, None, None, chunk=CHUNK, partials=(part, ml))
    group = heads // kv_heads
    _merge_chunks_kernel[(rows, kv_heads)](part, ml, lengths, out, out.stride(0), out.stride(1), chunks,
                                           G=group, D=dim, BLOCK_G=next_pow2(group), CHUNK=CHUNK)
    return out
