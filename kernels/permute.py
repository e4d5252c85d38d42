"""Token permutation into expert-sorted order and the weighted combine back, with their backward passes.

The layout (where each (token, slot) lands) is a counting sort computed on the device: per-chunk expert histograms
stored expert-major ([E, chunks]), so that one flat prefix sum over them gives, for every (expert, chunk), the
first sorted row of that expert's elements in that chunk; each element then adds its rank among equal ids inside
its chunk. That keeps the order stable in (token, slot) order and gives per-expert counts without a host
synchronisation, in four launches.

Two row movers serve all four directions:
  scatter: token rows -> sorted rows, out[dest[t, j]] = scale[t, j] * src[t]  (permute; unpermute's backward,
           which also needs d weights[t, j] = <d out[t], y_sorted[dest[t, j]]>, fused as an optional dot)
  combine: sorted rows -> token rows, out[t] = sum_j w[t, j] * src[dest[t, j]] in fp32  (unpermute; permute's
           backward with w = 1)
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ._triton import INTERPRET, check_device, next_pow2

_LAYOUT_BLOCK = 128  # elements per chunk: the in-chunk rank compares all pairs, BLOCK^2 work per chunk


def _row_configs() -> list[triton.Config]:
    """Tokens per program (BLOCK_T) and warps for the row movers; each program loops over the hidden dim."""
    if INTERPRET:
        return [triton.Config({"BLOCK_T": 4}, num_warps=4)]
    return [triton.Config({"BLOCK_T": t}, num_warps=w) for t, w in ((1, 4), (4, 4), (4, 8), (8, 8))]


@triton.jit
def _chunk_histogram_kernel(ids_ptr, hist_ptr, n, E, CHUNKS, BLOCK: tl.constexpr):
    """hist[e, chunk] = elements of this chunk routed to expert e (hist zeroed by the caller)."""
    chunk = tl.program_id(0)
    offs = chunk * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    ids = tl.load(ids_ptr + offs, mask=ok, other=0).to(tl.int32)
    # an id outside [0, E) is the caller's bug; masking it keeps the kernel inside its buffers
    tl.atomic_add(hist_ptr + ids * CHUNKS + chunk, 1, mask=ok & (ids >= 0) & (ids < E))


@triton.jit
def _dest_rows_kernel(ids_ptr, hist_ptr, cum_ptr, dest_ptr, n, E, CHUNKS, BLOCK: tl.constexpr):
    """dest = (exclusive prefix of the expert-major histogram at (expert, chunk)) + (earlier equal ids inside the
    chunk)."""
    chunk = tl.program_id(0)
    r = tl.arange(0, BLOCK)
    offs = chunk * BLOCK + r
    ok = offs < n
    ids = tl.load(ids_ptr + offs, mask=ok, other=-1).to(tl.int32)
    earlier_equal = (ids[:, None] == ids[None, :]) & (r[None, :] < r[:, None])
    rank = tl.sum(earlier_equal.to(tl.int32), axis=1)
    at = ids * CHUNKS + chunk
    valid = ok & (ids >= 0) & (ids < E)
    base = tl.load(cum_ptr + at, mask=valid, other=0) - tl.load(hist_ptr + at, mask=valid, other=0)
    tl.store(dest_ptr + offs, base + rank, mask=ok)


@triton.autotune(_row_configs(), key=["H", "TOP_K", "HAS_SCALE", "HAS_DOT"])
@triton.jit
def _scatter_rows_kernel(src_ptr, dest_ptr, scale_ptr, out_ptr, dot_ptr, dscale_ptr, T, H,
                         TOP_K: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_DOT: tl.constexpr,
                         BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr):
    """Each token row is read once and written to its TOP_K sorted rows."""
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = tokens < T
    kcols = tl.arange(0, BLOCK_K)
    dots = tl.zeros((BLOCK_T, BLOCK_K), tl.float32)
    for h0 in range(0, H, BLOCK_H):
        hcols = h0 + tl.arange(0, BLOCK_H)
        mask = t_ok[:, None] & (hcols[None, :] < H)
        x = tl.load(src_ptr + tokens[:, None].to(tl.int64) * H + hcols[None, :], mask=mask, other=0.0)
        for j in tl.static_range(TOP_K):
            dest = tl.load(dest_ptr + tokens * TOP_K + j, mask=t_ok, other=0).to(tl.int64)
            row = x
            if HAS_SCALE:
                scale = tl.load(scale_ptr + tokens * TOP_K + j, mask=t_ok, other=0.0)
                row = x.to(tl.float32) * scale[:, None]
            tl.store(out_ptr + dest[:, None] * H + hcols[None, :], row.to(out_ptr.dtype.element_ty), mask=mask)
            if HAS_DOT:
                other = tl.load(dot_ptr + dest[:, None] * H + hcols[None, :], mask=mask, other=0.0)
                part = tl.sum(x.to(tl.float32) * other.to(tl.float32), axis=1)
                dots += tl.where(kcols[None, :] == j, part[:, None], 0.0)
    if HAS_DOT:
        tl.store(dscale_ptr + tokens[:, None] * TOP_K + kcols[None, :], dots,
                 mask=t_ok[:, None] & (kcols[None, :] < TOP_K))


@triton.autotune(_row_configs(), key=["H", "TOP_K", "HAS_WEIGHT"])
@triton.jit
def _combine_rows_kernel(src_ptr, dest_ptr, weight_ptr, out_ptr, T, H,
                         TOP_K: tl.constexpr, HAS_WEIGHT: tl.constexpr,
                         BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr):
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = tokens < T
    for h0 in range(0, H, BLOCK_H):
        hcols = h0 + tl.arange(0, BLOCK_H)
        mask = t_ok[:, None] & (hcols[None, :] < H)
        acc = tl.zeros((BLOCK_T, BLOCK_H), tl.float32)
        for j in tl.static_range(TOP_K):
            src = tl.load(dest_ptr + tokens * TOP_K + j, mask=t_ok, other=0).to(tl.int64)
            y = tl.load(src_ptr + src[:, None] * H + hcols[None, :], mask=mask, other=0.0).to(tl.float32)
            if HAS_WEIGHT:
                y = y * tl.load(weight_ptr + tokens * TOP_K + j, mask=t_ok, other=0.0)[:, None]
            acc += y
        tl.store(out_ptr + tokens[:, None].to(tl.int64) * H + hcols[None, :],
                 acc.to(out_ptr.dtype.element_ty), mask=mask)


@dataclass(frozen=True)
class PermuteHandle:
    """What unpermute needs: the sorted row of each (token, slot), flattened [T*k] int32."""

    dest: torch.Tensor
    top_k: int


def expert_layout(ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [T, k] -> (dest [T*k] int32: the stable expert-sorted row of each (token, slot), counts [E] int64)."""
    flat = ids.reshape(-1)
    n = flat.numel()
    chunks = triton.cdiv(n, _LAYOUT_BLOCK)
    hist = torch.zeros(num_experts, chunks, device=ids.device, dtype=torch.int32)
    dest = torch.empty(n, device=ids.device, dtype=torch.int32)
    if n == 0:
        return dest, hist.sum(1, dtype=torch.int64)
    _chunk_histogram_kernel[(chunks,)](flat, hist, n, num_experts, chunks, BLOCK=_LAYOUT_BLOCK)
    cum = torch.cumsum(hist.view(-1), 0, dtype=torch.int32)
    _dest_rows_kernel[(chunks,)](flat, hist, cum, dest, n, num_experts, chunks, BLOCK=_LAYOUT_BLOCK)
    return dest, hist.sum(1, dtype=torch.int64)


def _block_h(hidden: int) -> int:
    return min(1024, next_pow2(hidden))


def _token_grid(tokens: int):
    return lambda meta: (triton.cdiv(tokens, meta["BLOCK_T"]),)


def _scatter(src, dest, top_k, scale=None, dot_with=None):
    """(out [T*k, H], d_scale [T, k] or None); see the module docstring."""
    T, H = src.shape
    out = torch.empty(T * top_k, H, device=src.device, dtype=src.dtype)
    d_scale = torch.empty(T, top_k, device=src.device, dtype=torch.float32) if dot_with is not None else None
    if T:
        _scatter_rows_kernel[_token_grid(T)](
            src, dest, scale if scale is not None else src, out, dot_with if dot_with is not None else src,
            d_scale if d_scale is not None else src, T, H, TOP_K=top_k, HAS_SCALE=scale is not None,
            HAS_DOT=dot_with is not None, BLOCK_H=_block_h(H), BLOCK_K=next_pow2(top_k))
    return out, d_scale


def _combine(src, dest, top_k, weights=None):
    """out [T, H] in src's dtype; see the module docstring."""
    T, H = src.shape[0] // top_k, src.shape[1]
    out = torch.empty(T, H, device=src.device, dtype=src.dtype)
    if T:
        _combine_rows_kernel[_token_grid(T)](
            src, dest, weights if weights is not None else src, out, T, H, TOP_K=top_k,
            HAS_WEIGHT=weights is not None, BLOCK_H=_block_h(H))
    return out


class _Permute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, ids, num_experts):
        dest, counts = expert_layout(ids, num_experts)
        x_sorted, _ = _scatter(x, dest, ids.shape[1])
        ctx.save_for_backward(dest)
        ctx.top_k = ids.shape[1]
        ctx.mark_non_differentiable(counts, dest)
        return x_sorted, counts, dest

    @staticmethod
    def backward(ctx, d_x_sorted, _d_counts, _d_dest):
        (dest,) = ctx.saved_tensors
        return _combine(d_x_sorted.contiguous(), dest, ctx.top_k), None, None


class _Unpermute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y_sorted, weights, dest, top_k):
        ctx.save_for_backward(y_sorted, weights, dest)
        ctx.top_k = top_k
        return _combine(y_sorted, dest, top_k, weights)

    @staticmethod
    def backward(ctx, d_out):
        y_sorted, weights, dest = ctx.saved_tensors
        need_dw = ctx.needs_input_grad[1]
        d_y, d_w = _scatter(d_out.contiguous(), dest, ctx.top_k, scale=weights,
                            dot_with=y_sorted if need_dw else None)
        return d_y, d_w, None, None


def permute(x: torch.Tensor, ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, PermuteHandle]:
    """x [T, h], ids [T, k] in [0, num_experts) -> (x_sorted [T*k, h], counts [E] int64, handle); stable in
    (token, slot) order."""
    check_device("x", x)
    if x.dim() != 2 or ids.dim() != 2 or ids.shape[0] != x.shape[0]:
        raise ValueError(f"permute needs x [T, h] and ids [T, k] with the same T; "
                         f"got x {tuple(x.shape)}, ids {tuple(ids.shape)}")
    if num_experts < 1:
        raise ValueError(f"num_experts={num_experts} must be >= 1")
    x_sorted, counts, dest = _Permute.apply(x.contiguous(), ids.contiguous(), num_experts)
    return x_sorted, counts, PermuteHandle(dest, ids.shape[1])


def unpermute(y_sorted: torch.Tensor, weights: torch.Tensor, handle: PermuteHandle) -> torch.Tensor:
    """y_sorted [T*k, h], weights [T, k] -> out [T, h] = sum_j weights[t, j] * y(t, j), fp32 sums."""
    check_device("y_sorted", y_sorted)
    if weights.dim() != 2 or weights.shape[1] != handle.top_k or y_sorted.shape[0] != weights.numel():
        raise ValueError(f"unpermute needs y_sorted [T*k, h] and weights [T, k={handle.top_k}]; got y_sorted "
                         f"{tuple(y_sorted.shape)}, weights {tuple(weights.shape)}")
    return _Unpermute.apply(y_sorted.contiguous(), weights.float().contiguous(), handle.dest, handle.top_k)
