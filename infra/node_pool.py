"""EfaNodePool: a managed node group of GPU instances whose EFA network interfaces, placement group, security
group, user data and labels are all derived from the instance catalog (core.catalog)."""
from __future__ import annotations

import base64
import re
import textwrap
from collections.abc import Mapping

from aws_cdk import aws_ec2 as ec2, aws_eks_v2 as eks, aws_iam as iam
from constructs import Construct

from moe_rl_eks.core.cluster import HUGEPAGES_RESOURCE, hugepages_mib
from moe_rl_eks.core.environment import NodePoolConfig
from moe_rl_eks.core.labels import EFA_PRESENT_LABEL, EFA_RESOURCE, GPU_RESOURCE, ROLE_LABEL, tolerations

from .cluster import MoeRlCluster
from .node_role import node_role as new_node_role

# aws_eks_v2's L2 Nodegroup rejects AL2023_X86_64_NVIDIA for p5/p5e/p5en (its GPU list is stale) and
# ec2.InstanceType rejects p6-b200 names, so the pool is the L1 CfnNodegroup with the AMI type set as a string.
NVIDIA_AMI_TYPE = "AL2023_x86_64_NVIDIA"
GPU_PRESENT_LABEL = "nvidia.com/gpu.present"  # what the NVIDIA device plugin's DaemonSet selects nodes by
RESERVED_LABELS = (ROLE_LABEL, EFA_PRESENT_LABEL, GPU_PRESENT_LABEL)
_LABEL_VALUE = re.compile(r"([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?")
_LABEL_NAME = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?")
_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?")
_CA_TEMPLATE = "k8s.io/cluster-autoscaler/node-template"
_MIME_BOUNDARY = "==MOERL=="


def network_interfaces(efa_interfaces: int, security_group_ids: list[str]) -> list[dict]:
    """Launch-template interfaces (CfnLaunchTemplate.NetworkInterfaceProperty arguments): one per network card,
    EFA on every card when ``efa_interfaces`` > 0.

    Card 0 / device 0 is the primary interface: EFA with ENA (``efa``) so the node keeps its IP networking;
    every other card carries an ``efa-only`` interface at device 1, which takes no IP address (no pod-IP
    exhaustion). Without EFA there is one plain ENA interface. Each interface lists every security group, and none
    has a SubnetId: the node group chooses the subnet.
    """
    def interface(card: int, kind: str | None) -> dict:
        return {"network_card_index": card, "device_index": 0 if card == 0 else 1, "groups": security_group_ids,
                "delete_on_termination": True, "interface_type": kind}

    if efa_interfaces == 0:
        return [interface(0, None)]
    return [interface(0, "efa")] + [interface(card, "efa-only") for card in range(1, efa_interfaces)]


# EFA registers (pins) buffers with the NIC, limited by RLIMIT_MEMLOCK. Pods run as UID 10001, and a non-root process
# gets no effective capability from `capabilities.add: [IPC_LOCK]`, so the limit itself must be lifted where
# containers inherit it: containerd's unit. Written before nodeadm starts containerd and the kubelet.
MEMLOCK_DROP_IN = "/etc/systemd/system/containerd.service.d/90-moe-rl-memlock.conf"


# GDRCopy's kernel driver, gdrdrv: DeepEP's NVSHMEM proxy over EFA reads GPU memory through /dev/gdrdrv, and the
# EKS AL2023 NVIDIA AMI neither builds nor loads it. Each GPU node builds it at first boot from the GDRCopy release
# the images' user-space library is (images/versions.env GDRCOPY_VERSION/GDRCOPY_COMMIT; a test holds them equal),
# against the running kernel and the NVIDIA driver sources the AMI carries, and a unit loads it on every boot
# before containerd, so the NVIDIA device plugin (gdrcopyEnabled) finds the device when it starts.
GDRCOPY_VERSION = "v2.5.2"
GDRCOPY_COMMIT = "c91ad9f178e5fb729fc5b6dc62a77c3bb364d6c9"
GDRDRV_UNIT = "moe-rl-gdrdrv.service"


def _gdrdrv_script() -> str:
    return textwrap.dedent(f"""\
        #!/bin/bash
        set -euo pipefail
        dnf install -y -q "kernel-devel-$(uname -r)" gcc make git
        work=$(mktemp -d)
        git clone -q --depth 1 --branch {GDRCOPY_VERSION} https://github.com/NVIDIA/gdrcopy.git "$work/gdrcopy"
        test "$(git -C "$work/gdrcopy" rev-parse HEAD)" = {GDRCOPY_COMMIT}
        # gdrdrv's Makefile finds the NVIDIA driver's nv-p2p sources under /usr/src/nvidia-*; none: stop here.
        make -C "$work/gdrcopy" driver KVER="$(uname -r)"
        install -D -m 0644 "$work/gdrcopy/src/gdrdrv/gdrdrv.ko" "/lib/modules/$(uname -r)/extra/gdrdrv.ko"
        depmod -a
        rm -rf "$work"
        # gdrdrv registers a character device but creates no node; pods run as UID 10001, so it is world-usable.
        cat > /usr/local/sbin/moe-rl-gdrdrv <<'SCRIPT'
        #!/bin/bash
        set -euo pipefail
        modprobe gdrdrv
        major=$(awk '$2 == "gdrdrv" {{print $1}}' /proc/devices)
        [ -c /dev/gdrdrv ] || mknod -m 0666 /dev/gdrdrv c "$major" 0
        SCRIPT
        chmod 0755 /usr/local/sbin/moe-rl-gdrdrv
        cat > /etc/systemd/system/{GDRDRV_UNIT} <<'UNIT'
        [Unit]
        Description=GDRCopy gdrdrv and /dev/gdrdrv
        Before=containerd.service kubelet.service
        [Service]
        Type=oneshot
        RemainAfterExit=yes
        ExecStart=/usr/local/sbin/moe-rl-gdrdrv
        [Install]
        WantedBy=multi-user.target
        UNIT
        systemctl daemon-reload
        systemctl enable --now {GDRDRV_UNIT}
        """)


def user_data(*, hugepages_2mi: int, local_nvme: bool) -> str:
    """nodeadm MIME user data: a NodeConfig (local NVMe as one RAID0 volume for containerd and the kubelet), a
    containerd drop-in with unlimited locked memory, GDRCopy's gdrdrv built and loaded (:func:`_gdrdrv_script`),
    and a script reserving 2 MiB hugepages; the scripts run before nodeadm starts the kubelet, so it advertises
    hugepages-2Mi."""
    parts = [('text/x-shellscript; charset="us-ascii"', textwrap.dedent(f"""\
        #!/bin/bash
        set -euo pipefail
        mkdir -p {MEMLOCK_DROP_IN.rsplit("/", 1)[0]}
        printf '[Service]\\nLimitMEMLOCK=infinity\\n' > {MEMLOCK_DROP_IN}
        systemctl daemon-reload
        systemctl try-restart containerd
        """)), ('text/x-shellscript; charset="us-ascii"', _gdrdrv_script())]
    if local_nvme:
        parts.append(("application/node.eks.aws", textwrap.dedent("""\
            ---
            apiVersion: node.eks.aws/v1alpha1
            kind: NodeConfig
            spec:
              instance:
                localStorage:
                  strategy: RAID0
            """)))
    if hugepages_2mi:
        parts.append(('text/x-shellscript; charset="us-ascii"', textwrap.dedent(f"""\
            #!/bin/bash
            set -euo pipefail
            echo "vm.nr_hugepages = {hugepages_2mi}" > /etc/sysctl.d/90-moe-rl-hugepages.conf
            sysctl -p /etc/sysctl.d/90-moe-rl-hugepages.conf
            """)))
    body = [f'MIME-Version: 1.0\nContent-Type: multipart/mixed; boundary="{_MIME_BOUNDARY}"\n']
    for content_type, text in parts:
        body.append(f"--{_MIME_BOUNDARY}\nContent-Type: {content_type}\n\n{text}")
    body.append(f"--{_MIME_BOUNDARY}--\n")
    return "\n".join(body)


class EfaNodePool(Construct):
    """A GPU managed node group in one subnet, with every EFA interface its instance type has.

    Attributes: ``pool`` (the validated props), ``efa_interfaces`` (per node), ``security_group`` (all traffic to
    and from itself: NCCL/libfabric between the pool's nodes), ``placement_group`` (cluster strategy; None without
    EFA or with a reservation), ``launch_template``, ``nodegroup`` (the CfnNodegroup), ``node_role``, ``spec`` (the
    catalog entry), ``labels``, ``taints`` (Kubernetes spelling, core.labels.Taint), ``tolerations`` (what the
    device plugins, the pool's Kueue flavor and its pods need to land on it).
    """

    def __init__(
        self,
        scope: Construct,
        id: str,
        *,
        cluster: "eks.ICluster | MoeRlCluster",
        subnet: ec2.ISubnet,
        role: str,
        pool: NodePoolConfig,
        node_role: iam.IRole | None = None,
        cluster_placement: bool | None = None,
        extra_labels: Mapping[str, str] | None = None,
        auto_repair: bool = True,
    ) -> None:
        """
        :param cluster: a :class:`MoeRlCluster` (the pool then waits for its VPC CNI add-on) or any ``eks.ICluster``;
            an imported one needs ``vpc`` and ``cluster_security_group_id``, and its VPC CNI must be at least
            core.cluster.VPC_CNI_MIN_VERSION_FOR_EFA_ONLY with permissions of its own (Pod Identity or IRSA): the
            default node role carries no CNI policy.
        :param subnet: the one subnet (the zone of the GPU capacity). EFA traffic does not cross zones.
        :param role: value of the ``moe-rl/role`` node label, e.g. ``trainer`` or ``rollout``.
        :param pool: instance type, sizes, capacity (``capacity_type`` takes ``eks.CapacityType`` or its name), EFA,
            root volume, hugepages and the GPU taint's effect (``taint_effect`` takes ``eks.TaintEffect``; default
            NO_SCHEDULE): :class:`~moe_rl_eks.core.environment.NodePoolConfig`, validated when built.
        :param node_role: default: a new role with the node policies EKS documents, less the CNI policy.
        :param cluster_placement: launch into a cluster placement group. Default: yes for EFA pools without a
            capacity reservation; a reservation (capacity block or ODCR) already fixes placement, and targeting one
            made outside the group would make launches fail.
        :param extra_labels: more node labels; default none. The pool's own labels (role, EFA, GPU) cannot be set here.
        :param auto_repair: EKS node auto-repair (the node monitoring agent's GPU, network and kubelet conditions
            replace an unhealthy node), one node at a time; default on. A gang cannot finish on a node whose GPU or
            EFA failed, and JobSet restarts the gang from its checkpoint once the replacement joins.
        """
        super().__init__(scope, id)
        if not isinstance(pool, NodePoolConfig):
            raise TypeError(f"pool: {pool!r} is not allowed; a moe_rl_eks.core.environment.NodePoolConfig")
        _check_label_value("role", role)
        for key, value in (extra_labels or {}).items():
            if key in RESERVED_LABELS:
                raise ValueError(f"extra_labels: {key!r} is not allowed; the pool sets {', '.join(RESERVED_LABELS)}")
            _check_label_key(key)
            _check_label_value(f"extra_labels[{key!r}]", value)
        network_ready = cluster.network_ready if isinstance(cluster, MoeRlCluster) else None
        eks_cluster: eks.ICluster = cluster.cluster if isinstance(cluster, MoeRlCluster) else cluster
        vpc, cluster_sg_id = _cluster_network(eks_cluster)
        self.pool = pool
        self.spec = pool.spec
        self.role = role
        self.efa_interfaces = efa_interfaces = self.spec.efa_interfaces if pool.efa else 0

        self.node_role = node_role or new_node_role(self, "NodeRole")
        self.security_group = ec2.SecurityGroup(
            self, "SecurityGroup", vpc=vpc, allow_all_outbound=False,
            description=f"{role} pool: all traffic between its nodes (EFA requires it)")
        self.security_group.add_ingress_rule(self.security_group, ec2.Port.all_traffic(), "EFA/NCCL within the pool")
        self.security_group.add_egress_rule(self.security_group, ec2.Port.all_traffic(), "EFA/NCCL within the pool")

        reservation = pool.capacity_reservation_id
        if cluster_placement is None:
            cluster_placement = bool(efa_interfaces) and not reservation
        if cluster_placement and not efa_interfaces:
            raise ValueError("cluster_placement: True is not allowed without EFA; set efa=True or leave it unset")
        self.placement_group = (ec2.CfnPlacementGroup(self, "PlacementGroup", strategy="cluster")
                                if cluster_placement else None)
        # EKS refuses a CAPACITY_BLOCK node group that names its instance type: it goes in the launch template.
        capacity_block = pool.capacity_type == "CAPACITY_BLOCK"
        lt = ec2.CfnLaunchTemplate
        sg_ids = [self.security_group.security_group_id, cluster_sg_id]
        data = lt.LaunchTemplateDataProperty(
            instance_type=pool.instance_type if capacity_block else None,
            network_interfaces=[lt.NetworkInterfaceProperty(**i) for i in network_interfaces(efa_interfaces, sg_ids)],
            # 2 hops so host-network daemons' containers (CNI, device plugins, CloudWatch agent) read instance
            # metadata; run pods are kept off it by their NetworkPolicy (k8s/), and the node role holds no CNI policy.
            metadata_options=lt.MetadataOptionsProperty(http_tokens="required", http_endpoint="enabled",
                                                        http_put_response_hop_limit=2),
            block_device_mappings=[lt.BlockDeviceMappingProperty(device_name="/dev/xvda", ebs=lt.EbsProperty(
                volume_size=pool.root_volume_gib, volume_type="gp3", encrypted=True, delete_on_termination=True))],
            user_data=base64.b64encode(
                user_data(hugepages_2mi=pool.hugepages_2mi, local_nvme=self.spec.local_nvme).encode()).decode(),
            placement=(lt.PlacementProperty(group_name=self.placement_group.ref)
                       if self.placement_group is not None else None),
            capacity_reservation_specification=(lt.CapacityReservationSpecificationProperty(
                capacity_reservation_target=lt.CapacityReservationTargetProperty(
                    capacity_reservation_id=reservation)) if reservation else None),
            instance_market_options=lt.InstanceMarketOptionsProperty(market_type="capacity-block")
            if capacity_block else None,
        )
        self.launch_template = ec2.CfnLaunchTemplate(self, "LaunchTemplate", launch_template_data=data)

        self.labels = {ROLE_LABEL: role, GPU_PRESENT_LABEL: "true", **(extra_labels or {})}
        if efa_interfaces:
            self.labels[EFA_PRESENT_LABEL] = "true"
        self.taints = pool.taints
        self.tolerations = tolerations(self.taints)
        self.nodegroup = eks.CfnNodegroup(
            self, "Nodegroup",
            cluster_name=eks_cluster.cluster_name,
            node_role=self.node_role.role_arn,
            subnets=[subnet.subnet_id],
            instance_types=None if capacity_block else [pool.instance_type],
            ami_type=NVIDIA_AMI_TYPE,
            capacity_type=pool.capacity_type,
            launch_template=eks.CfnNodegroup.LaunchTemplateSpecificationProperty(
                id=self.launch_template.ref, version=self.launch_template.attr_latest_version_number),
            scaling_config=eks.CfnNodegroup.ScalingConfigProperty(
                min_size=pool.min_size, desired_size=pool.desired_size, max_size=pool.max_size),
            labels=self.labels,
            taints=[eks.CfnNodegroup.TaintProperty(key=t.key, value=t.value, effect=pool.taint_effect)
                    for t in self.taints],
            tags=self.autoscaler_tags(),
            node_repair_config=eks.CfnNodegroup.NodeRepairConfigProperty(
                enabled=True, max_parallel_nodes_repaired_count=1) if auto_repair else None,
        )
        if network_ready is not None:
            # A node joins only once the CNI can wire its interfaces.
            self.nodegroup.node.add_dependency(network_ready)

    def autoscaler_tags(self) -> dict[str, str]:
        """Node-template tags: what a node of this group offers, so Cluster Autoscaler can scale it from zero
        (it reads them, with labels and taints, from DescribeNodegroup)."""
        resources = {GPU_RESOURCE: str(self.spec.gpus)}
        if self.efa_interfaces:
            resources[EFA_RESOURCE] = str(self.efa_interfaces)
        if self.pool.hugepages_2mi:
            resources[HUGEPAGES_RESOURCE] = f"{hugepages_mib(self.pool.hugepages_2mi)}Mi"
        tags = {f"{_CA_TEMPLATE}/resources/{k}": v for k, v in resources.items()}
        tags.update({f"{_CA_TEMPLATE}/label/{k}": v for k, v in self.labels.items()})
        tags.update({f"{_CA_TEMPLATE}/taint/{t.key}": f"{t.value}:{t.effect}" for t in self.taints})
        return tags


def _cluster_network(cluster: eks.ICluster) -> tuple[ec2.IVpc, str]:
    """The cluster's VPC and cluster security group (on every node interface); an imported cluster has them only
    when it was imported with them."""
    try:
        return cluster.vpc, cluster.cluster_security_group_id
    except Exception as exc:  # jsii raises its own error type for an attribute the import did not give
        raise ValueError(
            f"cluster: {cluster.node.path!r} is not allowed; an imported cluster needs vpc and "
            "cluster_security_group_id (eks.Cluster.from_cluster_attributes(..., vpc=..., "
            f"cluster_security_group_id=...)): every node interface carries the cluster security group ({exc})") from None


def _check_label_value(field: str, value: object) -> None:
    if not isinstance(value, str) or not value or not _LABEL_VALUE.fullmatch(value):
        raise ValueError(f"{field}: {value!r} is not allowed; a Kubernetes label value: at most 63 letters, digits, "
                         "'-', '_' or '.', beginning and ending with a letter or digit")


def _check_label_key(key: object) -> None:
    prefix, _, name = key.rpartition("/") if isinstance(key, str) else ("", "", "")
    if not _LABEL_NAME.fullmatch(name) or (prefix and not _DNS_SUBDOMAIN.fullmatch(prefix)):
        raise ValueError(f"extra_labels: {key!r} is not allowed; a Kubernetes label key ([prefix/]name, name at most "
                         "63 characters)")
