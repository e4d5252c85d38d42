"""Pod building blocks shared by the run chart and the validation chart: sizes, security, volumes, placement.

Typed L1 structs (`k8s` of k8s/kube.py) throughout: cdk8s-plus cannot express GPU, EFA or hugepages resources,
and the JobSet's pod template must be the same struct the Deployment uses.
"""
from __future__ import annotations

from dataclasses import dataclass

from moe_rl_eks.core import cluster, labels
from moe_rl_eks.core.environment import NodePoolConfig
from moe_rl_eks.core.schema import ConfigError

from .kube import k8s

# Kubelet, system reservations and the node's daemon sets (CNI, device plugins, FSx CSI, Pod Identity agent,
# metrics) keep this share of a GPU node's CPU and memory.
NODE_HEADROOM = 0.10
RUN_CONFIG_DIR = "/etc/moerl"
RUN_FILE = f"{RUN_CONFIG_DIR}/run.yaml"
# Tags are immutable, so `Always` only costs a manifest lookup; it also makes every pull check the registry's
# access control instead of trusting an image another pod left on the node.
PULL_POLICY = "Always"
UID = cluster.POD_UID  # set here so a root USER in an image cannot slip through


@dataclass(frozen=True)
class PodSize:
    cpu_millis: int
    memory_mib: int
    gpus: int = 0
    efa: int = 0
    hugepages_mib: int = 0

    def resources(self) -> k8s.ResourceRequirements:
        """Requests equal limits: GPUs and hugepages demand it, and Guaranteed QoS pins CPUs for NCCL threads."""
        amounts = {"cpu": k8s.Quantity.from_string(f"{self.cpu_millis}m"),
                   "memory": k8s.Quantity.from_string(f"{self.memory_mib}Mi")}
        if self.gpus:
            amounts[labels.GPU_RESOURCE] = k8s.Quantity.from_number(self.gpus)
        if self.efa:
            amounts[labels.EFA_RESOURCE] = k8s.Quantity.from_number(self.efa)
        if self.hugepages_mib:
            amounts[cluster.HUGEPAGES_RESOURCE] = k8s.Quantity.from_string(f"{self.hugepages_mib}Mi")
        return k8s.ResourceRequirements(requests=amounts, limits=amounts)


def _node_share(pool: NodePoolConfig, fraction: float, hugepages_mib: int) -> tuple[int, int]:
    spec = pool.spec
    usable = (1 - NODE_HEADROOM) * fraction
    cpu_millis = int(spec.vcpus * usable) * 1000
    memory_mib = int(spec.memory_gib * 1024 * usable) - hugepages_mib
    return cpu_millis, memory_mib


def trainer_size(pool: NodePoolConfig) -> PodSize:
    """One trainer pod per node: every GPU and EFA interface, the node's hugepages, the rest of its CPU/memory."""
    hugepages_mib = cluster.hugepages_mib(pool.hugepages_2mi)
    cpu, memory = _node_share(pool, 1.0, hugepages_mib)
    return PodSize(cpu, memory, gpus=pool.spec.gpus, efa=pool.spec.efa_interfaces if pool.efa else 0,
                   hugepages_mib=hugepages_mib)


def rollout_size(pool: NodePoolConfig, gpus_per_server: int) -> PodSize:
    """A rollout server gets its GPUs' share of the node and no EFA interface: a server spans GPUs of one node only
    (NVLink), and weights arrive over the node's IP network; a share of EFA would only cap servers per node."""
    spec = pool.spec
    cpu, memory = _node_share(pool, gpus_per_server / spec.gpus, 0)
    return PodSize(cpu, memory, gpus=gpus_per_server)


ORCHESTRATOR_SIZE = PodSize(cpu_millis=2000, memory_mib=4096)


def check_shm(size: PodSize, shm_gib: int, field: str, source: str) -> None:
    """/dev/shm is memory-backed and counts against the pod's memory limit: keep it to half of it."""
    if shm_gib * 1024 > size.memory_mib // 2:
        raise ConfigError(source, field, shm_gib, f"must be at most half of the pod's memory "
                          f"({size.memory_mib // 1024} GiB), so at most {size.memory_mib // 2048}")


def container_security() -> k8s.SecurityContext:
    """Non-root, no capabilities, read-only root, RuntimeDefault seccomp: what Pod Security's `restricted` asks.

    No IPC_LOCK for EFA either: a non-root container gets no effective capability from `capabilities.add`
    (Kubernetes sets no ambient capabilities). What lets UID 10001 pin EFA buffers is the node's unlimited
    RLIMIT_MEMLOCK (containerd's LimitMEMLOCK, infra/node_pool.py), which `moerl doctor --efa` checks at start."""
    return k8s.SecurityContext(
        allow_privilege_escalation=False,
        privileged=False,
        read_only_root_filesystem=True,
        run_as_non_root=True,
        run_as_user=UID,
        run_as_group=UID,
        capabilities=k8s.Capabilities(drop=["ALL"]),
        seccomp_profile=k8s.SeccompProfile(type="RuntimeDefault"),
    )




def startup_check(container: k8s.Container, role: str, *, efa: bool) -> k8s.Container:
    """An init container that runs `moerl doctor` in ``container``'s image, with its resources, devices, security
    and mounts: the pod starts only if its image, GPUs, EFA, hugepages and locked-memory limit are what the role
    needs (Kubernetes ignores an image's HEALTHCHECK)."""
    return k8s.Container(
        name="doctor", image=container.image, image_pull_policy=container.image_pull_policy,
        command=doctor_command(role, efa=efa), env=container.env, resources=container.resources,
        security_context=container.security_context, volume_mounts=container.volume_mounts)


def doctor_command(role: str, *, efa: bool) -> list[str]:
    """`moerl doctor` (tools/doctor.py, the images issue): exit 0 when the pod can do `role`'s work."""
    return ["moerl", "doctor", "--role", role, *(["--efa"] if efa else [])]


@dataclass(frozen=True)
class Volumes:
    """The volumes a pod mounts and where: run config, FSx, /dev/shm, a writable /tmp on a read-only root."""

    volumes: list[k8s.Volume]
    mounts: list[k8s.VolumeMount]


TMP_GIB = 8  # caches and scratch under /tmp


def standard_volumes(config_map: str, *, shm_gib: int | None, fsx_read_only: bool, tmp_gib: int = TMP_GIB,
                     fsx_writable: str | None = None) -> Volumes:
    """`fsx_writable`: one directory under the FSx mount that a pod whose FSx is read-only still writes (a rollout
    server's routing store), mounted again over it read-write; the rest of the volume stays read-only."""
    if fsx_writable is not None and not fsx_writable.startswith(f"{cluster.FSX_MOUNT_PATH}/"):
        raise ValueError(f"fsx_writable: {fsx_writable!r} is not under {cluster.FSX_MOUNT_PATH}/")
    volumes = [
        k8s.Volume(name="run-config", config_map=k8s.ConfigMapVolumeSource(name=config_map)),
        k8s.Volume(name="fsx", persistent_volume_claim=k8s.PersistentVolumeClaimVolumeSource(
            claim_name=cluster.FSX_CLAIM_NAME, read_only=fsx_read_only and fsx_writable is None)),
        k8s.Volume(name="tmp", empty_dir=k8s.EmptyDirVolumeSource(size_limit=k8s.Quantity.from_string(f"{tmp_gib}Gi"))),
    ]
    mounts = [
        k8s.VolumeMount(name="run-config", mount_path=RUN_CONFIG_DIR, read_only=True),
        k8s.VolumeMount(name="fsx", mount_path=cluster.FSX_MOUNT_PATH, read_only=fsx_read_only),
        k8s.VolumeMount(name="tmp", mount_path="/tmp"),
    ]
    if fsx_writable is not None:
        mounts.insert(2, k8s.VolumeMount(name="fsx", mount_path=fsx_writable, read_only=False,
                                         sub_path=fsx_writable.removeprefix(f"{cluster.FSX_MOUNT_PATH}/")))
    if shm_gib:
        volumes.append(k8s.Volume(name="dshm", empty_dir=k8s.EmptyDirVolumeSource(
            medium="Memory", size_limit=k8s.Quantity.from_string(f"{shm_gib}Gi"))))
        mounts.append(k8s.VolumeMount(name="dshm", mount_path="/dev/shm"))
    return Volumes(volumes, mounts)


def pod_spec(container: k8s.Container, volumes: Volumes, *, service_account: str, priority_class: str,
             init_containers: list[k8s.Container] | None = None, **extra) -> k8s.PodSpec:
    """Every pod of a run: one container (after its startup check), non-root under RuntimeDefault seccomp, and no
    Kubernetes API token (Pod Identity injects its own AWS token; nothing here talks to the API server)."""
    return k8s.PodSpec(
        containers=[container], init_containers=init_containers, volumes=volumes.volumes,
        service_account_name=service_account,
        automount_service_account_token=False, priority_class_name=priority_class,
        security_context=k8s.PodSecurityContext(
            run_as_non_root=True, run_as_user=UID, run_as_group=UID, fs_group=UID,
            seccomp_profile=k8s.SeccompProfile(type="RuntimeDefault")),
        **extra)


def scraped_on(port: int) -> dict[str, str]:
    """Pod annotations the managed Prometheus scraper keeps (infra/observability.py): scrape /metrics on `port`."""
    return {"prometheus.io/scrape": "true", "prometheus.io/port": str(port)}


# Writable locations a read-only root filesystem leaves: everything that caches goes under /tmp.
CACHE_ENV = {"HOME": "/tmp", "TRITON_CACHE_DIR": "/tmp/triton", "HF_HOME": "/tmp/huggingface",
             "PYTHONDONTWRITEBYTECODE": "1"}


def aws_env(region: str) -> dict[str, str]:
    """The region for AWS SDKs: run pods cannot reach the instance metadata service (NetworkPolicy), where SDKs
    would otherwise look it up; Pod Identity supplies the credentials."""
    return {"AWS_REGION": region, "AWS_DEFAULT_REGION": region}


def env_vars(values: dict[str, str], secret_env: tuple[str, str, str] | None = None) -> list[k8s.EnvVar]:
    """Sorted plain variables, plus (name, secret, key) read from a Secret."""
    out = [k8s.EnvVar(name=k, value=v) for k, v in sorted(values.items())]
    if secret_env:
        name, secret, key = secret_env
        out.append(k8s.EnvVar(name=name, value_from=k8s.EnvVarSource(
            secret_key_ref=k8s.SecretKeySelector(name=secret, key=key))))
    return out


def gpu_placement(role: str, pool: NodePoolConfig) -> dict:
    """Keyword arguments for k8s.PodSpec: only nodes of `role`'s pool, tolerating that pool's taints."""
    return dict(
        affinity=k8s.Affinity(node_affinity=k8s.NodeAffinity(
            required_during_scheduling_ignored_during_execution=k8s.NodeSelector(node_selector_terms=[
                k8s.NodeSelectorTerm(match_expressions=[
                    k8s.NodeSelectorRequirement(key=labels.ROLE_LABEL, operator="In", values=[role])])]))),
        tolerations=[k8s.Toleration(**t) for t in labels.tolerations(pool.taints)],
    )
