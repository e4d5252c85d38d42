"""The (instance type, EP backend) -> environment mapping, pinned: a change here changes every trainer pod."""
import pytest

from moe_rl_eks.k8s.collectives import collective_env

BASE = {"NCCL_SOCKET_IFNAME": "^docker,lo,veth", "NCCL_DEBUG": "WARN"}
EFA = {**BASE, "FI_PROVIDER": "efa", "FI_EFA_FORK_SAFE": "1", "NCCL_NET_PLUGIN": "ofi", "NCCL_TUNER_PLUGIN": "ofi",
       "NCCL_BUFFSIZE": "8388608", "NCCL_P2P_NET_CHUNKSIZE": "524288"}
EFA_RDMA = {**EFA, "FI_EFA_USE_DEVICE_RDMA": "1"}
# As AWS's EFA-patched DeepEP image and jobs set it (awsome-distributed-ai deepep-benchmark).
NVSHMEM_EFA = {"NVSHMEM_REMOTE_TRANSPORT": "libfabric", "NVSHMEM_LIBFABRIC_PROVIDER": "efa",
               "NVSHMEM_NETDEVS_POLICY": "EXTERNAL_SHARING_PCIE_SWITCH_NIC_EXCLUSIVE", "NVIDIA_GDRCOPY": "enabled"}


@pytest.mark.parametrize("instance, backend, expected", [
    ("p5.48xlarge", "alltoall", EFA_RDMA),
    ("p5.48xlarge", "local", EFA_RDMA),
    ("p5.48xlarge", "deepep", {**EFA_RDMA, **NVSHMEM_EFA}),
    ("p5en.48xlarge", "deepep", {**EFA_RDMA, **NVSHMEM_EFA}),
    ("p4d.24xlarge", "alltoall", EFA_RDMA),
    ("p6-b200.48xlarge", "alltoall", EFA_RDMA),
    # g6e's EFA has no GPUDirect RDMA: traffic goes through host memory.
    ("g6e.12xlarge", "alltoall", EFA),
    ("g6e.48xlarge", "deepep", {**EFA, **NVSHMEM_EFA}),
    # No EFA at all: NCCL over sockets, DeepEP intranode only.
    ("g6e.xlarge", "alltoall", BASE),
    ("g5.2xlarge", "deepep", {**BASE, "NVSHMEM_REMOTE_TRANSPORT": "none"}),
])
def test_env_per_instance_type_and_backend(instance, backend, expected):
    assert collective_env(instance, backend) == expected


def test_unknown_instance_type_names_the_catalog():
    with pytest.raises(KeyError, match="not in the catalog; supported: p4d.24xlarge"):
        collective_env("p3.16xlarge", "alltoall")
