"""What a role holds in GPU memory, torch-free: the one memory model for the fit check of a local GPU run (roles
sharing a GPU by memory shares) and for the trainer-at-scale planner. Bytes, not GiB; the model's own parameter
counts (core/run.py ModelConfig) are the input.

The trainer keeps float32 master weights, float32 gradients and AdamW's two float32 moments (16 bytes per
parameter when all its parameters are on one rank) and, with a KL term, a frozen reference in float32. Its routed
experts are split over its ranks (EP); with EP over part of the ranks (rl.training.expert_parallel) each expert's
copies are sharded over the rest, so either way a rank holds 1/ranks of them. Its dense weights are replicated, or
with FSDP (rl.training.fsdp) sharded over the same ranks, state and all; the reference is laid out as the policy
(model/parallelize.py). A rollout replica holds the weights in the served dtype and its KV cache: keys and values
of every layer per position."""
from __future__ import annotations

from dataclasses import dataclass

FP32 = 4
# CUDA context, the caching allocator's slack and the kernels' workspaces: measured around 1-2 GiB on an H200.
CUDA_OVERHEAD_BYTES = 2 * 2**30


@dataclass(frozen=True)
class RoleMemory:
    """What a role needs on each of its GPUs: a fixed part, and per position of a row's KV cache (the rollout)."""

    fixed_bytes: int  # weights, optimizer state, reference model, CUDA overhead
    per_token_bytes: int = 0  # KV cache per position (0 for the trainer, whose activations are not modelled here)


@dataclass(frozen=True)
class TrainerState:
    """What each trainer rank holds of the trained model, in bytes (float32 throughout)."""

    parameter_bytes: int
    gradient_bytes: int
    optimizer_bytes: int  # AdamW's exp_avg and exp_avg_sq

    @property
    def total_bytes(self) -> int:
        return self.parameter_bytes + self.gradient_bytes + self.optimizer_bytes


def trainer_state(*, replicated: int, experts: int, ranks: int, fsdp: bool,
                  expert_parallel: int | None = None) -> TrainerState:
    """Each of `ranks` ranks' share of the trained parameters: the routed experts split evenly over every rank
    (by EP, and with `expert_parallel` < ranks their copies by FSDP), the `replicated` (dense) ones whole on every
    rank, or split evenly too with `fsdp`."""
    check_expert_parallel(ranks, expert_parallel, fsdp)
    parameters = -(-experts // ranks) + (-(-replicated // ranks) if fsdp else replicated)
    return TrainerState(parameters * FP32, parameters * FP32, 2 * parameters * FP32)


def check_expert_parallel(ranks: int, expert_parallel: int | None, fsdp: bool) -> None:
    """The trainer's layouts (model/parallelize.py check_layout, which the torch side enforces)."""
    if expert_parallel is None or expert_parallel == ranks:
        return
    if expert_parallel < 2 or ranks % expert_parallel:
        raise ValueError(f"expert_parallel {expert_parallel} must be >= 2 and divide the {ranks} trainer ranks")
    if not fsdp:
        raise ValueError(f"expert_parallel {expert_parallel} < {ranks} ranks shards the experts' copies with FSDP: "
                         "it needs fsdp")


def reference_bytes(*, replicated: int, experts: int, ranks: int, fsdp: bool) -> int:
    """Each rank's share of the float32 KL reference: its experts, and the dense weights whole or (FSDP) split."""
    return trainer_state(replicated=replicated, experts=experts, ranks=ranks, fsdp=fsdp).parameter_bytes


def trainer_memory(*, replicated: int, experts: int, ranks: int, reference: bool, fsdp: bool = False) -> RoleMemory:
    """The trainer's state on each of `ranks` ranks (trainer_state), its KL reference, the CUDA overhead."""
    state = trainer_state(replicated=replicated, experts=experts, ranks=ranks, fsdp=fsdp)
    ref = reference_bytes(replicated=replicated, experts=experts, ranks=ranks, fsdp=fsdp) if reference else 0
    return RoleMemory(state.total_bytes + ref + CUDA_OVERHEAD_BYTES)


def kv_bytes_per_token(*, layers: int, kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    return 2 * layers * kv_heads * head_dim * dtype_bytes  # keys and values


def rollout_memory(*, replicated: int, experts: int, gpus: int, dtype_bytes: int, layers: int, kv_heads: int,
                   head_dim: int) -> RoleMemory:
    """A serving replica over `gpus` (one rank per GPU): its routed experts split as the trainer's are."""
    return RoleMemory((replicated + -(-experts // gpus)) * dtype_bytes + CUDA_OVERHEAD_BYTES,
                      kv_bytes_per_token(layers=layers, kv_heads=kv_heads, head_dim=head_dim, dtype_bytes=dtype_bytes))
