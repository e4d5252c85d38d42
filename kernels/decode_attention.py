"""Decode attention over a paged KV cache: one query token per row, each row reading only its own first
`lengths[b]` positions through its block table (flash-decoding: the positions are split over programs, the partial
softmaxes merged by a second kernel). Static shapes: the rows' slots, block tables and lengths are device tensors,
so a CUDA graph can hold it and replay it while lengths grow and blocks are added.

Layouts: q [B, H, D]; keys/values [blocks, block_size, H_kv, D] (a layer of the rollout engine's block pool);
tables [slots, max_blocks] int (position p of slot s lives at block tables[s, p // block_size], offset
p % block_size); slots [B], lengths [B] int; H = G * H_kv (grouped-query attention: query head h reads kv head
h // G).
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ._triton import INTERPRET, check_device, dot_acc, multiprocessors, next_pow2

BLOCK_N = 16 if INTERPRET else 64  # key positions per step of walk_keys (the decode splits' and the prefill tiles')


@triton.jit
def paged_offsets(table, n, valid, PAGE: tl.constexpr):
    """Block and in-block offset (int64) of one row's positions `n`, through the row's block table."""
    block = tl.load(table + n // PAGE, mask=valid, other=0).to(tl.int64)
    return block, (n % PAGE).to(tl.int64)


@triton.jit
def online_softmax_step(scores, v, m, s_sum, acc, EXACT: tl.constexpr):
    """One key/value tile of flash attention's running softmax (masked scores are -inf): the new running max, the
    rescaled sum and the rescaled accumulator plus this tile's softmax-weighted values. A row that has seen no
    position yet (all -inf: the exact mode's chunk past a row's own position) stays at -inf, 0, 0, not NaN."""
    m_new = tl.maximum(m, tl.max(scores, axis=1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # m_new wherever the row has seen a position
    alpha = tl.exp(m - m_use)
    p = tl.exp(scores - m_use[:, None])
    s_sum = s_sum * alpha + tl.sum(p, axis=1)
    if EXACT:
        acc = tl.dot(p, v, acc * alpha[:, None], input_precision="ieee")
    else:
        acc = dot_acc(p.to(v.dtype), v, acc * alpha[:, None])
    return m_new, s_sum, acc


@triton.jit
def walk_keys(q, k_ptr, v_ptr, table, pos, kvh, lo, hi, sm_scale, mx, s_sum, acc,
              stride_kb, stride_kn, stride_kh, stride_vb, stride_vn, stride_vh,
              D: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr, EXACT: tl.constexpr):
    """The running softmax (mx, s_sum, acc) of query rows at positions `pos` carried over key positions [lo, hi)
    of one kv head in BLOCK_N steps from lo, each row seeing the positions <= its own: a decode split's program and
    a prefill tile's alike."""
    d = tl.arange(0, D)
    for start in range(lo, hi, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        valid = n < hi
        block, offset = paged_offsets(table, n, valid, PAGE)
        k = tl.load(k_ptr + (block * stride_kb + offset * stride_kn + kvh * stride_kh)[:, None] + d[None, :],
                    mask=valid[:, None], other=0.0)
        if EXACT:  # float32 caches: full-precision products, not TF32
            scores = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            scores = dot_acc(q, tl.trans(k), tl.zeros((q.shape[0], BLOCK_N), tl.float32))
        scores = tl.where(valid[None, :] & (n[None, :] <= pos[:, None]), scores * sm_scale, float("-inf"))
        v = tl.load(v_ptr + (block * stride_vb + offset * stride_vn + kvh * stride_vh)[:, None] + d[None, :],
                    mask=valid[:, None], other=0.0)
        mx, s_sum, acc = online_softmax_step(scores, v, mx, s_sum, acc, EXACT)
    return mx, s_sum, acc


@triton.jit
def _partial_kernel(q_ptr, k_ptr, v_ptr, table_ptr, slot_ptr, len_ptr, o_ptr, ml_ptr, sm_scale, split_len,
                    stride_qb, stride_qh, stride_t, stride_kb, stride_kn, stride_kh, stride_vb, stride_vn, stride_vh,
                    G: tl.constexpr, SPLITS: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr,
                    BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, EXACT: tl.constexpr):
    """Program (row b, kv head, split): softmax-weighted sum of V over positions [split * split_len, ...) below
    the row's length, unnormalised, with its running max and sum (o [B, H, SPLITS, D], ml [B, H, SPLITS, 2])."""
    b, kvh, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    slot = tl.load(slot_ptr + b).to(tl.int64)
    length = tl.load(len_ptr + b)
    lo = split * split_len
    hi = tl.minimum(lo + split_len, length)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, D)
    heads = kvh * G + g
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=g[:, None] < G, other=0.0)
    m = tl.full((BLOCK_G,), float("-inf"), tl.float32)
    s_sum = tl.zeros((BLOCK_G,), tl.float32)
    acc = tl.zeros((BLOCK_G, D), tl.float32)
    pos = length - 1 + tl.zeros((BLOCK_G,), tl.int32)  # one token: every query row at the row's last position
    m, s_sum, acc = walk_keys(q, k_ptr, v_ptr, table_ptr + slot * stride_t, pos, kvh, lo, hi, sm_scale, m, s_sum, acc,
                              stride_kb, stride_kn, stride_kh, stride_vb, stride_vn, stride_vh, D, PAGE, BLOCK_N, EXACT)
    out = (b * tl.num_programs(1) * G + heads) * SPLITS + split  # [B, H, SPLITS] index
    tl.store(o_ptr + out[:, None] * D + d[None, :], acc, mask=g[:, None] < G)
    tl.store(ml_ptr + out * 2, m, mask=g < G)
    tl.store(ml_ptr + out * 2 + 1, s_sum, mask=g < G)


@triton.jit
def _merge_kernel(o_ptr, ml_ptr, out_ptr, SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, D: tl.constexpr):
    """Program (row b, head h): merge the splits' partial softmaxes into the attention output [B, H, D]."""
    bh = tl.program_id(0)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, D)
    ok = s < SPLITS
    m = tl.load(ml_ptr + (bh * SPLITS + s) * 2, mask=ok, other=float("-inf"))
    s_sum = tl.load(ml_ptr + (bh * SPLITS + s) * 2 + 1, mask=ok, other=0.0)
    top = tl.max(m, axis=0)  # split 0 always holds position 0, so this is finite
    scale = tl.where(ok & (m > float("-inf")), tl.exp(m - top), 0.0)
    o = tl.load(o_ptr + (bh * SPLITS + s)[:, None] * D + d[None, :], mask=ok[:, None], other=0.0)
    out = tl.sum(o * scale[:, None], axis=0) / tl.sum(s_sum * scale, axis=0)
    tl.store(out_ptr + bh * D + d, out.to(out_ptr.dtype.element_ty))


def decode_splits(rows: int, kv_heads: int, max_len: int, device: torch.device) -> int:
    """Enough programs to cover the GPU's multiprocessors about twice, at least 64 positions per split (a short
    context or a large batch gets one split: no merge work where it does not pay)."""
    if INTERPRET:
        return 2
    # plain integer arithmetic and the cached count: host time on every eager decode step (triton.cdiv ~3 us)
    return max(1, min(-(-2 * multiprocessors(device.index or 0) // (rows * kv_heads)), -(-max_len // 64)))


def check_paged(kernel: str, q_layout: str, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                tables: torch.Tensor) -> tuple[torch.Tensor, int, int, int, int, int]:
    """The paged attention kernels' inputs checked -> (q with a unit last stride, q's first dimension, heads, head
    dim, block size, kv heads). The kernels read q's rows and heads through their strides, so a view (the engine's
    q shares its rows with k) is read in place; only a q whose last dimension is strided is copied."""
    for name, t in (("q", q), ("keys", keys), ("values", values), ("tables", tables)):
        check_device(name, t)
    first, heads, dim = q.shape
    _, page, kv_heads, _ = keys.shape
    if heads % kv_heads or keys.shape != values.shape or keys.shape[-1] != dim or keys.stride(-1) != 1 \
            or values.stride(-1) != 1 or dim != next_pow2(dim) or tables.dim() != 2 or tables.stride(-1) != 1:
        raise ValueError(f"{kernel} needs q {q_layout} with D a power of two and H a multiple of H_kv, "
                         f"keys = values [blocks, block_size, H_kv, D] with unit last stride and tables [slots, "
                         f"max_blocks] contiguous rows; got q {tuple(q.shape)}, keys {tuple(keys.shape)}, "
                         f"values {tuple(values.shape)}, tables {tuple(tables.shape)}")
    return (q if q.stride(-1) == 1 else q.contiguous()), first, heads, dim, page, kv_heads


def decode_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, tables: torch.Tensor,
                     slots: torch.Tensor, lengths: torch.Tensor, splits: int | None = None) -> torch.Tensor:
    """q [B, H, D], keys/values [blocks, block_size, H_kv, D], tables [slots, max_blocks], slots [B], lengths [B]
    (>= 1) -> [B, H, D]: softmax(q k^T / sqrt(D)) v over the first lengths[b] positions of row b's slot, read
    through its block table. `splits` fixes how many programs share a row's positions (default: from the GPU's
    size); under a CUDA graph it must not change between replays."""
    q, rows, heads, dim, page, kv_heads = check_paged("decode_attention", "[B, H, D]", q, keys, values, tables)
    group = heads // kv_heads
    max_len = tables.shape[1] * page
    splits = splits or decode_splits(rows, kv_heads, max_len, q.device)
    split_len = triton.cdiv(max_len, splits)
    partial = torch.empty(rows, heads, splits, dim, device=q.device, dtype=torch.float32)
    ml = torch.empty(rows, heads, splits, 2, device=q.device, dtype=torch.float32)
    _partial_kernel[(rows, kv_heads, splits)](
        q, keys, values, tables, slots, lengths, partial, ml, 1.0 / math.sqrt(dim), split_len,
        q.stride(0), q.stride(1), tables.stride(0), keys.stride(0), keys.stride(1), keys.stride(2),
        values.stride(0), values.stride(1), values.stride(2),
        G=group, SPLITS=splits, D=dim, PAGE=page, BLOCK_G=max(16, next_pow2(group)),
        BLOCK_N=BLOCK_N, EXACT=q.dtype == torch.float32,
        num_warps=4, num_stages=2)
    out = torch.empty(rows, heads, dim, device=q.device, dtype=q.dtype)
    _merge_kernel[(rows * heads,)](partial, ml, out, SPLITS=splits, BLOCK_S=next_pow2(splits), D=dim)
    return out
