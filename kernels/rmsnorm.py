"""RMSNorm in one kernel (Hugging Face's order: normalise in float32, cast back, then scale by the weight), with
two optional fusions of what the rollout engine's decode step does around it: the residual add before it
(h + delta, also returned) and the rotary embedding after it (queries and keys: q_norm/k_norm then RoPE). At one
token per row the plain forms' dozen elementwise launches cost more than the data they touch. Each elementwise
step rounds to x's dtype where the PyTorch ops would, so the results match them up to the order of the sum of
squares."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._triton import INTERPRET, check_device, next_pow2


@triton.jit
def _rmsnorm_kernel(x_ptr, res_ptr, sum_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr, rows, N, heads, stride_t, split,
                    eps, HAS_RESIDUAL: tl.constexpr, HAS_ROPE: tl.constexpr, ROWS: tl.constexpr,
                    BLOCK: tl.constexpr):
    """Row r is head r % heads of token r // heads; x's tokens are stride_t apart (its heads contiguous), every
    other tensor is contiguous [rows, N]. Heads from `split` on are scaled by the weight's second row."""
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    c = tl.arange(0, BLOCK)
    row_ok = r < rows
    mask = row_ok[:, None] & (c[None, :] < N)
    at = r[:, None].to(tl.int64) * N + c[None, :]
    x_row = (r // heads).to(tl.int64) * stride_t + (r % heads) * N
    w_row = tl.where((r % heads) >= split, N, 0)
    x = tl.load(x_ptr + x_row[:, None] + c[None, :], mask=mask, other=0.0)
    if HAS_RESIDUAL:  # h + delta, rounded as the add would be, is both returned and normalised
        x = (x.to(tl.float32) + tl.load(res_ptr + at, mask=mask, other=0.0).to(tl.float32)).to(x.dtype)
        tl.store(sum_ptr + at, x, mask=mask)
    x32 = x.to(tl.float32)
    inv = tl.math.rsqrt(tl.sum(x32 * x32, axis=1) / N + eps)
    w = tl.load(w_ptr + w_row[:, None] + c[None, :], mask=mask, other=0.0).to(tl.float32)
    out = (w * (x32 * inv[:, None]).to(x.dtype).to(tl.float32)).to(x.dtype)
    if HAS_ROPE:  # half rotation: out * cos + cat(-out[D/2:], out[:D/2]) * sin, each product rounded
        half = N // 2
        partner_c = tl.where(c < half, c + half, c - half)
        partner = tl.load(x_ptr + x_row[:, None] + partner_c[None, :], mask=mask, other=0.0)
        if HAS_RESIDUAL:
            partner = (partner.to(tl.float32) + tl.load(res_ptr + r[:, None].to(tl.int64) * N + partner_c[None, :],
                                                        mask=mask, other=0.0).to(tl.float32)).to(x.dtype)
        wp = tl.load(w_ptr + w_row[:, None] + partner_c[None, :], mask=mask, other=0.0).to(tl.float32)
        partner = (wp * (partner.to(tl.float32) * inv[:, None]).to(x.dtype).to(tl.float32)).to(x.dtype)
        partner = tl.where(c[None, :] < half, -partner.to(tl.float32), partner.to(tl.float32)).to(x.dtype)
        token = (r // heads).to(tl.int64)
        cos = tl.load(cos_ptr + token[:, None] * N + c[None, :], mask=mask, other=0.0)
        sin = tl.load(sin_ptr + token[:, None] * N + c[None, :], mask=mask, other=0.0)
        a = (out.to(tl.float32) * cos.to(tl.float32)).to(x.dtype)
        b = (partner.to(tl.float32) * sin.to(tl.float32)).to(x.dtype)
        out = (a.to(tl.float32) + b.to(tl.float32)).to(x.dtype)
    tl.store(out_ptr + at, out, mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, residual: torch.Tensor | None = None,
             rope: tuple[torch.Tensor, torch.Tensor] | None = None, second_weight_from: int | None = None):
    """weight * (x * rsqrt(mean(x^2) + eps)) over the last dimension, in x's dtype (x, weight alike).

    residual: normalise x + residual instead and return (normalised, x + residual).
    rope: (cos, sin) [T, D] for x [T, heads, D] (or [B, S, heads, D] with T = B * S): apply the rotary embedding
    of token t to its heads' normalised rows.
    second_weight_from: weight is [2, D] and heads from this index on use its second row (the engine's queries and
    keys, q_norm then k_norm, normalised in one launch)."""
    check_device("x", x)
    want = x.shape[-1:] if second_weight_from is None else (2, x.shape[-1])
    if weight.dtype != x.dtype or tuple(weight.shape) != tuple(want) or not weight.is_contiguous():
        raise ValueError(f"rms_norm needs a contiguous weight {list(want)} of x's dtype {x.dtype}; got "
                         f"{tuple(weight.shape)} {weight.dtype}")
    n = x.shape[-1]
    heads = x.shape[-2] if rope is not None or second_weight_from is not None else 1
    split = heads if second_weight_from is None else second_weight_from
    # x may be a slice of wider token rows (the engine's fused q/k/v projection): read it in place when its heads
    # are contiguous, whatever the tokens' stride
    tokens = x.reshape(-1, heads, n)
    if residual is not None or tokens.stride(2) != 1 or tokens.stride(1) != n:
        tokens = tokens.contiguous()
    rows = tokens.shape[0] * heads
    out = torch.empty(rows, n, device=x.device, dtype=x.dtype)
    cos, sin = (t.reshape(-1, n).contiguous() for t in rope) if rope is not None else (out, out)
    if rope is not None and (cos.shape[0] != tokens.shape[0] or n % 2):
        raise ValueError(f"rope: cos/sin {tuple(rope[0].shape)} do not give one row of {n} per token of x "
                         f"{tuple(x.shape)}")
    res = residual.reshape(-1, n).contiguous() if residual is not None else out
    total = torch.empty_like(out) if residual is not None else out
    rows_per_program = max(1, min(16, 4096 // next_pow2(n)))
    _rmsnorm_kernel[(triton.cdiv(rows, rows_per_program),)](
        tokens, res, total, weight, cos, sin, out, rows, n, heads, tokens.stride(0), split, eps,
        HAS_RESIDUAL=residual is not None, HAS_ROPE=rope is not None, ROWS=rows_per_program, BLOCK=next_pow2(n))
    if residual is not None:
        return out.view(x.shape), total.view(x.shape)
    return out.view(x.shape)


@triton.jit
def _add_norm_project_kernel(x_ptr, res_ptr, sum_ptr, w_ptr, out_ptr, p_ptr, proj_ptr, N, P, eps,
                             BLOCK: tl.constexpr, BLOCK_P: tl.constexpr):
    """Program (t, j): token t's x + res and its RMSNorm (the same arithmetic as _rmsnorm_kernel; program j = 0
    stores both), then outputs j * BLOCK_P... of normed @ p.T (fp32 sums, rounded to proj's dtype)."""
    t = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK)
    ok = c < N
    x = tl.load(x_ptr + t * N + c, mask=ok, other=0.0)
    x = (x.to(tl.float32) + tl.load(res_ptr + t * N + c, mask=ok, other=0.0).to(tl.float32)).to(x.dtype)
    x32 = x.to(tl.float32)
    inv = tl.math.rsqrt(tl.sum(x32 * x32, axis=0) / N + eps)
    w = tl.load(w_ptr + c, mask=ok, other=0.0).to(tl.float32)
    normed = (w * (x32 * inv).to(x.dtype).to(tl.float32)).to(x.dtype)
    if tl.program_id(1) == 0:
        tl.store(sum_ptr + t * N + c, x, mask=ok)
        tl.store(out_ptr + t * N + c, normed, mask=ok)
    rows = tl.program_id(1) * BLOCK_P + tl.arange(0, BLOCK_P)
    p = tl.load(p_ptr + rows.to(tl.int64)[:, None] * N + c[None, :], mask=(rows < P)[:, None] & ok[None, :],
                other=0.0)
    proj = tl.sum(p.to(tl.float32) * normed.to(tl.float32)[None, :], axis=1)
    tl.store(proj_ptr + t * P + rows, proj.to(proj_ptr.dtype.element_ty), mask=rows < P)


def add_rms_norm_project(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                         proj: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(normed, x + residual, normed @ proj.T) in one launch, normed = rms_norm(x + residual) as `rms_norm` computes
    it: a decode step's post-attention norm with the router product that follows it (proj [E, h], a few experts'
    rows per program, so the small product is spread over the GPU instead of one GEMM's few tiles)."""
    for name, t in (("x", x), ("residual", residual), ("proj", proj)):
        check_device(name, t)
    n = x.shape[-1]
    if residual.shape != x.shape or weight.shape != (n,) or proj.dim() != 2 or proj.shape[1] != n \
            or weight.dtype != x.dtype:
        raise ValueError(f"add_rms_norm_project needs x = residual [..., {n}], weight [{n}] of x's dtype and proj "
                         f"[P, {n}]; got x {tuple(x.shape)}, residual {tuple(residual.shape)}, weight "
                         f"{tuple(weight.shape)} {weight.dtype}, proj {tuple(proj.shape)}")
    flat, res = x.reshape(-1, n).contiguous(), residual.reshape(-1, n).contiguous()
    tokens, outputs = flat.shape[0], proj.shape[0]
    normed, total = torch.empty_like(flat), torch.empty_like(flat)
    projected = torch.empty(tokens, outputs, device=x.device, dtype=proj.dtype)
    block_p = 2 if INTERPRET else 4
    if tokens:
        _add_norm_project_kernel[(tokens, triton.cdiv(outputs, block_p))](
            flat, res, total, weight, normed, proj.contiguous(), projected, n, outputs, eps, BLOCK=next_pow2(n),
            BLOCK_P=block_p)
    return normed.view(x.shape), total.view(x.shape), projected.view(*x.shape[:-1], outputs)
