"""x @ w.T whose every row is bitwise independent of the batch: how many rows there are, where the row sits and
what its neighbours hold. The exact numerics mode's product for the dense projections and the LM head, the same
kernel at a decode step's few rows and a packed forward's thousands, so the rollout engine and the trainer agree
bitwise.

What a fast GEMM varies with the batch, this fixes:
- the reduction over K in one program, in 16-wide tensor-core steps from 0 (no split-K, whose partial sums a small
  batch would otherwise be given to fill the GPU);
- the instructions: bf16/fp16 operands on the tensor cores with fp32 accumulation, fp32 operands as
  full-precision products (never TF32), the result rounded once to x's dtype.
What it lets vary is the tile (rows, columns and K per program, warps, pipeline depth), chosen by the problem's size
like any GEMM's: on the H200 every tile of TILES, and every other one measured from 16 to 256 rows and columns and
64 or 128 deep, gives a 16-bit product's every element the same bits (kernels/bench_invariant_tiles.py;
tests/kernels/test_invariant_matmul.py holds TILES to it on the GPU). A row's result is a chain of the same
tensor-core products over K whatever tile it sits in. fp32 operands keep one tile (their products are not the
tensor cores', and nothing measured them across tiles). Under the interpreter the tests' dot accumulates each
element's products in order as the tensor cores do (tests/kernels/conftest.py), so its tiles differ in rows and
columns but not in depth: a step of BLOCK_K products is added to the accumulator at once there.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._triton import INTERPRET, check_device, dot_acc, multiprocessors

# 16-bit operands' tiles (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages), largest first: `tile` takes the first that fills
# the GPU's multiprocessors. At Qwen3-30B-A3B's products on the H200 that choice came within 3 % of each case's
# fastest tile on average (21 % at worst) from 1 to 16,384 rows (kernels/results/h200-invariant-tiles.json). The last
# three, 16 rows tall (mma.sync, not a warpgroup's 64-row instruction) and 256 deep, serve a decode step's few rows:
# a program's K loop is a row's whole reduction, so narrow columns spread it over more programs and deep steps keep
# more of w in flight (on an H100 they took o_proj at one row from 1.32x cuBLAS to 0.89x, the router from 1.24x to
# 0.84x, with every element's bits unchanged: kernels/results/h100-invariant-tiles-few-rows.json).
TILES = ((256, 128, 64, 8, 3), (128, 128, 64, 8, 3), (64, 128, 64, 4, 4), (64, 64, 128, 4, 3), (64, 32, 128, 4, 3),
         (16, 64, 256, 4, 3), (16, 32, 256, 4, 4), (16, 16, 256, 2, 6))
FP32_TILE = (32, 64, 32, 4, 3)
# Small under the interpreter, so CPU tests cover partial and several tiles in every direction, and the choice
# between two of them (over its 3 "multiprocessors").
INTERPRET_TILES = ((32, 32, 16, 4, 1), (16, 16, 16, 4, 1))


# M changes with every batch: not specialised (Triton builds another binary for an integer argument equal to 1 or a
# multiple of 16), so a decode step's single row runs the very binary a packed forward does.
@triton.jit(do_not_specialize=["M"])
def _invariant_matmul_kernel(x_ptr, w_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                             IEEE: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok, col_ok = rows < M, cols < N
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xm
    w_rows = w_ptr + cols.to(tl.int64)[:, None] * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = (ks < K)[None, :]
        # masked lanes are 0: past K they add exact zeros, past M or N they fill rows/columns nobody stores
        x = tl.load(x_rows + ks[None, :], mask=row_ok[:, None] & k_ok, other=0.0)
        w = tl.load(w_rows + ks[None, :], mask=col_ok[:, None] & k_ok, other=0.0)
        if IEEE:
            acc = tl.dot(x, tl.trans(w), acc, input_precision="ieee")
        else:
            acc = dot_acc(x, tl.trans(w), acc)
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * stride_om + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


class _InvariantMatmul(torch.autograd.Function):
    """The forward's bits are the invariant product's; the backward is the standard one (two torch matmuls in the
    operands' dtype, as nn.Linear's under autocast): the exact mode's first optimizer step differentiates its
    forward (workloads/model/exact_autograd.py), and no row of a gradient needs the forward's invariance."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        return _product(x, w)

    @staticmethod
    def backward(ctx, gy: torch.Tensor):
        x, w = ctx.saved_tensors
        gx = gy @ w if ctx.needs_input_grad[0] else None
        gw = gy.reshape(-1, gy.shape[-1]).t() @ x.reshape(-1, x.shape[-1]) if ctx.needs_input_grad[1] else None
        return gx, gw


def invariant_matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [..., K], w [N, K] of x's dtype (bf16, fp16 or fp32) -> x @ w.T [..., N] in x's dtype, each row's bits
    a function of that row and w alone; differentiable (the standard gradient) where x or w requires grad."""
    if torch.is_grad_enabled() and (x.requires_grad or w.requires_grad):
        return _InvariantMatmul.apply(x, w)
    return _product(x, w)


def _product(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    check_device("x", x)
    check_device("w", w)
    K = x.shape[-1]
    if w.dim() != 2 or w.shape[1] != K or w.dtype != x.dtype or x.element_size() not in (2, 4):
        raise ValueError(f"invariant_matmul needs x [..., K] and w [N, K={K}] of one dtype among bfloat16, float16 "
                         f"and float32; got x {tuple(x.shape)} {x.dtype}, w {tuple(w.shape)} {w.dtype}")
    flat = x.reshape(-1, K)
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    w = w if w.stride(-1) == 1 else w.contiguous()
    M, N = flat.shape[0], w.shape[0]
    out = torch.empty(M, N, device=x.device, dtype=x.dtype)
    if M and N:
        launch(flat, w, out, tile(M, N, x.element_size(), x.device))
    return out.view(*x.shape[:-1], N)


def tile(M: int, N: int, element_size: int, device: torch.device) -> tuple[int, int, int, int, int]:
    """The largest tile no taller than M needs (the smallest's height at least: 16 rows on the GPU) whose programs
    fill the multiprocessors, else the smallest: large tiles re-read less of x and w, small ones spread a decode
    step's few rows over the GPU."""
    if element_size == 4 and not INTERPRET:
        return FP32_TILE
    # plain integer arithmetic: triton.cdiv and next_power_of_2 cost ~3 us of host time a call, a decode step's
    # whole product at a few rows
    tiles, sms = (INTERPRET_TILES, 3) if INTERPRET else (TILES, multiprocessors(device.index or 0))
    tallest = max(tiles[-1][0], 1 << (M - 1).bit_length())
    for t in tiles:
        if t[0] <= tallest and -(-M // t[0]) * -(-N // t[1]) >= sms:
            return t
    return tiles[-1]


def launch(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, tile: tuple[int, int, int, int, int]) -> None:
    """out [M, N] = x [M, K] @ w [N, K].T on the tile (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages)."""
    (M, K), N = x.shape, w.shape[0]
    bm, bn, bk, warps, stages = tile
    _invariant_matmul_kernel[(-(-M // bm), -(-N // bn))](
        x, w, out, M, N, K, x.stride(0), w.stride(0), out.stride(0), BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
        IEEE=x.dtype == torch.float32, num_warps=warps, num_stages=stages)
