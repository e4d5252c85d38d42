"""The EKS control plane (aws_eks_v2): private endpoint, every control-plane log type, KMS envelope encryption of
secrets, access entries, the managed add-ons GPU nodes need, and the kubectl provider that installs Helm charts."""
from __future__ import annotations

import json
from collections.abc import Sequence

from aws_cdk import (Acknowledgment, RemovalPolicy, Stack, Validations, aws_ec2 as ec2, aws_eks_v2 as eks,
                     aws_iam as iam, aws_kms as kms)
from aws_cdk.lambda_layer_kubectl_v33 import KubectlV33Layer
from constructs import Construct

from moe_rl_eks.core.labels import ROLE_LABEL

from ._ids import pascal

ALL_LOG_TYPES = (
    eks.ClusterLoggingTypes.API,
    eks.ClusterLoggingTypes.AUDIT,
    eks.ClusterLoggingTypes.AUTHENTICATOR,
    eks.ClusterLoggingTypes.CONTROLLER_MANAGER,
    eks.ClusterLoggingTypes.SCHEDULER,
)
# The kubectl Lambda layer ships kubectl/helm for one Kubernetes minor version.
_KUBERNETES_VERSIONS = {"1.33": eks.KubernetesVersion.V1_33}
# Pinned, not "latest": efa-only interfaces (no IP address) need a VPC CNI that skips them when it assigns pod IPs,
# and network-policy enforcement runs in the same add-on. This is the version the EKS user guide lists for 1.33.
VPC_CNI_VERSION = "v1.20.1-eksbuild.3"
# The CloudWatch agent needs these (AWS managed) to publish Container Insights metrics and logs.
CLOUDWATCH_AGENT_POLICY = "CloudWatchAgentServerPolicy"


class MoeRlCluster(Construct):
    """An EKS cluster for GPU node pools, secure by default.

    Attributes: ``cluster`` (the aws_eks_v2 Cluster), ``cluster_name``, ``cluster_security_group_id`` (put it on
    every node interface), ``secrets_key``, ``addons`` (name -> CfnAddon).
    Methods: :meth:`grant_admin` gives an IAM principal cluster-admin through an access entry.
    """

    def __init__(
        self,
        scope: Construct,
        id: str,
        *,
        vpc: ec2.IVpc,
        kubernetes_version: str = "1.33",
        cluster_name: str | None = None,
        public_endpoint_cidrs: Sequence[str] = (),
        admin_role_arn: str | None = None,
        subnets: Sequence[ec2.ISubnet] | None = None,
        system_instance_type: str = "m6i.xlarge",
        system_nodes: int = 2,
    ) -> None:
        """
        :param vpc: the VPC; the control plane and the kubectl provider use its private subnets.
        :param kubernetes_version: Kubernetes minor version; default 1.33 (the version of our kubectl layer).
        :param cluster_name: default: a name CloudFormation generates.
        :param public_endpoint_cidrs: default: none, the API endpoint is private only. Giving CIDRs opens a public
            endpoint reachable from those CIDRs only (never 0.0.0.0/0).
        :param admin_role_arn: an IAM role granted cluster admin (access entry); default: none, only the
            CloudFormation deployment role (cluster creator) is admin.
        :param subnets: control-plane subnets; default the VPC's private subnets.
        :param system_instance_type: instance type of the untainted system node group that runs CoreDNS, the
            autoscaler, Kueue, KEDA and the other cluster services (GPU pools are tainted); default m6i.xlarge.
        :param system_nodes: size of the system node group (spread over the private subnets); default 2.
        """
        super().__init__(scope, id)
        if kubernetes_version not in _KUBERNETES_VERSIONS:
            raise ValueError(f"kubernetes_version: {kubernetes_version!r} is not allowed; "
                             f"supported: {', '.join(_KUBERNETES_VERSIONS)}")
        for cidr in public_endpoint_cidrs:
            if cidr.endswith("/0"):
                raise ValueError(f"public_endpoint_cidrs: {cidr!r} is not allowed; the whole internet is not an allow-list")
        if system_nodes < 1:
            raise ValueError(f"system_nodes: {system_nodes} is not allowed; at least 1 (cluster services run there)")
        private = list(subnets) if subnets is not None else list(vpc.private_subnets)
        endpoint = (eks.EndpointAccess.PUBLIC_AND_PRIVATE.only_from(*public_endpoint_cidrs) if public_endpoint_cidrs
                    else eks.EndpointAccess.PRIVATE)
        self.secrets_key = kms.Key(self, "SecretsKey", enable_key_rotation=True, removal_policy=RemovalPolicy.DESTROY,
                                   description="EKS envelope encryption of Kubernetes secrets")
        kubectl_sg = ec2.SecurityGroup(self, "KubectlSecurityGroup", vpc=vpc, allow_all_outbound=True,
                                       description="kubectl provider Lambda: reaches the private API endpoint")
        self.cluster = eks.Cluster(
            self, "Cluster",
            version=_KUBERNETES_VERSIONS[kubernetes_version],
            cluster_name=cluster_name,
            vpc=vpc,
            vpc_subnets=[ec2.SubnetSelection(subnets=private)],
            endpoint_access=endpoint,
            cluster_logging=list(ALL_LOG_TYPES),
            secrets_encryption_key=self.secrets_key,
            # Managed node groups only: no Auto Mode, no default capacity.
            default_capacity_type=eks.DefaultCapacityType.NODEGROUP,
            default_capacity=0,
            # vpc-cni, coredns and kube-proxy are installed below as managed add-ons we configure and upgrade.
            bootstrap_self_managed_addons=False,
            kubectl_provider_options=eks.KubectlProviderOptions(
                kubectl_layer=KubectlV33Layer(self, "KubectlLayer"),
                private_subnets=private,
                security_groups=[kubectl_sg],
            ),
        )
        self.cluster.cluster_security_group.add_ingress_rule(
            kubectl_sg, ec2.Port.tcp(443), "kubectl provider to the API endpoint")
        self.cluster_name = self.cluster.cluster_name
        self.cluster_security_group_id = self.cluster.cluster_security_group_id
        if admin_role_arn is not None:
            self.grant_admin("Admin", admin_role_arn)
        self.addons: dict[str, eks.CfnAddon] = {}
        self._add_addon("vpc-cni", version=VPC_CNI_VERSION,
                        configuration={"enableNetworkPolicy": "true", "env": {"ENABLE_PREFIX_DELEGATION": "false"}})
        self._add_addon("kube-proxy")
        # The lazily created Pod Identity agent add-on; service accounts bound by Pod Identity reuse it.
        self.pod_identity_agent = self.cluster.eks_pod_identity_agent
        self.system_nodegroup = self.cluster.add_nodegroup_capacity(
            "System", instance_types=[ec2.InstanceType(system_instance_type)],
            ami_type=eks.NodegroupAmiType.AL2023_X86_64_STANDARD,
            min_size=system_nodes, desired_size=system_nodes, max_size=system_nodes + 1,
            subnets=ec2.SubnetSelection(subnets=private), labels={ROLE_LABEL: "system"})
        # Nodes become Ready only with the CNI and kube-proxy in place; add-ons with pods need a node to run on.
        self.system_nodegroup.node.add_dependency(self.addons["vpc-cni"], self.addons["kube-proxy"])
        self._add_addon("coredns").node.add_dependency(self.system_nodegroup)
        self._add_addon("aws-fsx-csi-driver").node.add_dependency(self.system_nodegroup)
        cloudwatch_role = self.pod_identity_role(
            "CloudWatchAgentRole", managed_policies=[iam.ManagedPolicy.from_aws_managed_policy_name(CLOUDWATCH_AGENT_POLICY)])
        _acknowledge(cloudwatch_role,
                     f"AwsSolutions::AwsSolutions-IAM4[Policy::arn:<AWS::Partition>:iam::aws:policy/{CLOUDWATCH_AGENT_POLICY}]",
                     "The CloudWatch observability add-on documents this AWS managed policy for its agent; it only "
                     "writes metrics and logs and AWS keeps it current with the agent.")
        self._add_addon("amazon-cloudwatch-observability", pod_identities={"cloudwatch-agent": cloudwatch_role}
                        ).node.add_dependency(self.system_nodegroup)
        self._acknowledge_construct_library_findings()

    def _acknowledge_construct_library_findings(self) -> None:
        """cdk-nag findings on roles and functions aws_eks_v2 creates for us, each with why it is acceptable."""
        managed = "AwsSolutions::AwsSolutions-IAM4[Policy::arn:<AWS::Partition>:iam::aws:policy/{}]"
        _acknowledge(self.cluster.role, managed.format("AmazonEKSClusterPolicy"),
                     "The EKS service role policy EKS requires for the control plane; AWS maintains it.")
        for policy in ("AmazonEKSWorkerNodePolicy", "AmazonEC2ContainerRegistryReadOnly", "AmazonEKS_CNI_Policy"):
            _acknowledge(self.system_nodegroup.role, managed.format(policy),
                         f"{policy} is the AWS managed policy EKS documents for node roles of managed node groups.")
        provider = self.cluster.node.find_child("KubectlProvider")
        handler = provider.node.find_child("Handler")
        for policy in ("service-role/AWSLambdaBasicExecutionRole", "service-role/AWSLambdaVPCAccessExecutionRole",
                       "AmazonEC2ContainerRegistryReadOnly"):
            _acknowledge(provider, managed.format(policy),
                         "Role of the kubectl provider Lambda that aws_eks_v2 creates (logs, VPC interfaces to reach the "
                         "private endpoint, pulling Helm charts from ECR); the Helm charts the cluster needs require it.")
        logical_id = Stack.of(self).get_logical_id
        ecr_public = ('{"Fn::If":["%s",{"Fn::Join":["",["arn:",{"Ref":"AWS::Partition"},'
                      '":iam::aws:policy/AmazonElasticContainerRegistryPublicReadOnly"]]},{"Ref":"AWS::NoValue"}]}'
                      ) % logical_id(handler.node.find_child("HasEcrPublic"))
        _acknowledge(provider, f"AwsSolutions::AwsSolutions-IAM4[Policy::{ecr_public}]",
                     "Read-only ECR Public access of the kubectl provider (charts hosted on ECR Public), added by aws_eks_v2.")
        _acknowledge(provider, f"AwsSolutions::AwsSolutions-IAM5[Resource::<{logical_id(handler.node.default_child)}.Arn>:*]",
                     "The provider framework may invoke any version of its own handler function, nothing else.")
        _acknowledge(provider, "AwsSolutions::AwsSolutions-L1",
                     "aws_eks_v2 pins the kubectl provider's runtime to the one its kubectl/helm layer is built for.")

    def pod_identity_role(self, id: str, **role_props) -> iam.Role:
        """An IAM role that EKS Pod Identity may assume for pods of this cluster."""
        role = iam.Role(self, id, assumed_by=iam.ServicePrincipal("pods.eks.amazonaws.com"), **role_props)
        role.assume_role_policy.add_statements(iam.PolicyStatement(
            actions=["sts:TagSession"], principals=[iam.ServicePrincipal("pods.eks.amazonaws.com")]))
        return role

    def grant_admin(self, id: str, principal_arn: str) -> eks.AccessEntry:
        """Give ``principal_arn`` cluster-wide admin through an EKS access entry."""
        return eks.AccessEntry(
            self, id, cluster=self.cluster, principal=principal_arn,
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


def _acknowledge(scope: Construct, finding: str, reason: str) -> None:
    Validations.of(scope).acknowledge(Acknowledgment(id=finding, reason=reason))
