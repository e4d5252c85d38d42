"""The EKS control plane (aws_eks_v2): private endpoint, every control-plane log type, KMS envelope encryption of
secrets, access entries, the managed add-ons GPU nodes need, and the kubectl provider that installs Helm charts."""
from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from aws_cdk import (Acknowledgment, CfnCondition, RemovalPolicy, Stack, Validations, aws_ec2 as ec2,
                     aws_eks_v2 as eks, aws_iam as iam, aws_kms as kms, aws_lambda as lambda_)
from aws_cdk.lambda_layer_kubectl_v35 import KubectlV35Layer
from aws_cdk.lambda_layer_kubectl_v36 import KubectlV36Layer
from constructs import Construct, IDependable

from moe_rl_eks.core.cluster import (DEFAULT_KUBERNETES_VERSION, KUBERNETES_VERSIONS, VPC_CNI_MIN_VERSION_FOR_EFA_ONLY,
                                    VPC_CNI_VERSION, kubernetes_versions_allowed)
from moe_rl_eks.core.environment import EndpointConfig
from moe_rl_eks.core.labels import ROLE_LABEL

from ._ids import pascal
from .node_role import node_role

ALL_LOG_TYPES = (
    eks.ClusterLoggingTypes.API,
    eks.ClusterLoggingTypes.AUDIT,
    eks.ClusterLoggingTypes.AUTHENTICATOR,
    eks.ClusterLoggingTypes.CONTROLLER_MANAGER,
    eks.ClusterLoggingTypes.SCHEDULER,
)
# Each supported version (core.cluster.KUBERNETES_VERSIONS) with the kubectl Lambda layer built for it: the layer
# ships the kubectl/helm that install manifests and charts (kubectl is supported within one minor of the server).
_KUBERNETES = {"1.35": (eks.KubernetesVersion.V1_35, KubectlV35Layer),
               "1.36": (eks.KubernetesVersion.V1_36, KubectlV36Layer)}
assert set(_KUBERNETES) == set(KUBERNETES_VERSIONS), "a supported Kubernetes version lacks its kubectl layer"
# The CloudWatch agent needs these (AWS managed) to publish Container Insights metrics and logs.
CLOUDWATCH_AGENT_POLICY = "CloudWatchAgentServerPolicy"
# The VPC CNI's own permissions, given to its aws-node service account by Pod Identity instead of the node role.
CNI_POLICY = "AmazonEKS_CNI_Policy"
POD_IDENTITY_PRINCIPAL = "pods.eks.amazonaws.com"
_MANAGED = "AwsSolutions::AwsSolutions-IAM4[Policy::arn:<AWS::Partition>:iam::aws:policy/{}]"


@dataclass(frozen=True)
class PodIdentityAccount:
    """A service account of :meth:`MoeRlCluster.service_account`: its IAM ``role`` and what must exist before a pod
    using it starts (``ready``: the ServiceAccount and its Pod Identity association; credentials are injected at
    pod start)."""

    role: iam.Role
    ready: tuple[IDependable, ...]


class MoeRlCluster(Construct):
    """An EKS cluster for GPU node pools, secure by default.

    What sibling constructs use: ``cluster`` (the aws_eks_v2 Cluster), ``cluster_name``, ``cluster_arn``,
    ``cluster_security_group_id`` (on every node interface), ``network_ready`` (node groups depend on it: the VPC
    CNI), ``services_ready`` (Helm charts depend on it: system nodes and CoreDNS), :meth:`service_account` (a
    service account bound to its own IAM role by Pod Identity), :meth:`pod_identity_role`, :meth:`grant_admin`.
    Also ``kubernetes_version`` (the minor, which the cluster services' pins follow), ``secrets_key``, ``addons``
    (name -> CfnAddon), ``system_nodegroup``.
    """

    def __init__(
        self,
        scope: Construct,
        id: str,
        *,
        vpc: ec2.IVpc,
        kubernetes_version: str = DEFAULT_KUBERNETES_VERSION,
        cluster_name: str | None = None,
        public_endpoint_cidrs: Sequence[str] = (),
        admin_role: iam.IRole | None = None,
        secrets_key: kms.IKey | None = None,
        subnets: Sequence[ec2.ISubnet] | None = None,
        system_instance_type: str = "m6i.2xlarge",
        system_nodes: int = 2,
        system_root_volume_gib: int = 100,
        vpc_cni_version: str | None = VPC_CNI_VERSION,
    ) -> None:
        """
        :param vpc: the VPC; the control plane and the kubectl provider use its private subnets.
        :param kubernetes_version: Kubernetes minor version, one of core.cluster.KUBERNETES_VERSIONS; default
            core.cluster.DEFAULT_KUBERNETES_VERSION.
        :param cluster_name: default: a name CloudFormation generates.
        :param public_endpoint_cidrs: default: none, the API endpoint is private only. Giving CIDRs opens a public
            endpoint reachable from those CIDRs only (never 0.0.0.0/0).
        :param admin_role: an IAM role granted cluster admin (access entry); default: none, only the CloudFormation
            deployment role (cluster creator) is admin.
        :param secrets_key: KMS key for envelope encryption of Kubernetes secrets; default a new key with rotation.
        :param subnets: control-plane subnets; default the VPC's private subnets.
        :param system_instance_type: instance type of the untainted system node group that runs CoreDNS, the
            autoscaler, Kueue, KEDA, the orchestrator and the other cluster services (GPU pools are tainted);
            default m6i.2xlarge (8 vCPU, 32 GiB): with the default 2 nodes, one alone holds the controllers (Kueue's
            manager alone requests 0.5 vCPU and 512 MiB) and two runs' orchestrators (2 vCPU and 4 GiB each), so a
            node lost or replaced in an upgrade leaves nothing pending.
        :param system_nodes: size of the system node group (spread over the private subnets); default 2.
        :param system_root_volume_gib: root volume of system nodes, which hold the controllers' and the
            orchestrator's images; default 100.
        :param vpc_cni_version: VPC CNI add-on version, at least core.cluster.VPC_CNI_MIN_VERSION_FOR_EFA_ONLY;
            default core.cluster.VPC_CNI_VERSION; None: the version EKS installs by default for the cluster's Kubernetes version.
        """
        super().__init__(scope, id)
        if kubernetes_version not in _KUBERNETES:
            raise ValueError(f"kubernetes_version: {kubernetes_version!r} is not allowed; "
                             f"{kubernetes_versions_allowed()}")
        endpoint = EndpointConfig(public=bool(public_endpoint_cidrs), public_cidrs=public_endpoint_cidrs)
        if system_nodes < 1:
            raise ValueError(f"system_nodes: {system_nodes} is not allowed; at least 1 (cluster services run there)")
        if vpc_cni_version is not None and _version(vpc_cni_version) < _version(VPC_CNI_MIN_VERSION_FOR_EFA_ONLY):
            raise ValueError(f"vpc_cni_version: {vpc_cni_version!r} is not allowed; at least "
                             f"v{VPC_CNI_MIN_VERSION_FOR_EFA_ONLY} (efa-only interfaces), e.g. v1.20.1-eksbuild.3")
        if not 20 <= system_root_volume_gib <= 16384:
            raise ValueError(f"system_root_volume_gib: {system_root_volume_gib} is not allowed; between 20 and 16384")
        private = list(subnets) if subnets is not None else list(vpc.private_subnets)
        access = (eks.EndpointAccess.PUBLIC_AND_PRIVATE.only_from(*endpoint.public_cidrs) if endpoint.public
                  else eks.EndpointAccess.PRIVATE)
        self.secrets_key = secrets_key or kms.Key(
            self, "SecretsKey", enable_key_rotation=True, removal_policy=RemovalPolicy.DESTROY,
            description="EKS envelope encryption of Kubernetes secrets")
        kubectl_sg = ec2.SecurityGroup(self, "KubectlSecurityGroup", vpc=vpc, allow_all_outbound=True,
                                       description="kubectl provider Lambda: reaches the private API endpoint")
        self.kubernetes_version = kubernetes_version
        version, layer = _KUBERNETES[kubernetes_version]
        self.cluster = eks.Cluster(
            self, "Cluster",
            version=version,
            cluster_name=cluster_name,
            vpc=vpc,
            vpc_subnets=[ec2.SubnetSelection(subnets=private)],
            endpoint_access=access,
            cluster_logging=list(ALL_LOG_TYPES),
            secrets_encryption_key=self.secrets_key,
            # Managed node groups only: no Auto Mode, no default capacity.
            default_capacity_type=eks.DefaultCapacityType.NODEGROUP,
            default_capacity=0,
            # vpc-cni, coredns and kube-proxy are installed below as managed add-ons we configure and upgrade.
            bootstrap_self_managed_addons=False,
            kubectl_provider_options=eks.KubectlProviderOptions(
                kubectl_layer=layer(self, "KubectlLayer"),
                private_subnets=private,
                security_groups=[kubectl_sg],
            ),
        )
        self.cluster.cluster_security_group.add_ingress_rule(
            kubectl_sg, ec2.Port.tcp(443), "kubectl provider to the API endpoint")
        self.cluster_name = self.cluster.cluster_name
        self.cluster_arn = self.cluster.cluster_arn
        self.cluster_security_group_id = self.cluster.cluster_security_group_id
        if admin_role is not None:
            self.grant_admin("Admin", admin_role)
        self.addons: dict[str, eks.CfnAddon] = {}
        # The lazily created Pod Identity agent add-on; service accounts bound by Pod Identity wait for it.
        self.pod_identity_agent = self.cluster.eks_pod_identity_agent
        cni_role = self.pod_identity_role(
            "VpcCniRole", managed_policies=[iam.ManagedPolicy.from_aws_managed_policy_name(CNI_POLICY)])
        _acknowledge(cni_role, _MANAGED.format(CNI_POLICY),
                     "The VPC CNI's own AWS managed policy (ENIs and IPs for pods), given to its aws-node service "
                     "account alone by Pod Identity instead of to every node.")
        self.network_ready: eks.CfnAddon = self._add_addon(
            "vpc-cni", version=vpc_cni_version, pod_identities={"aws-node": cni_role},
            configuration={"enableNetworkPolicy": "true", "env": {"ENABLE_PREFIX_DELEGATION": "false"}})
        self._add_addon("kube-proxy")
        system_role = node_role(self, "SystemNodeRole")
        self.system_nodegroup = self.cluster.add_nodegroup_capacity(
            "System", instance_types=[ec2.InstanceType(system_instance_type)],
            ami_type=eks.NodegroupAmiType.AL2023_X86_64_STANDARD, node_role=system_role,
            disk_size=system_root_volume_gib,
            min_size=system_nodes, desired_size=system_nodes, max_size=system_nodes + 1,
            subnets=ec2.SubnetSelection(subnets=private), labels={ROLE_LABEL: "system"})
        # Nodes become Ready only with the CNI and kube-proxy in place; add-ons with pods need a node to run on.
        self.system_nodegroup.node.add_dependency(self.network_ready, self.addons["kube-proxy"])
        coredns = self._add_addon("coredns")
        coredns.node.add_dependency(self.system_nodegroup)
        # Helm charts and their custom resources go in only once controllers can be scheduled and resolve names.
        self.services_ready: list[IDependable] = [self.system_nodegroup, coredns]
        self._add_addon("aws-fsx-csi-driver").node.add_dependency(self.system_nodegroup)
        cloudwatch_role = self.pod_identity_role(
            "CloudWatchAgentRole",
            managed_policies=[iam.ManagedPolicy.from_aws_managed_policy_name(CLOUDWATCH_AGENT_POLICY)])
        _acknowledge(cloudwatch_role, _MANAGED.format(CLOUDWATCH_AGENT_POLICY),
                     "The CloudWatch observability add-on documents this AWS managed policy for its agent; it only "
                     "writes metrics and logs and AWS keeps it current with the agent.")
        self._add_addon("amazon-cloudwatch-observability", pod_identities={"cloudwatch-agent": cloudwatch_role}
                        ).node.add_dependency(self.system_nodegroup)
        self._acknowledge_construct_library_findings()

    def _acknowledge_construct_library_findings(self) -> None:
        """cdk-nag findings on roles and functions aws_eks_v2 creates for us, each with why it is acceptable. They
        are found through the public ``kubectl_provider`` and by resource type, never by construct path."""
        _acknowledge(self.cluster.role, _MANAGED.format("AmazonEKSClusterPolicy"),
                     "The EKS service role policy EKS requires for the control plane; AWS maintains it.")
        provider = self.cluster.kubectl_provider
        for policy in ("service-role/AWSLambdaBasicExecutionRole", "service-role/AWSLambdaVPCAccessExecutionRole",
                       "AmazonEC2ContainerRegistryReadOnly"):
            _acknowledge(provider, _MANAGED.format(policy),
                         "Role of the kubectl provider Lambda that aws_eks_v2 creates (logs, VPC interfaces to reach the "
                         "private endpoint, pulling Helm charts from ECR); the Helm charts the cluster needs require it.")
        logical_id = Stack.of(self).get_logical_id
        for condition in _children(provider, CfnCondition):
            ecr_public = ('{"Fn::If":["%s",{"Fn::Join":["",["arn:",{"Ref":"AWS::Partition"},'
                          '":iam::aws:policy/AmazonElasticContainerRegistryPublicReadOnly"]]},{"Ref":"AWS::NoValue"}]}'
                          ) % logical_id(condition)
            _acknowledge(provider, f"AwsSolutions::AwsSolutions-IAM4[Policy::{ecr_public}]",
                         "Read-only ECR Public access of the kubectl provider (charts hosted on ECR Public), added by "
                         "aws_eks_v2.")
        for function in _children(provider, lambda_.CfnFunction):
            _acknowledge(provider, f"AwsSolutions::AwsSolutions-IAM5[Resource::<{logical_id(function)}.Arn>:*]",
                         "The provider framework may invoke any version of its own handler function, nothing else.")
        _acknowledge(provider, "AwsSolutions::AwsSolutions-L1",
                     "aws_eks_v2 pins the kubectl provider's runtime to the one its kubectl/helm layer is built for.")

    def pod_identity_role(self, id: str, **role_props) -> iam.Role:
        """An IAM role that EKS Pod Identity may assume for pods of this cluster only (:func:`pod_identity_role`)."""
        return pod_identity_role(self, id, cluster=self.cluster, **role_props)

    def service_account(self, id: str, *, name: str, namespace: str, labels: Mapping[str, str] | None = None,
                        depends_on: Sequence[IDependable] = ()) -> "PodIdentityAccount":
        """A service account bound by Pod Identity to a new IAM role that only this cluster may assume
        (:func:`service_account`); it also waits for the cluster's Pod Identity agent add-on."""
        return service_account(self, id, cluster=self.cluster, name=name, namespace=namespace, labels=labels,
                               depends_on=[self.pod_identity_agent, *depends_on])

    def grant_admin(self, id: str, principal: iam.IRole) -> eks.AccessEntry:
        """Give ``principal`` cluster-wide admin through an EKS access entry."""
        return eks.AccessEntry(
            self, id, cluster=self.cluster, principal=principal.role_arn,
            access_policies=[eks.AccessPolicy.from_access_policy_name(
                "AmazonEKSClusterAdminPolicy", access_scope_type=eks.AccessScopeType.CLUSTER)])

    def _add_addon(self, name: str, *, version: str | None = None, configuration: dict | None = None,
                   pod_identities: dict[str, iam.IRole] | None = None) -> eks.CfnAddon:
        # The L1 because the L2 Addon has no Pod Identity associations.
        addon = eks.CfnAddon(
            self, pascal(name),
            addon_name=name,
            cluster_name=self.cluster.cluster_name,
            addon_version=version,
            configuration_values=json.dumps(configuration) if configuration else None,
            resolve_conflicts="OVERWRITE",
            pod_identity_associations=[
                eks.CfnAddon.PodIdentityAssociationProperty(service_account=sa, role_arn=role.role_arn)
                for sa, role in (pod_identities or {}).items()] or None,
        )
        if pod_identities:
            addon.node.add_dependency(self.pod_identity_agent)
        self.addons[name] = addon
        return addon


def pod_identity_role(scope: Construct, id: str, *, cluster: eks.ICluster, **role_props) -> iam.Role:
    """An IAM role that EKS Pod Identity may assume for pods of ``cluster`` only: the trust policy names this
    account and that cluster (``aws:SourceAccount``, ``aws:SourceArn``), so no other cluster can use it."""
    stack = Stack.of(scope)
    principal = iam.ServicePrincipal(POD_IDENTITY_PRINCIPAL).with_conditions({
        "StringEquals": {"aws:SourceAccount": stack.account},
        "ArnEquals": {"aws:SourceArn": cluster.cluster_arn}})
    return iam.Role(scope, id, assumed_by=iam.SessionTagsPrincipal(principal), **role_props)


def service_account(scope: Construct, id: str, *, cluster: eks.ICluster, name: str, namespace: str,
                    labels: Mapping[str, str] | None = None, depends_on: Sequence[IDependable] = ()
                    ) -> PodIdentityAccount:
    """A Kubernetes service account on ``cluster`` (which needs a kubectl provider and a running Pod Identity
    agent) bound by Pod Identity to a new IAM role that only that cluster may assume. ``depends_on``: what the
    service account needs first (its namespace, the agent add-on)."""
    role = pod_identity_role(scope, f"{id}Role", cluster=cluster)
    manifest = cluster.add_manifest(f"{id}Manifest", {
        "apiVersion": "v1", "kind": "ServiceAccount",
        "metadata": {"name": name, "namespace": namespace, **({"labels": dict(labels)} if labels else {})}})
    association = eks.CfnPodIdentityAssociation(
        scope, f"{id}PodIdentity", cluster_name=cluster.cluster_name, namespace=namespace,
        service_account=name, role_arn=role.role_arn)
    for dependency in depends_on:
        manifest.node.add_dependency(dependency)
        association.node.add_dependency(dependency)
    return PodIdentityAccount(role=role, ready=(manifest, association))


def _version(addon_version: str) -> tuple[int, ...]:
    """``v1.20.1-eksbuild.3`` -> (1, 20, 1)."""
    match = re.fullmatch(r"v?(\d+)\.(\d+)\.(\d+)(-eksbuild\.\d+)?", addon_version)
    if not match:
        raise ValueError(f"vpc_cni_version: {addon_version!r} is not allowed; an add-on version like v1.20.1-eksbuild.3")
    return tuple(int(g) for g in match.groups()[:3])


def _children(scope: Construct, kind: type) -> list:
    return [c for c in scope.node.find_all() if isinstance(c, kind)]


def _acknowledge(scope: Construct, finding: str, reason: str) -> None:
    Validations.of(scope).acknowledge(Acknowledgment(id=finding, reason=reason))
