"""x @ w.T for a few rows of x (a decode step's projections): a memory-bound product that reads w once.

One program per block of output columns holds every row of x: at one row the product is a multiply and a row sum
(no tensor-core tile to pad), at 2-16 rows one padded 16-row tl.dot per reduction block. fp32 accumulation, the
result rounded once to x's dtype, as a bf16 GEMM's output is.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._triton import INTERPRET, check_device, dot_acc, next_pow2, quick_bench, within

MAX_ROWS = 16


def _configs() -> list[triton.Config]:
    if INTERPRET:
        return [triton.Config({"BLOCK_N": 16, "BLOCK_K": 32}, num_warps=4)]
    shapes = [(16, 256, 4), (16, 512, 4), (32, 256, 4), (32, 512, 8), (64, 256, 8), (16, 1024, 8),
              # one row only (multiply and sum): more, smaller programs for the narrow products (o_proj at one
              # token ran at 1.2 TB/s with 128 programs of 16 columns)
              (8, 1024, 4), (8, 512, 2), (4, 1024, 4), (4, 2048, 4), (2, 2048, 4)]
    return [triton.Config({"BLOCK_N": n, "BLOCK_K": k}, num_warps=w) for n, k, w in shapes]


def _prune(configs, named_args, **kwargs):
    """The several-row path's tl.dot needs column blocks of at least 16; no reduction block much wider than K."""
    configs = [c for c in configs if kwargs.get("BLOCK_M", 1) == 1 or c.kwargs["BLOCK_N"] >= 16]
    return within(configs, "BLOCK_K", named_args["K"])


@triton.autotune(_configs(), key=["M_KEY", "N", "K"], do_bench=quick_bench,
                 prune_configs_by={"early_config_prune": _prune})
@triton.jit
def _gemv_kernel(x_ptr, w_ptr, out_ptr, M, N, K, stride_xm, stride_wn, M_KEY, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    rows = tl.arange(0, BLOCK_M)
    w_rows = w_ptr + cols.to(tl.int64)[:, None] * stride_wn
    if BLOCK_M == 1:
        acc1 = tl.zeros((BLOCK_N,), tl.float32)
        for k0 in tl.range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + ks, mask=ks < K, other=0.0).to(tl.float32)
            w = tl.load(w_rows + ks[None, :], mask=col_ok[:, None] & (ks < K)[None, :], other=0.0).to(tl.float32)
            acc1 += tl.sum(w * x[None, :], axis=1)
        tl.store(out_ptr + cols, acc1.to(out_ptr.dtype.element_ty), mask=col_ok)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        for k0 in tl.range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + rows[:, None] * stride_xm + ks[None, :], mask=(rows < M)[:, None] & (ks < K)[None, :],
                        other=0.0)
            w = tl.load(w_rows + ks[None, :], mask=col_ok[:, None] & (ks < K)[None, :], other=0.0)
            if x.dtype == tl.float32:  # full fp32 products (tl.dot would round fp32 operands to tf32)
                acc = tl.dot(x, tl.trans(w.to(tl.float32)), acc, input_precision="ieee")
            else:
                acc = dot_acc(x, tl.trans(w.to(x.dtype)), acc)
        tl.store(out_ptr + rows[:, None] * N + cols[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=(rows < M)[:, None] & col_ok[None, :])


def gemv(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [..., K] with at most MAX_ROWS rows, w [N, K] (rows contiguous) -> x @ w.T [..., N] in x's dtype."""
    check_device("x", x)
    check_device("w", w)
    K = x.shape[-1]
    flat = x.reshape(-1, K)
    M, N = flat.shape[0], w.shape[0]
    if M > MAX_ROWS or w.shape[1] != K or w.stride(1) != 1:
        raise ValueError(f"gemv takes at most {MAX_ROWS} rows of x and a row-major w [N, {K}]; got x "
                         f"{tuple(x.shape)}, w {tuple(w.shape)} with strides {w.stride()}")
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    out = torch.empty(M, N, device=x.device, dtype=x.dtype)
    if M:
        block_m = 1 if M == 1 else 16
        _gemv_kernel[lambda meta: (triton.cdiv(N, meta["BLOCK_N"]),)](
            flat, w, out, M, N, K, flat.stride(0), w.stride(0), next_pow2(M), BLOCK_M=block_m)
    return out.view(*x.shape[:-1], N)


# (rows rounded up to a power of 2, N, K, dtype, device index) -> whether gemv beat cuBLAS there
_FASTER: dict[tuple, bool] = {}


def decode_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """F.linear(x, w) for a decode step: through gemv where it reads the weights faster than cuBLAS on this GPU,
    timed once per shape on first use (cold weights: do_bench clears L2 between runs; never while a CUDA graph is
    being captured, where the first use of a shape keeps cuBLAS). More than MAX_ROWS rows, or a CPU: F.linear."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if not x.is_cuda or rows > MAX_ROWS or rows == 0 or w.stride(-1) != 1:
        return torch.nn.functional.linear(x, w)
    key = (next_pow2(rows), w.shape[0], w.shape[1], x.dtype, x.device.index)
    faster = _FASTER.get(key)
    if faster is None:
        if torch.cuda.is_current_stream_capturing():
            return torch.nn.functional.linear(x, w)
        cublas = quick_bench(lambda: torch.nn.functional.linear(x, w))
        ours = quick_bench(lambda: gemv(x, w))
        faster = _FASTER[key] = ours < cublas
    return gemv(x, w) if faster else torch.nn.functional.linear(x, w)
