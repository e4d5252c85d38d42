"""Context parallelism for long samples, applied to the model from outside (parallelize.py): a packed micro-batch's
tokens are split into N contiguous slices over a CP group of N ranks, and attention is made whole again by an
all-to-all over heads (DeepSpeed-Ulysses): before attention each rank trades its slice of every head for every
token of H / N heads, runs the packed causal attention over the whole sequence for those heads, and trades back.

Why all-to-all over heads rather than ring attention: each head's attention over its whole sequence is one kernel
call, as without CP, so a query's keys are reduced in the same order (what exact numerics needs; ring attention
merges partial softmaxes in an order that depends on N), the packed layout's sequence boundaries need no special
cases, and the traffic is two all-to-alls of the slice's q/k/v/out (NVLink inside a node). Its limit: N divides
the query heads; key/value heads are expanded to one per query head when N does not divide them.

Everything else in a layer (norms, projections, the router and the experts) is per token, so a rank runs it on its
slice alone; EP dispatches a slice's tokens as any other rank's."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.nn.functional import all_to_all_single


@dataclass(frozen=True)
class ContextParallel:
    """A CP group: `size` ranks holding consecutive slices of the same packed micro-batch; this one is `rank`."""

    group: dist.ProcessGroup
    size: int
    rank: int

    def slice_bounds(self, tokens: int) -> tuple[int, int]:
        if tokens % self.size:
            raise ValueError(f"context parallelism over {self.size} ranks needs a packed row whose length divides "
                             f"by {self.size}, got {tokens} (pad it: trainer/step.py)")
        n = tokens // self.size
        return self.rank * n, (self.rank + 1) * n

    def gather(self, local: torch.Tensor) -> torch.Tensor:
        """Every rank's slice of a per-token tensor (dim 0), in order; differentiable (the backward sums each
        slice's gradient over the group)."""
        return _Gather.apply(local.contiguous(), self.group, self.size)

    def heads_to_sequence(self, x: torch.Tensor) -> torch.Tensor:
        """[1, H, s, D] this rank's slice of every head -> [1, H / N, N * s, D] every token of this rank's heads."""
        _, h, s, d = x.shape
        chunks = x.reshape(self.size, h // self.size, s, d).contiguous()  # chunk j goes to rank j
        received = all_to_all_single(torch.empty_like(chunks), chunks, group=self.group)  # [N, H/N, s, D] by rank
        return received.permute(1, 0, 2, 3).reshape(1, h // self.size, self.size * s, d)

    def sequence_to_heads(self, x: torch.Tensor) -> torch.Tensor:
        """The inverse: [1, H / N, N * s, D] -> [1, H, s, D]."""
        _, hn, t, d = x.shape
        s = t // self.size
        chunks = x.reshape(hn, self.size, s, d).permute(1, 0, 2, 3).contiguous()  # slice j goes back to rank j
        received = all_to_all_single(torch.empty_like(chunks), chunks, group=self.group)  # [N, H/N, s, D] by heads
        return received.reshape(1, hn * self.size, s, d)


def context_parallel_group(size: int) -> ContextParallel:
    """This rank's CP group: ranks [g * size, (g + 1) * size) of the default group share micro-batches. Every rank
    makes every group (torch.distributed's new_group is collective)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    groups = [dist.new_group(list(range(g * size, (g + 1) * size))) for g in range(world // size)]
    return ContextParallel(groups[rank // size], size, rank % size)


def check_heads(cp_size: int, heads: int) -> None:
    if heads % cp_size:
        raise ValueError(f"context parallelism over {cp_size} ranks splits the {heads} query heads: it must divide "
                         "them")


def ulysses_attention(cp: ContextParallel, packed_attention, q, k, v, segments: list[int], gqa: bool):
    """Attention.attend under CP: q [1, H, s, D], k and v [1, H_kv, s, D] (this rank's slice) -> [1, s, H, D]."""
    heads, kv_heads = q.shape[1], k.shape[1]
    if kv_heads % cp.size:  # each rank's query heads need their key/value heads: one per query head then
        k, v = (t.repeat_interleave(heads // kv_heads, dim=1) for t in (k, v))
        gqa = False
    out = packed_attention(cp.heads_to_sequence(q), cp.heads_to_sequence(k), cp.heads_to_sequence(v), segments,
                           gqa)  # [1, T, H / N, D]
    return cp.sequence_to_heads(out.transpose(1, 2)).transpose(1, 2)


class _Gather(torch.autograd.Function):
    """all_gather whose backward is a reduce-scatter made of one all-to-all (torch.distributed.nn's all_gather
    emulates it on gloo with scatters that take a subgroup's ranks for global ones)."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, group: dist.ProcessGroup, size: int) -> torch.Tensor:
        ctx.group, ctx.size = group, size
        parts = [torch.empty_like(local) for _ in range(size)]
        dist.all_gather(parts, local, group=group)
        return torch.cat(parts, dim=0)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        pieces = grad.contiguous()  # slice j of every rank's gradient goes to rank j, which sums them
        received = torch.empty_like(pieces)
        dist.all_to_all_single(received, pieces, group=ctx.group)
        return received.view(ctx.size, -1, *grad.shape[1:]).sum(dim=0), None, None
