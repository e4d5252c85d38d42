"""Deployment environments (`cdk.json` context key `environments`), parsed once into typed, validated objects.

The environment owns the cluster's shape: node pools and their sizes, network, storage, observability. Runs
(core.run) are checked against it; infra/ builds it.
"""
from __future__ import annotations

import ipaddress
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Mapping

from .catalog import CATALOG
from .labels import TAINT_EFFECTS, Taint, gpu_taints
from . import cluster as defaults
from .cluster import (DEFAULT_KUBERNETES_VERSION, KUBERNETES_VERSIONS, SUBNET_MASKS, kubernetes_versions_allowed,
                      vpc_fits_subnets)
from .schema import ConfigError, Validated, fail, parse

# The values of aws_eks_v2.CapacityType: a pool given the aws-cdk-lib enum member stores its value.
CapacityType = Literal["ON_DEMAND", "SPOT", "CAPACITY_BLOCK"]
CAPACITY_TYPES = ("ON_DEMAND", "SPOT", "CAPACITY_BLOCK")
# The values of aws_eks_v2.TaintEffect.
TaintEffect = Literal["NO_SCHEDULE", "NO_EXECUTE", "PREFER_NO_SCHEDULE"]


def _enum_value(value: Any) -> Any:
    # aws-cdk-lib's jsii enums are Python Enums whose value is the CloudFormation string; core/ imports no aws_cdk.
    return getattr(value, "value", value)


@dataclass(frozen=True)
class NodePoolConfig(Validated):
    """A GPU node pool: the props of infra.EfaNodePool and a pool of a cdk.json environment (written once).

    Defaults: 0 to 1 nodes, starting at 0 (more at creation only with an On-Demand Capacity Reservation behind them;
    a Capacity Block pool always starts at 0 and is scaled by `moerl scale-pool`), on-demand, every
    EFA interface of the type, a 200 GiB encrypted gp3 root volume, 5120 hugepages of 2 MiB."""

    instance_type: str
    min_size: int = 0
    desired_size: int = 0
    max_size: int = 1
    capacity_type: CapacityType = "ON_DEMAND"
    capacity_reservation_id: str | None = None  # required for CAPACITY_BLOCK (cr-...)
    efa: bool = True  # attach every EFA interface the type has; a rollout pool may opt out
    root_volume_gib: int = 200
    hugepages_2mi: int = 5120  # 2 MiB pages reserved at boot (10 GiB), for libfabric/NVSHMEM buffers
    # Effect of the nvidia.com/gpu taint that keeps other pods off (aws_eks_v2.TaintEffect or its name); the device
    # plugins, the pool's Kueue flavor and the run's pods tolerate exactly the pool's taints (core.labels).
    taint_effect: TaintEffect = "NO_SCHEDULE"

    def __post_init__(self) -> None:
        object.__setattr__(self, "capacity_type", _enum_value(self.capacity_type))
        object.__setattr__(self, "taint_effect", _enum_value(self.taint_effect))
        super().__post_init__()

    def validate(self) -> None:
        if self.capacity_type not in CAPACITY_TYPES:
            fail("capacity_type", self.capacity_type, "allowed: " + ", ".join(CAPACITY_TYPES))
        if self.taint_effect not in TAINT_EFFECTS:
            fail("taint_effect", self.taint_effect, "allowed: " + ", ".join(TAINT_EFFECTS))
        if self.instance_type not in CATALOG:
            fail("instance_type", self.instance_type, "supported: " + ", ".join(CATALOG))
        for name in ("min_size", "desired_size", "max_size"):
            if getattr(self, name) < 0:
                fail(name, getattr(self, name), "must be >= 0")
        if self.min_size > self.max_size:
            fail("min_size", self.min_size, f"must be <= max_size ({self.max_size})")
        if not self.min_size <= self.desired_size <= self.max_size:
            fail("desired_size", self.desired_size, f"must be between min_size ({self.min_size}) and max_size ({self.max_size})")
        if self.max_size < 1:
            fail("max_size", self.max_size, "must be >= 1")
        if (self.min_size or self.desired_size) and not self.capacity_reservation_id:
            fail("min_size" if self.min_size else "desired_size", self.min_size or self.desired_size,
                 "a GPU pool starts at 0 nodes unless a capacity reservation backs it (capacity_reservation_id): "
                 "creating a managed node group waits for every node it asks for, and on-demand GPU capacity in a "
                 "cluster placement group is often not there, which rolls the whole deploy back; the cluster "
                 "autoscaler adds nodes when pods ask for them")
        if self.efa and not CATALOG[self.instance_type].has_efa:
            with_efa = [n for n, t in CATALOG.items() if t.has_efa]
            fail("efa", self.efa, f"{self.instance_type} has no EFA; set efa: false or use one of {', '.join(with_efa)}")
        if self.capacity_type == "CAPACITY_BLOCK":
            if not self.capacity_reservation_id:
                fail("capacity_reservation_id", self.capacity_reservation_id, "required when capacity_type is CAPACITY_BLOCK (cr-...)")
            if self.min_size or self.desired_size:
                fail("min_size" if self.min_size else "desired_size", self.min_size or self.desired_size,
                     "a Capacity Block pool is created at 0 nodes: its instances exist only while the block is "
                     "active, and a node group created before then (or with fewer free instances) fails and rolls "
                     "the whole stack back; scale it once the block is active with `moerl scale-pool`")
        if self.capacity_reservation_id is not None and not re.fullmatch(r"cr-[0-9a-f]{8,17}", self.capacity_reservation_id):
            fail("capacity_reservation_id", self.capacity_reservation_id, "expected a reservation id like cr-0123456789abcdef0")
        if self.capacity_type == "SPOT" and self.capacity_reservation_id:
            fail("capacity_reservation_id", self.capacity_reservation_id, "spot capacity takes no reservation")
        if not 20 <= self.root_volume_gib <= 16384:
            fail("root_volume_gib", self.root_volume_gib, "must be between 20 and 16384")
        if self.hugepages_2mi < 0:
            fail("hugepages_2mi", self.hugepages_2mi, "must be >= 0")

    @property
    def spec(self):
        return CATALOG[self.instance_type]

    @property
    def taints(self) -> tuple[Taint, ...]:
        """The pool's node taints, in Kubernetes' spelling."""
        return gpu_taints(self.taint_effect)


@dataclass(frozen=True)
class EndpointConfig(Validated):
    public: bool = False  # private endpoint only unless opted in
    public_cidrs: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.public_cidrs, str):
            fail("public_cidrs", self.public_cidrs, "expected a list of CIDRs, not one string")
        object.__setattr__(self, "public_cidrs", tuple(self.public_cidrs))
        super().__post_init__()

    def validate(self) -> None:
        if self.public and not self.public_cidrs:
            fail("public_cidrs", list(self.public_cidrs), "a public endpoint needs an allow-list of CIDRs")
        if not self.public and self.public_cidrs:
            fail("public_cidrs", list(self.public_cidrs), "only allowed with public: true")
        for i, cidr in enumerate(self.public_cidrs):
            try:
                net = ipaddress.ip_network(cidr)
            except (TypeError, ValueError):
                fail(f"public_cidrs[{i}]", cidr, "expected a CIDR like 203.0.113.0/24 (host bits zero)")
            if net.prefixlen == 0:
                fail(f"public_cidrs[{i}]", cidr, "the whole internet is not an allow-list")


@dataclass(frozen=True)
class StorageConfig(Validated):
    fsx: bool = True  # FSx for Lustre in the GPU AZ, linked to the bucket
    fsx_storage_capacity_gib: int = 1200
    fsx_throughput_mbps_per_tib: Literal[125, 250, 500, 1000] = 250
    noncurrent_version_expiry_days: int = 30
    rollout_log_expiry_days: int = 90
    retain_on_delete: bool = True

    def validate(self) -> None:
        cap = self.fsx_storage_capacity_gib
        if cap != 1200 and (cap < 2400 or cap % 2400):
            fail("fsx_storage_capacity_gib", cap, "PERSISTENT_2 takes 1200 or a multiple of 2400")
        for name in ("noncurrent_version_expiry_days", "rollout_log_expiry_days"):
            if getattr(self, name) < 1:
                fail(name, getattr(self, name), "must be >= 1")


@dataclass(frozen=True)
class ObservabilityConfig(Validated):
    alarm_email: str | None = None  # subscribed to the alarm topic when given
    prometheus: bool = True  # Amazon Managed Prometheus workspace, scraper and alert rules

    def validate(self) -> None:
        if self.alarm_email is not None and not re.fullmatch(r"[^@\s]+@[^@\s]+\.[^@\s]+", self.alarm_email):
            fail("alarm_email", self.alarm_email, "expected an email address")


@dataclass(frozen=True)
class ClusterNamesConfig(Validated):
    """Names of the cluster-wide objects infra.ClusterServices creates and a run's manifests refer to: each GPU
    role's Kueue queues (its ClusterQueue and the LocalQueue in the run namespace share the name) and the
    PriorityClasses. One place, so a cluster that already has objects of these names can take others."""

    trainer_queue: str = defaults.TRAINER_QUEUE
    rollout_queue: str = defaults.ROLLOUT_QUEUE
    trainer_priority_class: str = defaults.TRAINER_PRIORITY_CLASS
    orchestrator_priority_class: str = defaults.ORCHESTRATOR_PRIORITY_CLASS
    rollout_priority_class: str = defaults.ROLLOUT_PRIORITY_CLASS

    def validate(self) -> None:
        for name in ("trainer_queue", "rollout_queue", "trainer_priority_class", "orchestrator_priority_class",
                     "rollout_priority_class"):
            value = getattr(self, name)
            if not isinstance(value, str) or not re.fullmatch(r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?", value):
                fail(name, value, "expected a Kubernetes object name (lowercase letters, digits, '-', '.')")
            if name.endswith("_priority_class") and value.startswith("system-"):
                fail(name, value, "the system- prefix is reserved for Kubernetes' own PriorityClasses")

    def queue(self, role: str) -> str:
        """The ClusterQueue and LocalQueue name of a GPU pool's role (``trainer`` or ``rollout``)."""
        return {"trainer": self.trainer_queue, "rollout": self.rollout_queue}[role]


ADMIN_ROLE_ARN = re.compile(r"arn:aws[a-z-]*:iam::\d{12}:role/[\w+=,.@/-]+")


@dataclass(frozen=True)
class EnvironmentConfig(Validated):
    account: str
    region: str
    gpu_availability_zone: str  # where the GPU capacity (and every EFA pool) lives
    availability_zones: tuple[str, ...]  # of the VPC; at least two (EKS), including the GPU zone
    rollout_pool: NodePoolConfig
    trainer_pool: NodePoolConfig
    kubernetes_version: str = DEFAULT_KUBERNETES_VERSION
    vpc_cidr: str = "10.0.0.0/16"
    endpoint: EndpointConfig = field(default_factory=EndpointConfig)
    # Granted cluster admin through an access entry; required: without it only CloudFormation's deployment role can
    # use the Kubernetes API, and a private endpoint is reachable only from inside the VPC.
    admin_role_arn: str | None = None
    run_namespace: str = "moe-rl"
    storage: StorageConfig = field(default_factory=StorageConfig)
    observability: ObservabilityConfig = field(default_factory=ObservabilityConfig)
    cluster_names: ClusterNamesConfig = field(default_factory=ClusterNamesConfig)
    name: str = ""  # filled from the key in `environments`

    def __post_init__(self) -> None:
        if isinstance(self.availability_zones, str):
            fail("availability_zones", self.availability_zones, "expected a list of zones, not one string")
        object.__setattr__(self, "availability_zones", tuple(self.availability_zones))
        super().__post_init__()

    def validate(self) -> None:
        if not re.fullmatch(r"\d{12}", self.account):
            fail("account", self.account, "expected a 12-digit AWS account id")
        if not re.fullmatch(r"[a-z]{2}(-gov)?-[a-z]+-\d", self.region):
            fail("region", self.region, "expected a region name like us-east-1")
        for i, az in enumerate(self.availability_zones):
            if not re.fullmatch(re.escape(self.region) + r"[a-z]", az):
                fail(f"availability_zones[{i}]", az, f"not an availability zone of {self.region} (like {self.region}a)")
        if len(set(self.availability_zones)) < 2:
            fail("availability_zones", list(self.availability_zones), "EKS needs at least two distinct zones")
        if self.gpu_availability_zone not in self.availability_zones:
            fail("gpu_availability_zone", self.gpu_availability_zone,
                 f"must be one of availability_zones ({', '.join(self.availability_zones)}) of {self.region}")
        if self.kubernetes_version not in KUBERNETES_VERSIONS:
            fail("kubernetes_version", self.kubernetes_version, kubernetes_versions_allowed())
        try:
            net = ipaddress.ip_network(self.vpc_cidr)
        except ValueError:
            fail("vpc_cidr", self.vpc_cidr, "expected a CIDR like 10.0.0.0/16")
        if not net.is_private or net.prefixlen < 16:
            fail("vpc_cidr", self.vpc_cidr, "expected a private CIDR of /16 or smaller")
        if not vpc_fits_subnets(net.prefixlen, len(self.availability_zones)):
            masks = ", ".join(f"/{m} {name}" for name, m in SUBNET_MASKS)
            fail("vpc_cidr", self.vpc_cidr, f"too small for one {masks} subnet in each of the "
                 f"{len(self.availability_zones)} zones; use a /16")
        if self.admin_role_arn is None:
            fail("admin_role_arn", None, "required: the IAM role that administers the cluster (an access entry); "
                 "reach a private endpoint from inside the VPC (VPN, SSM) or open a public one with "
                 "endpoint.public_cidrs")
        if not ADMIN_ROLE_ARN.fullmatch(self.admin_role_arn):
            fail("admin_role_arn", self.admin_role_arn, "expected an IAM role ARN like arn:aws:iam::123456789012:role/Name")
        if not re.fullmatch(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?", self.run_namespace):
            fail("run_namespace", self.run_namespace, "expected a Kubernetes namespace name")
        if self.trainer_pool.max_size > 1 and not self.trainer_pool.efa:
            fail("trainer_pool.efa", False, "a trainer pool of more than one node needs EFA for its collectives")

    def pools(self) -> dict[str, NodePoolConfig]:
        """Pools by role, the value of the `moe-rl/role` node label."""
        return {"rollout": self.rollout_pool, "trainer": self.trainer_pool}


def load_environments(context: Mapping[str, Any], *, source: str = "cdk.json") -> dict[str, EnvironmentConfig]:
    """Parse every environment under the context key `environments`."""
    envs = context.get("environments")
    if not isinstance(envs, Mapping) or not envs:
        raise ConfigError(source, "context.environments", envs, "expected a mapping of environment name to settings")
    out = {}
    for name, data in envs.items():
        if not re.fullmatch(r"[a-z][a-z0-9-]{0,19}", name):
            raise ConfigError(source, "context.environments", name, "environment names are lowercase letters, digits and '-'")
        env = parse(EnvironmentConfig, data, source=f"{source} environment {name!r}")
        out[name] = _with_name(env, name)
    return out


def _with_name(env: EnvironmentConfig, name: str) -> EnvironmentConfig:
    from dataclasses import replace
    return replace(env, name=name)


def load_cdk_json(path: str | Path = "cdk.json") -> dict[str, EnvironmentConfig]:
    path = Path(path)
    return load_environments(json.loads(path.read_text())["context"], source=str(path.name))


def select_environment(envs: Mapping[str, EnvironmentConfig], name: str) -> EnvironmentConfig:
    if name not in envs:
        raise ConfigError("cdk.json", "env", name, "known environments: " + ", ".join(envs))
    return envs[name]
