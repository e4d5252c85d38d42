"""The VPC GPU nodes live in: private subnets, flow logs, and the endpoints nodes need to pull images and talk to AWS."""
from __future__ import annotations

import ipaddress
from collections.abc import Sequence

from aws_cdk import (Acknowledgment, RemovalPolicy, Stack, Validations, aws_ec2 as ec2, aws_iam as iam, aws_kms as kms,
                     aws_logs as logs)
from constructs import Construct

from moe_rl_eks.core.cluster import SUBNET_MASKS, vpc_fits_subnets

_SUBNET_TYPES = {"public": ec2.SubnetType.PUBLIC, "private": ec2.SubnetType.PRIVATE_WITH_EGRESS,
                 "scraper": ec2.SubnetType.PRIVATE_ISOLATED}
# Interface endpoints a GPU node uses on every boot and every image pull; S3 (image layers) is a gateway endpoint.
INTERFACE_ENDPOINTS = {
    "EcrApi": ec2.InterfaceVpcEndpointAwsService.ECR,
    "EcrDocker": ec2.InterfaceVpcEndpointAwsService.ECR_DOCKER,
    "Sts": ec2.InterfaceVpcEndpointAwsService.STS,
    "Logs": ec2.InterfaceVpcEndpointAwsService.CLOUDWATCH_LOGS,
}


class MoeRlNetwork(Construct):
    """A VPC with public subnets (NAT only) and private subnets for nodes in every zone given.

    Attributes: ``vpc``, ``private_subnets`` (one per zone), ``scraper_subnets`` (one small isolated subnet per
    zone for the managed Prometheus scraper) and :meth:`private_subnet` (the one subnet of a zone,
    which is what an :class:`~moe_rl_eks.infra.EfaNodePool` takes). The enclosing stack must report the same
    zones from ``Stack.availability_zones`` so that synthesis needs no context lookup.
    """

    def __init__(
        self,
        scope: Construct,
        id: str,
        *,
        availability_zones: Sequence[str],
        cidr: str = "10.0.0.0/16",
        nat_gateways: int = 1,
        flow_log_retention: logs.RetentionDays = logs.RetentionDays.THREE_MONTHS,
        encryption_key: kms.IKey | None = None,
    ) -> None:
        """
        :param availability_zones: zones of the VPC (at least two, for EKS), including the zone of the GPU capacity.
        :param cidr: VPC CIDR; default 10.0.0.0/16. Private subnets get /19s: room for one IP per pod (VPC CNI).
        :param nat_gateways: NAT gateways for egress (Helm repositories, container registries other than ECR);
            default 1, which is cheapest; use one per zone where egress must survive a zone failure.
        :param flow_log_retention: retention of the VPC flow log group; default three months.
        :param encryption_key: KMS key for the flow log group; default a new key with rotation on.
        """
        super().__init__(scope, id)
        if len(set(availability_zones)) < 2:
            raise ValueError(f"availability_zones: {list(availability_zones)!r} is not allowed; EKS needs two distinct zones")
        try:
            network = ipaddress.ip_network(cidr)
        except ValueError:
            raise ValueError(f"cidr: {cidr!r} is not allowed; a CIDR like 10.0.0.0/16") from None
        if not network.is_private or not vpc_fits_subnets(network.prefixlen, len(availability_zones)):
            raise ValueError(f"cidr: {cidr!r} is not allowed; a private CIDR large enough for one /24 public, /19 "
                             f"private and /28 scraper subnet per zone (a /16)")
        if not 1 <= nat_gateways <= len(availability_zones):
            raise ValueError(f"nat_gateways: {nat_gateways} is not allowed; between 1 and {len(availability_zones)}")
        self.encryption_key = encryption_key or kms.Key(
            self, "FlowLogKey", enable_key_rotation=True, removal_policy=RemovalPolicy.DESTROY,
            description="VPC flow logs")
        self.vpc = ec2.Vpc(
            self, "Vpc",
            ip_addresses=ec2.IpAddresses.cidr(cidr),
            availability_zones=list(availability_zones),
            nat_gateways=nat_gateways,
            # Public: NAT gateways only. Private: nodes and pods. Scraper: the managed Prometheus scraper's interfaces
            # alone, so pods admit metrics scrapes from these CIDRs only (their ports also serve the weight-load
            # endpoint); isolated, the scraper needs no egress. Sizes in core.cluster.SUBNET_MASKS.
            subnet_configuration=[
                ec2.SubnetConfiguration(name=name, subnet_type=_SUBNET_TYPES[name], cidr_mask=mask,
                                        map_public_ip_on_launch=False if name == "public" else None)
                for name, mask in SUBNET_MASKS],
            restrict_default_security_group=True,
        )
        flow_log_group = logs.LogGroup(
            self, "FlowLogGroup", retention=flow_log_retention, encryption_key=self.encryption_key,
            removal_policy=RemovalPolicy.DESTROY)
        # CloudWatch Logs encrypts with the key on the group's behalf.
        self.encryption_key.grant_encrypt_decrypt(iam.ServicePrincipal(f"logs.{Stack.of(self).region}.amazonaws.com"))
        self.vpc.add_flow_log("FlowLog", destination=ec2.FlowLogDestination.to_cloud_watch_logs(flow_log_group),
                              traffic_type=ec2.FlowLogTrafficType.ALL,
                              max_aggregation_interval=ec2.FlowLogMaxAggregationInterval.ONE_MINUTE)
        self.vpc.add_gateway_endpoint("S3", service=ec2.GatewayVpcEndpointAwsService.S3)
        for name, service in INTERFACE_ENDPOINTS.items():
            endpoint = self.vpc.add_interface_endpoint(
                name, service=service, private_dns_enabled=True,
                subnets=ec2.SubnetSelection(subnet_type=ec2.SubnetType.PRIVATE_WITH_EGRESS))
            Validations.of(endpoint).acknowledge(Acknowledgment(
                id="AwsSolutions::AwsSolutions-EC23",
                reason="The endpoint's security group admits HTTPS from the VPC's own CIDR only; cdk-nag cannot "
                       "evaluate that CIDR because it is a reference to the VPC resource."))
        self.private_subnets: list[ec2.ISubnet] = list(self.vpc.private_subnets)
        self.scraper_subnets: list[ec2.ISubnet] = list(self.vpc.isolated_subnets)

    def private_subnet(self, availability_zone: str) -> ec2.ISubnet:
        """The private subnet of ``availability_zone``: the single subnet an EFA pool must use."""
        for subnet in self.private_subnets:
            if subnet.availability_zone == availability_zone:
                return subnet
        zones = [s.availability_zone for s in self.private_subnets]
        raise ValueError(f"availability_zone: {availability_zone!r} is not allowed; the VPC has private subnets in {zones}")

