"""Expert parallelism: which experts this rank owns and which dispatcher moves tokens to them."""
from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from moe_rl_eks.core.ep_backends import EpBackend, Topology, check_backend
from moe_rl_eks.core.run import ResolvedRun

from .compute import MoECompute
from .dispatch import AllToAllDispatcher, Dispatcher, LocalDispatcher, through_host

log = logging.getLogger(__name__)


def local_experts(ep: "ExpertParallel | None", num_experts: int) -> range | None:
    """The experts this rank holds under `ep`; None (all of them) without expert parallelism."""
    return ep.local_experts(num_experts) if ep is not None and ep.size > 1 else None


class ExpertParallel:
    """The EP process group and the resolved backend (core.run.resolve_run picks it once per run; see
    core/ep_backends.py). Every rank of `group` holds E / R experts in contiguous order; non-expert weights are
    replicated and each rank routes its own tokens."""

    def __init__(self, group: dist.ProcessGroup, backend: EpBackend, *, ranks_per_node: int | None = None,
                 device: str = "cpu"):
        self.group, self.backend = group, backend
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
        self.ranks_per_node = ranks_per_node or self.size
        self.device = device
        self._deepep_buffer = None  # one DeepEP Buffer shared by every layer
        log.info("expert parallelism: backend=%s ranks=%d rank=%d", backend, self.size, self.rank)

    @classmethod
    def for_run(cls, resolved: ResolvedRun, group: dist.ProcessGroup) -> "ExpertParallel":
        """The EP of a run resolved against its environment (core.run.resolve_run), logging the backend and why
        it was chosen, so the trainer's log says what the manifests were built for."""
        topo = resolved.topology
        if dist.get_world_size(group) != topo.ep_size:
            raise ValueError(f"the process group has {dist.get_world_size(group)} ranks; the resolved run expects "
                             f"{topo.ep_size} ({topo.nodes} nodes x {topo.ranks_per_node})")
        log.info("ep backend %s: %s", resolved.ep_backend, resolved.ep_backend_reason)
        return cls(group, resolved.ep_backend, ranks_per_node=topo.ranks_per_node, device=topo.device)

    def topology(self, num_experts: int) -> Topology:
        return Topology(nodes=self.size // self.ranks_per_node, ranks_per_node=self.ranks_per_node,
                        device="cuda" if self.device.startswith("cuda") else "cpu", num_experts=num_experts)

    def local_experts(self, num_experts: int) -> range:
        per_rank = num_experts // self.size
        return range(self.rank * per_rank, (self.rank + 1) * per_rank)

    def dispatcher(self, compute: MoECompute, num_experts: int, hidden_size: int) -> Dispatcher:
        check_backend(self.backend, self.topology(num_experts))
        if self.backend == "local":
            return LocalDispatcher(compute, num_experts)
        if self.backend == "alltoall":
            return AllToAllDispatcher(compute, num_experts, self.group)
        from .deepep import DeepEPDispatcher, make_buffer  # needs deep_ep and CUDA: imported only when chosen

        if self._deepep_buffer is None:
            self._deepep_buffer = make_buffer(self.group, hidden_size)
        return DeepEPDispatcher(compute, num_experts, self._deepep_buffer)

    def sum_replicated_grads(self, module) -> None:
        """All-reduce (sum) the gradients of the weights every rank holds a copy of (all but the experts), so
        they equal the gradient of the sum of the ranks' losses, as the experts' gradients already do. A weight
        this rank's tokens never reached (a rank with no tokens) adds zeros, so every rank reduces the same
        bytes. One flat buffer, one collective."""
        params = [p for name, p in module.named_parameters() if p.requires_grad and ".mlp.experts." not in name]
        if not params or self.size == 1:
            return
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params])
        host = flat.cpu() if through_host(flat, self.group) else flat
        dist.all_reduce(host, group=self.group)
        flat.copy_(host)
        offset = 0
        for p in params:
            p.grad = flat[offset:offset + p.numel()].view_as(p).clone()
            offset += p.numel()
