"""Cluster facts shared by infra/ and k8s/: supported Kubernetes versions, hugepage units, and the names of the
in-cluster objects infra/ creates and the run manifests (k8s/) refer to.

The infra stack installs them once per cluster; a run's manifests only reference them, so both sides import
these names from here.
"""
from __future__ import annotations

# Kubernetes minor versions we ship: each needs a kubectl Lambda layer (aws-cdk.lambda-layer-kubectl-vXY, for Helm
# charts and manifests: infra/cluster.py), the cluster services' releases for it (infra.services.KUBERNETES_PINS:
# KEDA, the Cluster Autoscaler's image) and kubernetes-validate's schemas for it (the strict validation tests). The
# run charts use one typed API for all of them (k8s/kube.py). 1.35 and 1.36 are in EKS standard support (1.33 left it
# on 29 July 2026; 1.34 leaves it in December 2026).
KUBERNETES_VERSIONS = ("1.35", "1.36")
# A new environment's version: 1.35, whose pins are all checked against their releases' files; 1.36's KEDA 2.21.0
# is validated against KEDA 2.20.2's CRD schemas (2.21.0's files were not reachable: docs/support-matrix.md).
DEFAULT_KUBERNETES_VERSION = "1.35"


def kubernetes_versions_allowed() -> str:
    """What to say of an unsupported Kubernetes version."""
    return "supported: " + ", ".join(KUBERNETES_VERSIONS)


# efa-only interfaces (every EFA card but the first) take no IP address; older VPC CNIs fail on them (EKS user guide,
# "EFA and EFA-only interfaces"). Every add-on version EKS offers for a version above is newer.
VPC_CNI_MIN_VERSION_FOR_EFA_ONLY = "1.18.5"
# The VPC CNI add-on infra/ installs: pinned, not EKS's per-version default (fixed when that Kubernetes version
# launched), so an upgrade is deliberate. The newest seen published (July 2026, for 1.33); EKS usually offers a CNI
# add-on version for every Kubernetes version in support, but that was not checked here (no AWS account):
# `aws eks describe-addon-versions --addon-name vpc-cni --kubernetes-version 1.35` lists what is offered.
VPC_CNI_VERSION = "v1.22.3-eksbuild.1"
# The VPC's subnets, one of each per zone, allocated in this order (infra/network.py): public (NAT gateways only),
# private (nodes and pods: the VPC CNI gives every pod a VPC address), and the managed scraper's own.
SUBNET_MASKS = (("public", 24), ("private", 19), ("scraper", 28))


def vpc_fits_subnets(vpc_prefix_length: int, zones: int) -> bool:
    """Whether a VPC of this prefix length holds SUBNET_MASKS in ``zones`` zones, each subnet aligned to its size
    as CDK allocates them."""
    offset = 0
    for _, mask in SUBNET_MASKS:
        size = 2 ** (32 - mask)
        for _ in range(zones):
            offset = -(-offset // size) * size + size
    return offset <= 2 ** (32 - vpc_prefix_length)


# Hugepages: nodes reserve 2 MiB pages at boot (vm.nr_hugepages); pods and queues count them in this resource.
HUGEPAGE_MIB = 2
HUGEPAGES_RESOURCE = "hugepages-2Mi"


def hugepages_mib(pages: int) -> int:
    """MiB of ``pages`` 2 MiB hugepages (what a pod requests, what a node advertises)."""
    return pages * HUGEPAGE_MIB


# Service accounts in the run namespace, each bound to its own least-privilege IAM role by Pod Identity.
TRAINER_SERVICE_ACCOUNT = "moe-rl-trainer"
ORCHESTRATOR_SERVICE_ACCOUNT = "moe-rl-orchestrator"
ROLLOUT_SERVICE_ACCOUNT = "moe-rl-rollout"
# FSx for Lustre, statically provisioned: the PersistentVolume and the claim trainers mount.
FSX_CLAIM_NAME = "moe-rl-fsx"
FSX_MOUNT_PATH = "/fsx"
# Default names (core.environment.ClusterNamesConfig; an environment's cluster_names may choose others). Kueue: one
# ClusterQueue per GPU pool and a LocalQueue of the same name in the run namespace pointing at it.
TRAINER_QUEUE = "moe-rl-trainer"
ROLLOUT_QUEUE = "moe-rl-rollout"
# PriorityClasses: trainers preempt rollout servers, never the reverse. The orchestrator outranks rollout servers
# but preempts nothing: it lands on the system nodes, next to the cluster's controllers (which run at
# system-cluster-critical, far above every class here).
TRAINER_PRIORITY_CLASS = "moe-rl-trainer"
ORCHESTRATOR_PRIORITY_CLASS = "moe-rl-orchestrator"
ROLLOUT_PRIORITY_CLASS = "moe-rl-rollout"
CLUSTER_SERVICES_PRIORITY_CLASS = "system-cluster-critical"
# Stack outputs (`cdk deploy --outputs-file`) the manifests read: output key -> meaning.
OUTPUT_TRAINER_REPOSITORY_URI = "TrainerRepositoryUri"
OUTPUT_ROLLOUT_REPOSITORY_URI = "RolloutRepositoryUri"
OUTPUT_ORCHESTRATOR_REPOSITORY_URI = "OrchestratorRepositoryUri"
OUTPUT_BUCKET_NAME = "ArtifactBucketName"
OUTPUT_CLUSTER_NAME = "ClusterName"
OUTPUT_PROMETHEUS_ENDPOINT = "PrometheusEndpoint"
# Comma-separated CIDRs of the subnets the managed Prometheus scraper's interfaces live in (nothing else does): the
# only sources run pods accept metrics scrapes from.
OUTPUT_SCRAPER_CIDRS = "ScraperSubnetCidrs"
# The artifact bucket's layout; each Pod Identity role is granted exactly its prefixes (infra/run_access.py), and a
# run's S3 locations are checked against them before manifests are written (k8s/outputs.py).
RUNS_PREFIX = "runs/"  # runs/<run>/...: checkpoints and outputs; the trainer reads and writes
WEIGHTS_PREFIX = "weights/"  # published weight versions (the S3 weight store's default prefix): trainer writes, rollout reads
PROMPTS_PREFIX = "prompts/"  # prompt datasets the orchestrator reads
ROLLOUT_LOGS_PREFIX = "rollout-logs/"  # generated samples and rewards the orchestrator writes
# Where the run directories live on the shared file system; infra prepares it owned by the pods' UID.
RUNS_DIR = f"{FSX_MOUNT_PATH}/runs"
POD_UID = 10001  # every run pod's UID and GID: unprivileged, above host UIDs
# Ports and commands the manifests (k8s/) start and the workloads (workloads/) serve.
ROLLOUT_PORT = 8000  # OpenAI-style /v1/completions, /health, /metrics
ORCHESTRATOR_PORT = 8080  # /health, /metrics (queue depth: the rollout autoscaler's signal)
TRAINER_METRICS_PORT = 9400  # /metrics of trainer rank 0 on each node
TRAINER_RENDEZVOUS_PORT = 29400  # torchrun c10d rendezvous
