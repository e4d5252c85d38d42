"""Token dispatchers: move each (token, expert) pair to the rank that owns the expert, hand the experts one
expert-sorted batch with per-expert counts, and bring the results back summed with the routing weights.
Autograd flows through both directions. Experts sit on ranks in contiguous ranges: rank r owns experts
[r * E / R, (r + 1) * E / R), so node-limited routing (contiguous expert ranges) keeps traffic inside nodes.

`local` (one rank) and `alltoall` (torch.distributed.all_to_all_single, NCCL or gloo) live here; `deepep` in
deepep.py, `deepep_ll` (a server's decode) in deepep_ll.py. ExpertParallel (parallel.py) builds the right one.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch
import torch.distributed as dist

from .compute import MoECompute


class Dispatcher(ABC):
    num_local_experts: int

    @abstractmethod
    def dispatch(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """x [T, h], weights [T, k] float32, ids [T, k] global expert ids -> (x_sorted [N, h] grouped by local
        expert, counts [num_local_experts] int64, handle for combine)."""

    @abstractmethod
    def combine(self, y_sorted: torch.Tensor, handle: Any) -> torch.Tensor:
        """Expert outputs [N, h] (same order as dispatch gave) -> [T, h] = sum_j weights[t, j] * y of (t, j)."""

    @abstractmethod
    def received_rows(self, handle: Any) -> int:
        """Rows of h values the dispatch that made `handle` delivered to this rank (its traffic, for metrics)."""


class LocalDispatcher(Dispatcher):
    def __init__(self, compute: MoECompute, num_experts: int):
        self.compute, self.num_local_experts = compute, num_experts

    def dispatch(self, x, weights, ids):
        x_sorted, counts, handle = self.compute.permute(x, ids, self.num_local_experts)
        return x_sorted, counts, (handle, weights)

    def combine(self, y_sorted, handle):
        permute_handle, weights = handle
        return self.compute.unpermute(y_sorted, weights, permute_handle)

    def received_rows(self, handle):
        return handle[0][0].numel()  # every (token, slot) pair, though none crossed a network


def through_host(tensor: torch.Tensor, group) -> bool:
    """gloo moves host memory only: CUDA tensors on a gloo group (ranks sharing one GPU) go through the host."""
    return tensor.is_cuda and dist.get_backend(group) == dist.Backend.GLOO


def _all_to_all(out: torch.Tensor, inp: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    if through_host(inp, group):
        host_out = out.cpu()
        dist.all_to_all_single(host_out, inp.cpu(), out_splits, in_splits, group=group)
        return out.copy_(host_out)
    dist.all_to_all_single(out, inp, out_splits, in_splits, group=group)
    return out


class _AllToAll(torch.autograd.Function):
    """all_to_all_single of rows; the backward is the same exchange with the split sizes swapped."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        return _all_to_all(out, x.contiguous(), out_splits, in_splits, group)

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        grad_in = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        return _all_to_all(grad_in, grad.contiguous(), in_splits, out_splits, ctx.group), None, None, None


def source_major_to_expert_major(counts: torch.Tensor) -> torch.Tensor:
    """counts [R, E_local] of rows received from each source rank, grouped by local expert inside each source
    block -> the row index that lists them grouped by local expert first (stable in source rank order)."""
    flat = counts.reshape(-1)
    start = torch.cumsum(flat, 0) - flat  # where block (r, e) starts in the received, source-major rows
    by_expert = counts.t().reshape(-1)
    start_by_expert = start.view(counts.shape).t().reshape(-1)
    offset_in_block = torch.arange(int(flat.sum()), device=counts.device) - torch.repeat_interleave(
        torch.cumsum(by_expert, 0) - by_expert, by_expert)
    return torch.repeat_interleave(start_by_expert, by_expert) + offset_in_block


class AllToAllDispatcher(Dispatcher):
    """Sort by global expert (so rows are already grouped by owner rank), exchange the per-expert counts once,
    then exchange the rows with all_to_all_single and regroup them by local expert. The routing weights never
    travel: combine applies them on the source rank after the rows come back."""

    def __init__(self, compute: MoECompute, num_experts: int, group):
        self.compute, self.group = compute, group
        self.ranks = dist.get_world_size(group)
        self.num_experts = num_experts
        self.num_local_experts = num_experts // self.ranks

    def dispatch(self, x, weights, ids):
        x_sorted, counts, permute_handle = self.compute.permute(x, ids, self.num_experts)
        send_counts = counts.view(self.ranks, self.num_local_experts)
        recv_counts = _all_to_all(torch.empty_like(send_counts), send_counts, [1] * self.ranks, [1] * self.ranks,
                                  self.group)
        # The one host sync of a layer: the split sizes all_to_all_single needs.
        send_splits = send_counts.sum(1).tolist()
        recv_splits = recv_counts.sum(1).tolist()
        received = _AllToAll.apply(x_sorted, recv_splits, send_splits, self.group)
        order = source_major_to_expert_major(recv_counts)
        handle = (permute_handle, weights, order, send_splits, recv_splits)
        return received[order], recv_counts.sum(0), handle

    def combine(self, y_sorted, handle):
        permute_handle, weights, order, send_splits, recv_splits = handle
        source_major = torch.zeros_like(y_sorted).index_copy(0, order, y_sorted)
        returned = _AllToAll.apply(source_major, send_splits, recv_splits, self.group)
        return self.compute.unpermute(returned, weights, permute_handle)

    def received_rows(self, handle):
        return sum(handle[4])


class PhasedDispatcher(Dispatcher):
    """An expert-parallel server's dispatcher: `prefill` (the all-to-all) outside `ExpertParallel.decode_phase()`,
    `decode` (DeepEP low-latency) inside it. Every rank of a step runs the same phase, so they all call the same
    collective kernels."""

    def __init__(self, phase_source, prefill: Dispatcher, decode: Dispatcher):
        if prefill.num_local_experts != decode.num_local_experts:
            raise ValueError(f"prefill and decode dispatchers disagree on local experts: "
                             f"{prefill.num_local_experts} vs {decode.num_local_experts}")
        self.phase_source, self.prefill, self.decode = phase_source, prefill, decode
        self.num_local_experts = prefill.num_local_experts

    def _chosen(self) -> Dispatcher:
        return self.decode if self.phase_source.decoding else self.prefill

    def dispatch(self, x, weights, ids):
        chosen = self._chosen()
        x_sorted, counts, handle = chosen.dispatch(x, weights, ids)
        return x_sorted, counts, (chosen, handle)

    def combine(self, y_sorted, handle: Any):
        chosen, inner = handle
        return chosen.combine(y_sorted, inner)

    def received_rows(self, handle):
        chosen, inner = handle
        return chosen.received_rows(inner)
