"""What a role holds in GPU memory, torch-free: the one memory model for the fit check of a local GPU run (roles
sharing a GPU by memory shares) and for the trainer-at-scale planner. Bytes, not GiB; the model's own parameter
counts (core/run.py ModelConfig) are the input.

The trainer keeps float32 master weights, float32 gradients and AdamW's two float32 moments (16 bytes per
parameter when all its parameters are on one rank) and, with a KL term, a frozen reference in float32. A rollout
replica holds the weights in the served dtype and its KV cache: keys and values of every layer per position."""
from __future__ import annotations

from dataclasses import dataclass

FP32 = 4
TRAINER_STATE_BYTES_PER_PARAMETER = 4 * FP32  # master weights, gradients, AdamW exp_avg and exp_avg_sq
# CUDA context, the caching allocator's slack and the kernels' workspaces: measured around 1-2 GiB on an H200.
CUDA_OVERHEAD_BYTES = 2 * 2**30


@dataclass(frozen=True)
class RoleMemory:
    """What a role needs on each of its GPUs: a fixed part, and per position of a row's KV cache (the rollout)."""

    fixed_bytes: int  # weights, optimizer state, reference model, CUDA overhead
    per_token_bytes: int = 0  # KV cache per position (0 for the trainer, whose activations are not modelled here)


def trainer_memory(*, replicated: int, experts: int, ranks: int, reference: bool) -> RoleMemory:
    """The trainer's state on each of `ranks` expert-parallel ranks: the routed experts split evenly, every other
    parameter replicated (today's trainer; FSDP would shard those too)."""
    per_parameter = TRAINER_STATE_BYTES_PER_PARAMETER + (FP32 if reference else 0)
    return RoleMemory((replicated + -(-experts // ranks)) * per_parameter + CUDA_OVERHEAD_BYTES)


def kv_bytes_per_token(*, layers: int, kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    return 2 * layers * kv_heads * head_dim * dtype_bytes  # keys and values


def rollout_memory(*, replicated: int, experts: int, gpus: int, dtype_bytes: int, layers: int, kv_heads: int,
                   head_dim: int) -> RoleMemory:
    """A serving replica over `gpus` (one rank per GPU): its routed experts split as the trainer's are."""
    return RoleMemory((replicated + -(-experts // gpus)) * dtype_bytes + CUDA_OVERHEAD_BYTES,
                      kv_bytes_per_token(layers=layers, kv_heads=kv_heads, head_dim=head_dim, dtype_bytes=dtype_bytes))
