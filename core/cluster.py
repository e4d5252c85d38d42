"""Names of the in-cluster objects infra/ creates and the run manifests (k8s/) refer to.

The infra stack installs them once per cluster; a run's manifests only reference them, so both sides import
these names from here.
"""
from __future__ import annotations

# Service accounts in the run namespace, each bound to its own least-privilege IAM role by Pod Identity.
TRAINER_SERVICE_ACCOUNT = "moe-rl-trainer"
ORCHESTRATOR_SERVICE_ACCOUNT = "moe-rl-orchestrator"
ROLLOUT_SERVICE_ACCOUNT = "moe-rl-rollout"
# FSx for Lustre, statically provisioned: the PersistentVolume and the claim trainers mount.
FSX_CLAIM_NAME = "moe-rl-fsx"
FSX_MOUNT_PATH = "/fsx"
# Kueue: one ClusterQueue per GPU pool, a LocalQueue in the run namespace pointing at each.
def cluster_queue(role: str) -> str:
    return f"moe-rl-{role}"


def local_queue(role: str) -> str:
    return f"moe-rl-{role}"


# PriorityClasses: trainers preempt rollout servers, never the reverse.
TRAINER_PRIORITY_CLASS = "moe-rl-trainer"
ROLLOUT_PRIORITY_CLASS = "moe-rl-rollout"
# Stack outputs (`cdk deploy --outputs-file`) the manifests read: output key -> meaning.
OUTPUT_TRAINER_REPOSITORY_URI = "TrainerRepositoryUri"
OUTPUT_ROLLOUT_REPOSITORY_URI = "RolloutRepositoryUri"
OUTPUT_BUCKET_NAME = "ArtifactBucketName"
OUTPUT_CLUSTER_NAME = "ClusterName"
OUTPUT_PROMETHEUS_ENDPOINT = "PrometheusEndpoint"
# Ports and commands the manifests (k8s/) start and the workloads (workloads/) serve.
ROLLOUT_PORT = 8000  # OpenAI-style /v1/completions, /health, /metrics
ORCHESTRATOR_PORT = 8080  # /health, /metrics (queue depth: the rollout autoscaler's signal)
TRAINER_METRICS_PORT = 9400  # /metrics of trainer rank 0 on each node
TRAINER_RENDEZVOUS_PORT = 29400  # torchrun c10d rendezvous
