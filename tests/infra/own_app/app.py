"""A platform team's own CDK app, run by tests/infra/test_infra_own_app.py against the installed wheel: its own VPC
and stacks, no cdk.json of this project. One stack builds a new cluster with our constructs; another adds an EFA
pool and the cluster services (device plugins, Kueue, KEDA, JobSet, the autoscaler) to a cluster it imports (with
its network and an existing kubectl provider), under queue and PriorityClass names of its own."""
import json
import sys

import aws_cdk as cdk
from aws_cdk import aws_ec2 as ec2, aws_eks_v2 as eks, aws_iam as iam

import moe_rl_eks.infra
from moe_rl_eks.core.environment import ClusterNamesConfig, NodePoolConfig
from moe_rl_eks.infra import ClusterServices, DevicePlugins, EfaNodePool, MoeRlCluster, add_checks

ENV = cdk.Environment(account="444444444444", region="us-west-2")
ZONES = ["us-west-2a", "us-west-2b"]


class NewClusterStack(cdk.Stack):
    @property
    def availability_zones(self):  # explicit zones: synthesis looks nothing up
        return ZONES

    def __init__(self, scope, id, **kwargs):
        super().__init__(scope, id, env=ENV, **kwargs)
        vpc = ec2.Vpc(self, "TeamVpc", availability_zones=ZONES, nat_gateways=1,
                      restrict_default_security_group=True)
        vpc.add_flow_log("FlowLog")
        admin = iam.Role.from_role_arn(self, "Admin", "arn:aws:iam::444444444444:role/TeamAdmin", mutable=False)
        cluster = MoeRlCluster(self, "Cluster", vpc=vpc, admin_role=admin)
        trainers = EfaNodePool(
            self, "Trainers", cluster=cluster, subnet=vpc.private_subnets[0], role="trainer",
            pool=NodePoolConfig(instance_type="p5en.48xlarge", capacity_type=eks.CapacityType.CAPACITY_BLOCK,
                                capacity_reservation_id="cr-0123456789abcdef0", max_size=2,
                                taint_effect=eks.TaintEffect.NO_EXECUTE),
            extra_labels={"team": "research"})
        DevicePlugins(self, "Devices", cluster=cluster.cluster, pools=[trainers], depends_on=cluster.services_ready)


class ImportedClusterStack(cdk.Stack):
    @property
    def availability_zones(self):
        return ZONES

    def __init__(self, scope, id, **kwargs):
        super().__init__(scope, id, env=ENV, **kwargs)
        vpc = ec2.Vpc.from_vpc_attributes(self, "TheirVpc", vpc_id="vpc-0123456789abcdef0", availability_zones=ZONES,
                                          private_subnet_ids=["subnet-0aaaaaaaaaaaaaaaa", "subnet-0bbbbbbbbbbbbbbbb"])
        provider = eks.KubectlProvider.from_kubectl_provider_attributes(
            self, "TheirKubectl", service_token="arn:aws:lambda:us-west-2:444444444444:function:their-kubectl",
            role=iam.Role.from_role_arn(self, "TheirKubectlRole", "arn:aws:iam::444444444444:role/their-kubectl"))
        cluster = eks.Cluster.from_cluster_attributes(
            self, "Theirs", cluster_name="their-cluster", vpc=vpc, cluster_security_group_id="sg-0123456789abcdef0",
            kubectl_provider=provider)
        rollout = EfaNodePool(self, "Rollout", cluster=cluster, subnet=vpc.private_subnets[1], role="rollout",
                              pool=NodePoolConfig(instance_type="p5.48xlarge", max_size=4))
        ClusterServices(self, "Services", cluster=cluster, pools={"rollout": rollout}, run_namespace="research",
                        kubernetes_version="1.36", names=ClusterNamesConfig(rollout_queue="research-rollout",
                                                 rollout_priority_class="research-rollout"))


app = cdk.App(outdir=sys.argv[1])
add_checks(app)  # cdk-nag AwsSolutions and the EKS guardrails: any finding fails synthesis
NewClusterStack(app, "TeamNewCluster")
ImportedClusterStack(app, "TeamImportedCluster")
app.synth()
print(json.dumps({"moe_rl_eks.infra": moe_rl_eks.infra.__file__}))
