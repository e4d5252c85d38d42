"""Router logits -> (top-k weights, expert ids) in one kernel, with its backward.

Scoring is softmax (Qwen3: select on probabilities, optionally renormalise the k chosen) or sigmoid (DeepSeek-V3:
select on sigmoid + bias, bias steering selection only, group-limited to the best `topk_group` of `n_group`
contiguous expert groups scored by the sum of their two best biased scores; weights are the unbiased sigmoid
scores, renormalised, times `scaling`). Ties go to the lower expert id; slots come out in descending score order.
The spec is any object with RoutingSpec's attributes (top_k, scoring, n_group, topk_group, renormalize, scaling).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._triton import check_device, next_pow2

@triton.jit
def _scores(logits_ptr, rows, cols, T, E, stride_t, SIGMOID: tl.constexpr):
    """Row block of logits -> fp32 (scores, num): softmax over the row and its unnormalised exponentials
    exp(logit - row max), or sigmoid twice; padded columns score 0. num's bits do not depend on the block's shape
    (a max and elementwise operations); the softmax's row sum's do (its reduction's order follows the layout)."""
    mask = (rows[:, None] < T) & (cols[None, :] < E)
    logits = tl.load(logits_ptr + rows[:, None] * stride_t + cols[None, :], mask=mask, other=float("-inf"))
    logits = logits.to(tl.float32)
    if SIGMOID:
        scores = tl.where(mask, tl.sigmoid(logits), 0.0)
        num = scores
    else:
        row_max = tl.max(logits, axis=1)
        # rows past T are all -inf: shift them by 0 so they give exp(-inf) = 0, never NaN
        row_max = tl.where(row_max == float("-inf"), 0.0, row_max)
        num = tl.where(mask, tl.exp(logits - row_max[:, None]), 0.0)
        scores = num / tl.maximum(tl.sum(num, axis=1), 1e-30)[:, None]
    return scores, num


@triton.jit
def _top_k(select, values, cols, E: tl.constexpr, TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr,
           BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
    """Per row of `select` [R, BLOCK_E], the TOP_K best real columns (distinct, ties to the lower id) in
    descending order -> (their `values`, renormalised to sum 1 if RENORMALIZE; ids), [R, BLOCK_K] each. The sum
    is taken slot by slot, so with `values` of shape-independent bits (_scores' num) a row's weights are the same
    bits in a block of one row (the decode kernels) or many (route)."""
    kcols = tl.arange(0, BLOCK_K)
    top_w = tl.zeros((select.shape[0], BLOCK_K), tl.float32)
    top_id = tl.zeros((select.shape[0], BLOCK_K), tl.int32)
    taken = tl.zeros((select.shape[0], BLOCK_E), tl.int32)
    total = tl.zeros((select.shape[0],), tl.float32)
    for j in tl.static_range(TOP_K):
        idx = _first_argmax_free(select, taken, cols, E, BLOCK_E)
        hit = cols[None, :] == idx[:, None]
        w = tl.sum(tl.where(hit, values, 0.0), axis=1)  # one term and zeros: exact in any order
        total += w
        top_w = tl.where(kcols[None, :] == j, w[:, None], top_w)
        top_id = tl.where(kcols[None, :] == j, idx[:, None], top_id)
        taken = tl.where(hit, 1, taken)
    if RENORMALIZE:
        # DeepSeek-V3's guard on the sum; far below fp32 resolution of any real sum of scores
        top_w = top_w / (total[:, None] + 1e-20)
    return top_w, top_id


@triton.jit
def _first_argmax(values, cols, BLOCK: tl.constexpr):
    """Per row, the lowest column holding the row maximum."""
    best = tl.max(values, axis=1)
    return tl.min(tl.where(values == best[:, None], cols[None, :], BLOCK), axis=1)


@triton.jit
def _first_argmax_free(values, taken, cols, E: tl.constexpr, BLOCK: tl.constexpr):
    """Like _first_argmax over the real columns not yet taken, so k picks stay distinct even when fewer than k
    experts have a finite score (a -inf bias forbids experts)."""
    free = (taken == 0) & (cols[None, :] < E)
    best = tl.max(tl.where(free, values, float("-inf")), axis=1)
    return tl.min(tl.where(free & (values == best[:, None]), cols[None, :], BLOCK), axis=1)


@triton.jit
def _route_fwd_kernel(logits_ptr, bias_ptr, weights_ptr, ids_ptr, T, stride_t, stride_bias_t, scaling,
                      E: tl.constexpr, SIGMOID: tl.constexpr, HAS_BIAS: tl.constexpr, TOP_K: tl.constexpr,
                      N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr, RENORMALIZE: tl.constexpr,
                      BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
                      BLOCK_G: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_E)
    scores, num = _scores(logits_ptr, rows, cols, T, E, stride_t, SIGMOID)
    # unbiased softmax selects on the exponentials: the probabilities' order, without the ties that dividing by the
    # row sum can round two of them into (and that sum's bits follow the block's shape)
    select = scores if SIGMOID or HAS_BIAS else num
    if HAS_BIAS:  # [E] (stride_bias_t = 0) or per token [T, E]
        bias_mask = (rows[:, None] < T) & (cols[None, :] < E)
        select = select + tl.load(bias_ptr + rows[:, None] * stride_bias_t + cols[None, :], mask=bias_mask,
                                  other=0.0).to(tl.float32)
    select = tl.where(cols[None, :] < E, select, float("-inf"))

    if N_GROUP > 1:
        group_of = cols // (E // N_GROUP)
        gcols = tl.arange(0, BLOCK_G)
        group_score = tl.full((BLOCK_T, BLOCK_G), float("-inf"), tl.float32)
        for g in tl.static_range(N_GROUP):
            in_group = tl.where(group_of[None, :] == g, select, float("-inf"))
            score = tl.max(in_group, axis=1)
            if E // N_GROUP > 1:  # a group scores its best two, or its only expert
                first = _first_argmax(in_group, cols, BLOCK_E)
                score += tl.max(tl.where(cols[None, :] == first[:, None], float("-inf"), in_group), axis=1)
            group_score = tl.where(gcols[None, :] == g, score[:, None], group_score)
        keep = tl.zeros((BLOCK_T, BLOCK_E), tl.int32)
        for _ in tl.static_range(TOPK_GROUP):
            g_best = _first_argmax(group_score, gcols, BLOCK_G)
            keep = tl.where(group_of[None, :] == g_best[:, None], 1, keep)
            group_score = tl.where(gcols[None, :] == g_best[:, None], float("-inf"), group_score)
        select = tl.where(keep != 0, select, float("-inf"))

    # renormalised weights from the exponentials: the division by the row sum cancels, and with it its bits
    top_w, top_id = _top_k(select, num if RENORMALIZE else scores, cols, E, TOP_K, RENORMALIZE, BLOCK_E, BLOCK_K)
    top_w = top_w * scaling

    kcols = tl.arange(0, BLOCK_K)
    out = rows[:, None] * TOP_K + kcols[None, :]
    mask = (rows[:, None] < T) & (kcols[None, :] < TOP_K)
    tl.store(weights_ptr + out, top_w, mask=mask)
    tl.store(ids_ptr + out, top_id.to(tl.int64), mask=mask)


@triton.jit
def _route_bwd_kernel(logits_ptr, ids_ptr, weights_ptr, dweights_ptr, dlogits_ptr, T, stride_t, scaling,
                      E: tl.constexpr, SIGMOID: tl.constexpr, TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr,
                      BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
    """d logits from d weights. With a_j the chosen (unbiased) scores, S = sum_j a_j and c the scaling:
    w_j = c a_j / S when renormalising (da_j = (c g_j - sum_m g_m w_m) / S), else w_j = c a_j (da_j = c g_j);
    then through softmax (p * (dA - <p, dA>)) or sigmoid (dA * s (1 - s))."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_E)
    kcols = tl.arange(0, BLOCK_K)
    scores, _ = _scores(logits_ptr, rows, cols, T, E, stride_t, SIGMOID)
    kmask = (rows[:, None] < T) & (kcols[None, :] < TOP_K)
    slot = rows[:, None] * TOP_K + kcols[None, :]
    ids = tl.load(ids_ptr + slot, mask=kmask, other=-1).to(tl.int32)
    g = tl.load(dweights_ptr + slot, mask=kmask, other=0.0).to(tl.float32)
    w = tl.load(weights_ptr + slot, mask=kmask, other=0.0)
    if RENORMALIZE:
        chosen = tl.zeros((BLOCK_T, BLOCK_K), tl.float32)
        for j in tl.static_range(TOP_K):
            id_j = tl.sum(tl.where(kcols[None, :] == j, ids, 0), axis=1)
            a_j = tl.sum(tl.where(cols[None, :] == id_j[:, None], scores, 0.0), axis=1)
            chosen = tl.where(kcols[None, :] == j, a_j[:, None], chosen)
        total = tl.sum(chosen, axis=1) + 1e-20
        da = (scaling * g - tl.sum(g * w, axis=1)[:, None]) / total[:, None]
    else:
        da = scaling * g
    d_scores = tl.zeros((BLOCK_T, BLOCK_E), tl.float32)
    for j in tl.static_range(TOP_K):
        id_j = tl.sum(tl.where(kcols[None, :] == j, ids, 0), axis=1)
        da_j = tl.sum(tl.where(kcols[None, :] == j, da, 0.0), axis=1)
        d_scores += tl.where(cols[None, :] == id_j[:, None], da_j[:, None], 0.0)
    if SIGMOID:
        d_logits = d_scores * scores * (1.0 - scores)
    else:
        d_logits = scores * (d_scores - tl.sum(scores * d_scores, axis=1)[:, None])
    mask = (rows[:, None] < T) & (cols[None, :] < E)
    tl.store(dlogits_ptr + rows[:, None] * stride_t + cols[None, :],
             d_logits.to(dlogits_ptr.dtype.element_ty), mask=mask)


def validate_spec(spec, num_experts: int) -> None:
    """Raise ValueError naming the field when `spec` cannot route over `num_experts` experts."""
    if spec.scoring not in ("softmax", "sigmoid"):
        raise ValueError(f"routing scoring={spec.scoring!r}; allowed: 'softmax', 'sigmoid'")
    if spec.n_group < 1 or num_experts % spec.n_group:
        raise ValueError(f"routing n_group={spec.n_group} must be >= 1 and divide the {num_experts} experts")
    if not 1 <= spec.topk_group <= spec.n_group:
        raise ValueError(f"routing topk_group={spec.topk_group} must be in [1, n_group={spec.n_group}]")
    selectable = spec.topk_group * (num_experts // spec.n_group)
    if not 1 <= spec.top_k <= selectable:
        raise ValueError(f"routing top_k={spec.top_k} must be in [1, {selectable}] (experts in the "
                         f"{spec.topk_group} selected group(s) of {num_experts // spec.n_group})")


def _launch_params(num_experts: int, top_k: int) -> dict:
    block_e = next_pow2(num_experts)
    # about 4096 live scores per program keeps the row block in registers up to 256 experts
    return dict(E=num_experts, TOP_K=top_k, BLOCK_E=block_e, BLOCK_K=next_pow2(top_k),
                BLOCK_T=max(1, min(64, 4096 // block_e)))


class _Route(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, bias, spec):
        T, E = logits.shape
        params = _launch_params(E, spec.top_k)
        weights = torch.empty(T, spec.top_k, device=logits.device, dtype=torch.float32)
        ids = torch.empty(T, spec.top_k, device=logits.device, dtype=torch.int64)
        grid = (triton.cdiv(T, params["BLOCK_T"]),)
        if T:
            _route_fwd_kernel[grid](
                logits, bias if bias is not None else logits, weights, ids, T, logits.stride(0),
                bias.stride(0) if bias is not None and bias.dim() == 2 else 0, float(spec.scaling),
                SIGMOID=spec.scoring == "sigmoid", HAS_BIAS=bias is not None, N_GROUP=spec.n_group,
                TOPK_GROUP=spec.topk_group, RENORMALIZE=bool(spec.renormalize), BLOCK_G=next_pow2(spec.n_group),
                **params)
        ctx.save_for_backward(logits, ids, weights)
        ctx.spec = spec
        ctx.mark_non_differentiable(ids)
        return weights, ids

    @staticmethod
    def backward(ctx, d_weights, _d_ids):
        logits, ids, weights = ctx.saved_tensors
        spec = ctx.spec
        T, E = logits.shape
        params = _launch_params(E, spec.top_k)
        d_logits = torch.empty_like(logits)
        grid = (triton.cdiv(T, params["BLOCK_T"]),)
        if T:
            _route_bwd_kernel[grid](
                logits, ids, weights, d_weights.contiguous(), d_logits, T, logits.stride(0), float(spec.scaling),
                SIGMOID=spec.scoring == "sigmoid", RENORMALIZE=bool(spec.renormalize), **params)
        return d_logits, None, None


def route(logits: torch.Tensor, spec, bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] -> (weights [T, k] float32, ids [T, k] int64); differentiable in logits, not in bias
    ([E] or [T, E], added to the scores for selection only)."""
    check_device("logits", logits)
    if logits.dim() != 2:
        raise ValueError(f"logits must be [tokens, experts]; got shape {tuple(logits.shape)}")
    num_experts = logits.shape[1]
    validate_spec(spec, num_experts)
    if bias is not None and tuple(bias.shape) not in ((num_experts,), tuple(logits.shape)):
        raise ValueError(f"routing bias must have shape ({num_experts},) or {tuple(logits.shape)} "
                         f"(per token, -inf forbids an expert); got {tuple(bias.shape)}")
    return _Route.apply(logits.contiguous(), None if bias is None else bias.detach().contiguous(), spec)
