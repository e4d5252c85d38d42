"""The IAM role of managed node groups (the system group and every EFA pool)."""
from __future__ import annotations

from aws_cdk import Acknowledgment, Validations, aws_iam as iam
from constructs import Construct

# The AWS managed policies EKS documents for node roles, less AmazonEKS_CNI_Policy: the VPC CNI (aws-node) gets that
# through Pod Identity (MoeRlCluster), so pods that reach the instance metadata service find no network-changing
# credentials on the node.
NODE_POLICIES = ("AmazonEKSWorkerNodePolicy", "AmazonEC2ContainerRegistryPullOnly")


def node_role(scope: Construct, id: str) -> iam.Role:
    """A role EC2 instances of a managed node group assume, with NODE_POLICIES."""
    role = iam.Role(scope, id, assumed_by=iam.ServicePrincipal("ec2.amazonaws.com"),
                    managed_policies=[iam.ManagedPolicy.from_aws_managed_policy_name(p) for p in NODE_POLICIES])
    for policy in NODE_POLICIES:
        Validations.of(role).acknowledge(Acknowledgment(
            id=f"AwsSolutions::AwsSolutions-IAM4[Policy::arn:<AWS::Partition>:iam::aws:policy/{policy}]",
            reason=f"{policy} is the AWS managed policy EKS documents for node roles; AWS keeps it in step "
                   "with what the kubelet and image pulls need."))
    return role
