"""The EFA instance catalog: the one place that states what each GPU instance type offers.

infra/ derives launch-template network interfaces and node labels from it, k8s/ derives GPU and EFA resource
requests and NCCL settings, workloads/ derives the expert-parallel topology. Facts come from the EC2 instance
type documentation and `describe_instance_types` (a test checks them against moto's copy of that data).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class InstanceType:
    name: str
    gpu_model: str
    gpus: int
    gpu_memory_mib: int  # per GPU, as describe_instance_types reports it
    vcpus: int
    memory_gib: int
    network_cards: int
    efa_interfaces: int  # one EFA per network card that carries one; 0 means the type has no EFA
    network_gbps: int
    nvlink_domain: int  # GPUs that reach each other over NVLink; 1 means PCIe only
    local_nvme: bool

    @property
    def has_efa(self) -> bool:
        return self.efa_interfaces > 0

    @property
    def efa_gpudirect_rdma(self) -> bool:
        # EFA reads and writes GPU memory directly (FI_EFA_USE_DEVICE_RDMA) on the P-family types; the EFA of
        # g5/g6e moves data through host memory.
        return self.has_efa and self.gpu_model in _GPUDIRECT_RDMA_GPUS

    @property
    def gpu_memory_gib(self) -> float:
        return self.gpu_memory_mib / 1024


_GPUDIRECT_RDMA_GPUS = frozenset({"A100", "H100", "H200", "B200"})
_TYPES = (
    # name, gpu, gpus, MiB/GPU, vCPU, GiB, cards, EFA, Gbps, NVLink domain, NVMe
    InstanceType("p4d.24xlarge", "A100", 8, 40960, 96, 1152, 4, 4, 400, 8, True),
    InstanceType("p4de.24xlarge", "A100", 8, 81920, 96, 1152, 4, 4, 400, 8, True),
    InstanceType("p5.48xlarge", "H100", 8, 81920, 192, 2048, 32, 32, 3200, 8, True),
    InstanceType("p5e.48xlarge", "H200", 8, 144384, 192, 2048, 32, 32, 3200, 8, True),
    InstanceType("p5en.48xlarge", "H200", 8, 144384, 192, 2048, 16, 16, 3200, 8, True),
    InstanceType("p6-b200.48xlarge", "B200", 8, 183359, 192, 2048, 8, 8, 3200, 8, True),
    InstanceType("g6e.xlarge", "L40S", 1, 45776, 4, 32, 1, 0, 20, 1, True),
    InstanceType("g6e.2xlarge", "L40S", 1, 45776, 8, 64, 1, 0, 20, 1, True),
    InstanceType("g6e.12xlarge", "L40S", 4, 45776, 48, 384, 1, 1, 100, 1, True),
    InstanceType("g6e.24xlarge", "L40S", 4, 45776, 96, 768, 2, 2, 200, 1, True),
    InstanceType("g6e.48xlarge", "L40S", 8, 45776, 192, 1536, 4, 4, 400, 1, True),
    InstanceType("g5.xlarge", "A10G", 1, 22888, 4, 16, 1, 0, 10, 1, True),
    InstanceType("g5.2xlarge", "A10G", 1, 22888, 8, 32, 1, 0, 10, 1, True),
    InstanceType("g5.12xlarge", "A10G", 4, 22888, 48, 192, 1, 1, 40, 1, True),
    InstanceType("g5.48xlarge", "A10G", 8, 22888, 192, 768, 1, 1, 100, 1, True),
)

CATALOG: dict[str, InstanceType] = {t.name: t for t in _TYPES}


def instance_type(name: str) -> InstanceType:
    """Look up a catalog entry; unknown names raise KeyError listing what is supported."""
    try:
        return CATALOG[name]
    except KeyError:
        raise KeyError(f"instance type {name!r} is not in the catalog; supported: {', '.join(CATALOG)}") from None
