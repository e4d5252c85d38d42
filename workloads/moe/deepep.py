"""The `deepep` dispatcher: DeepEP V1's `deep_ep.Buffer` normal (training) kernels. get_dispatch_layout once per
batch, dispatch, then combine with the same handle; the backward passes reuse that handle (combine's backward is
a cached dispatch, dispatch's backward a combine). Intranode over NVLink or internode over NVSHMEM (RDMA/EFA)
through the same calls; AWS's EFA-patched DeepEP and UCCL-EP expose this same `deep_ep` API.

DeepEP sends each token once per destination rank (not once per top-k slot) and its combine sums without
weights, so the routing weights travel with the tokens and are applied on the expert side.
"""
from __future__ import annotations

from typing import Any

import torch

from .compute import MoECompute
from .dispatch import Dispatcher


class DeepEPUnavailable(RuntimeError):
    pass


def _deep_ep():
    try:
        import deep_ep
    except ImportError as exc:
        raise DeepEPUnavailable(
            "ep backend 'deepep' needs the deep_ep package (DeepEP V1 built against this torch and NVSHMEM, or "
            f"UCCL-EP); it cannot be imported: {exc}. Use ep_backend: alltoall instead") from exc
    return deep_ep


def make_buffer(group, hidden_size: int):
    """One Buffer for every layer, sized from DeepEP's own hints for bf16 rows of `hidden_size`."""
    deep_ep = _deep_ep()
    if not torch.cuda.is_available():
        raise DeepEPUnavailable("ep backend 'deepep' needs CUDA GPUs; none is visible")
    ranks, hidden_bytes = group.size(), hidden_size * 2
    if hidden_bytes % 16:
        raise DeepEPUnavailable(f"ep backend 'deepep' needs hidden_size * 2 bytes divisible by 16 (int4 copies); "
                                f"hidden_size {hidden_size} is not a multiple of 8")
    nvl_bytes = rdma_bytes = 0
    for config in (deep_ep.Buffer.get_dispatch_config(ranks), deep_ep.Buffer.get_combine_config(ranks)):
        nvl_bytes = max(nvl_bytes, config.get_nvl_buffer_size_hint(hidden_bytes, ranks))
        rdma_bytes = max(rdma_bytes, config.get_rdma_buffer_size_hint(hidden_bytes, ranks))
    return deep_ep.Buffer(group, nvl_bytes, rdma_bytes)


class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weights, ids, buffer, num_experts, out: dict):
        idx = ids.to(getattr(_deep_ep(), "topk_idx_t", torch.int64))
        per_rank, per_rdma_rank, per_expert, in_rank, _ = buffer.get_dispatch_layout(idx, num_experts)
        recv_x, recv_ids, recv_weights, counts, handle, _ = buffer.dispatch(
            x, topk_idx=idx, topk_weights=weights, num_tokens_per_rank=per_rank,
            num_tokens_per_rdma_rank=per_rdma_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)
        out.update(handle=handle, recv_ids=recv_ids, counts=counts)
        ctx.buffer, ctx.handle = buffer, handle
        return recv_x, recv_weights

    @staticmethod
    def backward(ctx, grad_x, grad_weights):
        grad_x, grad_weights, _ = ctx.buffer.combine(grad_x.contiguous(), ctx.handle,
                                                     topk_weights=grad_weights.float().contiguous())
        return grad_x, grad_weights, None, None, None, None


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, buffer, handle):
        ctx.buffer, ctx.handle = buffer, handle
        combined, _, _ = buffer.combine(y.contiguous(), handle)
        return combined

    @staticmethod
    def backward(ctx, grad):
        grad_y, *_ = ctx.buffer.dispatch(grad.contiguous(), handle=ctx.handle)
        return grad_y, None, None


class DeepEPDispatcher(Dispatcher):
    def __init__(self, compute: MoECompute, num_experts: int, buffer):
        self.compute, self.buffer, self.num_experts = compute, buffer, num_experts
        self.num_local_experts = num_experts // buffer.group_size

    def dispatch(self, x, weights, ids):
        if x.dtype != torch.bfloat16:
            raise DeepEPUnavailable(f"ep backend 'deepep' moves bfloat16 tokens, got {x.dtype}; run the model in "
                                    "bfloat16 or under bf16 autocast (the GPU trainer does)")
        info: dict[str, Any] = {}
        recv_x, recv_weights = _Dispatch.apply(x, weights.float(), ids, self.buffer, self.num_experts, info)
        # Slots routed to other ranks' experts arrive as -1: sort them after the last local expert and drop them.
        local = info["recv_ids"] >= 0
        slot_ids = torch.where(local, info["recv_ids"], self.num_local_experts)
        x_sorted, counts, permute_handle = self.compute.permute(recv_x, slot_ids, self.num_local_experts + 1)
        rows = sum(info["counts"])  # DeepEP returns the per-expert counts on the host: no extra sync
        weights_here = torch.where(local, recv_weights, 0.0)
        handle = (permute_handle, weights_here, info["handle"], x_sorted.shape[0], recv_x.shape[0])
        return x_sorted[:rows], counts[:self.num_local_experts], handle

    def combine(self, y_sorted, handle):
        permute_handle, weights_here, deepep_handle, all_slots, _ = handle
        padded = torch.cat([y_sorted, y_sorted.new_zeros(all_slots - y_sorted.shape[0], y_sorted.shape[1])])
        per_token = self.compute.unpermute(padded, weights_here, permute_handle)
        return _Combine.apply(per_token, self.buffer, deepep_handle)

    def received_rows(self, handle):
        return handle[4]  # one row per (token, this rank), however many of its experts are here
