"""The one mapping from (instance type, EP backend) to the environment of a trainer process.

Facts are from ../shared/REFERENCE.md (EKS user guide, aws-ofi-nccl, awsome-distributed-training, AWS's DeepEP
fork). Tests pin the result per instance type and backend, so a change here is a visible, reviewed change.
"""
from __future__ import annotations

from moe_rl_eks.core.catalog import instance_type as lookup
from moe_rl_eks.core.container import DEEPEP_EFA_NVSHMEM_ENV
from moe_rl_eks.core.ep_backends import EpBackend

# Pod interfaces NCCL must not pick for its bootstrap sockets (loopback and container bridges).
SOCKET_IFNAME_EXCLUDE = "^docker,lo,veth"


def collective_env(instance_type: str, backend: EpBackend) -> dict[str, str]:
    """Environment variables for NCCL (gradients, all-to-all) and the EP backend on `instance_type`."""
    spec = lookup(instance_type)
    env = {
        "NCCL_SOCKET_IFNAME": SOCKET_IFNAME_EXCLUDE,
        "NCCL_DEBUG": "WARN",
    }
    if spec.has_efa:
        env |= {
            # libfabric's EFA provider, through the aws-ofi-nccl net plugin and its tuner (both in the image,
            # found on LD_LIBRARY_PATH by name).
            "FI_PROVIDER": "efa",
            "FI_EFA_FORK_SAFE": "1",  # dataloader workers fork after EFA memory is registered
            "NCCL_NET_PLUGIN": "ofi",
            "NCCL_TUNER_PLUGIN": "ofi",
            # Buffer and chunk sizes AWS's EFA guides use for 8-GPU nodes.
            "NCCL_BUFFSIZE": "8388608",
            "NCCL_P2P_NET_CHUNKSIZE": "524288",
        }
        if spec.efa_gpudirect_rdma:
            env["FI_EFA_USE_DEVICE_RDMA"] = "1"
    if backend == "deepep":
        # Stock DeepEP needs InfiniBand GPU-initiated RDMA; over EFA, AWS's fork runs NVSHMEM on libfabric (with
        # the NIC policy and GDRCopy AWS's reference sets).
        # Without EFA only the intranode (NVLink) kernels run and NVSHMEM needs no remote transport.
        env |= DEEPEP_EFA_NVSHMEM_ENV if spec.has_efa else {"NVSHMEM_REMOTE_TRANSPORT": "none"}
    return env
