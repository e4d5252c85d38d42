"""The constructs used on their own: a platform team's stack, early validation of props, the checks' wiring."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import aws_cdk as cdk
import pytest
from aws_cdk import aws_ec2 as ec2, aws_eks_v2 as eks, aws_s3 as s3
from aws_cdk.assertions import Match, Template

from infra_helpers import REPO
from moe_rl_eks.core.environment import EnvironmentConfig, NodePoolConfig, load_environments
from moe_rl_eks.core.schema import ConfigError
from moe_rl_eks.infra import ClusterServices, DevicePlugins, EfaNodePool, MoeRlCluster, MoeRlStack, add_checks
from moe_rl_eks.infra.checks import EksGuardrails
from moe_rl_eks.infra.node_pool import network_interfaces, user_data

ENV = cdk.Environment(account="333333333333", region="us-west-2")


class PlatformStack(cdk.Stack):
    """A platform team's own stack: their VPC, our cluster construct and one p5 pool."""

    def __init__(self, scope, id, **kwargs):
        super().__init__(scope, id, env=ENV, **kwargs)
        vpc = ec2.Vpc(self, "TeamVpc", availability_zones=self.availability_zones, nat_gateways=1)
        self.cluster = MoeRlCluster(self, "Cluster", vpc=vpc, public_endpoint_cidrs=["198.51.100.0/24"])
        self.pool = EfaNodePool(self, "P5", cluster=self.cluster, subnet=vpc.private_subnets[0], role="trainer",
                                pool=NodePoolConfig(instance_type="p5.48xlarge", max_size=4))

    @property
    def availability_zones(self):
        return ["us-west-2a", "us-west-2b"]


@pytest.fixture(scope="module")
def platform():
    app = cdk.App()
    stack = PlatformStack(app, "Platform")
    return stack, Template.from_stack(stack)


def test_platform_team_stack_imports_the_cluster_and_an_efa_pool(platform):
    stack, template = platform
    template.has_resource_properties("AWS::EKS::Cluster", {"ResourcesVpcConfig": Match.object_like(
        {"EndpointPublicAccess": True, "PublicAccessCidrs": ["198.51.100.0/24"]})})
    template.has_resource_properties("AWS::EKS::Nodegroup", {"InstanceTypes": ["p5.48xlarge"], "AmiType": "AL2023_x86_64_NVIDIA"})
    assert stack.pool.efa_interfaces == 32 and stack.pool.placement_group is not None
    template.has_resource_properties("AWS::EC2::LaunchTemplate", {"LaunchTemplateData": Match.object_like({
        "NetworkInterfaces": Match.array_with([Match.object_like({"NetworkCardIndex": 31, "DeviceIndex": 1,
                                                                  "InterfaceType": "efa-only"})])})})


def test_efa_pool_waits_for_the_clusters_vpc_cni_without_the_app_wiring_it(platform):
    stack, template = platform
    (cni,) = [k for k, r in template.find_resources("AWS::EKS::Addon").items()
              if r["Properties"]["AddonName"] == "vpc-cni"]
    (nodegroup,) = [r for r in template.find_resources("AWS::EKS::Nodegroup").values()
                    if r["Properties"]["Labels"]["moe-rl/role"] == "trainer"]
    assert cni in nodegroup["DependsOn"]


@pytest.mark.parametrize("props, fragment", [
    (dict(instance_type="p9.48xlarge"), "instance_type: 'p9.48xlarge' is not allowed; supported: p4d"),
    (dict(instance_type="g5.xlarge"), "efa: True is not allowed; g5.xlarge has no EFA"),
    (dict(instance_type="p5en.48xlarge", capacity_type=eks.CapacityType.CAPACITY_BLOCK),
     "capacity_reservation_id: None is not allowed; required when capacity_type is CAPACITY_BLOCK"),
    (dict(instance_type="p5.48xlarge", capacity_type="RESERVED"), "capacity_type: 'RESERVED' is not allowed"),
    (dict(instance_type="p5.48xlarge", min_size=1, desired_size=1, max_size=2),
     "min_size: 1 is not allowed; a GPU pool starts at 0"),
    (dict(instance_type="p5en.48xlarge", capacity_type=eks.CapacityType.CAPACITY_BLOCK, desired_size=2, max_size=2,
          capacity_reservation_id="cr-0123456789abcdef0"),
     "desired_size: 2 is not allowed; a Capacity Block pool is created at 0 nodes"),
])
def test_node_pool_props_are_validated_when_built_in_code(props, fragment):
    with pytest.raises(ConfigError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        NodePoolConfig(**props)


def test_node_pool_props_take_the_aws_cdk_lib_capacity_type():
    pool = NodePoolConfig(instance_type="p5en.48xlarge", capacity_type=eks.CapacityType.CAPACITY_BLOCK,
                          capacity_reservation_id="cr-0123456789abcdef0", max_size=2)
    assert pool.capacity_type == "CAPACITY_BLOCK"


def test_efa_pool_rejects_bad_construct_props_at_construction():
    stack = PlatformStack(cdk.App(), "Bad")
    subnet = stack.cluster.cluster.vpc.private_subnets[0]
    p5 = NodePoolConfig(instance_type="p5.48xlarge")
    with pytest.raises(ValueError, match=r"cluster_placement: True is not allowed without EFA"):
        EfaNodePool(stack, "W", cluster=stack.cluster, subnet=subnet, role="rollout", cluster_placement=True,
                    pool=NodePoolConfig(instance_type="g6e.12xlarge", efa=False))
    with pytest.raises(ValueError, match=r"role: 'GPU trainers!' is not allowed; a Kubernetes label value"):
        EfaNodePool(stack, "L", cluster=stack.cluster, subnet=subnet, role="GPU trainers!", pool=p5)
    with pytest.raises(ValueError, match=r"extra_labels: 'moe-rl/role' is not allowed; the pool sets moe-rl/role"):
        EfaNodePool(stack, "R", cluster=stack.cluster, subnet=subnet, role="trainer", pool=p5,
                    extra_labels={"moe-rl/role": "rollout"})
    with pytest.raises(ValueError, match=r"extra_labels\['team'\]: 'a b' is not allowed"):
        EfaNodePool(stack, "V", cluster=stack.cluster, subnet=subnet, role="trainer", pool=p5,
                    extra_labels={"team": "a b"})
    with pytest.raises(TypeError, match=r"pool: .* is not allowed; a moe_rl_eks.core.environment.NodePoolConfig"):
        EfaNodePool(stack, "D", cluster=stack.cluster, subnet=subnet, role="trainer", pool={"instance_type": "p5"})


def test_efa_pool_on_an_imported_cluster_without_its_network_says_what_the_import_needs():
    stack = cdk.Stack(cdk.App(), "Imported", env=ENV)
    vpc = ec2.Vpc.from_vpc_attributes(stack, "Vpc", vpc_id="vpc-1", availability_zones=["us-west-2a"],
                                      private_subnet_ids=["subnet-1"])
    bare = eks.Cluster.from_cluster_attributes(stack, "Bare", cluster_name="theirs")
    with pytest.raises(ValueError, match=r"an imported cluster needs vpc and cluster_security_group_id"):
        EfaNodePool(stack, "P", cluster=bare, subnet=vpc.private_subnets[0], role="trainer",
                    pool=NodePoolConfig(instance_type="p5.48xlarge"))


@pytest.mark.parametrize("cidrs, fragment", [
    (["0.0.0.0/0"], r"public_cidrs\[0\]: '0.0.0.0/0' is not allowed; the whole internet is not an allow-list"),
    ("203.0.113.0/24", r"public_cidrs: '203.0.113.0/24' is not allowed; expected a list of CIDRs, not one string"),
    (["10.0.0.0/33"], r"public_cidrs\[0\]: '10.0.0.0/33' is not allowed; expected a CIDR"),
])
def test_cluster_rejects_bad_public_endpoint_cidrs(cidrs, fragment):
    stack = cdk.Stack(cdk.App(), "Open", env=ENV)
    vpc = ec2.Vpc(stack, "Vpc", max_azs=2)
    with pytest.raises(ConfigError, match=fragment):
        MoeRlCluster(stack, "Cluster", vpc=vpc, public_endpoint_cidrs=cidrs)


def _dev() -> EnvironmentConfig:
    return load_environments(json.loads((REPO / "cdk.json").read_text())["context"])["dev"]


def test_environment_built_in_code_is_validated_like_one_read_from_cdk_json():
    from dataclasses import asdict, replace

    dev = _dev()
    with pytest.raises(ConfigError, match=r"admin_role_arn: 'PlatformAdmin' is not allowed; expected an IAM role ARN"):
        replace(dev, admin_role_arn="PlatformAdmin")
    with pytest.raises(ConfigError, match=r"admin_role_arn: None is not allowed; required"):
        replace(dev, admin_role_arn=None)
    fields = {k: v for k, v in asdict(dev).items() if k not in ("rollout_pool", "trainer_pool", "endpoint", "storage",
                                                                "observability")}
    with pytest.raises(ConfigError, match=r"availability_zones: 'us-east-1a' is not allowed; expected a list"):
        EnvironmentConfig(**{**fields, "availability_zones": "us-east-1a"}, rollout_pool=dev.rollout_pool,
                          trainer_pool=dev.trainer_pool)


def test_stack_refuses_an_env_of_its_own_and_names_where_env_comes_from():
    with pytest.raises(ValueError, match=r"env: .* is not allowed; MoeRlStack sets it from config \(account 111111111111"):
        MoeRlStack(cdk.App(), "Dup", config=_dev(), env=ENV)


def test_network_interfaces_layout_for_p5en_and_without_efa():
    layout = network_interfaces(16, ["sg-pool", "sg-cluster"])
    assert [(i["network_card_index"], i["device_index"], i["interface_type"]) for i in layout] == \
        [(0, 0, "efa")] + [(c, 1, "efa-only") for c in range(1, 16)]
    assert all(i["groups"] == ["sg-pool", "sg-cluster"] and "subnet_id" not in i for i in layout)
    assert [(i["network_card_index"], i["interface_type"]) for i in network_interfaces(0, ["sg"])] == [(0, None)]


def test_user_data_is_mime_with_nodeconfig_and_hugepages_only_when_asked_and_memlock_always():
    text = user_data(hugepages_2mi=1024, local_nvme=True)
    assert text.startswith("MIME-Version: 1.0") and "application/node.eks.aws" in text
    assert "vm.nr_hugepages = 1024" in text and text.rstrip().endswith("--")
    plain = user_data(hugepages_2mi=0, local_nvme=False)
    assert "NodeConfig" not in plain and "hugepages" not in plain
    assert "LimitMEMLOCK=infinity" in plain and "LimitMEMLOCK=infinity" in text


def test_add_checks_makes_synth_fail_on_an_unacknowledged_nag_finding(tmp_path):
    app = cdk.App(outdir=str(tmp_path))
    add_checks(app)
    stack = cdk.Stack(app, "Leaky", env=ENV)
    s3.Bucket(stack, "NoTls")  # no TLS-only policy, no access logs
    with pytest.raises(RuntimeError, match=r"(?s)ValidationFailed.*AwsSolutions-S10"):
        app.synth()


def test_guardrails_plugin_fails_synth_on_a_public_endpoint_without_allow_list(tmp_path):
    app = cdk.App(outdir=str(tmp_path))
    cdk.Validations.of(app).add_plugins(EksGuardrails())
    stack = cdk.Stack(app, "Public", env=ENV)
    eks.CfnCluster(stack, "Cluster", role_arn="arn:aws:iam::333333333333:role/eks",
                   resources_vpc_config=eks.CfnCluster.ResourcesVpcConfigProperty(
                       subnet_ids=["subnet-1", "subnet-2"], endpoint_public_access=True))
    with pytest.raises(RuntimeError, match="ValidationFailed") as err:
        app.synth()
    assert "MoeRl-EKS-PublicEndpoint" in str(err.value) and "MoeRl-EKS-ControlPlaneLogs" in str(err.value)


def test_stack_without_fsx_and_prometheus_and_with_an_allow_listed_public_endpoint():
    context = json.loads((REPO / "cdk.json").read_text())["context"]
    dev = context["environments"]["dev"]
    dev.update(storage={"fsx": False}, observability={"prometheus": False},
               endpoint={"public": True, "public_cidrs": ["203.0.113.0/24"]})
    assert dev["endpoint"]["public"]  # dev ships allow-listed; the variant keeps that
    app = cdk.App()
    add_checks(app)  # the variant is nag-clean and passes the guardrails too: synthesis would raise otherwise
    stack = MoeRlStack(app, "Lean", config=load_environments(context)["dev"])
    template = Template.from_stack(stack)
    template.resource_count_is("AWS::FSx::FileSystem", 0)
    template.resource_count_is("AWS::APS::Workspace", 0)
    template.resource_count_is("AWS::CloudWatch::Alarm", 3)  # node-side alarms stay
    assert "PrometheusEndpoint" not in template.to_json()["Outputs"]
    template.has_resource_properties("AWS::EKS::Cluster", {"ResourcesVpcConfig": Match.object_like(
        {"EndpointPublicAccess": True, "PublicAccessCidrs": ["203.0.113.0/24"]})})
    assert "PersistentVolume" not in json.dumps(template.to_json())


def test_a_no_execute_pool_is_tolerated_by_the_device_plugins_and_its_kueue_flavor():
    from infra_helpers import helm_charts, kubernetes_objects

    context = json.loads((REPO / "cdk.json").read_text())["context"]
    context["environments"]["dev"]["trainer_pool"]["taint_effect"] = "NO_EXECUTE"
    stack = MoeRlStack(cdk.App(), "NoExecute", config=load_environments(context)["dev"])
    template = Template.from_stack(stack).to_json()
    template_props = [r["Properties"] for r in template["Resources"].values() if r["Type"] == "AWS::EKS::Nodegroup"]
    (trainer,) = [p for p in template_props if p["Labels"]["moe-rl/role"] == "trainer"]
    assert trainer["Taints"] == [{"Key": "nvidia.com/gpu", "Value": "true", "Effect": "NO_EXECUTE"}]
    assert trainer["Tags"]["k8s.io/cluster-autoscaler/node-template/taint/nvidia.com/gpu"] == "true:NoExecute"
    toleration = {"key": "nvidia.com/gpu", "operator": "Equal", "value": "true"}
    both = [{**toleration, "effect": "NoExecute"}, {**toleration, "effect": "NoSchedule"}]  # trainer and rollout pools
    charts = helm_charts(template)
    for plugin in ("nvidia-device-plugin", "aws-efa-k8s-device-plugin"):
        assert charts[plugin]["Values"]["tolerations"] == both, plugin
    flavors = {o["metadata"]["name"]: o["spec"] for o in kubernetes_objects(template) if o["kind"] == "ResourceFlavor"}
    assert flavors["moe-rl-trainer"]["tolerations"] == [both[0]]
    assert flavors["moe-rl-rollout"]["tolerations"] == [both[1]]


@pytest.mark.parametrize("construct, user", [
    (lambda stack, cluster: DevicePlugins(stack, "Devices", cluster=cluster, pools=[stack.pool]), "DevicePlugins"),
    (lambda stack, cluster: ClusterServices(stack, "Services", cluster=cluster, pools={"trainer": stack.pool},
                                            run_namespace="moe-rl"), "ClusterServices"),
])
def test_services_on_an_imported_cluster_without_a_kubectl_provider_say_what_to_pass(construct, user):
    stack = PlatformStack(cdk.App(), "NoKubectl")
    vpc = stack.cluster.cluster.vpc
    imported = eks.Cluster.from_cluster_attributes(stack, "Theirs", cluster_name="their-cluster", vpc=vpc,
                                                   cluster_security_group_id="sg-0123456789abcdef0")
    with pytest.raises(ValueError, match=rf"cluster: 'NoKubectl/Theirs' is not allowed for {user}; it has no "
                                         r"kubectl provider: import it with .*kubectl_provider=.*kubectl_provider_options="):
        construct(stack, imported)


def test_cluster_services_refuse_unknown_roles_and_names_that_are_not_the_typed_config():
    stack = PlatformStack(cdk.App(), "BadServices")
    with pytest.raises(ValueError, match=r"pools: \['trainers'\] is not allowed; the roles are trainer and rollout"):
        ClusterServices(stack, "Services", cluster=stack.cluster, pools={"trainers": stack.pool}, run_namespace="x")
    with pytest.raises(TypeError, match=r"names: \{'trainer_queue': 'q'\} is not allowed; a moe_rl_eks.core"):
        ClusterServices(stack, "Services2", cluster=stack.cluster, pools={"trainer": stack.pool}, run_namespace="x",
                        names={"trainer_queue": "q"})


def test_device_plugins_need_the_pools_whose_taints_they_tolerate():
    stack = PlatformStack(cdk.App(), "NoPools")
    with pytest.raises(ValueError, match=r"pools: \[\] is not allowed; one or more EfaNodePool"):
        DevicePlugins(stack, "Devices", cluster=stack.cluster.cluster, pools=[])


@pytest.mark.parametrize("literals, expected", [(True, "aws"), (False, "<AWS::Partition>")])
def test_nag_acknowledgments_spell_the_partition_as_nag_prints_it_in_either_kind_of_app(literals, expected):
    # New apps set enablePartitionLiterals (cdk.json does); an app without it keeps the pseudo parameter.
    from moe_rl_eks.infra.checks import nag_partition

    app = cdk.App(context={"@aws-cdk/core:enablePartitionLiterals": literals})
    assert nag_partition(cdk.Stack(app, "S", env=ENV)) == expected


@pytest.mark.parametrize("version, fragment", [
    ("v1.18.4-eksbuild.1", "at least v1.18.5 (efa-only interfaces)"),
    ("latest", "an add-on version like v1.20.1-eksbuild.3"),
])
def test_cluster_refuses_a_vpc_cni_too_old_for_efa_only_interfaces(version, fragment):
    stack = cdk.Stack(cdk.App(), "Cni", env=ENV)
    vpc = ec2.Vpc(stack, "Vpc", max_azs=2)
    with pytest.raises(ValueError, match=r"vpc_cni_version: .* is not allowed; " + fragment.replace("(", r"\(").replace(")", r"\)")):
        MoeRlCluster(stack, "Cluster", vpc=vpc, vpc_cni_version=version)


@pytest.mark.parametrize("cidr, fragment", [
    ("10.0.0.0/33", "a CIDR like 10.0.0.0/16"),
    ("10.0.0.0/18", "large enough for one /24 public, /19 private and /28 scraper subnet per zone"),
    ("8.8.0.0/16", "a private CIDR"),
])
def test_network_refuses_a_cidr_its_subnets_do_not_fit(cidr, fragment):
    from moe_rl_eks.infra import MoeRlNetwork

    stack = cdk.Stack(cdk.App(), "Net", env=ENV)
    with pytest.raises(ValueError, match=rf"cidr: '{re.escape(cidr)}' is not allowed; .*{re.escape(fragment)}"):
        MoeRlNetwork(stack, "Network", availability_zones=["us-west-2a", "us-west-2b"], cidr=cidr)


def test_storage_refuses_a_repository_prefix_ecr_would_refuse():
    from moe_rl_eks.infra import MoeRlStorage

    stack = cdk.Stack(cdk.App(), "Repos", env=ENV)
    vpc = ec2.Vpc(stack, "Vpc", max_azs=2)
    with pytest.raises(ValueError, match=r"repository_prefix: 'Moe RL' is not allowed; lowercase letters"):
        MoeRlStorage(stack, "Storage", vpc=vpc, fsx_subnet=None, repository_prefix="Moe RL")


def test_cluster_refuses_a_kubernetes_version_it_has_no_kubectl_layer_and_pins_for():
    stack = cdk.Stack(cdk.App(), "K134", env=ENV)
    vpc = ec2.Vpc(stack, "Vpc", availability_zones=["us-west-2a", "us-west-2b"], nat_gateways=1)
    with pytest.raises(ValueError, match=r"kubernetes_version: '1.34' is not allowed; supported: 1.35, 1.36$"):
        MoeRlCluster(stack, "Cluster", vpc=vpc, kubernetes_version="1.34")


def test_cluster_services_pin_for_an_imported_clusters_version_which_they_must_be_told():
    stack = PlatformStack(cdk.App(), "TheirVersion")
    provider = eks.KubectlProvider.from_kubectl_provider_attributes(
        stack, "TheirKubectl", service_token="arn:aws:lambda:us-west-2:444444444444:function:their-kubectl")
    imported = eks.Cluster.from_cluster_attributes(stack, "Theirs", cluster_name="their-cluster",
                                                   vpc=stack.cluster.cluster.vpc, kubectl_provider=provider)
    with pytest.raises(ValueError, match=r"kubernetes_version: None is not allowed; the imported cluster's minor, "
                                         r"which picks KEDA's release and the autoscaler's image, "
                                         r"supported: 1.35, 1.36"):
        ClusterServices(stack, "Unversioned", cluster=imported, pools={"trainer": stack.pool}, run_namespace="x")
    services = ClusterServices(stack, "Services", cluster=imported, pools={"trainer": stack.pool}, run_namespace="x",
                               kubernetes_version="1.36")
    assert (services.pins.keda.version, services.pins.cluster_autoscaler_image_tag) == ("2.21.0", "v1.36.1")
    # On our own cluster the version is the cluster's; another one is refused.
    own = ClusterServices(stack, "OwnServices", cluster=stack.cluster, pools={"trainer": stack.pool}, run_namespace="y")
    assert (stack.cluster.kubernetes_version, own.pins.keda.version) == ("1.35", "2.20.2")
    with pytest.raises(ValueError, match=r"kubernetes_version: '1.36' is not allowed; the cluster runs 1.35 \(leave"):
        ClusterServices(stack, "Mismatch", cluster=stack.cluster, pools={"trainer": stack.pool}, run_namespace="z",
                        kubernetes_version="1.36")


def test_every_user_data_script_is_shellcheck_clean(tmp_path):
    shellcheck = shutil.which("shellcheck", path=str(Path(sys.executable).parent)) or shutil.which("shellcheck")
    assert shellcheck, "shellcheck is not installed: it comes with the dev extra (pyproject.toml)"
    text = user_data(hugepages_2mi=1024, local_nvme=True)
    scripts = [part[part.index("#!/bin/bash"):] for part in text.split("--==MOERL==") if "#!/bin/bash" in part]
    assert len(scripts) == 3  # memlock, gdrdrv, hugepages
    paths = []
    for i, script in enumerate(scripts):
        paths.append(tmp_path / f"part{i}.sh")
        paths[-1].write_text(script)
    result = subprocess.run([shellcheck, *map(str, paths)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
