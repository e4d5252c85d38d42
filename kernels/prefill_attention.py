"""Variable-length causal prefill attention over a paged KV cache: the query tokens of several prompts packed into
one batch (no padding), each token attending to its own row's positions up to its own, read through the row's
block table (whose blocks already hold this chunk's keys and values, and any earlier chunk's: chunked prefill).

A program takes a tile of up to `BLOCK_M` consecutive tokens of one row and one kv head, with the kv head's `G`
query heads stacked (BLOCK_M * G query rows share every key/value tile they load), and walks the keys from
position 0 to its last token's position (causal: nothing beyond is read).

Layouts as in `decode_attention`: q [N, H, D] (token n of row slots[n] at position positions[n]); keys/values
[blocks, block_size, H_kv, D]; tables [slots, max_blocks]. The tiles come from `prefill_tiles`.
"""
from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import triton
import triton.language as tl

from ._triton import INTERPRET, dot_acc, next_pow2
from .decode_attention import check_paged, online_softmax_step, paged_offsets

BLOCK_M = 16  # tokens of one row per program


@triton.jit
def _prefill_kernel(q_ptr, k_ptr, v_ptr, table_ptr, slot_ptr, pos_ptr, tile_ptr, o_ptr, sm_scale,
                    stride_qn, stride_qh, stride_on, stride_oh, stride_t, stride_kb, stride_kn, stride_kh,
                    stride_vb, stride_vn, stride_vh,
                    G: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, EXACT: tl.constexpr):
    tile, kvh = tl.program_id(0), tl.program_id(1)
    first = tl.load(tile_ptr + tile * 2)
    count = tl.load(tile_ptr + tile * 2 + 1)
    r = tl.arange(0, BLOCK_M * BLOCK_G)
    m, g = r // BLOCK_G, r % BLOCK_G
    row_ok = (m < count) & (g < G)
    tok = (first + m).to(tl.int64)
    d = tl.arange(0, D)
    heads = kvh * G + g
    pos = tl.load(pos_ptr + tok, mask=m < count, other=0)
    q = tl.load(q_ptr + tok[:, None] * stride_qn + heads[:, None] * stride_qh + d[None, :], mask=row_ok[:, None],
                other=0.0)
    slot = tl.load(slot_ptr + first).to(tl.int64)
    hi = tl.load(pos_ptr + first + count - 1) + 1  # the tile's last token sees positions [0, hi)
    table = table_ptr + slot * stride_t
    mx = tl.full((BLOCK_M * BLOCK_G,), float("-inf"), tl.float32)
    s_sum = tl.zeros((BLOCK_M * BLOCK_G,), tl.float32)
    acc = tl.zeros((BLOCK_M * BLOCK_G, D), tl.float32)
    for start in range(0, hi, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        valid = n < hi
        block, offset = paged_offsets(table, n, valid, PAGE)
        k = tl.load(k_ptr + (block * stride_kb + offset * stride_kn + kvh * stride_kh)[:, None] + d[None, :],
                    mask=valid[:, None], other=0.0)
        if EXACT:  # float32 caches: full-precision products, not TF32
            scores = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            scores = dot_acc(q, tl.trans(k), tl.zeros((BLOCK_M * BLOCK_G, BLOCK_N), tl.float32))
        # every query row sees position 0, so each row's running max is finite after the first tile
        scores = tl.where(valid[None, :] & (n[None, :] <= pos[:, None]), scores * sm_scale, float("-inf"))
        v = tl.load(v_ptr + (block * stride_vb + offset * stride_vn + kvh * stride_vh)[:, None] + d[None, :],
                    mask=valid[:, None], other=0.0)
        mx, s_sum, acc = online_softmax_step(scores, v, mx, s_sum, acc, EXACT)
    out = acc / s_sum[:, None]
    tl.store(o_ptr + tok[:, None] * stride_on + heads[:, None] * stride_oh + d[None, :],
             out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None])


def prefill_tiles(segments: Iterable[tuple[int, int]], device) -> torch.Tensor:
    """segments (first token, count): runs of consecutive positions of one row in the packed batch -> the kernel's
    tiles [T, 2] (first token, count <= BLOCK_M), built once per forward and shared by its layers."""
    tiles = [(first + j, min(BLOCK_M, count - j)) for first, count in segments for j in range(0, count, BLOCK_M)]
    return torch.tensor(tiles, dtype=torch.int32).reshape(-1, 2).to(device, non_blocking=True)


def prefill_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, tables: torch.Tensor,
                      slots: torch.Tensor, positions: torch.Tensor, tiles: torch.Tensor) -> torch.Tensor:
    """q [N, H, D] of tokens at `positions` [N] of rows `slots` [N] -> [N, H, D]: causal softmax attention of each
    token over its row's positions <= its own, through the block tables. Tokens outside every tile are left
    unwritten."""
    q, tokens, heads, dim, page, kv_heads = check_paged("prefill_attention", "[N, H, D]", q, keys, values, tables)
    out = torch.empty(tokens, heads, dim, device=q.device, dtype=q.dtype)
    group = heads // kv_heads
    _prefill_kernel[(tiles.shape[0], kv_heads)](
        q, keys, values, tables, slots, positions, tiles, out, 1.0 / math.sqrt(dim),
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), tables.stride(0),
        keys.stride(0), keys.stride(1), keys.stride(2), values.stride(0), values.stride(1), values.stride(2),
        G=group, D=dim, PAGE=page, BLOCK_M=BLOCK_M, BLOCK_G=next_pow2(group), BLOCK_N=16 if INTERPRET else 64,
        EXACT=q.dtype == torch.float32, num_warps=8 if dim * group >= 512 else 4, num_stages=2)
    return out
