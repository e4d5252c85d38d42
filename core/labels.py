"""Node and pod labels shared by the node pools (infra/) and the manifests that target them (k8s/)."""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

ROLE_LABEL = "moe-rl/role"  # node label and pod label: rollout | trainer | orchestrator
EFA_PRESENT_LABEL = "vpc.amazonaws.com/efa.present"
GPU_TAINT_KEY = "nvidia.com/gpu"
RUN_LABEL = "moe-rl/run"
APP_NAME_LABEL = "app.kubernetes.io/name"
PART_OF_LABEL = "app.kubernetes.io/part-of"
PART_OF = "moe-rl-eks"
# Resource names the device plugins advertise.
GPU_RESOURCE = "nvidia.com/gpu"
EFA_RESOURCE = "vpc.amazonaws.com/efa"


@dataclass(frozen=True)
class Taint:
    """A node taint in Kubernetes' spelling; what tolerates it is derived here, once, for every consumer (device
    plugins, Kueue flavors, run pods), so a pool's taint effect cannot leave one of them behind."""

    key: str
    value: str
    effect: str  # NoSchedule | NoExecute | PreferNoSchedule

    def toleration(self) -> dict[str, str]:
        return {"key": self.key, "operator": "Equal", "value": self.value, "effect": self.effect}


# EKS (node groups, aws_eks_v2.TaintEffect) and Kubernetes (tolerations, Cluster Autoscaler tags) spell effects apart.
TAINT_EFFECTS = {"NO_SCHEDULE": "NoSchedule", "NO_EXECUTE": "NoExecute", "PREFER_NO_SCHEDULE": "PreferNoSchedule"}


def gpu_taints(effect: str) -> tuple[Taint, ...]:
    """The taints of a GPU pool whose ``nvidia.com/gpu`` taint has ``effect`` (EKS spelling)."""
    return (Taint(GPU_TAINT_KEY, "true", TAINT_EFFECTS[effect]),)


def tolerations(taints: Iterable[Taint]) -> list[dict[str, str]]:
    """Tolerations for every taint given (several pools' taints at once), each once, in a stable order."""
    unique = {(t.key, t.value, t.effect): t for t in taints}
    return [unique[k].toleration() for k in sorted(unique)]
