"""Expert parallelism: which experts this rank owns and which dispatcher moves tokens to them."""
from __future__ import annotations

import contextlib
import importlib.util
import logging

import torch
import torch.distributed as dist

from moe_rl_eks.core.ep_backends import (DecodeBackend, EpBackend, Topology, check_backend, ll_tokens_per_rank,
                                         resolve_decode_backend)
from moe_rl_eks.core.run import ResolvedRun

from .compute import MoECompute
from .dispatch import AllToAllDispatcher, Dispatcher, LocalDispatcher, PhasedDispatcher, through_host

log = logging.getLogger(__name__)


def decode_phase(ep: "ExpertParallel | None"):
    """`ep.decode_phase()`, or nothing to switch without expert parallelism."""
    return ep.decode_phase() if ep is not None else contextlib.nullcontext()


def local_experts(ep: "ExpertParallel | None", num_experts: int) -> range | None:
    """The experts this rank holds under `ep`; None (all of them) without expert parallelism."""
    return ep.local_experts(num_experts) if ep is not None and ep.size > 1 else None


class ExpertParallel:
    """The EP process group and the resolved backend (core.run.resolve_run picks it once per run; see
    core/ep_backends.py). Every rank of `group` holds E / R experts in contiguous order; non-expert weights are
    replicated and each rank routes its own tokens.

    EP over part of the ranks (`mesh`, model/parallelize.py expert_mesh): `group` is this rank's EP group (mesh
    dimension "ep"), and the groups' copies of each expert are sharded over "edp"; weights every rank holds whole
    then sum their gradients over every rank, not the EP group."""

    def __init__(self, group: dist.ProcessGroup, backend: EpBackend, *, ranks_per_node: int | None = None,
                 device: str = "cpu", decode: DecodeBackend | None = None, decode_rows_per_rank: int = 0,
                 mesh=None):
        """decode: a server's decode forwards (inside `decode_phase()`) dispatch with this instead of `backend`;
        "deepep_ll" sizes DeepEP's low-latency buffer for `decode_rows_per_rank` tokens per rank."""
        self.group, self.backend, self.mesh = group, backend, mesh
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
        # the EP group holding global rank 0: its ranks gather and publish the experts (the other groups' copies
        # are the same weights)
        self.first_copy = mesh is None or 0 in dist.get_process_group_ranks(group)
        self.ranks_per_node = ranks_per_node or self.size
        self.device = device
        self.decode_backend = decode or backend
        self.decode_tokens_per_rank = ll_tokens_per_rank(decode_rows_per_rank, self.size)
        self.decoding = False  # set by decode_phase(): read by the PhasedDispatcher of every layer
        self._deepep_buffer = None  # one DeepEP Buffer shared by every layer
        self._ll_buffer = None  # and one low-latency Buffer
        log.info("expert parallelism: backend=%s ranks=%d rank=%d", backend, self.size, self.rank)
        if self.decode_backend != backend:
            log.info("expert parallelism: decode backend=%s tokens per rank=%d", self.decode_backend,
                     self.decode_tokens_per_rank)

    @classmethod
    def for_serving(cls, group: dist.ProcessGroup, config, *, device: str, rows_per_rank: int,
                    exact: bool = False) -> "ExpertParallel":
        """A sharded rollout server's EP: prefill over the all-to-all, decode over DeepEP's low-latency kernels
        where resolve_decode_backend allows them (logged with the reason either way; never in the `exact` numerics
        mode). `config` is the ModelConfig; the server's GPUs are one node's."""
        size = dist.get_world_size(group)
        topo = Topology(nodes=1, ranks_per_node=size, device="cuda" if device.startswith("cuda") else "cpu",
                        num_experts=config.num_experts, dtype=config.dtype)
        decode, why = resolve_decode_backend(topo, hidden_size=config.hidden_size, top_k=config.num_experts_per_tok,
                                             rows_per_rank=rows_per_rank,
                                             deepep_importable=importlib.util.find_spec("deep_ep") is not None,
                                             exact=exact)
        log.info("ep decode backend %s: %s", decode, why)
        return cls(group, "alltoall", device=device, decode=decode, decode_rows_per_rank=rows_per_rank)

    @contextlib.contextmanager
    def decode_phase(self):
        """Forwards inside run as decode steps (every rank enters it for the same forwards)."""
        self.decoding = True
        try:
            yield
        finally:
            self.decoding = False

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
        base = self._dispatcher(compute, num_experts, hidden_size)
        if self.decode_backend != "deepep_ll":
            return base
        from .deepep_ll import DeepEPLowLatencyDispatcher, make_ll_buffer  # deep_ep and CUDA: only when chosen

        if self._ll_buffer is None:
            self._ll_buffer = make_ll_buffer(self.group, self.decode_tokens_per_rank, hidden_size, num_experts)
        return PhasedDispatcher(self, base, DeepEPLowLatencyDispatcher(compute, num_experts, self._ll_buffer,
                                                                       self.decode_tokens_per_rank))

    def _dispatcher(self, compute: MoECompute, num_experts: int, hidden_size: int) -> Dispatcher:
        if self.backend == "local":
            return LocalDispatcher(compute, num_experts)
        if self.backend == "alltoall":
            return AllToAllDispatcher(compute, num_experts, self.group)
        from .deepep import DeepEPDispatcher, make_buffer  # needs deep_ep and CUDA: imported only when chosen

        if self._deepep_buffer is None:
            self._deepep_buffer = make_buffer(self.group, hidden_size)
        return DeepEPDispatcher(compute, num_experts, self._deepep_buffer)

    def sum_replicated_grads(self, params) -> None:
        """All-reduce (sum) the gradients of `params`, weights every rank holds a copy of (not the experts), so
        they equal the gradient of the sum of the ranks' losses, as the experts' gradients already do. A weight
        this rank's tokens never reached (a rank with no tokens) adds zeros, so every rank reduces the same
        bytes. One flat buffer, one collective."""
        params = [p for p in params if p.requires_grad]
        group = self.group if self.mesh is None else dist.group.WORLD  # every rank's copy
        if not params or dist.get_world_size(group) == 1:
            return
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params])
        host = flat.cpu() if through_host(flat, group) else flat
        dist.all_reduce(host, group=group)
        flat.copy_(host)
        offset = 0
        for p in params:
            p.grad = flat[offset:offset + p.numel()].view_as(p).clone()
            offset += p.numel()
