"""Compute backends by configuration name, the one registry of this project's kernels. A backend is two parts:
its MoE compute (`MoECompute`: routing, permutation, experts, the fused training norm, a decode step's whole MoE
layer) and its paged-forward kernels (`ForwardKernels`: the rollout engine's norms, attention, KV-cache writes and
small products). `triton` lives in moe_rl_eks.kernels and is imported only when chosen, so a CPU run never needs
triton."""
from __future__ import annotations

import importlib
from typing import Any

from ..moe.compute import MoECompute
from .forward_kernels import ForwardKernels

# name -> ("module:class" of its MoECompute, "module:class" of its ForwardKernels)
COMPUTE_BACKENDS: dict[str, tuple[str, str]] = {
    "torch": ("moe_rl_eks.workloads.moe.torch_compute:TorchCompute",
              "moe_rl_eks.workloads.model.forward_kernels:TorchForwardKernels"),
    "triton": ("moe_rl_eks.kernels.backend:TritonCompute", "moe_rl_eks.kernels.backend:TritonForwardKernels"),
    # triton with every row's result independent of its batch (moe_rl_eks.kernels.invariant_*): the exact mode
    "exact": ("moe_rl_eks.kernels.backend:ExactCompute", "moe_rl_eks.kernels.backend:ExactForwardKernels"),
}


def _load(name: str, part: int) -> Any:
    if name not in COMPUTE_BACKENDS:
        raise ValueError(f"compute backend {name!r} is not known; allowed: {', '.join(COMPUTE_BACKENDS)}")
    module, cls = COMPUTE_BACKENDS[name][part].split(":")
    try:
        return getattr(importlib.import_module(module), cls)()
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"compute backend {name!r} cannot be loaded from {module}.{cls}: {exc}") from exc


def get_compute(name: str) -> MoECompute:
    return _load(name, 0)


def get_forward_kernels(name: str) -> ForwardKernels:
    return _load(name, 1)
