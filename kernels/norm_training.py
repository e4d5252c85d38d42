"""RMSNorm for mixed-precision training, forward and backward each one kernel, optionally followed by the rotary
embedding (Qwen3's q_norm / k_norm then RoPE on every head). The plain modules under bf16 autocast over float32
master weights make about a dozen float32 passes over each activation per direction (the float32 copy, its
square, mean, scale, cast back, the float32 weight product, then RoPE's two products, its half-swap `cat`, the
sum and the cast autocast adds before the next matmul); these read the input once and write the output once.

Numerics are the plain modules' (Hugging Face's order): normalise in float32, round to x's dtype, scale by the
weight in float32, apply RoPE in float32, then round once to `out_dtype` (which autocast would do before the next
matmul or attention). The backward is the exact derivative of that forward with the roundings taken as identity,
computed in float32 (the plain autograd graph also rounds the normalised value's gradient to x's dtype).

Backward, per row with r = rsqrt(mean(x^2) + eps), n = x r, o = w n, g = dL/do . w:
  dL/dx = r g - x r^3 mean(g x),  dL/dw = sum over rows of dL/do . n
RoPE (half rotation, out[c] = o[c] cos[c] + s(c) o[p(c)] sin[c], p the partner column D/2 away, s = -1 on the first
half): dL/do[j] = dy[j] cos[j] + s(p(j)) dy[p(j)] sin[p(j)], s(p(j)) = +1 on the first half."""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ._triton import INTERPRET, check_device, multiprocessors, next_pow2


@triton.jit
def _norm_forward_kernel(x_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr, rstd_ptr, rows, N, heads, eps,
                         HAS_ROPE: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    c = tl.arange(0, BLOCK)
    row_ok = r < rows
    col_ok = c < N
    mask = row_ok[:, None] & col_ok[None, :]
    base = r[:, None].to(tl.int64) * N
    x = tl.load(x_ptr + base + c[None, :], mask=mask, other=0.0)
    x32 = x.to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(x32 * x32, axis=1) / N + eps)
    w = tl.load(w_ptr + c, mask=col_ok, other=0.0).to(tl.float32)
    out = w[None, :] * (x32 * rstd[:, None]).to(x.dtype).to(tl.float32)
    if HAS_ROPE:
        half = N // 2
        pc = tl.where(c < half, c + half, c - half)
        xp = tl.load(x_ptr + base + pc[None, :], mask=mask, other=0.0)
        wp = tl.load(w_ptr + pc, mask=col_ok, other=0.0).to(tl.float32)
        partner = wp[None, :] * (xp.to(tl.float32) * rstd[:, None]).to(x.dtype).to(tl.float32)
        partner = tl.where(c[None, :] < half, -partner, partner)
        token = (r // heads).to(tl.int64)
        cos = tl.load(cos_ptr + token[:, None] * N + c[None, :], mask=mask, other=0.0).to(tl.float32)
        sin = tl.load(sin_ptr + token[:, None] * N + c[None, :], mask=mask, other=0.0).to(tl.float32)
        out = out * cos + partner * sin
    tl.store(out_ptr + base + c[None, :], out.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(rstd_ptr + r, rstd, mask=row_ok)


@triton.jit
def _norm_backward_kernel(dy_ptr, dy_stride_t, dy_stride_h, x_ptr, w_ptr, cos_ptr, sin_ptr, rstd_ptr, dx_ptr,
                          dw_ptr, rows, N, heads, HAS_ROPE: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """Each program walks row blocks pid, pid + programs, ...; its share of dL/dw goes to dw_ptr[pid]."""
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    c = tl.arange(0, BLOCK)
    col_ok = c < N
    w = tl.load(w_ptr + c, mask=col_ok, other=0.0).to(tl.float32)
    dw = tl.zeros((BLOCK,), tl.float32)
    for block in range(pid, tl.cdiv(rows, ROWS), programs):
        r = block * ROWS + tl.arange(0, ROWS)
        row_ok = r < rows
        mask = row_ok[:, None] & col_ok[None, :]
        token = (r // heads).to(tl.int64)
        dy_row = token * dy_stride_t + (r % heads).to(tl.int64) * dy_stride_h
        dy = tl.load(dy_ptr + dy_row[:, None] + c[None, :], mask=mask, other=0.0).to(tl.float32)
        if HAS_ROPE:
            half = N // 2
            pc = tl.where(c < half, c + half, c - half)
            dyp = tl.load(dy_ptr + dy_row[:, None] + pc[None, :], mask=mask, other=0.0).to(tl.float32)
            cos = tl.load(cos_ptr + token[:, None] * N + c[None, :], mask=mask, other=0.0).to(tl.float32)
            sinp = tl.load(sin_ptr + token[:, None] * N + pc[None, :], mask=mask, other=0.0).to(tl.float32)
            dy = dy * cos + tl.where(c[None, :] < half, dyp * sinp, -dyp * sinp)
        base = r[:, None].to(tl.int64) * N
        x = tl.load(x_ptr + base + c[None, :], mask=mask, other=0.0)
        x32 = x.to(tl.float32)
        rstd = tl.load(rstd_ptr + r, mask=row_ok, other=0.0)
        dw += tl.sum(dy * (x32 * rstd[:, None]).to(x.dtype).to(tl.float32), axis=0)
        g = dy * w[None, :]
        mean_gx = tl.sum(g * x32, axis=1) / N
        dx = rstd[:, None] * g - x32 * (rstd * rstd * rstd * mean_gx)[:, None]
        tl.store(dx_ptr + base + c[None, :], dx.to(dx_ptr.dtype.element_ty), mask=mask)
    tl.store(dw_ptr + pid * N + c, dw, mask=col_ok)


def _rows_per_program(n: int) -> int:
    return max(1, min(32, 4096 // next_pow2(n)))


@functools.cache
def _programs(device_index: int) -> int:
    # a few per multiprocessor; a few under the interpreter, so the row-block loop's stride is exercised
    return 3 if INTERPRET else 4 * multiprocessors(device_index)


class _NormRope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, cos, sin, eps, out_dtype):
        """x [tokens, heads, N] contiguous; cos/sin [tokens, N] float32 or None."""
        tokens, heads, n = x.shape
        rows = tokens * heads
        out = torch.empty(x.shape, device=x.device, dtype=out_dtype)
        rstd = torch.empty(rows, device=x.device, dtype=torch.float32)
        rope = cos is not None
        per = _rows_per_program(n)
        if rows:
            _norm_forward_kernel[(triton.cdiv(rows, per),)](
                x, weight, cos if rope else x, sin if rope else x, out, rstd, rows, n, heads, eps,
                HAS_ROPE=rope, ROWS=per, BLOCK=next_pow2(n), num_warps=8 if n >= 1024 else 4)
        ctx.save_for_backward(x, weight, rstd, cos, sin)
        return out

    @staticmethod
    def backward(ctx, dy):
        x, weight, rstd, cos, sin = ctx.saved_tensors
        tokens, heads, n = x.shape
        rows = tokens * heads
        # dy may be strided over (token, head) (the gradient of a transposed attention input): read in place as
        # long as its last dimension is contiguous
        dy3 = dy if dy.stride(2) == 1 else dy.contiguous()
        dx = torch.empty_like(x)
        per = _rows_per_program(n)
        programs = max(1, min(_programs(x.device.index or 0), triton.cdiv(rows, per)))
        dw = torch.zeros(programs, n, device=x.device, dtype=torch.float32)
        rope = cos is not None
        if rows:
            _norm_backward_kernel[(programs,)](
                dy3, dy3.stride(0), dy3.stride(1), x, weight, cos if rope else x, sin if rope else x, rstd, dx, dw,
                rows, n, heads, HAS_ROPE=rope, ROWS=per, BLOCK=next_pow2(n), num_warps=8 if n >= 1024 else 4)
        return dx, dw.sum(0).to(weight.dtype), None, None, None, None


def rms_norm_training(x: torch.Tensor, weight: torch.Tensor, eps: float, out_dtype: torch.dtype,
                      rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """weight * RMSNorm(x) over the last dimension, in `out_dtype`, with autograd to x and weight.

    rope: (cos, sin) [T, D] for x [..., T', heads, D] with T' x (leading dims) = T tokens: the rotary embedding of
    token t applied to each of its heads' normalised rows (q_norm/k_norm then RoPE)."""
    check_device("x", x)
    n = x.shape[-1]
    if weight.shape != (n,):
        raise ValueError(f"rms_norm_training needs a weight [{n}]; got {tuple(weight.shape)}")
    heads, cos, sin = 1, None, None
    if rope is not None:
        heads = x.shape[-2] if x.dim() >= 2 else 0
        cos, sin = (t.reshape(-1, n).float().contiguous() for t in rope)
        if n % 2 or heads == 0 or cos.shape[0] * heads != x.numel() // n or sin.shape != cos.shape:
            raise ValueError(f"rope: cos/sin {tuple(rope[0].shape)}/{tuple(rope[1].shape)} do not give one even row "
                             f"of {n} per token of x {tuple(x.shape)} (heads on dim -2)")
    out = _NormRope.apply(x.reshape(-1, heads, n).contiguous(), weight.contiguous(), cos, sin, float(eps), out_dtype)
    return out.view(x.shape)
