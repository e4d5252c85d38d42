"""x @ w.T whose every row is bitwise independent of the batch: how many rows there are, where the row sits and
what its neighbours hold. The exact numerics mode's product for the dense projections and the LM head, the same
kernel at a decode step's few rows and a packed forward's thousands, so the rollout engine and the trainer agree
bitwise.

What a fast GEMM varies with the batch, this fixes:
- one tile shape for every M (cuBLAS and autotuned kernels pick tiles, and so tensor-core instructions and
  reduction orders, by the problem's size): a row is computed by the same instructions wherever it sits, and a
  tensor-core product's row depends on its own operand row only;
- the reduction over K in one program, in BLOCK_K steps from 0 (no split-K, whose partial sums a small batch
  would otherwise be given to fill the GPU);
- fp32 accumulation, the result rounded once to x's dtype (bf16 operands on the tensor cores; fp32 operands as
  full-precision products, never TF32).
The price is the parallelism of split-K and of tiles fitted to small M at a decode step (kernels/bench_exact.py
measures it).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._triton import INTERPRET, check_device, dot_acc

# (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) per operand size: one each, never chosen by M. Small under the
# interpreter so CPU tests cover partial and several tiles in every direction.
TILES = {2: (64, 64, 64, 4, 4), 4: (32, 64, 32, 4, 3)}
INTERPRET_TILE = (16, 16, 16, 4, 1)


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


def invariant_matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [..., K], w [N, K] of x's dtype (bf16, fp16 or fp32) -> x @ w.T [..., N] in x's dtype, each row's bits
    a function of that row and w alone."""
    check_device("x", x)
    check_device("w", w)
    K = x.shape[-1]
    if w.dim() != 2 or w.shape[1] != K or w.dtype != x.dtype or x.element_size() not in TILES:
        raise ValueError(f"invariant_matmul needs x [..., K] and w [N, K={K}] of one dtype among bfloat16, float16 "
                         f"and float32; got x {tuple(x.shape)} {x.dtype}, w {tuple(w.shape)} {w.dtype}")
    flat = x.reshape(-1, K)
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    w = w if w.stride(-1) == 1 else w.contiguous()
    M, N = flat.shape[0], w.shape[0]
    out = torch.empty(M, N, device=x.device, dtype=x.dtype)
    if M and N:
        launch(flat, w, out, INTERPRET_TILE if INTERPRET else TILES[x.element_size()])
    return out.view(*x.shape[:-1], N)


def launch(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, tile: tuple[int, int, int, int, int]) -> None:
    """out [M, N] = x [M, K] @ w [N, K].T on the tile (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages)."""
    (M, K), N = x.shape, w.shape[0]
    bm, bn, bk, warps, stages = tile
    _invariant_matmul_kernel[(triton.cdiv(M, bm), triton.cdiv(N, bn))](
        x, w, out, M, N, K, x.stride(0), w.stride(0), out.stride(0), BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
        IEEE=x.dtype == torch.float32, num_warps=warps, num_stages=stages)
