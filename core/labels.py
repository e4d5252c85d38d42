"""Node and pod labels shared by the node pools (infra/) and the manifests that target them (k8s/)."""
from __future__ import annotations

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
