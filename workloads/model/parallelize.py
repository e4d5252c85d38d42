"""Parallelism applied to a MoETransformer from outside it, torchtitan's `parallelize_<model>(model, dims, job)`
shape: expert parallelism, activation checkpointing and FSDP2 over a DeviceMesh, chosen by a `ParallelPlan`. The
model file stays plain PyTorch (no process group, no collective); every collective of the trainer's model state
(publishing, gathering, loading) lives here, beside the layout that needs it.

It lives in the model's room, not the trainer's, because it rewires the model's own modules and knows nothing of
training beyond which weights are sharded; any role that holds a model may apply it (the trainer today; a sharded
rollout replica still builds its experts' split through `MoETransformer(ep=...)`).

Order, as torchtitan applies it: expert parallelism (each rank keeps its contiguous slice of the experts and a
dispatcher over the EP ranks), activation checkpointing (each decoder layer recomputed in the backward), then
FSDP2 (`fully_shard` per decoder layer, then the root) of the dense weights over the data-parallel mesh dimension.
Apply it to a model built on the meta device, then `to_empty` onto the rank's device and `load_full_state`: no
rank ever holds every expert.

Layouts, on a 1-D mesh "dp" of every trainer rank:
- EP degree = the mesh's size: the experts split over every rank (as the trainer always has; FSDP leaves them
  out), the dense weights replicated or, with `fsdp`, sharded over the same ranks.
- EP over part of the ranks (torchtitan's dp_shard_in_ep x dp_shard_mod_ep): consecutive ranks form an EP group
  (within a node, where the all-to-all is fastest), and each expert's copies, one per group, are sharded by FSDP2
  over the ranks holding them ("edp", strided), so each rank still holds 1/world of the experts' state. Needs
  `fsdp` (the dense weights sharded over "dp"). The (ep, edp) mesh is `expert_mesh`'s."""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
from torch.utils.checkpoint import (CheckpointPolicy, checkpoint as recomputed, create_selective_checkpoint_contexts,
                                    set_checkpoint_early_stop)

from moe_rl_eks.core.ep_backends import EpBackend

from ..moe.dispatch import LocalDispatcher, through_host
from ..moe.layer import Experts
from ..moe.parallel import ExpertParallel
from .context_parallel import ContextParallel, check_heads, context_parallel_group, ulysses_attention
from .transformer import MoETransformer, packed_attention

EXPERT_MARK = ".mlp.experts."
# What "save_attention" checkpointing keeps of a layer: the attention kernels' outputs (flash, memory-efficient,
# cuDNN on GPUs; the CPU kernel here), whose recomputation is the costliest part of a long sequence's layer.
ATTENTION_OPS = {getattr(torch.ops.aten, name).default for name in (
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu")}
CHECKPOINTING = ("off", "full", "save_attention")
Checkpointing = Literal["off", "full", "save_attention"]
PARAM_DTYPES = ("float32", "bfloat16")
ParamDtype = Literal["float32", "bfloat16"]


@dataclass(frozen=True)
class ParallelPlan:
    """How the model is laid out over the mesh. The default is one process with nothing applied; the trainer's
    plan before FSDP (ep_degree = its ranks, fsdp off) is exactly the EP trainer it always was."""

    ep_degree: int = 1  # ranks the experts are split over: the mesh's size (the one layout built)
    ep_backend: EpBackend = "alltoall"  # the dispatcher between EP ranks (core.run.resolve_run chooses it)
    ranks_per_node: int | None = None  # EP ranks per node (DeepEP's intranode limit); default: all of them
    fsdp: bool = False  # FSDP2 of the dense weights over "dp" (default: replicated on every rank)
    activation_checkpointing: Checkpointing = "off"  # "full": keep each layer's input; "save_attention": also
    # the attention kernels' outputs
    compute: str = "torch"  # the model's compute backend (model/backends.py), chosen when the model is built
    cp_degree: int = 1  # context parallelism: consecutive ranks sharing each packed micro-batch's tokens
    # FSDP's gathered parameters (what layers compute with): "bfloat16" is torchtitan's mixed precision, the
    # sharded float32 parameters the master copy AdamW steps, gradients reduced in float32. "float32": the
    # trainer's own bf16 autocast on GPUs casts them per op instead.
    param_dtype: ParamDtype = "float32"

    def __post_init__(self):
        if self.activation_checkpointing not in CHECKPOINTING:
            raise ValueError(f"activation_checkpointing {self.activation_checkpointing!r} is not one of "
                             f"{CHECKPOINTING}")
        if self.ep_degree < 1:
            raise ValueError(f"ep_degree must be >= 1, got {self.ep_degree}")
        if self.cp_degree < 1:
            raise ValueError(f"cp_degree must be >= 1, got {self.cp_degree}")
        if self.param_dtype not in PARAM_DTYPES:
            raise ValueError(f"param_dtype {self.param_dtype!r} is not one of {PARAM_DTYPES}")


def parallelize(model: MoETransformer, mesh, plan: ParallelPlan, *, ep: ExpertParallel | None = None,
                cp: ContextParallel | None = None) -> ExpertParallel | None:
    """Apply `plan` to `model` (built on the meta device with `compute=plan.compute`, every expert) over `mesh`
    (a 1-D DeviceMesh named "dp"; None for one process) in place. `ep`: an ExpertParallel already made for this
    mesh (the policy's, for its reference model, so both share DeepEP's buffers); `cp`: the policy's CP group, for
    its reference (groups are made once). Returns the model's EP."""
    size = 1 if mesh is None else mesh.size()
    if model.compute_name != plan.compute:
        raise ValueError(f"parallelize: the model was built with compute {model.compute_name!r}, the plan says "
                         f"{plan.compute!r}; build it as MoETransformer(config, compute=plan.compute)")
    check_layout(plan, size, model.config.num_experts)
    if plan.ep_degree > 1 and ep is None:
        ranks_per_node = min(plan.ranks_per_node or plan.ep_degree, plan.ep_degree)  # an EP group within a node
        if plan.ep_degree == size:
            ep = ExpertParallel(mesh.get_group("dp"), plan.ep_backend, ranks_per_node=ranks_per_node,
                                device=mesh.device_type)
        else:
            experts = expert_mesh(mesh.device_type, size, plan.ep_degree)
            ep = ExpertParallel(experts.get_group("ep"), plan.ep_backend, ranks_per_node=ranks_per_node,
                                device=mesh.device_type, mesh=experts)
    split_experts(model, ep if plan.ep_degree > 1 else None)
    if plan.cp_degree > 1:
        split_context(model, cp or context_parallel_group(plan.cp_degree))
    checkpoint_layers(model, plan.activation_checkpointing)
    if plan.fsdp and size > 1:
        shard_dense(model, mesh, ep, getattr(torch, plan.param_dtype))
    return model.ep


def check_layout(plan: ParallelPlan, size: int, num_experts: int) -> None:
    """The layouts built (module docstring), else a ValueError naming the plan's numbers."""
    if size % plan.cp_degree:
        raise ValueError(f"cp_degree {plan.cp_degree} must divide the {size} ranks")
    if plan.ep_degree == size:
        return
    if plan.ep_degree < 2 or size % plan.ep_degree:
        raise ValueError(f"ep_degree {plan.ep_degree} on a mesh of {size} ranks: EP must span every rank or a "
                         f"divisor of them >= 2")
    if not plan.fsdp:
        # each copy's gradient would otherwise need its own all-reduce over the copies: FSDP's reduce-scatter
        # sums them and leaves each rank its shard
        raise ValueError(f"ep_degree {plan.ep_degree} < {size} ranks shards the experts' copies with FSDP: turn "
                         "fsdp on")
    if num_experts % size:
        raise ValueError(f"ep_degree {plan.ep_degree} < {size} ranks: the {num_experts} experts must split evenly "
                         f"over all {size} ranks (each EP rank's {num_experts // plan.ep_degree} over its "
                         f"{size // plan.ep_degree} copies)")


def expert_mesh(device_type: str, world: int, ep_degree: int):
    """The (ep, edp) mesh of EP over part of the ranks: global rank r is EP rank r % ep_degree of group
    r // ep_degree (consecutive ranks: a node's GPUs), and its experts' copies are on the ranks r + k * ep_degree.
    Its dimensions are listed EP first so that a DTensor sharded [Shard(0), Shard(0)] over it cuts the expert
    dimension by EP rank, then each slice by copy: the experts' global order (checkpoints)."""
    from torch.distributed.device_mesh import DeviceMesh

    ranks = torch.arange(world).view(world // ep_degree, ep_degree).T
    return DeviceMesh(device_type, ranks, mesh_dim_names=("ep", "edp"))


def expert_tensor(tensor: torch.Tensor, ep: ExpertParallel, mesh):
    """An expert tensor of this rank (its EP slice, or with sharded copies its FSDP shard of it) as a DTensor of
    every expert, sharded along the expert dimension over every rank (`mesh`: the 1-D "dp" one), for DCP: a run
    with another layout reads its own slices. Shares the tensor's storage."""
    from torch.distributed.tensor import DTensor, Shard

    if ep.mesh is None:
        return DTensor.from_local(tensor, mesh, [Shard(0)], run_check=False)
    return DTensor.from_local(local(tensor), ep.mesh, [Shard(0), Shard(0)], run_check=False)


def split_experts(model: MoETransformer, ep: ExpertParallel | None) -> None:
    """Each MoE layer keeps this rank's contiguous slice of the experts and dispatches over `ep` (None: every
    expert, local dispatch). The new expert tensors are made where the old ones were (meta, before to_empty)."""
    c = model.config
    for layer in model.model.layers:
        block = layer.mlp
        block.dispatcher = (ep.dispatcher(model.compute, c.num_experts, c.hidden_size) if ep is not None
                            else LocalDispatcher(model.compute, c.num_experts))
        if block.dispatcher.num_local_experts != block.experts.gate_up_proj.shape[0]:
            with torch.device(block.experts.gate_up_proj.device):
                block.experts = Experts(block.dispatcher.num_local_experts, c.hidden_size, c.moe_intermediate_size)
    model.ep = ep


def split_context(model: MoETransformer, cp: ContextParallel) -> None:
    """Each rank runs its slice of a packed row; attention gathers every token of its heads (context_parallel.py)."""
    check_heads(cp.size, model.config.num_attention_heads)
    model.cp = cp
    for layer in model.model.layers:
        layer.self_attn.attend = functools.partial(ulysses_attention, cp, packed_attention)


def _save_attention(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in ATTENTION_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _recomputed_forward(forward, context: dict, *args):
    if not torch.is_grad_enabled():  # scoring, rollouts: nothing to keep for a backward
        return forward(*args)
    # Early stop off: the recomputation must replay every collective of the layer (the EP all-to-alls, FSDP's
    # all-gathers are outside it) on every rank, whatever the rank's own tensors need.
    with set_checkpoint_early_stop(False):
        return recomputed(forward, *args, use_reentrant=False, **context)


def checkpointed(model: MoETransformer) -> bool:
    """Whether checkpoint_layers recomputes the model's layers (any mode but "off")."""
    return any("forward" in layer.__dict__ for layer in model.model.layers)


def checkpoint_layers(model: MoETransformer, mode: Checkpointing) -> None:
    """Recompute each decoder layer's activations in the backward instead of keeping them ("off" undoes it). The
    layer's own forward is wrapped in place rather than the layer in a wrapper module, so parameter names stay
    Hugging Face's (checkpoints, publication, DCP keys)."""
    if mode not in CHECKPOINTING:
        raise ValueError(f"activation_checkpointing {mode!r} is not one of {CHECKPOINTING}")
    context = ({"context_fn": functools.partial(create_selective_checkpoint_contexts, _save_attention)}
               if mode == "save_attention" else {})
    for layer in model.model.layers:
        layer.__dict__.pop("forward", None)  # back to the class's forward
        if mode != "off":
            layer.forward = functools.partial(_recomputed_forward, layer.forward, context)


def shard_dense(model: MoETransformer, mesh, ep: ExpertParallel | None, param_dtype: torch.dtype) -> None:
    """FSDP2 over `mesh`: one group per decoder layer (its attention, norms and router), then the root (embedding,
    final norm, lm_head). The experts: left out where EP splits them over every rank (their gradients already sum
    over ranks); with copies (`ep.mesh`), each layer's experts first get a group of their own over "edp", which
    sums the copies' gradients as it reduce-scatters them. Parameters gathered in `param_dtype` (float32: the
    trainer's autocast casts per op; bfloat16: layers compute in it), reduced in float32 into float32 shards, the
    master copy AdamW steps. Gradients are summed, not averaged: each rank's loss is its share of the whole
    batch's, as the EP trainer's all-reduce sums them."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    groups, experts = [], set()
    if ep is not None and ep.mesh is not None:
        # each expert group's own: a nested fully_shard's parameters are left to it by the layer's
        groups = [fully_shard(layer.mlp.experts, mesh=ep.mesh["edp"], mp_policy=policy)
                  for layer in model.model.layers]
    else:
        experts = {p for name, p in model.named_parameters() if EXPERT_MARK in name}
    groups += [fully_shard(layer, mesh=mesh, ignored_params=experts, mp_policy=policy) for layer in model.model.layers]
    groups.append(fully_shard(model, mesh=mesh, ignored_params=experts, mp_policy=policy))
    for group in groups:  # these settings are each group's own (they do not recurse)
        group.set_gradient_divide_factor(1.0)
        # A plain SUM on the wire: a custom factor is otherwise NCCL's PREMUL_SUM, which gloo refuses.
        group.set_force_sum_reduction_for_comms(True)
        # A rank with no tokens leaves attention's projections out of its graph (Attention.forward's empty
        # batch), and an expert no token reached may be too: zeros keep every rank's reduce-scatter the same size.
        group.set_reduce_scatter_unused_params(True)


def is_sharded(tensor: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor: an FSDP shard's local tensor, or the tensor itself."""
    return tensor.to_local() if is_sharded(tensor) else tensor


@torch.no_grad()
def load_full_state(model: MoETransformer, state: dict[str, torch.Tensor]) -> None:
    """Load a state whose dense tensors are whole and whose experts are this rank's slice (trainer.initial_weights)
    into a parallelized model: FSDP's parameters take their shard of the whole tensor, cut here without a
    collective (every rank holds the same whole tensor)."""
    from torch.distributed.tensor import distribute_tensor

    mine = model.state_dict()
    if mine.keys() != state.keys():
        raise ValueError(f"load_full_state: missing {sorted(mine.keys() - state.keys())}, unexpected "
                         f"{sorted(state.keys() - mine.keys())}")
    for name, target in mine.items():
        source = state[name].to(local(target).device)
        if is_sharded(target):
            source = distribute_tensor(source, target.device_mesh, target.placements, src_data_rank=None)
        target.copy_(source)


def unsharded_state(model: MoETransformer, dtype: torch.dtype | None = None, *, keep_dense: bool = True
                    ) -> dict[str, torch.Tensor]:
    """The model's state with the experts as this rank's slice and every other tensor whole, cast to `dtype`
    (floating tensors only). FSDP's shards are all-gathered (a collective: every rank calls it) one tensor at a
    time into host memory, so no GPU holds more than one whole dense tensor; a rank that does not need them
    (`keep_dense` false: only rank 0 publishes the dense weights) drops them as they arrive."""
    state = {}
    for name, tensor in model.state_dict().items():
        tensor = tensor.detach()
        if is_sharded(tensor):
            tensor = tensor.full_tensor().cpu()
        if keep_dense or EXPERT_MARK in name:
            state[name] = tensor.to(dtype) if dtype is not None and tensor.is_floating_point() else tensor
    return state


def gather_state(model: MoETransformer, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor] | None:
    """The whole model's state (Hugging Face names, fused experts [E, ...]) in host memory on EP rank 0, cast to
    `dtype`; None on the other ranks. A collective under EP or FSDP. Expert tensors travel one at a time and go
    to host memory as they arrive, so no GPU holds more than one tensor's experts beyond its own slice: a model
    larger than one GPU publishes like one that fits."""
    ep = model.ep
    state = unsharded_state(model, dtype, keep_dense=ep is None or ep.rank == 0 and ep.first_copy)
    if ep is None or ep.size == 1:
        return {k: v.cpu() for k, v in state.items()}
    if not ep.first_copy:  # another EP group's copy of the same experts
        return None
    root = ep.rank == 0
    gathered = {} if root else None
    for name, tensor in state.items():
        if EXPERT_MARK not in name:
            if root:
                gathered[name] = tensor.cpu()
            continue
        part = tensor.cpu() if through_host(tensor, ep.group) else tensor.contiguous()
        parts = [torch.empty_like(part) for _ in range(ep.size)] if root else None
        dist.gather(part, parts, dst=dist.get_global_rank(ep.group, 0), group=ep.group)
        if root:
            gathered[name] = torch.cat([p.cpu() for p in parts])
    return gathered
