"""EfaNodePool: a managed node group of GPU instances whose EFA network interfaces, placement group, security
group, user data and labels are all derived from the instance catalog (core.catalog)."""
from __future__ import annotations

import base64
import textwrap
from collections.abc import Mapping

from aws_cdk import Acknowledgment, Validations, aws_ec2 as ec2, aws_eks_v2 as eks, aws_iam as iam
from constructs import Construct

from moe_rl_eks.core.environment import NodePoolConfig
from moe_rl_eks.core.labels import EFA_PRESENT_LABEL, EFA_RESOURCE, GPU_RESOURCE, GPU_TAINT_KEY, ROLE_LABEL
from moe_rl_eks.core.schema import parse

# aws_eks_v2's L2 Nodegroup rejects AL2023_X86_64_NVIDIA for p5/p5e/p5en (its GPU list is stale) and
# ec2.InstanceType rejects p6-b200 names, so the pool is the L1 CfnNodegroup with the AMI type set as a string.
NVIDIA_AMI_TYPE = "AL2023_x86_64_NVIDIA"
NODE_POLICIES = ("AmazonEKSWorkerNodePolicy", "AmazonEC2ContainerRegistryPullOnly", "AmazonEKS_CNI_Policy")
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


def user_data(*, hugepages_2mi: int, local_nvme: bool) -> str:
    """nodeadm MIME user data: a NodeConfig (local NVMe as one RAID0 volume for containerd and the kubelet) and a
    script reserving 2 MiB hugepages, which runs before nodeadm starts the kubelet so it advertises hugepages-2Mi."""
    parts = []
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

    Attributes: ``efa_interfaces`` (per node), ``security_group`` (all traffic to and from itself: NCCL/libfabric
    between the pool's nodes), ``placement_group`` (cluster strategy; None without EFA or with a reservation),
    ``launch_template``, ``nodegroup`` (the CfnNodegroup), ``node_role``, ``spec`` (the catalog entry), ``labels``,
    ``taints``.
    """

    def __init__(
        self,
        scope: Construct,
        id: str,
        *,
        cluster: eks.ICluster,
        subnet: ec2.ISubnet,
        role: str,
        instance_type: str,
        min_size: int = 0,
        desired_size: int = 0,
        max_size: int = 1,
        capacity_type: str = "ON_DEMAND",
        capacity_reservation_id: str | None = None,
        efa: bool = True,
        root_volume_gib: int = 200,
        hugepages_2mi: int = 5120,
        extra_labels: Mapping[str, str] | None = None,
        node_role: iam.IRole | None = None,
        cluster_placement: bool | None = None,
    ) -> None:
        """
        :param cluster: the EKS cluster; its cluster security group goes on every interface.
        :param subnet: the one subnet (the zone of the GPU capacity). EFA traffic does not cross zones.
        :param role: value of the ``moe-rl/role`` node label, e.g. ``trainer`` or ``rollout``.
        :param instance_type: a type of core.catalog.
        :param min_size: default 0 (scale from zero). :param desired_size: default 0. :param max_size: default 1.
        :param capacity_type: ON_DEMAND (default), SPOT or CAPACITY_BLOCK (needs ``capacity_reservation_id``).
        :param capacity_reservation_id: a capacity block or on-demand reservation (cr-...); default none.
        :param efa: default True: attach every EFA interface of the type and add the cluster placement group.
            False (e.g. a rollout pool of single nodes) keeps one plain ENA interface.
        :param root_volume_gib: encrypted gp3 root volume; default 200.
        :param hugepages_2mi: 2 MiB hugepages reserved at boot (for libfabric/NVSHMEM); default 5120 (10 GiB).
        :param extra_labels: more node labels; default none.
        :param node_role: default: a new role with the three policies EKS documents for nodes.
        :param cluster_placement: launch into a cluster placement group. Default: yes for EFA pools without a
            capacity reservation; a reservation (capacity block or ODCR) already fixes placement, and targeting one
            made outside the group would make launches fail.
        """
        super().__init__(scope, id)
        self.config = parse(NodePoolConfig, {
            "instance_type": instance_type, "min_size": min_size, "desired_size": desired_size, "max_size": max_size,
            "capacity_type": capacity_type, "capacity_reservation_id": capacity_reservation_id, "efa": efa,
            "root_volume_gib": root_volume_gib, "hugepages_2mi": hugepages_2mi,
        }, source=f"EfaNodePool {id!r}")
        self.spec = self.config.spec
        self.role = role
        self.efa_interfaces = efa_interfaces = self.spec.efa_interfaces if efa else 0

        self.node_role = node_role or self._default_node_role()
        self.security_group = ec2.SecurityGroup(
            self, "SecurityGroup", vpc=cluster.vpc, allow_all_outbound=False,
            description=f"{role} pool: all traffic between its nodes (EFA requires it)")
        self.security_group.add_ingress_rule(self.security_group, ec2.Port.all_traffic(), "EFA/NCCL within the pool")
        self.security_group.add_egress_rule(self.security_group, ec2.Port.all_traffic(), "EFA/NCCL within the pool")

        if cluster_placement is None:
            cluster_placement = bool(efa_interfaces) and not capacity_reservation_id
        if cluster_placement and not efa_interfaces:
            raise ValueError("cluster_placement: True is not allowed without EFA; set efa=True or leave it unset")
        self.placement_group = (ec2.CfnPlacementGroup(self, "PlacementGroup", strategy="cluster")
                                if cluster_placement else None)
        lt = ec2.CfnLaunchTemplate
        sg_ids = [self.security_group.security_group_id, cluster.cluster_security_group_id]
        data = lt.LaunchTemplateDataProperty(
            network_interfaces=[lt.NetworkInterfaceProperty(**i) for i in network_interfaces(efa_interfaces, sg_ids)],
            # 2 hops: containers (one hop behind the node) may read instance metadata.
            metadata_options=lt.MetadataOptionsProperty(http_tokens="required", http_endpoint="enabled",
                                                        http_put_response_hop_limit=2),
            block_device_mappings=[lt.BlockDeviceMappingProperty(device_name="/dev/xvda", ebs=lt.EbsProperty(
                volume_size=root_volume_gib, volume_type="gp3", encrypted=True, delete_on_termination=True))],
            user_data=base64.b64encode(
                user_data(hugepages_2mi=hugepages_2mi, local_nvme=self.spec.local_nvme).encode()).decode(),
            placement=(lt.PlacementProperty(group_name=self.placement_group.ref)
                       if self.placement_group is not None else None),
            capacity_reservation_specification=(lt.CapacityReservationSpecificationProperty(
                capacity_reservation_target=lt.CapacityReservationTargetProperty(
                    capacity_reservation_id=capacity_reservation_id)) if capacity_reservation_id else None),
            instance_market_options=(lt.InstanceMarketOptionsProperty(market_type="capacity-block")
                                     if capacity_type == "CAPACITY_BLOCK" else None),
        )
        self.launch_template = ec2.CfnLaunchTemplate(self, "LaunchTemplate", launch_template_data=data)

        # nvidia.com/gpu.present is what the NVIDIA device plugin's DaemonSet selects nodes by.
        self.labels = {ROLE_LABEL: role, "nvidia.com/gpu.present": "true", **(extra_labels or {})}
        if efa_interfaces:
            self.labels[EFA_PRESENT_LABEL] = "true"
        self.taints = [{"key": GPU_TAINT_KEY, "value": "true", "effect": "NO_SCHEDULE"}]
        self.nodegroup = eks.CfnNodegroup(
            self, "Nodegroup",
            cluster_name=cluster.cluster_name,
            node_role=self.node_role.role_arn,
            subnets=[subnet.subnet_id],
            instance_types=[instance_type],
            ami_type=NVIDIA_AMI_TYPE,
            capacity_type=capacity_type,
            launch_template=eks.CfnNodegroup.LaunchTemplateSpecificationProperty(
                id=self.launch_template.ref, version=self.launch_template.attr_latest_version_number),
            scaling_config=eks.CfnNodegroup.ScalingConfigProperty(
                min_size=min_size, desired_size=desired_size, max_size=max_size),
            labels=self.labels,
            taints=[eks.CfnNodegroup.TaintProperty(**t) for t in self.taints],
            tags=self.autoscaler_tags(),
        )

    def autoscaler_tags(self) -> dict[str, str]:
        """Node-template tags: what a node of this group offers, so Cluster Autoscaler can scale it from zero
        (it reads them, with labels and taints, from DescribeNodegroup)."""
        resources = {GPU_RESOURCE: str(self.spec.gpus)}
        if self.efa_interfaces:
            resources[EFA_RESOURCE] = str(self.efa_interfaces)
        if self.config.hugepages_2mi:
            resources["hugepages-2Mi"] = f"{self.config.hugepages_2mi * 2}Mi"
        tags = {f"{_CA_TEMPLATE}/resources/{k}": v for k, v in resources.items()}
        tags.update({f"{_CA_TEMPLATE}/label/{k}": v for k, v in self.labels.items()})
        tags.update({f"{_CA_TEMPLATE}/taint/{t['key']}": f"{t['value']}:NoSchedule" for t in self.taints})
        return tags

    def _default_node_role(self) -> iam.Role:
        role = iam.Role(self, "NodeRole", assumed_by=iam.ServicePrincipal("ec2.amazonaws.com"),
                        managed_policies=[iam.ManagedPolicy.from_aws_managed_policy_name(p) for p in NODE_POLICIES])
        for policy in NODE_POLICIES:
            Validations.of(role).acknowledge(Acknowledgment(
                id=f"AwsSolutions::AwsSolutions-IAM4[Policy::arn:<AWS::Partition>:iam::aws:policy/{policy}]",
                reason=f"{policy} is the AWS managed policy EKS documents for node roles; AWS keeps it in step "
                       "with what the kubelet, the VPC CNI and image pulls need."))
        return role

    @classmethod
    def from_config(cls, scope: Construct, id: str, *, cluster: eks.ICluster, subnet: ec2.ISubnet, role: str,
                    config: NodePoolConfig) -> "EfaNodePool":
        """A pool from an environment's validated :class:`~moe_rl_eks.core.environment.NodePoolConfig`."""
        return cls(scope, id, cluster=cluster, subnet=subnet, role=role, instance_type=config.instance_type,
                   min_size=config.min_size, desired_size=config.desired_size, max_size=config.max_size,
                   capacity_type=config.capacity_type, capacity_reservation_id=config.capacity_reservation_id,
                   efa=config.efa, root_volume_gib=config.root_volume_gib, hugepages_2mi=config.hugepages_2mi)
