"""The `deepep_ll` dispatcher: DeepEP V1's low-latency kernels (`deep_ep.Buffer` in low-latency mode), for an
expert-parallel server's decode forwards. Inference only (no autograd).

low_latency_dispatch takes at most a fixed M tokens per rank (every rank holds the same M; the buffer is sized for
it) and hands each rank an expert-major packed batch [E_local, M * ranks, h] in which only the first count[e] rows
of expert e hold tokens, with no host synchronisation. The MoECompute backends take expert-sorted rows with
counts, so the valid rows are gathered into that order and the experts' outputs scattered back into the packed
layout for low_latency_combine, which applies the routing weights and sums on the source rank (the weights
never travel). That gather needs the received total on the host: one read per layer, as the all-to-all's split
sizes are.
"""
from __future__ import annotations

import torch

from .compute import MoECompute
from .dispatch import Dispatcher


class DeepEPLowLatencyUnavailable(RuntimeError):
    pass


def _deep_ep():
    try:
        import deep_ep
    except ImportError as exc:
        raise DeepEPLowLatencyUnavailable(
            f"the deepep_ll decode dispatcher needs the deep_ep package (DeepEP V1 built against this torch and "
            f"NVSHMEM: images/scripts/build_deepep.sh); it cannot be imported: {exc}") from exc
    return deep_ep


def make_ll_buffer(group, tokens_per_rank: int, hidden_size: int, num_experts: int):
    """One low-latency Buffer for every layer, sized by DeepEP's hint for `tokens_per_rank` bf16 tokens of
    `hidden_size`. DeepEP wants as many queue pairs per rank as local experts in this mode. NVLink (or one shared
    GPU) carries the bytes between a node's ranks."""
    deep_ep = _deep_ep()
    if not torch.cuda.is_available():
        raise DeepEPLowLatencyUnavailable("the deepep_ll decode dispatcher needs CUDA GPUs; none is visible")
    ranks = group.size()
    size = deep_ep.Buffer.get_low_latency_rdma_size_hint(tokens_per_rank, hidden_size, ranks, num_experts)
    return deep_ep.Buffer(group, 0, size, low_latency_mode=True, num_qps_per_rank=num_experts // ranks,
                          allow_nvlink_for_low_latency_mode=True)


def packed_order(counts: torch.Tensor, rows_per_expert: int, total: int) -> torch.Tensor:
    """counts [E_local] of valid rows per expert in a packed [E_local, rows_per_expert, h] batch (its first
    count[e] rows of expert e) -> [total] row indices into the packed batch viewed as [E_local * rows_per_expert,
    h] that list the valid rows grouped by expert (the order MoECompute.experts takes). total = counts.sum()."""
    counts = counts.to(torch.int64)
    starts = torch.cumsum(counts, 0) - counts
    expert = torch.repeat_interleave(torch.arange(counts.numel(), device=counts.device), counts, output_size=total)
    return expert * rows_per_expert + torch.arange(total, device=counts.device) - starts[expert]


def packed_to_sorted(packed: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """packed [E_local, M', h] with counts [E_local] -> (x_sorted [N, h], counts int64, order [N]) for the experts;
    `order` puts their outputs back (`sorted_to_packed`)."""
    experts, rows, hidden = packed.shape
    total = int(counts.sum())  # the host read: the expert-sorted batch has this many rows
    order = packed_order(counts, rows, total)
    return packed.reshape(experts * rows, hidden).index_select(0, order), counts.to(torch.int64), order


def sorted_to_packed(y_sorted: torch.Tensor, order: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """Expert outputs [N, h] in `packed_to_sorted`'s order -> a contiguous packed [E_local, M', h] batch holding them
    in the rows they came from. The other rows are left unwritten: combine reads only the valid ones."""
    experts, rows, hidden = shape
    out = y_sorted.new_empty(experts * rows, hidden)
    return out.index_copy_(0, order, y_sorted).view(experts, rows, hidden)


class DeepEPLowLatencyDispatcher(Dispatcher):
    def __init__(self, compute: MoECompute, num_experts: int, buffer, tokens_per_rank: int):
        self.compute, self.buffer = compute, buffer
        self.num_experts, self.tokens_per_rank = num_experts, tokens_per_rank
        self.num_local_experts = num_experts // buffer.group_size

    def dispatch(self, x, weights, ids):
        if x.dtype != torch.bfloat16:
            raise DeepEPLowLatencyUnavailable(f"the deepep_ll decode dispatcher moves bfloat16 tokens, got {x.dtype}")
        if x.shape[0] > self.tokens_per_rank:
            raise ValueError(f"deepep_ll dispatch: {x.shape[0]} tokens on this rank; its buffer holds at most "
                             f"{self.tokens_per_rank} per rank (decode rows per rank)")
        idx = ids.to(getattr(_deep_ep(), "topk_idx_t", torch.int64)).contiguous()
        packed, counts, ll_handle, _, _ = self.buffer.low_latency_dispatch(
            x.contiguous(), idx, self.tokens_per_rank, self.num_experts, use_fp8=False)
        x_sorted, counts, order = packed_to_sorted(packed, counts)
        return x_sorted, counts, (ll_handle, idx, weights.float().contiguous(), order, packed.shape)

    def combine(self, y_sorted, handle):
        ll_handle, idx, weights, order, shape = handle
        combined, _, _ = self.buffer.low_latency_combine(sorted_to_packed(y_sorted, order, shape), idx, weights,
                                                         ll_handle)
        return combined

    def received_rows(self, handle):
        return handle[3].numel()  # one row per (token, expert here)

