"""What a role's container is told and runs: the roles, the console command each pod starts, and the environment
variables the manifests (k8s/) set and the container's own checks (`moerl doctor`) read."""
from __future__ import annotations

from typing import Literal

Role = Literal["trainer", "rollout", "orchestrator"]
ROLES: tuple[Role, ...] = ("trainer", "rollout", "orchestrator")
# The `moerl` subcommand (tools/cli.py) each role's pod starts.
ROLE_COMMANDS: dict[Role, str] = {"trainer": "train", "rollout": "serve-rollout", "orchestrator": "orchestrate"}

# The images record which DeepEP they carry (images/gpu.Dockerfile sets it from the same build argument that
# selects the build). `efa-v1`: AWS's patched V1 (NVSHMEM host proxy over libfabric), internode-capable on EFA;
# `stock-v1`: upstream V1, whose internode kernels need InfiniBand GPU-initiated RDMA (intranode only on EFA);
# `none`: no DeepEP (an image built otherwise, or a machine checked outside the images).
DEEPEP_VARIANT_ENV = "MOERL_DEEPEP_VARIANT"
DEEPEP_VARIANTS = ("efa-v1", "stock-v1", "none")
# The trainer pods' manifests (k8s/trainer.py) pass the run's resolved EP backend, and "1" in MOERL_DEEPEP_EFA
# when the run file says its trainer image carries an EFA-capable DeepEP (deploy.images.deepep_efa).
EP_BACKEND_ENV = "MOERL_EP_BACKEND"
DEEPEP_EFA_ENV = "MOERL_DEEPEP_EFA"

# NVSHMEM for AWS's EFA-patched DeepEP, as AWS's own DeepEP image and Kubernetes jobs set it (awslabs/
# awsome-distributed-ai, micro-benchmarks/expert-parallelism/deepep-benchmark): the host proxy over libfabric's
# EFA provider; each GPU takes the NIC(s) behind its own PCIe switch, not shared with another GPU (without the
# policy NVSHMEM may pick one NIC for several GPUs); and GDRCopy, which the NVIDIA container runtime then mounts
# as /dev/gdrdrv (NVSHMEM's proxy reads GPU-side flags through it). k8s/ sets these; `moerl doctor` checks them.
DEEPEP_EFA_NVSHMEM_ENV = {
    "NVSHMEM_REMOTE_TRANSPORT": "libfabric",
    "NVSHMEM_LIBFABRIC_PROVIDER": "efa",
    "NVSHMEM_NETDEVS_POLICY": "EXTERNAL_SHARING_PCIE_SWITCH_NIC_EXCLUSIVE",
    "NVIDIA_GDRCOPY": "enabled",
}
GDRDRV_DEVICE = "/dev/gdrdrv"  # GDRCopy's kernel driver, on the node and passed into the container
