"""CDK constructs for EKS with EFA GPU pools (`from moe_rl_eks.infra import EfaNodePool, MoeRlCluster`).

Exports load lazily: importing this package does not import aws_cdk until a construct is used, so tools that only
need core/ or the synth summary stay light.
"""
from __future__ import annotations

import importlib

_EXPORTS = {
    "EfaNodePool": ".node_pool",
    "MoeRlCluster": ".cluster",
    "MoeRlNetwork": ".network",
    "MoeRlStorage": ".storage",
    "MoeRlObservability": ".observability",
    "ClusterServices": ".services",
    "DevicePlugins": ".services",
    "RunAccess": ".run_access",
    "MoeRlStack": ".stack",
    "add_checks": ".checks",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name], __name__), name)
    globals()[name] = value
    return value
