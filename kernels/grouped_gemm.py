"""Grouped GEMMs over an expert-sorted batch, with the SwiGLU activation fused, forward and backward.

Rows of expert e are the contiguous block [offset_e, offset_e + count_e) of the sorted batch. The row-grouped
kernel is persistent (one program per multiprocessor) and finds each tile's expert and rows from `counts` alone (a
cumulative sum over at most a few hundred experts, in registers), so no tile schedule is built on the host and
nothing synchronises with it. Weight gradients reduce over each expert's rows in a second kernel, one program
per (expert, output tile); empty experts get 0. Operands are read through TMA descriptors (Hopper's bulk tensor
copies), which also zero-fill past a tensor's bounds.

Forward:  gate_up = x @ w13[e]^T  (kept for backward),  act = silu(gate) * up,  y = act @ w2[e]^T
Backward: d_act = dy @ w2[e] -> d_gate_up through SwiGLU (its own pass),  dx = d_gate_up @ w13[e],
          dw2[e] = dy_e^T @ act_e,  dw13[e] = d_gate_up_e^T @ x_e
bf16 operands, fp32 accumulation and activation arithmetic; d_act is stored in bf16 between its product and the
SwiGLU backward pass, as gate_up and d_gate_up are.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from moe_rl_eks.core.hardware import TMA_ROW_BYTES

from ._triton import INTERPRET, check_device, dot_acc, multiprocessors, next_pow2

# Row tiles of one expert that sweep its columns together; smaller under the interpreter so that CPU tests, whose
# experts have a handful of 16-row tiles, cover full and partial groups.
GROUP_M = 2 if INTERPRET else 8


# Tensor descriptors carry their tile shape, which is the autotuned config's: these set it before each launch.
def _row_grouped_blocks(nargs):
    nargs["a_desc"].block_shape = [nargs["BM"], nargs["BK"]]
    nargs["b_desc"].block_shape = [nargs["BN"], nargs["BK"]] if nargs["B_NK"] else [nargs["BK"], nargs["BN"]]


def _wgrad_blocks(nargs):  # both operands are read as [rows, features] tiles
    nargs["a_desc"].block_shape = [nargs["BK"], nargs["BM"]]
    nargs["b_desc"].block_shape = [nargs["BK"], nargs["BN"]]


# A tile (BM, BN, BK, warps, stages) that fits where the tuned ones do not (float32 operands); `_fitting` offers it
# to the autotuner only then, so bf16 tuning does not compile and time it as well.
FALLBACK = (64, 64, 32, 4, 2)


def _configs(wide_ok: bool, persistent: bool) -> list[triton.Config]:
    """Tile shapes to autotune over: the persistent row-grouped kernel's, or the weight-gradient kernel's. For the
    persistent kernel also FLATTEN: whether the tile loop and the K loop are pipelined as one, so the next tile's
    loads overlap this tile's epilogue. It paid for the plain products and made the gate/up product a third
    slower on the H200 (kernels/BENCHMARKS.md), so it is tuned."""
    hook = _row_grouped_blocks if persistent else _wgrad_blocks
    if INTERPRET:  # small tiles so CPU tests cover partial and multi-tile experts at small shapes
        flat = {"FLATTEN": False} if persistent else {}
        return [triton.Config({"BM": 16, "BN": 16, "BK": 16, **flat}, num_warps=4, num_stages=1, pre_hook=hook)]
    shapes = [(128, 128, 64, 8, 4), (128, 128, 64, 8, 3), (128, 128, 64, 4, 4), (64, 128, 64, 4, 4)]
    if wide_ok:  # the fused gate/up kernel already holds two BN-wide accumulators
        shapes += [(128, 256, 64, 8, 3), (128, 256, 64, 8, 4), (128, 128, 128, 8, 3)]
    else:
        shapes += [(128, 64, 64, 4, 4), (64, 128, 64, 4, 5)]
    shapes.append(FALLBACK)
    configs = []
    for bm, bn, bk, w, s in shapes:
        for flatten in ((False, True) if persistent and bm == 128 and w == 8 else (False,)):
            tile = {"BM": bm, "BN": bn, "BK": bk, **({"FLATTEN": flatten} if persistent else {})}
            configs.append(triton.Config(tile, num_warps=w, num_stages=s, pre_hook=hook))
    return configs


@triton.jit
def _expert_tile(counts_ptr, tile, num_n, E: tl.constexpr, BLOCK_E: tl.constexpr, BM: tl.constexpr,
                 GROUP_M: tl.constexpr):
    """Flat output-tile index -> (expert, first row, expert's end row, column tile). Tiles are numbered expert by
    expert; inside an expert, GROUP_M row tiles sweep the columns together so the expert's weight tiles are
    reused from L2 while they are hot (an expert's weights can exceed L2: 58 MB at DeepSeek-V3's shape)."""
    ecols = tl.arange(0, BLOCK_E)
    counts = tl.load(counts_ptr + ecols, mask=ecols < E, other=0).to(tl.int32)
    m_tiles = (counts + BM - 1) // BM
    tile_end = tl.cumsum(m_tiles * num_n, 0)
    row_end = tl.cumsum(counts, 0)
    e = tl.sum((tile_end <= tile).to(tl.int32), 0)
    this = ecols == e
    local = tile - tl.sum(tl.where(this, tile_end - m_tiles * num_n, 0), 0)
    expert_tiles = tl.sum(tl.where(this, m_tiles, 0), 0)
    expert_end = tl.sum(tl.where(this, row_end, 0), 0)
    expert_start = expert_end - tl.sum(tl.where(this, counts, 0), 0)
    group = GROUP_M * num_n
    first_m = (local // group) * GROUP_M
    group_m = tl.minimum(expert_tiles - first_m, GROUP_M)
    pid_m = first_m + (local % group) % group_m
    pid_n = (local % group) // group_m
    return e, expert_start + pid_m * BM, expert_end, pid_n


@triton.jit
def _total_tiles(counts_ptr, num_n, E: tl.constexpr, BLOCK_E: tl.constexpr, BM: tl.constexpr):
    ecols = tl.arange(0, BLOCK_E)
    counts = tl.load(counts_ptr + ecols, mask=ecols < E, other=0).to(tl.int32)
    return tl.sum((counts + BM - 1) // BM, 0) * num_n


@triton.jit
def _grouped_gemm_kernel(a_desc, b_desc, c_ptr, aux_ptr, counts_ptr, N_OUT, K, B_ROWS, stride_cm, stride_auxm,
                         E: tl.constexpr, BLOCK_E: tl.constexpr, SWIGLU: tl.constexpr, STORE_AUX: tl.constexpr,
                         B_NK: tl.constexpr, GROUP_M: tl.constexpr, FLATTEN: tl.constexpr,
                         BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """C[rows of e] = epilogue(A[rows of e] @ B_e). B is a 2-D descriptor over all experts' weights, B_ROWS rows
    per expert: stored [E*N, K] (B_NK, read as tiles [BN, BK] and transposed) or [E*K, N] (tiles [BK, BN]).
    SWIGLU: a second product with B rows N_OUT further down gives `up`; C = silu(gate) * up and, if STORE_AUX,
    aux = [gate | up].

    Persistent: each program walks output tiles with a stride of the grid. Loads go through TMA. A tile's rows past its expert, and
    columns past N_OUT, read other experts' data and are masked at the store; columns past K are zero-filled
    (A's by the descriptor's bounds, so B's rows there, which may belong to the next expert, add 0)."""
    num_n = tl.cdiv(N_OUT, BN)
    total = _total_tiles(counts_ptr, num_n, E, BLOCK_E, BM)
    for tile in tl.range(tl.program_id(0), total, tl.num_programs(0), flatten=FLATTEN):
        e, row0, row_end, pid_n = _expert_tile(counts_ptr, tile, num_n, E, BLOCK_E, BM, GROUP_M)
        col0 = pid_n * BN
        b_row = e * B_ROWS
        acc = tl.zeros((BM, BN), tl.float32)
        acc_up = tl.zeros((BM, BN), tl.float32)
        for k0 in range(0, K, BK):
            a = a_desc.load([row0, k0])
            if B_NK:
                b = b_desc.load([b_row + col0, k0]).T
            else:
                b = b_desc.load([b_row + k0, col0])
            acc = dot_acc(a, b, acc)
            if SWIGLU:
                acc_up = dot_acc(a, b_desc.load([b_row + N_OUT + col0, k0]).T, acc_up)

        rows = row0 + tl.arange(0, BM)
        cols = col0 + tl.arange(0, BN)
        out_rows = rows.to(tl.int64)[:, None]
        mask = (rows < row_end)[:, None] & (cols < N_OUT)[None, :]
        c_ptrs = c_ptr + out_rows * stride_cm + cols[None, :]
        if not SWIGLU:
            tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask)
        else:
            if STORE_AUX:
                aux_ptrs = aux_ptr + out_rows * stride_auxm + cols[None, :]
                tl.store(aux_ptrs, acc.to(aux_ptr.dtype.element_ty), mask=mask)
                tl.store(aux_ptrs + N_OUT, acc_up.to(aux_ptr.dtype.element_ty), mask=mask)
            act = acc * tl.sigmoid(acc) * acc_up
            tl.store(c_ptrs, act.to(c_ptr.dtype.element_ty), mask=mask)


def _shared_memory_per_block() -> int:
    return triton.runtime.driver.active.utils.get_device_properties(torch.cuda.current_device())["max_shared_mem"]


def _fitting(configs, named_args, **kwargs):
    """The tuned configs whose pipelined operand tiles fit the GPU's shared memory at these operands' element
    size, or else the smallest (FALLBACK): tiles tuned for bf16 need twice the memory with float32 operands, and a
    launch that does not fit fails instead of being skipped by the autotuner. The fused gate/up kernel loads two
    weight tiles per step."""
    if INTERPRET:
        return configs
    limit = _shared_memory_per_block()
    element = named_args["a_desc"].base.element_size()
    weight_tiles = 2 if kwargs.get("SWIGLU") else 1

    def shared(c):
        bm, bn, bk = (c.kwargs[k] for k in ("BM", "BN", "BK"))
        return c.num_stages * (bm * bk + weight_tiles * bn * bk) * element

    def fallback(c):
        return (*(c.kwargs[k] for k in ("BM", "BN", "BK")), c.num_warps, c.num_stages) == FALLBACK

    fitting = [c for c in configs if not fallback(c) and shared(c) <= limit]
    return fitting or [min(configs, key=shared)]


_KEY = ["N_OUT", "K", "SWIGLU", "B_NK"]
_PRUNE = {"early_config_prune": _fitting}
_gemm_swiglu = triton.autotune(_configs(wide_ok=False, persistent=True), key=_KEY, prune_configs_by=_PRUNE)(
    _grouped_gemm_kernel)
_gemm_plain = triton.autotune(_configs(wide_ok=True, persistent=True), key=_KEY, prune_configs_by=_PRUNE)(
    _grouped_gemm_kernel)

# The exact numerics mode's tiles (BM, BN, BK, warps, stages) per operand size, never tuned: the tuned choice may
# differ between the engine's process and the trainer's. A row's products are a function of the row and its
# expert's weights alone: its tile's other rows (however many the expert received, or another expert's past its
# end) are other rows of the same tensor-core products, and on the H200 every tile measured, these two included,
# gives the same bits (kernels/bench_invariant_tiles.py), so the tile follows the batch's size: 64 rows while the
# experts average fewer than 64 rows each (a decode step's or a short prefill's; a 128-row tile would be mostly
# padding), 128 above. float32 operands keep one tile.
EXACT_TILES = {2: ((64, 128, 64, 4, 4), (128, 128, 64, 8, 4)), 4: (FALLBACK,)}


def _fixed(tile: tuple[int, int, int, int, int], flatten: bool = False):
    """A kernel of one config (autotune's wrapper only for its pre-hook: the TMA descriptors' block shapes)."""
    bm, bn, bk, warps, stages = (16, 16, 16, 4, 1) if INTERPRET else tile
    config = triton.Config({"BM": bm, "BN": bn, "BK": bk, "FLATTEN": flatten}, num_warps=warps, num_stages=stages,
                           pre_hook=_row_grouped_blocks)
    return triton.autotune([config], key=_KEY)(_grouped_gemm_kernel)


_gemm_exact = {size: tuple(_fixed(tile) for tile in tiles) for size, tiles in EXACT_TILES.items()}


def _exact_kernel(rows: int, experts: int, element_size: int):
    """EXACT_TILES' kernel for `rows` rows over `experts` experts."""
    small, *large = _gemm_exact[element_size]
    return large[0] if large and rows >= 64 * experts else small


@triton.jit
def _swiglu_backward_kernel(d_act_ptr, gate_up_ptr, out_ptr, n_rows, WIDTH: tl.constexpr, BLOCK_W: tl.constexpr,
                            BLOCK_R: tl.constexpr):
    """[d_gate | d_up] of act = silu(gate) * up, one BLOCK_R x WIDTH row block per program, fp32 arithmetic.
    Its own pass rather than the d_act product's epilogue: there, loading gate and up stalled every tile (no
    other work hides the loads in a non-specialised kernel) and took the product to half its dense rate."""
    rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)[:, None]
    cols = tl.arange(0, BLOCK_W)[None, :]
    mask = (rows < n_rows) & (cols < WIDTH)
    d_act = tl.load(d_act_ptr + rows * WIDTH + cols, mask=mask, other=0.0).to(tl.float32)
    gate = tl.load(gate_up_ptr + rows * (2 * WIDTH) + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + rows * (2 * WIDTH) + WIDTH + cols, mask=mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(gate)
    d_gate = d_act * up * sig * (1.0 + gate * (1.0 - sig))
    d_up = d_act * gate * sig
    tl.store(out_ptr + rows * (2 * WIDTH) + cols, d_gate.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(out_ptr + rows * (2 * WIDTH) + WIDTH + cols, d_up.to(out_ptr.dtype.element_ty), mask=mask)


def _swiglu_backward(d_act, gate_up):
    n, width = d_act.shape
    out = torch.empty(n, 2 * width, device=d_act.device, dtype=d_act.dtype)
    block_w = next_pow2(width)
    block_r = max(1, 4096 // block_w)  # about 4096 elements of each operand per program
    _swiglu_backward_kernel[(triton.cdiv(n, block_r),)](d_act, gate_up, out, n, WIDTH=width, BLOCK_W=block_w,
                                                        BLOCK_R=block_r)
    return out


@triton.autotune(_configs(wide_ok=True, persistent=False), key=["M_OUT", "N_OUT"], prune_configs_by=_PRUNE)
@triton.jit
def _grouped_wgrad_kernel(a_desc, b_desc, c_ptr, counts_ptr, M_OUT, N_OUT, stride_ce,
                          E: tl.constexpr, BLOCK_E: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                          BK: tl.constexpr):
    """C[e] = A[rows of e]^T @ B[rows of e]: A [N, M_OUT], B [N, N_OUT], C [E, M_OUT, N_OUT]. The reduction runs
    over the expert's rows, so only its last partial tile has rows of the next expert: they are zeroed there."""
    pid = tl.program_id(0)
    e = tl.program_id(1)
    num_n = tl.cdiv(N_OUT, BN)
    m0 = (pid // num_n) * BM
    n0 = (pid % num_n) * BN
    ecols = tl.arange(0, BLOCK_E)
    counts = tl.load(counts_ptr + ecols, mask=ecols < E, other=0).to(tl.int32)
    count = tl.sum(tl.where(ecols == e, counts, 0), 0)
    start = tl.sum(tl.where(ecols < e, counts, 0), 0)
    full = count - count % BK
    acc = tl.zeros((BM, BN), tl.float32)
    for k0 in range(0, full, BK):
        acc = dot_acc(a_desc.load([start + k0, m0]).T, b_desc.load([start + k0, n0]), acc)
    if full < count:
        k_ok = (full + tl.arange(0, BK) < count)[:, None]
        a = a_desc.load([start + full, m0])
        b = b_desc.load([start + full, n0])
        acc = dot_acc(tl.where(k_ok, a, tl.zeros_like(a)).T, tl.where(k_ok, b, tl.zeros_like(b)), acc)
    rm = m0 + tl.arange(0, BM)
    rn = n0 + tl.arange(0, BN)
    mask = (rm < M_OUT)[:, None] & (rn < N_OUT)[None, :]
    tl.store(c_ptr + e.to(tl.int64) * stride_ce + rm[:, None] * N_OUT + rn[None, :],
             acc.to(c_ptr.dtype.element_ty), mask=mask)


def _descriptor(t: torch.Tensor) -> TensorDescriptor:
    """A 2-D TMA descriptor; its block shape is set per config by the configs' pre_hook."""
    return TensorDescriptor(t, list(t.shape), list(t.stride()), [16, 16])


@functools.cache
def _programs(device_index: int) -> int:
    # one program per multiprocessor; a few under the interpreter, so the tile loop's stride is exercised
    return 3 if INTERPRET else multiprocessors(device_index)


def _grouped_gemm(kernel, a, b, counts, n_out, out, *, b_nk, swiglu=False, aux=None):
    """b is [E, N, K] (b_nk) or [E, K, N], contiguous."""
    n_rows, k = a.shape
    num_experts = b.shape[0]
    if n_rows == 0:
        return out
    programs = _programs(a.device.index or 0)

    def grid(meta):  # at most the upper bound on real tiles, cdiv(N, BM) + E row tiles per column tile
        return (min(programs, (triton.cdiv(n_rows, meta["BM"]) + num_experts) * triton.cdiv(n_out, meta["BN"])),)

    kernel[grid](_descriptor(a), _descriptor(b.view(-1, b.shape[2])), out, aux if aux is not None else out, counts,
                 n_out, k, b.shape[1], out.stride(0), aux.stride(0) if aux is not None else 0,
                 E=num_experts, BLOCK_E=next_pow2(num_experts), SWIGLU=swiglu, STORE_AUX=aux is not None, B_NK=b_nk,
                 GROUP_M=GROUP_M)
    return out


def _grouped_wgrad(a, b, counts, num_experts, dtype):
    """[E, a.shape[1], b.shape[1]]: per expert, a_e^T @ b_e."""
    m_out, n_out = a.shape[1], b.shape[1]
    if a.shape[0] == 0:  # an EP rank can receive no rows at all
        return torch.zeros(num_experts, m_out, n_out, device=a.device, dtype=dtype)
    out = torch.empty(num_experts, m_out, n_out, device=a.device, dtype=dtype)

    def grid(meta):
        return (triton.cdiv(m_out, meta["BM"]) * triton.cdiv(n_out, meta["BN"]), num_experts)

    _grouped_wgrad_kernel[grid](_descriptor(a), _descriptor(b), out, counts, m_out, n_out, out.stride(0),
                                E=num_experts, BLOCK_E=next_pow2(num_experts))
    return out


class _SwiGLUExperts(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, counts, w13, w2, training, exact):
        n, hidden = x.shape
        width = w2.shape[2]
        act = torch.empty(n, width, device=x.device, dtype=x.dtype)
        gate_up = torch.empty(n, 2 * width, device=x.device, dtype=x.dtype) if training else None
        up_kernel, down_kernel = ((_exact_kernel(n, w13.shape[0], x.element_size()),) * 2 if exact
                                  else (_gemm_swiglu, _gemm_plain))
        # w13[e] is [2I, h] = [N, K]: gate rows first, up rows `width` further down
        _grouped_gemm(up_kernel, x, w13, counts, width, act, b_nk=True, swiglu=True, aux=gate_up)
        y = torch.empty(n, hidden, device=x.device, dtype=x.dtype)
        _grouped_gemm(down_kernel, act, w2, counts, hidden, y, b_nk=True)
        ctx.save_for_backward(x, counts, w13, w2, gate_up, act)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, counts, w13, w2, gate_up, act = ctx.saved_tensors
        dy = dy.contiguous()
        n, hidden = x.shape
        num_experts, width = w2.shape[0], w2.shape[2]
        # w2[e] is [h, I] = [K, N] here
        d_act = _grouped_gemm(_gemm_plain, dy, w2, counts, width, torch.empty_like(act), b_nk=False)
        d_gate_up = _swiglu_backward(d_act, gate_up)
        dx = dw13 = dw2 = None
        if ctx.needs_input_grad[0]:
            dx = torch.empty(n, hidden, device=x.device, dtype=x.dtype)
            _grouped_gemm(_gemm_plain, d_gate_up, w13, counts, hidden, dx, b_nk=False)
        if ctx.needs_input_grad[2]:
            dw13 = _grouped_wgrad(d_gate_up, x, counts, num_experts, w13.dtype)
        if ctx.needs_input_grad[3]:
            dw2 = _grouped_wgrad(dy, act, counts, num_experts, w2.dtype)
        return dx, None, dw13, dw2, None, None


def swiglu_experts(x_sorted: torch.Tensor, counts: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, *,
                   exact: bool = False) -> torch.Tensor:
    """x_sorted [N, h] grouped by expert, counts [E] (sum N, zeros allowed), w13 [E, 2I, h], w2 [E, h, I] ->
    [N, h]: row r of expert e is w2[e] @ (silu(w13[e, :I] @ x_r) * (w13[e, I:] @ x_r)).
    exact: the forward on EXACT_TILES, each row's bits independent of the batch and of the process (the
    backward stays on the tuned tiles)."""
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
    align = TMA_ROW_BYTES // x_sorted.element_size()
    if hidden % align or two_width // 2 % align:
        raise ValueError(f"experts reads rows through TMA, which needs {TMA_ROW_BYTES}-byte rows: hidden "
                         f"{hidden} and width {two_width // 2} must be multiples of {align} for {x_sorted.dtype}")
    # autograd disables grad mode inside forward, so whether to keep gate_up for backward is decided here
    training = torch.is_grad_enabled() and any(t.requires_grad for t in (x_sorted, w13, w2))
    return _SwiGLUExperts.apply(x_sorted.contiguous(), counts.contiguous(), w13.contiguous(), w2.contiguous(),
                                training, exact)
