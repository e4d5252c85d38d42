"""Grouped GEMMs over an expert-sorted batch, with the SwiGLU activation fused, forward and backward.

Rows of expert e are the contiguous block [offset_e, offset_e + count_e) of the sorted batch. Each program of the
row-grouped kernel finds its expert and row tile from `counts` alone (a cumulative sum over at most a few hundred
experts, in registers), so no tile schedule is built on the host and nothing synchronises with it. The grid is
the upper bound cdiv(N, BM) + E tiles; programs past the real tile count return at once. Weight gradients
reduce over each expert's rows in a second kernel, one program per (expert, output tile); empty experts get 0.

Forward:  gate_up = x @ w13[e]^T  (kept for backward),  act = silu(gate) * up,  y = act @ w2[e]^T
Backward: d_act = dy @ w2[e] -> d_gate_up through SwiGLU (fused epilogue),  dx = d_gate_up @ w13[e],
          dw2[e] = dy_e^T @ act_e,  dw13[e] = d_gate_up_e^T @ x_e
bf16 operands, fp32 accumulation and activation arithmetic.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._triton import INTERPRET, check_device, dot_acc, next_pow2

_PLAIN, _SWIGLU_FWD, _SWIGLU_BWD = 0, 1, 2


def _configs(wide_ok: bool) -> list[triton.Config]:
    if INTERPRET:  # small tiles so CPU tests cover partial and multi-tile experts at small shapes
        return [triton.Config({"BM": 16, "BN": 16, "BK": 16}, num_warps=4, num_stages=1)]
    configs = [
        triton.Config({"BM": 128, "BN": 128, "BK": 64}, num_warps=8, num_stages=4),
        triton.Config({"BM": 128, "BN": 128, "BK": 64}, num_warps=8, num_stages=3),
        triton.Config({"BM": 128, "BN": 128, "BK": 64}, num_warps=4, num_stages=4),
        triton.Config({"BM": 64, "BN": 128, "BK": 64}, num_warps=4, num_stages=4),
    ]
    if wide_ok:  # the fused gate/up kernel already holds two BN-wide accumulators
        configs += [triton.Config({"BM": 128, "BN": 256, "BK": 64}, num_warps=8, num_stages=3),
                    triton.Config({"BM": 128, "BN": 256, "BK": 64}, num_warps=8, num_stages=4),
                    triton.Config({"BM": 128, "BN": 128, "BK": 128}, num_warps=8, num_stages=3)]
    else:
        configs += [triton.Config({"BM": 128, "BN": 64, "BK": 64}, num_warps=4, num_stages=4),
                    triton.Config({"BM": 64, "BN": 128, "BK": 64}, num_warps=4, num_stages=5)]
    return configs


@triton.jit
def _expert_tile(counts_ptr, pid_m, E: tl.constexpr, BLOCK_E: tl.constexpr, BM: tl.constexpr):
    """Flat M-tile index -> (expert, first row of the tile, end row of the expert, number of real tiles)."""
    ecols = tl.arange(0, BLOCK_E)
    counts = tl.load(counts_ptr + ecols, mask=ecols < E, other=0).to(tl.int32)
    tiles = (counts + BM - 1) // BM
    tile_end = tl.cumsum(tiles, 0)
    row_end = tl.cumsum(counts, 0)
    e = tl.sum((tile_end <= pid_m).to(tl.int32), 0)
    this = ecols == e
    first_tile = tl.sum(tl.where(this, tile_end - tiles, 0), 0)
    expert_end = tl.sum(tl.where(this, row_end, 0), 0)
    expert_start = expert_end - tl.sum(tl.where(this, counts, 0), 0)
    return e, expert_start + (pid_m - first_tile) * BM, expert_end, tl.sum(tiles, 0)


_EVEN = {"EVEN_K": lambda args: args["K"] % args["BK"] == 0, "EVEN_N": lambda args: args["N_OUT"] % args["BN"] == 0}


@triton.jit
def _grouped_gemm_kernel(a_ptr, b_ptr, c_ptr, aux_ptr, counts_ptr, N_ROWS, N_OUT, K,
                         stride_am, stride_be, stride_bn, stride_bk, stride_cm, stride_auxm, up_offset,
                         E: tl.constexpr, BLOCK_E: tl.constexpr, EPILOGUE: tl.constexpr,
                         STORE_AUX: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr,
                         BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """C[rows of e] = epilogue(A[rows of e] @ B[e]), B[e][k, n] at b_ptr + e*stride_be + n*stride_bn + k*stride_bk.
    EPILOGUE _SWIGLU_FWD: a second product with B rows shifted by up_offset gives `up`; C = silu(gate) * up and,
    if STORE_AUX, aux = [gate | up]. EPILOGUE _SWIGLU_BWD: acc is d_act; aux holds [gate | up]; C = [d_gate | d_up]."""
    pid = tl.program_id(0)
    num_n = tl.cdiv(N_OUT, BN)
    pid_m = pid // num_n
    pid_n = pid % num_n
    e, row0, row_end, total_tiles = _expert_tile(counts_ptr, pid_m, E, BLOCK_E, BM)
    if pid_m >= total_tiles:
        return
    rows = row0 + tl.arange(0, BM)
    cols = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    # Rows past this expert and columns past N_OUT load valid memory and are masked at the store, which keeps
    # the inner loop free of row/column masks. Clamping columns hides their contiguity from the compiler (scalar
    # loads when B is contiguous along n: 20x slower backward), so it is done only for a ragged last tile.
    rows_in = tl.minimum(rows, N_ROWS - 1).to(tl.int64)
    cols_in = cols if EVEN_N else tl.minimum(cols, N_OUT - 1)
    a_ptrs = a_ptr + rows_in[:, None] * stride_am + rk[None, :]
    b_ptrs = b_ptr + e.to(tl.int64) * stride_be + cols_in[None, :] * stride_bn + rk[:, None] * stride_bk
    acc = tl.zeros((BM, BN), tl.float32)
    acc_up = tl.zeros((BM, BN), tl.float32)
    for k0 in range(0, K, BK):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            k_ok = rk < K - k0
            a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_ok[:, None], other=0.0)
        acc = dot_acc(a, b, acc)
        if EPILOGUE == 1:
            if EVEN_K:
                b_up = tl.load(b_ptrs + up_offset)
            else:
                b_up = tl.load(b_ptrs + up_offset, mask=k_ok[:, None], other=0.0)
            acc_up = dot_acc(a, b_up, acc_up)
        a_ptrs += BK
        b_ptrs += BK * stride_bk

    out_rows = rows.to(tl.int64)[:, None]
    mask = (rows < row_end)[:, None] & (cols < N_OUT)[None, :]
    c_ptrs = c_ptr + out_rows * stride_cm + cols[None, :]
    if EPILOGUE == 0:
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask)
    elif EPILOGUE == 1:
        if STORE_AUX:
            aux_ptrs = aux_ptr + out_rows * stride_auxm + cols[None, :]
            tl.store(aux_ptrs, acc.to(aux_ptr.dtype.element_ty), mask=mask)
            tl.store(aux_ptrs + N_OUT, acc_up.to(aux_ptr.dtype.element_ty), mask=mask)
        act = acc * tl.sigmoid(acc) * acc_up
        tl.store(c_ptrs, act.to(c_ptr.dtype.element_ty), mask=mask)
    else:
        aux_ptrs = aux_ptr + out_rows * stride_auxm + cols[None, :]
        gate = tl.load(aux_ptrs, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(aux_ptrs + N_OUT, mask=mask, other=0.0).to(tl.float32)
        sig = tl.sigmoid(gate)
        d_gate = acc * up * sig * (1.0 + gate * (1.0 - sig))
        d_up = acc * gate * sig
        tl.store(c_ptrs, d_gate.to(c_ptr.dtype.element_ty), mask=mask)
        tl.store(c_ptrs + N_OUT, d_up.to(c_ptr.dtype.element_ty), mask=mask)


_KEY = ["N_OUT", "K", "EPILOGUE"]
_with_even = triton.heuristics(_EVEN)(_grouped_gemm_kernel)
_gemm_swiglu = triton.autotune(_configs(wide_ok=False), key=_KEY)(_with_even)
_gemm_plain = triton.autotune(_configs(wide_ok=True), key=_KEY)(_with_even)


@triton.autotune(_configs(wide_ok=True), key=["M_OUT", "N_OUT"])
@triton.heuristics({"EVEN_MN": lambda args: args["M_OUT"] % args["BM"] == 0 and args["N_OUT"] % args["BN"] == 0})
@triton.jit
def _grouped_wgrad_kernel(a_ptr, b_ptr, c_ptr, counts_ptr, M_OUT, N_OUT, stride_am, stride_bm, stride_ce,
                          E: tl.constexpr, BLOCK_E: tl.constexpr, EVEN_MN: tl.constexpr,
                          BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """C[e] = A[rows of e]^T @ B[rows of e]: A [N, M_OUT], B [N, N_OUT], C [E, M_OUT, N_OUT]."""
    pid = tl.program_id(0)
    e = tl.program_id(1)
    num_n = tl.cdiv(N_OUT, BN)
    rm = (pid // num_n) * BM + tl.arange(0, BM)
    rn = (pid % num_n) * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    ecols = tl.arange(0, BLOCK_E)
    counts = tl.load(counts_ptr + ecols, mask=ecols < E, other=0).to(tl.int32)
    count = tl.sum(tl.where(ecols == e, counts, 0), 0)
    start = tl.sum(tl.where(ecols < e, counts, 0), 0)
    # both operands are contiguous along the output dims: clamp only ragged tiles (see _grouped_gemm_kernel)
    rm_in = rm if EVEN_MN else tl.minimum(rm, M_OUT - 1)
    rn_in = rn if EVEN_MN else tl.minimum(rn, N_OUT - 1)
    acc = tl.zeros((BM, BN), tl.float32)
    for k0 in range(0, count, BK):
        k_ok = k0 + rk < count
        rows = (start + k0 + rk).to(tl.int64)
        a = tl.load(a_ptr + rows[:, None] * stride_am + rm_in[None, :], mask=k_ok[:, None], other=0.0)
        b = tl.load(b_ptr + rows[:, None] * stride_bm + rn_in[None, :], mask=k_ok[:, None], other=0.0)
        acc = dot_acc(tl.trans(a), b, acc)
    mask = (rm < M_OUT)[:, None] & (rn < N_OUT)[None, :]
    tl.store(c_ptr + e.to(tl.int64) * stride_ce + rm[:, None] * N_OUT + rn[None, :],
             acc.to(c_ptr.dtype.element_ty), mask=mask)


def _grouped_gemm(kernel, a, b, b_strides, counts, n_out, epilogue, out, aux=None, store_aux=False,
                  up_offset=0):
    n_rows, k = a.shape
    num_experts = b.shape[0]
    if n_rows == 0:
        return out

    def grid(meta):
        return ((triton.cdiv(n_rows, meta["BM"]) + num_experts) * triton.cdiv(n_out, meta["BN"]),)

    kernel[grid](a, b, out, aux if aux is not None else out, counts, n_rows, n_out, k,
                 a.stride(0), b.stride(0), b_strides[0], b_strides[1], out.stride(0),
                 aux.stride(0) if aux is not None else 0, up_offset,
                 E=num_experts, BLOCK_E=next_pow2(num_experts), EPILOGUE=epilogue, STORE_AUX=store_aux)
    return out


def _grouped_wgrad(a, b, counts, num_experts, dtype):
    """[E, a.shape[1], b.shape[1]]: per expert, a_e^T @ b_e."""
    m_out, n_out = a.shape[1], b.shape[1]
    if a.shape[0] == 0:  # an EP rank can receive no rows at all
        return torch.zeros(num_experts, m_out, n_out, device=a.device, dtype=dtype)
    out = torch.empty(num_experts, m_out, n_out, device=a.device, dtype=dtype)

    def grid(meta):
        return (triton.cdiv(m_out, meta["BM"]) * triton.cdiv(n_out, meta["BN"]), num_experts)

    _grouped_wgrad_kernel[grid](a, b, out, counts, m_out, n_out, a.stride(0), b.stride(0), out.stride(0),
                                E=num_experts, BLOCK_E=next_pow2(num_experts))
    return out


class _SwiGLUExperts(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, counts, w13, w2, training):
        n, hidden = x.shape
        width = w2.shape[2]
        act = torch.empty(n, width, device=x.device, dtype=x.dtype)
        gate_up = torch.empty(n, 2 * width, device=x.device, dtype=x.dtype) if training else None
        # w13[e] as B[k, n] = w13[e, n, k]; up rows start `width` rows further down
        _grouped_gemm(_gemm_swiglu, x, w13, (w13.stride(1), w13.stride(2)), counts, width, _SWIGLU_FWD, act,
                      aux=gate_up, store_aux=training, up_offset=width * w13.stride(1))
        y = torch.empty(n, hidden, device=x.device, dtype=x.dtype)
        _grouped_gemm(_gemm_plain, act, w2, (w2.stride(1), w2.stride(2)), counts, hidden, _PLAIN, y)
        ctx.save_for_backward(x, counts, w13, w2, gate_up, act)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, counts, w13, w2, gate_up, act = ctx.saved_tensors
        dy = dy.contiguous()
        n, hidden = x.shape
        num_experts, width = w2.shape[0], w2.shape[2]
        d_gate_up = torch.empty(n, 2 * width, device=x.device, dtype=x.dtype)
        # w2[e] as B[k, n] = w2[e, k, n]
        _grouped_gemm(_gemm_plain, dy, w2, (w2.stride(2), w2.stride(1)), counts, width, _SWIGLU_BWD, d_gate_up,
                      aux=gate_up)
        dx = dw13 = dw2 = None
        if ctx.needs_input_grad[0]:
            dx = torch.empty(n, hidden, device=x.device, dtype=x.dtype)
            _grouped_gemm(_gemm_plain, d_gate_up, w13, (w13.stride(2), w13.stride(1)), counts, hidden, _PLAIN, dx)
        if ctx.needs_input_grad[2]:
            dw13 = _grouped_wgrad(d_gate_up, x, counts, num_experts, w13.dtype)
        if ctx.needs_input_grad[3]:
            dw2 = _grouped_wgrad(dy, act, counts, num_experts, w2.dtype)
        return dx, None, dw13, dw2, None


def swiglu_experts(x_sorted: torch.Tensor, counts: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """x_sorted [N, h] grouped by expert, counts [E] (sum N, zeros allowed), w13 [E, 2I, h], w2 [E, h, I] ->
    [N, h]: row r of expert e is w2[e] @ (silu(w13[e, :I] @ x_r) * (w13[e, I:] @ x_r))."""
    check_device("x_sorted", x_sorted)
    if x_sorted.dim() != 2 or w13.dim() != 3 or w2.dim() != 3:
        raise ValueError(f"experts needs x_sorted [N, h], w13 [E, 2I, h], w2 [E, h, I]; got "
                         f"{tuple(x_sorted.shape)}, {tuple(w13.shape)}, {tuple(w2.shape)}")
    num_experts, two_width, hidden = w13.shape
    if (two_width % 2 or x_sorted.shape[1] != hidden or tuple(w2.shape) != (num_experts, hidden, two_width // 2)
            or tuple(counts.shape) != (num_experts,)):
        raise ValueError(f"experts shapes disagree: x_sorted {tuple(x_sorted.shape)}, counts {tuple(counts.shape)}, "
                         f"w13 {tuple(w13.shape)} (want [E, 2I, h]), w2 {tuple(w2.shape)} (want [E, h, I])")
    if not (x_sorted.dtype == w13.dtype == w2.dtype):
        raise ValueError(f"experts dtypes must match: x_sorted {x_sorted.dtype}, w13 {w13.dtype}, w2 {w2.dtype}")
    # autograd disables grad mode inside forward, so whether to keep gate_up for backward is decided here
    training = torch.is_grad_enabled() and any(t.requires_grad for t in (x_sorted, w13, w2))
    return _SwiGLUExperts.apply(x_sorted.contiguous(), counts.contiguous(), w13.contiguous(), w2.contiguous(),
                                training)
