"""Variable-length causal prefill attention over a paged KV cache: the query tokens of several prompts packed into
one batch (no padding), each token attending to its own row's positions up to its own, read through the row's
block table (whose blocks already hold this chunk's keys and values, and any earlier chunk's: chunked prefill).

A program takes a tile of up to `BLOCK_M` consecutive tokens of one row and one kv head, with the kv head's `G`
query heads stacked (BLOCK_M * G query rows share every key/value tile they load), and walks the keys from
position 0 to its last token's position (causal: nothing beyond is read).

The exact numerics mode (invariant_attention.py) runs the same kernel with `chunk` > 0: the keys taken in chunks of
`chunk` positions, each chunk's running softmax started afresh and the chunks' partial softmaxes merged in order
(`merge_partials`), so that a decode step can instead give each chunk its own program and merge them in a second
launch with the same arithmetic (CHUNK_PROGRAMS, invariant_attention.py).

Layouts as in `decode_attention`: q [N, H, D] (token n of row slots[n] at position positions[n]); keys/values
[blocks, block_size, H_kv, D]; tables [slots, max_blocks]. The tiles come from `prefill_tiles`.
"""
from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import triton
import triton.language as tl

from ._triton import next_pow2
from .decode_attention import BLOCK_N, check_paged, walk_keys

BLOCK_M = 16  # tokens of one row per program


@triton.jit
def merge_partials(mx, s_sum, acc, cm, cs, cacc):
    """The running softmax (mx, s_sum, acc) followed by a chunk's own (cm, cs, cacc), one elementwise formula for
    the walk in one program and the merge launch alike (their bits must agree). A chunk none of a row's positions
    reached (cm -inf, cs and cacc 0) leaves the row's state bitwise as it was once mx is finite (after chunk 0,
    which every row sees)."""
    m_new = tl.maximum(mx, cm)
    alpha = tl.exp(mx - m_new)
    beta = tl.exp(cm - m_new)
    return m_new, s_sum * alpha + cs * beta, acc * alpha[:, None] + cacc * beta[:, None]


@triton.jit
def _prefill_kernel(q_ptr, k_ptr, v_ptr, table_ptr, slot_ptr, pos_ptr, tile_ptr, o_ptr, part_ptr, ml_ptr, sm_scale,
                    stride_qn, stride_qh, stride_on, stride_oh, stride_t, stride_kb, stride_kn, stride_kh,
                    stride_vb, stride_vn, stride_vh,
                    G: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, EXACT: tl.constexpr, CHUNK: tl.constexpr,
                    DECODE: tl.constexpr, CHUNK_PROGRAMS: tl.constexpr):
    """Program (tile, kv head[, chunk]). DECODE: tile b is row b's one token, at position pos_ptr[b] - 1 (pos_ptr
    holds the rows' lengths). CHUNK 0: one walk over the keys; else chunks of CHUNK positions merged in order, or
    with CHUNK_PROGRAMS this program's chunk alone, its partial softmax stored (part [N, H, chunks, D], ml
    [N, H, chunks, 2]) for invariant_attention's merge launch."""
    tile, kvh = tl.program_id(0), tl.program_id(1)
    if DECODE:
        first = tile
        count = 1
    else:
        first = tl.load(tile_ptr + tile * 2)
        count = tl.load(tile_ptr + tile * 2 + 1)
    r = tl.arange(0, BLOCK_M * BLOCK_G)
    m, g = r // BLOCK_G, r % BLOCK_G
    row_ok = (m < count) & (g < G)
    tok = (first + m).to(tl.int64)
    d = tl.arange(0, D)
    heads = kvh * G + g
    if DECODE:
        pos = tl.load(pos_ptr + tok, mask=m < count, other=1) - 1
    else:
        pos = tl.load(pos_ptr + tok, mask=m < count, other=0)
    q = tl.load(q_ptr + tok[:, None] * stride_qn + heads[:, None] * stride_qh + d[None, :], mask=row_ok[:, None],
                other=0.0)
    slot = tl.load(slot_ptr + first).to(tl.int64)
    hi = tl.max(pos, axis=0) + 1  # the tile's last token sees positions [0, hi)
    table = table_ptr + slot * stride_t
    mx = tl.full((BLOCK_M * BLOCK_G,), float("-inf"), tl.float32)
    s_sum = tl.zeros((BLOCK_M * BLOCK_G,), tl.float32)
    acc = tl.zeros((BLOCK_M * BLOCK_G, D), tl.float32)
    if CHUNK == 0:
        # every query row sees position 0, so each row's running max is finite after the first tile
        mx, s_sum, acc = walk_keys(q, k_ptr, v_ptr, table, pos, kvh, 0, hi, sm_scale, mx, s_sum, acc, stride_kb,
                                   stride_kn, stride_kh, stride_vb, stride_vn, stride_vh, D, PAGE, BLOCK_N, EXACT)
    elif CHUNK_PROGRAMS:
        lo = tl.program_id(2) * CHUNK
        if lo < hi:  # a chunk past the row's length is never read by the merge
            mx, s_sum, acc = walk_keys(q, k_ptr, v_ptr, table, pos, kvh, lo, tl.minimum(lo + CHUNK, hi), sm_scale,
                                       mx, s_sum, acc, stride_kb, stride_kn, stride_kh, stride_vb, stride_vn,
                                       stride_vh, D, PAGE, BLOCK_N, EXACT)
            at = (tok * G * tl.num_programs(1) + heads) * tl.num_programs(2) + tl.program_id(2)  # [N, H, chunks]
            tl.store(part_ptr + at[:, None] * D + d[None, :], acc, mask=row_ok[:, None])
            tl.store(ml_ptr + at * 2, mx, mask=row_ok)
            tl.store(ml_ptr + at * 2 + 1, s_sum, mask=row_ok)
    else:
        for lo in range(0, hi, CHUNK):
            cm = tl.full((BLOCK_M * BLOCK_G,), float("-inf"), tl.float32)
            cs = tl.zeros((BLOCK_M * BLOCK_G,), tl.float32)
            cacc = tl.zeros((BLOCK_M * BLOCK_G, D), tl.float32)
            cm, cs, cacc = walk_keys(q, k_ptr, v_ptr, table, pos, kvh, lo, tl.minimum(lo + CHUNK, hi), sm_scale,
                                     cm, cs, cacc, stride_kb, stride_kn, stride_kh, stride_vb, stride_vn, stride_vh,
                                     D, PAGE, BLOCK_N, EXACT)
            mx, s_sum, acc = merge_partials(mx, s_sum, acc, cm, cs, cacc)
    if not CHUNK_PROGRAMS:
        out = acc / s_sum[:, None]
        tl.store(o_ptr + tok[:, None] * stride_on + heads[:, None] * stride_oh + d[None, :],
                 out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None])


def tile_warps(block_g: int, dim: int) -> int:
    """Warps of a prefill tile (BLOCK_M tokens x BLOCK_G heads, against D-wide keys)."""
    return 8 if dim * block_g >= 512 else 4


def decode_tile(block_g: int, dim: int) -> tuple[int, int]:
    """(BLOCK_M, warps) of a decode step's one-token tiles. Its query rows beyond the token's G heads are idle; a
    tile of 128 or more rows on 8 warps is halved onto 4, each warp keeping its 16 (or more) query rows of the same
    tensor-core instructions over the same key tiles, so a query's bits stay a prefill's (on Hopper both are
    wgmma m64 tiles: the second warp group held only idle rows). Any other tile stays the prefill's: a narrower
    one can take other instructions and layouts (a 2-token tile, 16 rows on mma.sync with the key columns split
    over warps, gave other bits on an H100)."""
    warps = tile_warps(block_g, dim)
    if warps == 8 and BLOCK_M * block_g >= 128:
        return BLOCK_M // 2, 4
    return BLOCK_M, warps


def prefill_tiles(segments: Iterable[tuple[int, int]], device) -> torch.Tensor:
    """segments (first token, count): runs of consecutive positions of one row in the packed batch -> the kernel's
    tiles [T, 2] (first token, count <= BLOCK_M), built once per forward and shared by its layers."""
    tiles = [(first + j, min(BLOCK_M, count - j)) for first, count in segments for j in range(0, count, BLOCK_M)]
    return torch.tensor(tiles, dtype=torch.int32).reshape(-1, 2).to(device, non_blocking=True)


def launch(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, tables: torch.Tensor, slots: torch.Tensor,
           positions: torch.Tensor, tiles: torch.Tensor | None, out: torch.Tensor | None, *, chunk: int = 0,
           partials: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """The kernel over q [N, H, D] (checked by check_paged): tiles [T, 2] of a prefill, or None for one token per
    row, `positions` then holding each row's length (its token at length - 1). With `partials` (part
    [N, H, chunks, D], ml [N, H, chunks, 2], float32) a program per chunk fills them instead of `out`."""
    heads, dim = q.shape[1], q.shape[2]
    kv_heads = keys.shape[2]
    if chunk % BLOCK_N:
        raise ValueError(f"chunk {chunk} must be a multiple of the kernel's {BLOCK_N} positions per step")
    part, ml = partials if partials is not None else (q, q)  # unused pointers without chunk programs
    grid = (q.shape[0] if tiles is None else tiles.shape[0], kv_heads) + (() if partials is None else (part.shape[2],))
    stride_on = out.stride(0) if out is not None else heads * dim
    block_g = next_pow2(heads // kv_heads)
    block_m, warps = decode_tile(block_g, dim) if tiles is None else (BLOCK_M, tile_warps(block_g, dim))
    _prefill_kernel[grid](
        q, keys, values, tables, slots, positions, tiles if tiles is not None else slots,
        out if out is not None else q, part, ml, 1.0 / math.sqrt(dim),
        q.stride(0), q.stride(1), stride_on, out.stride(1) if out is not None else dim, tables.stride(0),
        keys.stride(0), keys.stride(1), keys.stride(2), values.stride(0), values.stride(1), values.stride(2),
        G=heads // kv_heads, D=dim, PAGE=keys.shape[1], BLOCK_M=block_m, BLOCK_G=block_g,
        BLOCK_N=BLOCK_N, EXACT=q.dtype == torch.float32, CHUNK=chunk, DECODE=tiles is None,
        CHUNK_PROGRAMS=partials is not None, num_warps=warps, num_stages=2)


def prefill_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, tables: torch.Tensor,
                      slots: torch.Tensor, positions: torch.Tensor, tiles: torch.Tensor, chunk: int = 0
                      ) -> torch.Tensor:
    """q [N, H, D] of tokens at `positions` [N] of rows `slots` [N] -> [N, H, D]: causal softmax attention of each
    token over its row's positions <= its own, through the block tables. Tokens outside every tile are left
    unwritten. `chunk` > 0: the keys in chunks of that many positions merged in order (the exact mode's order)."""
    q = check_paged("prefill_attention", "[N, H, D]", q, keys, values, tables)[0]
    out = torch.empty(q.shape, device=q.device, dtype=q.dtype)
    launch(q, keys, values, tables, slots, positions, tiles, out, chunk=chunk)
    return out
