"""MoECompute backends by configuration name. `triton` lives in moe_rl_eks.kernels and is imported only when
chosen, so a CPU run never needs triton."""
from __future__ import annotations

import importlib

from .compute import MoECompute

# name -> (module, class)
COMPUTE_BACKENDS: dict[str, tuple[str, str]] = {
    "torch": ("moe_rl_eks.workloads.moe.torch_compute", "TorchCompute"),
    "triton": ("moe_rl_eks.kernels.backend", "TritonCompute"),
}


def get_compute(name: str) -> MoECompute:
    if name not in COMPUTE_BACKENDS:
        raise ValueError(f"compute backend {name!r} is not known; allowed: {', '.join(COMPUTE_BACKENDS)}")
    module, cls = COMPUTE_BACKENDS[name]
    try:
        return getattr(importlib.import_module(module), cls)()
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"compute backend {name!r} cannot be loaded from {module}.{cls}: {exc}") from exc
