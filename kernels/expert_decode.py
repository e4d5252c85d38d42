"""The MoE layer of a decode step in two kernels: routing + gate/up + SwiGLU, then down + the weighted combine.

At a few tokens per step the experts are memory-bound matrix-vector products, and the training path's sort,
permutation, grouped GEMM and combine (a dozen launches, each a few microseconds, per layer) cost more than the
weights they read. Here:

1. `_decode_up_kernel`, one program per (token, slot, column block of the expert width): routes its token from
   the router logits itself (softmax or sigmoid, an [E] selection bias, top-k, renormalisation and scaling, the
   same arithmetic and tie order as routing.py's kernel), then reads its expert's gate and up rows once and
   stores act = silu(gate) * up (fp32 arithmetic, rounded to the weights' dtype as the grouped GEMM stores it).
2. `_decode_down_kernel`, one program per (token, column block of the hidden size): for each of the token's k
   experts in slot order, the down product rounded to the weights' dtype (the grouped GEMM's output), times the
   routing weight, summed in fp32 and rounded once (permute.py's combine).

No atomics and nothing shared between tokens: a token's output does not depend on which other tokens shared the
step, bitwise. The cost is that an expert chosen by several tokens is read once per token (from L2 when it is
hot), which is why the engine uses this path only up to `DECODE_MAX_TOKENS` tokens per step.

`exact=True` (the exact numerics mode) takes the products on the tensor cores instead, the token's row alone in a
16-row tile, each reduction a chain of the same tensor-core products over K as the grouped GEMM's (grouped_gemm.py):
on the H200 every tile measured gives a row those bits (kernels/bench_invariant_tiles.py), so a decoded token's
expert outputs are the bits a prefill or the trainer's forward gives it through routing, permutation and the
grouped GEMM. Its down products take a program per (token, slot) and a third launch combines the slots in order
(the same combine_step), since a 16-row tile's least of 16 columns would leave a token only HIDDEN / 16 programs
walking its k experts one after another. Its routing is the route kernel's bits where `layout_free` holds
(sigmoid, or renormalised softmax without a bias: on the H200 a probability's division by its row sum, reduced in
the fused kernel's one-row block, gave about one output element in 100 tokens another last bit); elsewhere the exact
mode decodes through the grouped path.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._triton import INTERPRET, check_device, dot_acc, next_pow2, quick_bench, within
from .routing import _scores, _top_k

# Up to this many tokens per step the decode kernels beat sort + grouped GEMM + combine; beyond it the engine uses
# the grouped path. H200, Qwen3-30B-A3B's layer (`python3 -m moe_rl_eks.kernels.bench_decode`, 2026-12-01): 37 vs 74
# us at 1 token, 100 vs 137 at 4, 172 vs 195 at 8, 301 vs 263 at 16 (workloads/BENCHMARKS-rl.md).
DECODE_MAX_TOKENS = 8


def _configs(block_n: str, block_k: str) -> list[triton.Config]:
    if INTERPRET:  # small blocks so CPU tests cover several column and reduction blocks
        return [triton.Config({block_n: 8, block_k: 16}, num_warps=4)]
    # (column rows, reduction block, warps): enough programs to fill the GPU at one token (I = 768 gives 8 x 96
    # programs at 8 rows), and wide loads per program to keep bytes in flight. On the H200 the smallest row blocks
    # won (8 for gate/up, 4 for down, of the first six shapes), hence the smaller ones too.
    shapes = [(8, 512, 4), (16, 256, 4), (16, 512, 8), (8, 1024, 4), (4, 1024, 4), (4, 512, 2), (2, 1024, 2),
              (2, 1024, 4), (1, 1024, 2), (4, 2048, 4), (2, 2048, 4)]
    return [triton.Config({block_n: n, block_k: k}, num_warps=w) for n, k, w in shapes]


def _exact_configs(block_n: str, block_k: str) -> list[triton.Config]:
    """The exact form's blocks: at least 16 columns and 16 deep (a tensor-core product's least), and under the
    interpreter the grouped GEMM's 16-deep steps (its emulated dot adds a step's products to the sum at once)."""
    if INTERPRET:
        return [triton.Config({block_n: 16, block_k: 16}, num_warps=4)]
    shapes = [(16, 128, 4), (32, 128, 4), (16, 64, 4), (32, 64, 4), (64, 64, 4), (16, 128, 2), (16, 256, 2),
              (16, 256, 4), (16, 512, 4), (16, 1024, 4)]
    return [triton.Config({block_n: n, block_k: k}, num_warps=w) for n, k, w in shapes]


@triton.jit
def _route_token(logits_ptr, bias_ptr, t, scaling, E: tl.constexpr, SIGMOID: tl.constexpr, HAS_BIAS: tl.constexpr,
                 TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
    """Token t's routing as routing.py's kernel computes it: ([1, BLOCK_K] weights, [1, BLOCK_K] expert ids),
    the same bits where `layout_free` holds."""
    rows = t + tl.arange(0, 1)
    cols = tl.arange(0, BLOCK_E)
    scores, num = _scores(logits_ptr, rows, cols, t + 1, E, E, SIGMOID)
    select = scores if SIGMOID or HAS_BIAS else num  # as routing.py's kernel selects
    if HAS_BIAS:
        select = select + tl.load(bias_ptr + cols[None, :], mask=cols[None, :] < E, other=0.0).to(tl.float32)
    select = tl.where(cols[None, :] < E, select, float("-inf"))
    top_w, top_id = _top_k(select, num if RENORMALIZE else scores, cols, E, TOP_K, RENORMALIZE, BLOCK_E, BLOCK_K)
    return top_w * scaling, top_id


@triton.jit
def _decode_up_kernel(x_ptr, logits_ptr, bias_ptr, w13_ptr, act_ptr, weights_ptr, ids_ptr, scaling,
                      E: tl.constexpr, HIDDEN: tl.constexpr, WIDTH: tl.constexpr, TOP_K: tl.constexpr,
                      SIGMOID: tl.constexpr, HAS_BIAS: tl.constexpr, RENORMALIZE: tl.constexpr,
                      BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_H: tl.constexpr,
                      EXACT: tl.constexpr):
    pair = tl.program_id(0)  # token * TOP_K + slot
    pid_n = tl.program_id(1)
    t = pair // TOP_K
    top_w, top_id = _route_token(logits_ptr, bias_ptr, t, scaling, E, SIGMOID, HAS_BIAS, TOP_K, RENORMALIZE,
                                 BLOCK_E, BLOCK_K)
    kcols = tl.arange(0, BLOCK_K)
    e = tl.sum(tl.where(kcols[None, :] == pair % TOP_K, top_id, 0)).to(tl.int64)
    if (pair % TOP_K == 0) & (pid_n == 0):  # one program per token records its routing
        out = t * TOP_K + kcols[None, :]
        tl.store(weights_ptr + out, top_w, mask=kcols[None, :] < TOP_K)
        tl.store(ids_ptr + out, top_id.to(tl.int64), mask=kcols[None, :] < TOP_K)

    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < WIDTH
    gate_rows = w13_ptr + e * (2 * WIDTH * HIDDEN) + cols.to(tl.int64)[:, None] * HIDDEN
    if EXACT:
        # the token's row and 15 zero rows: [16, BLOCK_N] tensor-core products, row 0 stored
        tile_rows = tl.arange(0, 16)[:, None]
        acc_gate = tl.zeros((16, BLOCK_N), tl.float32)
        acc_up = tl.zeros((16, BLOCK_N), tl.float32)
        for k0 in tl.range(0, HIDDEN, BLOCK_H):
            ks = k0 + tl.arange(0, BLOCK_H)
            k_ok = ks < HIDDEN
            x = tl.load(x_ptr + t * HIDDEN + ks[None, :] + tile_rows * 0, mask=(tile_rows == 0) & k_ok[None, :],
                        other=0.0)
            mask = col_ok[:, None] & k_ok[None, :]
            gate = tl.load(gate_rows + ks[None, :], mask=mask, other=0.0)
            up = tl.load(gate_rows + WIDTH * HIDDEN + ks[None, :], mask=mask, other=0.0)
            acc_gate = dot_acc(x, tl.trans(gate), acc_gate)
            acc_up = dot_acc(x, tl.trans(up), acc_up)
        act = acc_gate * tl.sigmoid(acc_gate) * acc_up
        tl.store(act_ptr + pair * WIDTH + cols[None, :] + tile_rows * 0, act.to(act_ptr.dtype.element_ty),
                 mask=(tile_rows == 0) & col_ok[None, :])
    else:
        acc_gate = tl.zeros((BLOCK_N,), tl.float32)
        acc_up = tl.zeros((BLOCK_N,), tl.float32)
        for k0 in tl.range(0, HIDDEN, BLOCK_H):
            ks = k0 + tl.arange(0, BLOCK_H)
            k_ok = ks < HIDDEN
            x = tl.load(x_ptr + t * HIDDEN + ks, mask=k_ok, other=0.0).to(tl.float32)
            mask = col_ok[:, None] & k_ok[None, :]
            gate = tl.load(gate_rows + ks[None, :], mask=mask, other=0.0).to(tl.float32)
            up = tl.load(gate_rows + WIDTH * HIDDEN + ks[None, :], mask=mask, other=0.0).to(tl.float32)
            acc_gate += tl.sum(gate * x[None, :], axis=1)
            acc_up += tl.sum(up * x[None, :], axis=1)
        act = acc_gate * tl.sigmoid(acc_gate) * acc_up
        tl.store(act_ptr + pair * WIDTH + cols, act.to(act_ptr.dtype.element_ty), mask=col_ok)


@triton.jit
def _decode_down_kernel(act_ptr, w2_ptr, weights_ptr, ids_ptr, out_ptr, HIDDEN: tl.constexpr,
                        WIDTH: tl.constexpr, TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_I: tl.constexpr):
    t = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < HIDDEN
    total = tl.zeros((BLOCK_N,), tl.float32)
    for j in tl.static_range(TOP_K):
        e = tl.load(ids_ptr + t * TOP_K + j)
        weight = tl.load(weights_ptr + t * TOP_K + j)
        w_rows = w2_ptr + e * (HIDDEN * WIDTH) + rows.to(tl.int64)[:, None] * WIDTH
        acc = tl.zeros((BLOCK_N,), tl.float32)
        for i0 in tl.range(0, WIDTH, BLOCK_I):
            i = i0 + tl.arange(0, BLOCK_I)
            i_ok = i < WIDTH
            a = tl.load(act_ptr + (t * TOP_K + j) * WIDTH + i, mask=i_ok, other=0.0).to(tl.float32)
            w = tl.load(w_rows + i[None, :], mask=row_ok[:, None] & i_ok[None, :], other=0.0).to(tl.float32)
            acc += tl.sum(w * a[None, :], axis=1)
        total = combine_step(total, acc.to(out_ptr.dtype.element_ty), weight)
    tl.store(out_ptr + t * HIDDEN + rows, total.to(out_ptr.dtype.element_ty), mask=row_ok)


@triton.jit
def combine_step(total, y, weight):
    """A token's combine after one more of its experts: its output y, rounded to the layer's dtype as the grouped
    GEMM stores it, times the routing weight, added in fp32 (permute.py's combine), in slot order."""
    return total + y.to(tl.float32) * weight


@triton.jit
def _decode_down_exact_kernel(act_ptr, w2_ptr, ids_ptr, y_ptr, HIDDEN: tl.constexpr, WIDTH: tl.constexpr,
                              BLOCK_N: tl.constexpr, BLOCK_I: tl.constexpr):
    """The exact form's down product, a program per (token, slot, block of hidden rows), as _decode_up_kernel's:
    the pair's act row alone in a 16-row tile, y [pairs, HIDDEN] rounded to y's dtype. A program per slot rather
    than a loop over the token's k experts spreads a token over k times the programs (the 16-row tiles' least of
    16 columns leaves HIDDEN / 16 of them per slot); _combine_kernel adds the slots in order."""
    pair = tl.program_id(0)  # token * TOP_K + slot
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < HIDDEN
    tile_rows = tl.arange(0, 16)[:, None]
    e = tl.load(ids_ptr + pair)
    w_rows = w2_ptr + e * (HIDDEN * WIDTH) + rows.to(tl.int64)[:, None] * WIDTH
    acc = tl.zeros((16, BLOCK_N), tl.float32)
    for i0 in tl.range(0, WIDTH, BLOCK_I):
        i = i0 + tl.arange(0, BLOCK_I)
        i_ok = i < WIDTH
        a = tl.load(act_ptr + pair * WIDTH + i[None, :] + tile_rows * 0, mask=(tile_rows == 0) & i_ok[None, :],
                    other=0.0)
        w = tl.load(w_rows + i[None, :], mask=row_ok[:, None] & i_ok[None, :], other=0.0)
        acc = dot_acc(a, tl.trans(w), acc)
    tl.store(y_ptr + pair * HIDDEN + rows[None, :] + tile_rows * 0, acc.to(y_ptr.dtype.element_ty),
             mask=(tile_rows == 0) & row_ok[None, :])


@triton.jit
def _combine_kernel(y_ptr, weights_ptr, out_ptr, HIDDEN: tl.constexpr, TOP_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """Program (token, block of hidden rows): the token's k expert outputs y [T * k, HIDDEN] combined in slot
    order, as _decode_down_kernel combines them."""
    t = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < HIDDEN
    total = tl.zeros((BLOCK_N,), tl.float32)
    for j in tl.static_range(TOP_K):
        y = tl.load(y_ptr + (t * TOP_K + j) * HIDDEN + rows, mask=row_ok, other=0.0)
        total = combine_step(total, y, tl.load(weights_ptr + t * TOP_K + j))
    tl.store(out_ptr + t * HIDDEN + rows, total.to(out_ptr.dtype.element_ty), mask=row_ok)


# One block shape per layer shape, whatever the token count: a token's sums are then taken in the same order in
# every step (the bitwise independence above). It is tuned at one token, the latency-bound case (decode_experts).
def _tuned(kernel, configs: list[triton.Config], key: list[str], block: str, size: str):
    return triton.autotune(configs, key=key, do_bench=quick_bench, prune_configs_by={
        "early_config_prune": lambda configs, named, **kw: within(configs, block, kw[size])})(kernel)


# per form (exact or not): the gate/up kernel
_UP = {exact: _tuned(_decode_up_kernel, configs("BLOCK_N", "BLOCK_H"), ["E", "HIDDEN", "WIDTH", "TOP_K"], "BLOCK_H",
                     "HIDDEN") for exact, configs in ((False, _configs), (True, _exact_configs))}
_DOWN = _tuned(_decode_down_kernel, _configs("BLOCK_N", "BLOCK_I"), ["HIDDEN", "WIDTH", "TOP_K"], "BLOCK_I", "WIDTH")
_DOWN_EXACT = _tuned(_decode_down_exact_kernel, _exact_configs("BLOCK_N", "BLOCK_I"), ["HIDDEN", "WIDTH"], "BLOCK_I",
                     "WIDTH")
COMBINE_BLOCK = 16 if INTERPRET else 128
_TUNED: set[tuple] = set()  # layer shapes whose block shapes were tuned (at one token)


def layout_free(spec, bias: torch.Tensor | None) -> bool:
    """Whether the fused routing gives routing.py's kernel's weights and ids bitwise (the exact mode's decode):
    sigmoid scores, or renormalised softmax without a bias (from exp(logit - max), routing._top_k). Softmax
    weights that are not renormalised divide by the row's sum, and softmax with a bias selects on the
    probabilities; that sum's bits follow the block of rows it is reduced in."""
    return spec.scoring == "sigmoid" or (bool(spec.renormalize) and bias is None)


def supports(spec, bias: torch.Tensor | None) -> bool:
    """Whether the decode kernels route like `spec`: one expert group, and no bias or one [E] bias."""
    return spec.n_group == 1 and spec.scoring in ("softmax", "sigmoid") and (bias is None or bias.dim() == 1)


def decode_experts(x: torch.Tensor, logits: torch.Tensor, spec, bias: torch.Tensor | None, w13: torch.Tensor,
                   w2: torch.Tensor, *, exact: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [T, h], router logits [T, E], w13 [E, 2I, h], w2 [E, h, I] -> (out [T, h] in x's dtype, routing weights
    [T, k] float32, expert ids [T, k] int64): route each token, then sum_j weight_j * down_j(silu(gate_j(x)) *
    up_j(x)) over its k experts. No autograd (decoding only); `supports(spec, bias)` must hold. `exact`: the
    products the grouped GEMM's (the module's docstring says how)."""
    for name, t in (("x", x), ("logits", logits), ("w13", w13), ("w2", w2)):
        check_device(name, t)
    if not supports(spec, bias):
        raise ValueError(f"decode_experts routes with one expert group and an [E] bias; got n_group="
                         f"{spec.n_group}, scoring={spec.scoring!r}, bias shape "
                         f"{None if bias is None else tuple(bias.shape)}")
    T, hidden = x.shape
    num_experts, two_width, _ = w13.shape
    width = two_width // 2
    if logits.shape != (T, num_experts) or w13.shape[2] != hidden or w2.shape != (num_experts, hidden, width):
        raise ValueError(f"decode_experts: x {tuple(x.shape)}, logits {tuple(logits.shape)}, w13 "
                         f"{tuple(w13.shape)} and w2 {tuple(w2.shape)} do not agree on [T, h], [T, E], [E, 2I, h], "
                         f"[E, h, I]")
    top_k = spec.top_k
    x, logits, w13, w2 = x.contiguous(), logits.contiguous(), w13.contiguous(), w2.contiguous()
    if exact and not layout_free(spec, bias):
        raise ValueError(f"decode_experts(exact=True) routes as routing.py only where the weights' bits do not "
                         f"depend on the block of rows (layout_free): scoring={spec.scoring!r}, renormalize="
                         f"{spec.renormalize}, bias {'given' if bias is not None else 'none'}")
    weights = torch.empty(T, top_k, device=x.device, dtype=torch.float32)
    ids = torch.empty(T, top_k, device=x.device, dtype=torch.int64)
    act = torch.empty(T * top_k, width, device=x.device, dtype=w13.dtype)
    out = torch.empty(T, hidden, device=x.device, dtype=x.dtype)
    if T == 0:
        return out, weights, ids
    shape = (num_experts, hidden, width, top_k, x.dtype, w13.dtype, x.device, exact)
    if T > 1 and shape not in _TUNED:
        decode_experts(x[:1], logits[:1], spec, bias, w13, w2, exact=exact)
    _TUNED.add(shape)
    _UP[exact][lambda meta: (T * top_k, triton.cdiv(width, meta["BLOCK_N"]))](
        x, logits, bias if bias is not None else logits, w13, act, weights, ids, float(spec.scaling),
        E=num_experts, HIDDEN=hidden, WIDTH=width, TOP_K=top_k, SIGMOID=spec.scoring == "sigmoid",
        HAS_BIAS=bias is not None, RENORMALIZE=bool(spec.renormalize), BLOCK_E=next_pow2(num_experts),
        BLOCK_K=next_pow2(top_k), EXACT=exact)
    if not exact:
        _DOWN[lambda meta: (T, triton.cdiv(hidden, meta["BLOCK_N"]))](
            act, w2, weights, ids, out, HIDDEN=hidden, WIDTH=width, TOP_K=top_k)
        return out, weights, ids
    y = torch.empty(T * top_k, hidden, device=x.device, dtype=x.dtype)
    _DOWN_EXACT[lambda meta: (T * top_k, triton.cdiv(hidden, meta["BLOCK_N"]))](
        act, w2, ids, y, HIDDEN=hidden, WIDTH=width)
    _combine_kernel[(T, triton.cdiv(hidden, COMBINE_BLOCK))](y, weights, out, HIDDEN=hidden, TOP_K=top_k,
                                                             BLOCK_N=COMBINE_BLOCK)
    return out, weights, ids
