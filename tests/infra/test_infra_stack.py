"""What the synthesized dev and prod stacks contain, per construct (aws_cdk.assertions on the CLI's templates)."""
from __future__ import annotations

import base64
import json
import re

import pytest
import yaml
from aws_cdk.assertions import Match, Template

from moe_rl_eks.core import cluster as names
from moe_rl_eks.core import metrics
from moe_rl_eks.core.catalog import CATALOG
from moe_rl_eks.core.cluster import VPC_CNI_VERSION
from moe_rl_eks.infra.node_pool import GDRCOPY_COMMIT, GDRCOPY_VERSION, GDRDRV_UNIT, MEMLOCK_DROP_IN
from moe_rl_eks.infra.services import CHARTS, CHART_TIMEOUT, KUBERNETES_PINS, pinned_charts

from infra_helpers import (REPO, STACK_CORE_KINDS, helm_charts, join_string, kubernetes_objects, pool, resources_of,
                           strictly_validated_kinds)

# the session's `cdk synth` of every environment (conftest.cdk_out) runs once, not once a worker (make test's workers)
pytestmark = pytest.mark.xdist_group("cdk_out")


@pytest.mark.parametrize("env,role,instance_type,efa", [
    ("dev", "trainer", "p5.48xlarge", 32),
    ("prod", "trainer", "p5en.48xlarge", 16),
    ("prod", "rollout", "p5e.48xlarge", 32),
])
def test_efa_pool_has_every_efa_interface_card0_efa_then_efa_only(templates, env, role, instance_type, efa):
    props, data = pool(templates[env], role)
    assert props.get("InstanceTypes", [data.get("InstanceType")]) == [instance_type]
    assert CATALOG[instance_type].efa_interfaces == efa
    layout = [(i["NetworkCardIndex"], i["DeviceIndex"], i["InterfaceType"]) for i in data["NetworkInterfaces"]]
    assert layout == [(0, 0, "efa")] + [(card, 1, "efa-only") for card in range(1, efa)]
    for interface in data["NetworkInterfaces"]:
        assert "SubnetId" not in interface
        # The pool's own security group and the cluster security group on every interface.
        assert interface["Groups"][1]["Fn::GetAtt"][1] == "ClusterSecurityGroupId"
        assert len(interface["Groups"]) == 2
    assert "SecurityGroupIds" not in data and "SubnetId" not in json.dumps(data)


def test_efa_pool_placement_group_is_cluster_strategy(templates):
    template = Template.from_json(templates["dev"])
    template.resource_count_is("AWS::EC2::PlacementGroup", 1)  # the trainer's; the dev rollout pool opts out of EFA
    template.has_resource_properties("AWS::EC2::PlacementGroup", {"Strategy": "cluster"})
    _, data = pool(templates["dev"], "trainer")
    assert templates["dev"]["Resources"][data["Placement"]["GroupName"]["Ref"]]["Type"] == "AWS::EC2::PlacementGroup"
    _, rollout = pool(templates["dev"], "rollout")
    assert "Placement" not in rollout
    assert [(i["NetworkCardIndex"], i["DeviceIndex"], i.get("InterfaceType")) for i in rollout["NetworkInterfaces"]] == [(0, 0, None)]
    # A capacity block fixes placement itself: the prod trainer targets it and gets no placement group.
    _, prod_rollout = pool(templates["prod"], "rollout")
    _, prod_trainer = pool(templates["prod"], "trainer")
    assert "Placement" in prod_rollout and "Placement" not in prod_trainer


def test_efa_pool_security_group_allows_all_traffic_to_and_from_itself(templates):
    template = templates["prod"]
    _, data = pool(template, "trainer")
    sg = data["NetworkInterfaces"][0]["Groups"][0]["Fn::GetAtt"][0]
    ingress = [r["Properties"] for r in resources_of(template, "AWS::EC2::SecurityGroupIngress").values()
               if r["Properties"]["GroupId"] == {"Fn::GetAtt": [sg, "GroupId"]}]
    egress = [r["Properties"] for r in resources_of(template, "AWS::EC2::SecurityGroupEgress").values()
              if r["Properties"]["GroupId"] == {"Fn::GetAtt": [sg, "GroupId"]}]
    assert [(r["IpProtocol"], r["SourceSecurityGroupId"]) for r in ingress] == [("-1", {"Fn::GetAtt": [sg, "GroupId"]})]
    assert [(r["IpProtocol"], r["DestinationSecurityGroupId"]) for r in egress] == [("-1", {"Fn::GetAtt": [sg, "GroupId"]})]
    # No other egress: allow_all_outbound is off on the pool group (the cluster group carries node egress).
    assert template["Resources"][sg]["Properties"].get("SecurityGroupEgress") in (None, [])


def test_gpu_pools_require_imdsv2_encrypted_gp3_root_and_nodeadm_user_data(templates):
    for env in ("dev", "prod"):
        for role in ("trainer", "rollout"):
            props, data = pool(templates[env], role)
            assert data["MetadataOptions"] == {"HttpTokens": "required", "HttpEndpoint": "enabled", "HttpPutResponseHopLimit": 2}
            ebs = data["BlockDeviceMappings"][0]["Ebs"]
            assert (ebs["VolumeType"], ebs["Encrypted"], ebs["VolumeSize"]) == ("gp3", True, 200)
            user_data = base64.b64decode(data["UserData"]).decode()
            assert "kind: NodeConfig" in user_data and "strategy: RAID0" in user_data
            assert "vm.nr_hugepages = 5120" in user_data


def test_gpu_node_user_data_lifts_the_locked_memory_limit_containers_inherit(templates):
    # Pods run as UID 10001: IPC_LOCK gives them nothing, so containerd itself must run with unlimited memlock.
    for env in ("dev", "prod"):
        for role in ("trainer", "rollout"):
            _, data = pool(templates[env], role)
            script = base64.b64decode(data["UserData"]).decode()
            assert f"printf '[Service]\\nLimitMEMLOCK=infinity\\n' > {MEMLOCK_DROP_IN}" in script
            assert MEMLOCK_DROP_IN.startswith("/etc/systemd/system/containerd.service.d/")
            # Reloaded before nodeadm starts containerd and the kubelet (a running containerd is restarted).
            assert script.index(MEMLOCK_DROP_IN) < script.index("systemctl daemon-reload") < \
                script.index("systemctl try-restart containerd")


def test_gpu_nodes_build_and_load_gdrcopys_driver_from_the_images_release_before_containerd(templates):
    # DeepEP's NVSHMEM proxy over EFA needs /dev/gdrdrv; the EKS NVIDIA AMI has no gdrdrv module.
    versions = dict(line.split("=", 1) for line in (REPO / "images" / "versions.env").read_text().splitlines()
                    if line and not line.startswith("#"))
    assert (GDRCOPY_VERSION, GDRCOPY_COMMIT) == (versions["GDRCOPY_VERSION"], versions["GDRCOPY_COMMIT"])
    for env in ("dev", "prod"):
        for role in ("trainer", "rollout"):
            _, data = pool(templates[env], role)
            script = base64.b64decode(data["UserData"]).decode()
            assert f"--branch {GDRCOPY_VERSION} https://github.com/NVIDIA/gdrcopy.git" in script
            assert f'rev-parse HEAD)" = {GDRCOPY_COMMIT}' in script  # a moved tag stops the boot step
            assert 'make -C "$work/gdrcopy" driver KVER="$(uname -r)"' in script
            assert "mknod -m 0666 /dev/gdrdrv" in script  # pods run as UID 10001
            unit = script[script.index(f"/etc/systemd/system/{GDRDRV_UNIT} <<'UNIT'"):script.index("\nUNIT\n")]
            assert "Before=containerd.service kubelet.service" in unit and "Type=oneshot" in unit
            assert f"systemctl enable --now {GDRDRV_UNIT}" in script
    # The device plugin then passes /dev/gdrdrv to GPU containers that ask for it (NVIDIA_GDRCOPY=enabled).
    assert helm_charts(templates["prod"])["nvidia-device-plugin"]["Values"]["gdrcopyEnabled"] is True


def test_capacity_block_pool_names_its_instance_type_in_the_launch_template_only(templates):
    props, data = pool(templates["prod"], "trainer")
    assert props["CapacityType"] == "CAPACITY_BLOCK"
    assert "InstanceTypes" not in props  # EKS rejects a CAPACITY_BLOCK node group that names it
    assert data["InstanceType"] == "p5en.48xlarge"
    on_demand, on_demand_lt = pool(templates["prod"], "rollout")
    assert on_demand["InstanceTypes"] == ["p5e.48xlarge"] and "InstanceType" not in on_demand_lt


def test_pools_without_a_reservation_and_capacity_block_pools_start_at_zero_nodes(templates):
    for env in ("dev", "prod"):
        for role in ("trainer", "rollout"):
            props, data = pool(templates[env], role)
            scaling = props["ScalingConfig"]
            if "CapacityReservationSpecification" not in data or props["CapacityType"] == "CAPACITY_BLOCK":
                assert (scaling["MinSize"], scaling["DesiredSize"]) == (0, 0), (env, role)
    # prod's trainer pool is the Capacity Block one: created empty, scaled by `moerl scale-pool` once it is active.
    props, _ = pool(templates["prod"], "trainer")
    assert props["CapacityType"] == "CAPACITY_BLOCK" and props["ScalingConfig"]["DesiredSize"] == 0


def test_gpu_pools_use_the_al2023_nvidia_ami_one_subnet_labels_and_taints(templates):
    template = Template.from_json(templates["prod"])
    template.has_resource_properties("AWS::EKS::Nodegroup", {
        "AmiType": "AL2023_x86_64_NVIDIA", "CapacityType": "CAPACITY_BLOCK",
        "Labels": {"moe-rl/role": "trainer", "vpc.amazonaws.com/efa.present": "true", "nvidia.com/gpu.present": "true"},
        "Taints": [{"Key": "nvidia.com/gpu", "Value": "true", "Effect": "NO_SCHEDULE"}],
        "ScalingConfig": {"MinSize": 0, "DesiredSize": 0, "MaxSize": 16},
    })
    props, data = pool(templates["prod"], "trainer")
    assert len(props["Subnets"]) == 1
    assert data["CapacityReservationSpecification"] == {"CapacityReservationTarget": {"CapacityReservationId": "cr-0123456789abcdef0"}}
    assert data["InstanceMarketOptions"] == {"MarketType": "capacity-block"}
    dev_rollout, _ = pool(templates["dev"], "rollout")
    assert "vpc.amazonaws.com/efa.present" not in dev_rollout["Labels"]


def test_gpu_pools_carry_cluster_autoscaler_node_template_tags(templates):
    props, _ = pool(templates["prod"], "trainer")
    prefix = "k8s.io/cluster-autoscaler/node-template"
    assert props["Tags"][f"{prefix}/resources/nvidia.com/gpu"] == "8"
    assert props["Tags"][f"{prefix}/resources/vpc.amazonaws.com/efa"] == "16"
    assert props["Tags"][f"{prefix}/resources/hugepages-2Mi"] == "10240Mi"
    assert props["Tags"][f"{prefix}/label/moe-rl/role"] == "trainer"
    assert props["Tags"][f"{prefix}/taint/nvidia.com/gpu"] == "true:NoSchedule"


def test_cluster_runs_a_standard_support_version_and_is_private_logs_everything_and_encrypts_secrets(templates):
    Template.from_json(templates["dev"]).has_resource_properties("AWS::EKS::Cluster", {"Version": "1.35"})
    # dev's admin path: an allow-listed public endpoint (a documentation range to replace) and an admin role.
    Template.from_json(templates["dev"]).has_resource_properties("AWS::EKS::Cluster", {"ResourcesVpcConfig":
        Match.object_like({"EndpointPublicAccess": True, "PublicAccessCidrs": ["203.0.113.0/24"]})})
    template = Template.from_json(templates["prod"])
    template.has_resource_properties("AWS::EKS::Cluster", {
        "Version": "1.35",
        "ResourcesVpcConfig": Match.object_like({"EndpointPublicAccess": False, "EndpointPrivateAccess": True}),
        "Logging": {"ClusterLogging": {"EnabledTypes": Match.array_with([
            {"Type": t} for t in ("api", "audit", "authenticator", "controllerManager", "scheduler")])}},
        "EncryptionConfig": [{"Provider": {"KeyArn": Match.any_value()}, "Resources": ["secrets"]}],
    })


def test_cluster_addons_and_admin_access_entry(templates):
    addons = {r["Properties"]["AddonName"]: r["Properties"] for r in resources_of(templates["prod"], "AWS::EKS::Addon").values()}
    assert set(addons) == {"vpc-cni", "kube-proxy", "coredns", "eks-pod-identity-agent", "aws-fsx-csi-driver",
                           "amazon-cloudwatch-observability"}
    assert json.loads(addons["vpc-cni"]["ConfigurationValues"])["enableNetworkPolicy"] == "true"
    assert addons["vpc-cni"]["AddonVersion"] == VPC_CNI_VERSION  # pinned, and new enough for efa-only interfaces
    assert addons["amazon-cloudwatch-observability"]["PodIdentityAssociations"][0]["ServiceAccount"] == "cloudwatch-agent"
    for env in ("dev", "prod"):
        admins = [join_string(r["Properties"]["PrincipalArn"]) for r in resources_of(templates[env], "AWS::EKS::AccessEntry").values()]
        assert [a for a in admins if ":role/" in a and "TOKEN" not in a], env  # every environment has an admin role
    admin = [r["Properties"] for r in resources_of(templates["prod"], "AWS::EKS::AccessEntry").values()
             if r["Properties"]["PrincipalArn"] == "arn:aws:iam::222222222222:role/PlatformAdmin"]
    assert [join_string(p["PolicyArn"]).rsplit("/", 1)[-1] for p in admin[0]["AccessPolicies"]] == ["AmazonEKSClusterAdminPolicy"]
    assert admin[0]["AccessPolicies"][0]["AccessScope"] == {"Type": "cluster"}


def test_the_vpc_cni_gets_its_policy_by_pod_identity_and_no_node_role_carries_it(templates):
    template = templates["prod"]
    (cni,) = [r["Properties"] for r in resources_of(template, "AWS::EKS::Addon").values()
              if r["Properties"]["AddonName"] == "vpc-cni"]
    (association,) = cni["PodIdentityAssociations"]
    assert association["ServiceAccount"] == "aws-node"
    role = template["Resources"][association["RoleArn"]["Fn::GetAtt"][0]]["Properties"]
    assert [join_string(p).rsplit("/", 1)[-1] for p in role["ManagedPolicyArns"]] == ["AmazonEKS_CNI_Policy"]
    node_roles = [r["Properties"] for r in resources_of(template, "AWS::IAM::Role").values()
                  if "ec2.amazonaws.com" in json.dumps(r["Properties"]["AssumeRolePolicyDocument"])]
    assert len(node_roles) == 3  # system, trainer, rollout
    for node_role in node_roles:
        policies = [join_string(p).rsplit("/", 1)[-1] for p in node_role["ManagedPolicyArns"]]
        assert "AmazonEKS_CNI_Policy" not in policies and "AmazonEKSWorkerNodePolicy" in policies


def test_pod_identity_roles_trust_only_this_cluster_in_this_account(templates):
    template = templates["prod"]
    (cluster_id,) = resources_of(template, "AWS::EKS::Cluster")
    pod_roles = {k: r["Properties"]["AssumeRolePolicyDocument"] for k, r in resources_of(template, "AWS::IAM::Role").items()
                 if "pods.eks.amazonaws.com" in json.dumps(r["Properties"]["AssumeRolePolicyDocument"])}
    # run roles (3), cluster autoscaler, KEDA, CloudWatch agent, VPC CNI
    assert len(pod_roles) == 7
    for logical_id, document in pod_roles.items():
        (statement,) = document["Statement"]
        assert sorted(statement["Action"]) == ["sts:AssumeRole", "sts:TagSession"], logical_id
        assert statement["Condition"] == {"StringEquals": {"aws:SourceAccount": "222222222222"},
                                          "ArnEquals": {"aws:SourceArn": {"Fn::GetAtt": [cluster_id, "Arn"]}}}, logical_id
    associated = {r["Properties"]["RoleArn"]["Fn::GetAtt"][0]
                  for r in resources_of(template, "AWS::EKS::PodIdentityAssociation").values()}
    assert associated <= set(pod_roles)


def test_charts_install_with_wait_after_system_nodes_and_coredns_and_queues_after_kueue(templates):
    template = templates["prod"]
    (nodegroup,) = [k for k, r in resources_of(template, "AWS::EKS::Nodegroup").items()
                    if r["Properties"]["Labels"]["moe-rl/role"] == "system"]
    (coredns,) = [k for k, r in resources_of(template, "AWS::EKS::Addon").items()
                  if r["Properties"]["AddonName"] == "coredns"]
    charts = {r["Properties"]["Release"]: (k, r) for k, r in resources_of(template, "Custom::AWSCDK-EKS-HelmChart").items()}
    assert set(charts) == set(pinned_charts("1.35"))
    for name, (_, chart) in charts.items():
        assert chart["Properties"]["Wait"] is True, name
        assert chart["Properties"]["Timeout"] == f"{CHART_TIMEOUT.to_seconds()}s", name
        assert {nodegroup, coredns} <= set(chart["DependsOn"]), name
    assert CHART_TIMEOUT.to_minutes() < 15  # the kubectl handler Lambda's limit
    # The autoscaler's pods start only once their service account and its Pod Identity association exist.
    (association,) = [k for k, r in resources_of(template, "AWS::EKS::PodIdentityAssociation").items()
                      if r["Properties"]["ServiceAccount"] == "cluster-autoscaler"]
    (account,) = [k for k, r in resources_of(template, "Custom::AWSCDK-EKS-KubernetesResource").items()
                  if '"kind":"ServiceAccount","metadata":{"name":"cluster-autoscaler"'
                  in join_string(r["Properties"]["Manifest"]).replace(" ", "")]
    assert {association, account} <= set(charts["cluster-autoscaler"][1]["DependsOn"])
    kueue_id = charts["kueue"][0]
    queues = [r for r in resources_of(template, "Custom::AWSCDK-EKS-KubernetesResource").values()
              if "ClusterQueue" in join_string(r["Properties"]["Manifest"])]
    assert len(queues) == 2 and all(kueue_id in q["DependsOn"] for q in queues)


def test_cluster_services_run_at_system_cluster_critical_and_the_orchestrator_preempts_nothing(templates):
    charts = helm_charts(templates["prod"])
    assert charts["keda"]["Values"]["priorityClassName"] == "system-cluster-critical"
    assert charts["kueue"]["Values"]["controllerManager"]["manager"]["priorityClassName"] == "system-cluster-critical"
    assert charts["cluster-autoscaler"]["Values"]["priorityClassName"] == "system-cluster-critical"
    # The JobSet chart has no such value: its controller's Deployment is patched after the release is installed.
    (patch,) = [r for r in resources_of(templates["prod"], "Custom::AWSCDK-EKS-KubernetesPatch").values()
                if r["Properties"]["ResourceName"] == "deployment/jobset-controller"]
    assert patch["Properties"]["ResourceNamespace"] == CHARTS["jobset"].namespace
    assert json.loads(join_string(patch["Properties"]["ApplyPatchJson"])) == {
        "spec": {"template": {"spec": {"priorityClassName": "system-cluster-critical"}}}}
    (jobset_chart,) = [k for k, r in resources_of(templates["prod"], "Custom::AWSCDK-EKS-HelmChart").items()
                       if r["Properties"]["Release"] == "jobset"]
    assert jobset_chart in patch["DependsOn"]
    classes = {o["metadata"]["name"]: o for o in kubernetes_objects(templates["prod"]) if o["kind"] == "PriorityClass"}
    orchestrator = classes[names.ORCHESTRATOR_PRIORITY_CLASS]
    assert orchestrator["preemptionPolicy"] == "Never"
    assert classes[names.ROLLOUT_PRIORITY_CLASS]["value"] < orchestrator["value"] < classes[names.TRAINER_PRIORITY_CLASS]["value"]
    assert max(c["value"] for c in classes.values()) < 2_000_000_000  # far below system-cluster-critical


def test_system_nodes_have_room_for_controllers_orchestrators_and_their_images(templates):
    (system,) = [r["Properties"] for r in resources_of(templates["prod"], "AWS::EKS::Nodegroup").values()
                 if r["Properties"]["Labels"]["moe-rl/role"] == "system"]
    assert system["DiskSize"] == 100
    # 8 vCPU / 32 GiB: either of the two nodes alone holds the controllers and two orchestrators of 2 vCPU / 4 GiB.
    assert system["InstanceTypes"] == ["m6i.2xlarge"]
    assert system["ScalingConfig"]["MinSize"] == 2


def test_cluster_services_are_pinned_and_configured_for_efa(templates):
    charts = helm_charts(templates["prod"])
    assert {name: c["Version"] for name, c in charts.items()} == \
        {name: c.version for name, c in pinned_charts("1.35").items()}
    assert charts["keda"]["Version"] == "2.20.2"  # the KEDA release tested on the cluster's 1.35
    assert charts["cluster-autoscaler"]["Values"]["image"]["tag"] == "v1.35.0"  # the cluster's minor version
    nvidia = charts["nvidia-device-plugin"]["Values"]
    # Each set explicitly (the chart's defaults moved twice in 0.19.x): no MOFED, no GDS, GDRCopy into GPU pods.
    assert (nvidia["mofedEnabled"], nvidia["gdsEnabled"], nvidia["gdrcopyEnabled"]) == (False, False, True)
    efa_types = charts["aws-efa-k8s-device-plugin"]["Values"]["supportedInstanceLabels"]["values"]
    assert set(efa_types) == {n for n, t in CATALOG.items() if t.has_efa}
    assert charts["cluster-autoscaler"]["Values"]["rbac"]["serviceAccount"] == {"create": False, "name": "cluster-autoscaler"}


def test_kueue_queue_per_pool_priority_classes_namespace_and_fsx_claim(templates):
    objects = kubernetes_objects(templates["prod"])
    by_kind = {}
    for o in objects:
        by_kind.setdefault(o["kind"], {})[o["metadata"]["name"]] = o
    for queue_name, max_nodes, spec in ((names.TRAINER_QUEUE, 16, CATALOG["p5en.48xlarge"]),
                                        (names.ROLLOUT_QUEUE, 8, CATALOG["p5e.48xlarge"])):
        queue = by_kind["ClusterQueue"][queue_name]
        assert queue["apiVersion"] == "kueue.x-k8s.io/v1beta2"  # v1beta1 is not served from Kueue 0.20
        quota = {r["name"]: r["nominalQuota"] for r in queue["spec"]["resourceGroups"][0]["flavors"][0]["resources"]}
        assert quota["nvidia.com/gpu"] == spec.gpus * max_nodes
        assert quota["vpc.amazonaws.com/efa"] == spec.efa_interfaces * max_nodes
        local = by_kind["LocalQueue"][queue_name]
        assert (local["metadata"]["namespace"], local["spec"]["clusterQueue"]) == ("moe-rl", queue_name)
    assert by_kind["PriorityClass"][names.TRAINER_PRIORITY_CLASS]["value"] > by_kind["PriorityClass"][names.ROLLOUT_PRIORITY_CLASS]["value"]
    assert by_kind["PriorityClass"][names.ROLLOUT_PRIORITY_CLASS]["preemptionPolicy"] == "Never"
    assert "moe-rl" in by_kind["Namespace"]
    assert by_kind["Namespace"]["moe-rl"]["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "baseline"
    claim = by_kind["PersistentVolumeClaim"][names.FSX_CLAIM_NAME]
    assert claim["metadata"]["namespace"] == "moe-rl"
    assert by_kind["PersistentVolume"][claim["spec"]["volumeName"]]["spec"]["csi"]["driver"] == "fsx.csi.aws.com"
    # the fs weight store publishes under an flock: Lustre needs the flock mount option for it
    assert by_kind["PersistentVolume"][claim["spec"]["volumeName"]]["spec"]["mountOptions"] == ["flock"]


def test_a_one_off_job_makes_the_fsx_runs_directory_the_pods_own_before_any_run(templates):
    template = templates["prod"]
    (job_resource,) = [r for r in resources_of(template, "Custom::AWSCDK-EKS-KubernetesResource").values()
                       if '"kind":"Job"' in join_string(r["Properties"]["Manifest"]).replace(" ", "")]
    (job,) = json.loads(join_string(job_resource["Properties"]["Manifest"]))
    pod = job["spec"]["template"]["spec"]
    # The template is immutable: a changed one gets a new name; a finished Job goes away by itself.
    assert re.fullmatch(r"moe-rl-fsx-prepare-[0-9a-f]{10}", job["metadata"]["name"])
    assert job["spec"]["ttlSecondsAfterFinished"] == 86400
    (container,) = pod["containers"]
    script = container["command"][-1]
    uid = 10001
    assert f"chown {uid}:{uid} {names.RUNS_DIR}" in script and f"mkdir -p {names.RUNS_DIR}" in script
    assert script.index("chmod 2775") < script.index("chown")  # setgid survives chown on a directory
    assert container["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["CHOWN", "FOWNER", "FSETID"]}
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert pod["volumes"] == [{"name": "fsx", "persistentVolumeClaim": {"claimName": names.FSX_CLAIM_NAME}}]
    assert container["volumeMounts"] == [{"name": "fsx", "mountPath": names.FSX_MOUNT_PATH}]
    assert ":" in container["image"] and not container["image"].endswith(":latest")
    # Applied after the claim it mounts.
    (claim_id,) = [k for k, r in resources_of(template, "Custom::AWSCDK-EKS-KubernetesResource").items()
                   if "PersistentVolumeClaim" in join_string(r["Properties"]["Manifest"])]
    assert claim_id in job_resource["DependsOn"]
    # and once Kueue answers: its Job webhook fails closed in every namespace
    (kueue_id,) = [k for k, r in resources_of(template, "Custom::AWSCDK-EKS-HelmChart").items()
                   if r["Properties"]["Release"] == "kueue"]
    assert kueue_id in job_resource["DependsOn"]


def test_run_service_accounts_are_bound_by_pod_identity_to_roles_without_wildcard_actions(templates):
    template = templates["prod"]
    associations = {r["Properties"]["ServiceAccount"]: r["Properties"] for r in
                    resources_of(template, "AWS::EKS::PodIdentityAssociation").values()}
    run_accounts = (names.TRAINER_SERVICE_ACCOUNT, names.ORCHESTRATOR_SERVICE_ACCOUNT, names.ROLLOUT_SERVICE_ACCOUNT)
    grants = {}
    for sa in run_accounts:
        assert associations[sa]["Namespace"] == "moe-rl"
        role = associations[sa]["RoleArn"]["Fn::GetAtt"][0]
        policies = [p for p in resources_of(template, "AWS::IAM::Policy").values()
                    if {"Ref": role} in p["Properties"]["Roles"]]
        actions = [a for p in policies for s in p["Properties"]["PolicyDocument"]["Statement"]
                   for a in ([s["Action"]] if isinstance(s["Action"], str) else s["Action"])]
        assert actions and not [a for a in actions if "*" in a], (sa, actions)
        grants[sa] = {(a, join_string(r)) for p in policies for st in p["Properties"]["PolicyDocument"]["Statement"]
                      for a in ([st["Action"]] if isinstance(st["Action"], str) else st["Action"])
                      for r in ([st["Resource"]] if not isinstance(st["Resource"], list) else st["Resource"])}
    # Weight versions go to the S3 weight store's default prefix: the trainer publishes, rollout servers only read.
    assert ("s3:PutObject", "TOKEN/weights/*") in grants[names.TRAINER_SERVICE_ACCOUNT]
    assert ("s3:GetObject", "TOKEN/weights/*") in grants[names.ROLLOUT_SERVICE_ACCOUNT]
    assert not {a for a, _ in grants[names.ROLLOUT_SERVICE_ACCOUNT]} & {"s3:PutObject", "s3:DeleteObject"}
    assert ("s3:PutObject", "TOKEN/rollout-logs/*") in grants[names.ORCHESTRATOR_SERVICE_ACCOUNT]


def test_storage_bucket_fsx_and_repositories(templates):
    template = Template.from_json(templates["prod"])
    template.has_resource_properties("AWS::S3::Bucket", {
        "BucketEncryption": {"ServerSideEncryptionConfiguration": [Match.object_like({
            "ServerSideEncryptionByDefault": Match.object_like({"SSEAlgorithm": "aws:kms"})})]},
        "VersioningConfiguration": {"Status": "Enabled"},
        "LoggingConfiguration": Match.object_like({"DestinationBucketName": Match.any_value()}),
        "LifecycleConfiguration": {"Rules": Match.array_with([Match.object_like({"Prefix": "rollout-logs/"})])},
    })
    template.has_resource_properties("AWS::S3::BucketPolicy", {"PolicyDocument": {"Statement": Match.array_with([
        Match.object_like({"Effect": "Deny", "Condition": {"Bool": {"aws:SecureTransport": "false"}}})])}})
    template.has_resource_properties("AWS::FSx::FileSystem", {
        "FileSystemType": "LUSTRE", "StorageCapacity": 4800,
        "LustreConfiguration": Match.object_like({"DeploymentType": "PERSISTENT_2", "PerUnitStorageThroughput": 500})})
    # Linked at the root: /fsx/runs/<run>/ is s3://<bucket>/runs/<run>/, the prefix the trainer's role may write.
    template.has_resource_properties("AWS::FSx::DataRepositoryAssociation", {
        "FileSystemPath": "/", "DataRepositoryPath": Match.any_value()})
    (dra,) = resources_of(templates["prod"], "AWS::FSx::DataRepositoryAssociation").values()
    assert join_string(dra["Properties"]["DataRepositoryPath"]) == "s3://TOKEN/"
    assert names.RUNS_DIR.removeprefix(names.FSX_MOUNT_PATH + "/") + "/" == "runs/"
    template.resource_count_is("AWS::ECR::Repository", 3)  # trainer, rollout, orchestrator
    names_ = sorted(r["Properties"]["RepositoryName"] for r in resources_of(templates["prod"], "AWS::ECR::Repository").values())
    # `make images REGISTRY=<account>.dkr.ecr.<region>.amazonaws.com/moe-rl-prod` pushes to these
    assert names_ == ["moe-rl-prod/orchestrator", "moe-rl-prod/rollout", "moe-rl-prod/trainer"]
    template.all_resources_properties("AWS::ECR::Repository", {
        "ImageScanningConfiguration": {"ScanOnPush": True}, "ImageTagMutability": "IMMUTABLE"})
    fs = next(iter(resources_of(templates["prod"], "AWS::FSx::FileSystem").values()))["Properties"]
    trainer, _ = pool(templates["prod"], "trainer")
    assert fs["SubnetIds"] == trainer["Subnets"]  # the file system lives in the GPU zone


def test_observability_alarms_dashboard_prometheus_rules_and_alert_routing(templates):
    template = Template.from_json(templates["prod"])
    template.has_resource_properties("AWS::CloudWatch::Alarm", {"MetricName": "node_gpu_temperature", "Namespace": "ContainerInsights"})
    template.has_resource_properties("AWS::CloudWatch::Alarm", {"MetricName": "node_efa_rx_dropped"})
    template.resource_count_is("AWS::CloudWatch::Dashboard", 1)
    rules = next(iter(resources_of(templates["prod"], "AWS::APS::RuleGroupsNamespace").values()))["Properties"]["Data"]
    for alert, metric in (("TrainerStalled", metrics.TRAINER_LAST_STEP_TIMESTAMP), ("TrainerStraggler", metrics.STRAGGLER_RATIO),
                          ("RolloutBacklog", metrics.ROLLOUT_QUEUE_DEPTH)):
        assert f"alert: {alert}" in rules and metric.name in rules
    workspace = next(iter(resources_of(templates["prod"], "AWS::APS::Workspace").values()))["Properties"]
    routing = yaml.safe_load(yaml.safe_load(join_string(workspace["AlertManagerDefinition"]))["alertmanager_config"])
    receiver = {r["name"]: r for r in routing["receivers"]}[routing["route"]["receiver"]]
    assert receiver["sns_configs"][0]["topic_arn"] == "TOKEN"  # the alarm topic's ARN
    assert receiver["sns_configs"][0]["sigv4"]["region"] == "us-east-2"
    template.resource_count_is("AWS::APS::Scraper", 1)


def test_scraper_writes_to_the_cmk_workspace_through_a_role_pair_and_gets_no_access_entry_from_us(templates):
    template = templates["prod"]
    (scraper,) = resources_of(template, "AWS::APS::Scraper").values()
    roles = scraper["Properties"]["RoleConfiguration"]
    source, target = roles["SourceRoleArn"]["Fn::GetAtt"][0], roles["TargetRoleArn"]["Fn::GetAtt"][0]
    (source_trust,) = template["Resources"][source]["Properties"]["AssumeRolePolicyDocument"]["Statement"]
    assert source_trust["Principal"] == {"Service": "scraper.aps.amazonaws.com"}
    assert source_trust["Condition"]["StringEquals"] == {"aws:SourceAccount": "222222222222"}
    (target_trust,) = template["Resources"][target]["Properties"]["AssumeRolePolicyDocument"]["Statement"]
    assert target_trust["Principal"] == {"AWS": {"Fn::GetAtt": [source, "Arn"]}}
    # The scraper's ARN is its external id; only this account's scrapers (their ARN is known after creation).
    assert join_string(target_trust["Condition"]["StringLike"]["sts:ExternalId"]).endswith(
        ":aps:us-east-2:222222222222:scraper/*")
    assert join_string(source_trust["Condition"]["ArnLike"]["aws:SourceArn"]).endswith(
        ":aps:us-east-2:222222222222:scraper/*")
    (workspace_id, workspace), = resources_of(template, "AWS::APS::Workspace").items()
    target_actions = {(a, json.dumps(st["Resource"])) for p in resources_of(template, "AWS::IAM::Policy").values()
                      if {"Ref": target} in p["Properties"]["Roles"] for st in p["Properties"]["PolicyDocument"]["Statement"]
                      for a in ([st["Action"]] if isinstance(st["Action"], str) else st["Action"])}
    assert ("aps:RemoteWrite", json.dumps({"Fn::GetAtt": [workspace_id, "Arn"]})) in target_actions
    key = json.dumps(workspace["Properties"]["KmsKeyArn"])
    assert {("kms:Decrypt", key), ("kms:GenerateDataKey", key)} <= target_actions
    # AMP makes the scraper's access entry itself: none here, and no RBAC for its user.
    entries = [json.dumps(r["Properties"]) for r in resources_of(template, "AWS::EKS::AccessEntry").values()]
    assert not [e for e in entries if "Scraper" in e or "aps-collector" in e]
    assert not [o for o in kubernetes_objects(template) if "aps-collector" in json.dumps(o)]


def test_scraper_interfaces_live_in_subnets_of_their_own_whose_cidrs_are_an_output(templates):
    template = templates["prod"]
    (scraper,) = resources_of(template, "AWS::APS::Scraper").values()
    subnet_ids = [s["Ref"] for s in scraper["Properties"]["Source"]["EksConfiguration"]["SubnetIds"]]
    assert len(subnet_ids) == 3
    cidrs = [template["Resources"][s]["Properties"]["CidrBlock"] for s in subnet_ids]
    assert all(c.endswith("/28") for c in cidrs)
    node_subnets = {s["Ref"] for ng in resources_of(template, "AWS::EKS::Nodegroup").values() for s in ng["Properties"]["Subnets"]}
    assert not node_subnets & set(subnet_ids)
    output = templates["prod"]["Outputs"][names.OUTPUT_SCRAPER_CIDRS]["Value"]
    assert output == ",".join(cidrs)  # known at synthesis: the run manifests admit scrapes from these only


def test_keda_operator_may_query_only_the_prometheus_workspace_before_it_starts(templates):
    template = templates["prod"]
    (logical_id, association), = [(k, r) for k, r in resources_of(template, "AWS::EKS::PodIdentityAssociation").items()
                                   if r["Properties"]["ServiceAccount"] == "keda-operator"]
    assert association["Properties"]["Namespace"] == KUBERNETES_PINS["1.35"].keda.namespace
    role = association["Properties"]["RoleArn"]["Fn::GetAtt"][0]
    (workspace_id,) = resources_of(template, "AWS::APS::Workspace")
    statements = [s for p in resources_of(template, "AWS::IAM::Policy").values() if {"Ref": role} in p["Properties"]["Roles"]
                  for s in p["Properties"]["PolicyDocument"]["Statement"]]
    assert statements == [{"Action": "aps:QueryMetrics", "Effect": "Allow", "Resource": {"Fn::GetAtt": [workspace_id, "Arn"]}}]
    (keda_chart,) = [r for r in resources_of(template, "Custom::AWSCDK-EKS-HelmChart").values()
                     if r["Properties"]["Release"] == "keda"]
    assert logical_id in keda_chart["DependsOn"]


def test_stack_outputs_use_the_shared_keys(templates):
    outputs = templates["prod"]["Outputs"]
    for key in (names.OUTPUT_CLUSTER_NAME, names.OUTPUT_BUCKET_NAME, names.OUTPUT_TRAINER_REPOSITORY_URI,
                names.OUTPUT_ROLLOUT_REPOSITORY_URI, names.OUTPUT_ORCHESTRATOR_REPOSITORY_URI,
                names.OUTPUT_PROMETHEUS_ENDPOINT, names.OUTPUT_SCRAPER_CIDRS):
        assert key in outputs


def test_every_core_kubernetes_object_the_stack_applies_passes_strict_validation(templates):
    assert strictly_validated_kinds(templates["dev"]) | strictly_validated_kinds(templates["prod"]) == STACK_CORE_KINDS


def _rules(template: dict, kind: str, group: dict) -> set[tuple]:
    """(from port, to port, peer) of every TCP rule of `kind` (Ingress/Egress) on `group`, inline or separate."""
    peer_key = "SourceSecurityGroupId" if kind == "Ingress" else "DestinationSecurityGroupId"
    separate = [r["Properties"] for r in resources_of(template, f"AWS::EC2::SecurityGroup{kind}").values()
                if r["Properties"]["GroupId"] == group]
    inline = []
    if "Fn::GetAtt" in group and group["Fn::GetAtt"][0] in template["Resources"]:
        inline = template["Resources"][group["Fn::GetAtt"][0]]["Properties"].get(f"SecurityGroup{kind}", [])
    return {(r["FromPort"], r["ToPort"], json.dumps(r.get(peer_key), sort_keys=True))
            for r in separate + inline if r.get("IpProtocol") == "tcp"}


def test_lustre_ports_are_open_both_ways_between_fsx_and_the_cluster_security_group(templates):
    template = templates["prod"]
    (fs,) = resources_of(template, "AWS::FSx::FileSystem").values()
    (lustre,) = fs["Properties"]["SecurityGroupIds"]
    _, data = pool(template, "trainer")
    cluster_sg = data["NetworkInterfaces"][0]["Groups"][1]  # every node interface carries it

    def lnet_from(group: dict) -> set[tuple]:  # servers and clients each open LNet connections on these ports
        return {(low, high, json.dumps(group, sort_keys=True)) for low, high in ((988, 988), (1018, 1023))}

    assert lnet_from(cluster_sg) <= _rules(template, "Ingress", lustre)
    assert lnet_from(cluster_sg) <= _rules(template, "Egress", lustre)
    assert lnet_from(lustre) <= _rules(template, "Ingress", cluster_sg)


def test_gpu_pools_repair_unhealthy_nodes_one_at_a_time(templates):
    for env in ("dev", "prod"):
        for role in ("trainer", "rollout"):
            props, _ = pool(templates[env], role)
            assert props["NodeRepairConfig"] == {"Enabled": True, "MaxParallelNodesRepairedCount": 1}, (env, role)


def test_every_pin_supports_each_kubernetes_version_it_is_installed_on():
    from moe_rl_eks.core.cluster import KUBERNETES_VERSIONS

    def minor(version: str) -> tuple[int, int]:
        major, minor_ = version.split(".")
        return int(major), int(minor_)

    for version in KUBERNETES_VERSIONS:
        for name, chart in pinned_charts(version).items():
            low, high = chart.kubernetes
            assert chart.kubernetes_source, name
            assert minor(low) <= minor(version) and (high is None or minor(version) <= minor(high)), \
                f"{name} {chart.version} supports Kubernetes {low} to {high or 'any'} ({chart.kubernetes_source}), " \
                f"not {version}"
        # One autoscaler minor per Kubernetes minor.
        assert KUBERNETES_PINS[version].cluster_autoscaler_image_tag.startswith(f"v{version}."), version
    # KEDA 2.20 is tested on 1.33-1.35 only, so 1.36 gets 2.21; 1.35 keeps the release its CRD schemas come from.
    assert {version: pins.keda.version for version, pins in KUBERNETES_PINS.items()} == {"1.35": "2.20.2",
                                                                                         "1.36": "2.21.0"}
    assert not minor("1.36") <= minor(KUBERNETES_PINS["1.35"].keda.kubernetes[1])
    # The pins the issue of Dec 2026 asked for: Kueue with v1beta2, JobSet 0.12, the plugin's revert.
    assert [CHARTS[n].version for n in ("kueue", "jobset", "nvidia-device-plugin")] == ["0.19.2", "0.12.0", "0.19.3"]


def test_kueue_gives_back_a_whole_gang_that_is_not_ready_in_time_and_admits_one_partial_gang_at_most(templates):
    values = helm_charts(templates["prod"])["kueue"]["Values"]
    config = json.loads(values["managerConfig"]["controllerManagerConfigYaml"])  # JSON is the YAML the chart reads
    assert (config["apiVersion"], config["kind"]) == ("config.kueue.x-k8s.io/v1beta2", "Configuration")
    assert config["waitForPodsReady"] == {
        "timeout": "30m", "blockAdmission": True,
        "requeuingStrategy": {"timestamp": "Eviction", "backoffBaseSeconds": 60, "backoffMaxSeconds": 3600}}
    # The trainer gang is a JobSet: its integration must stay on, or Kueue would not suspend and admit it.
    assert "jobset.x-k8s.io/jobset" in config["integrations"]["frameworks"]
    assert config["leaderElection"]["leaderElect"] is True and config["webhook"]["port"] == 9443
    # The trainer queue admits a gang only against the whole pool's quota (all of its pods or none).
    (trainer_queue,) = [o for o in kubernetes_objects(templates["prod"])
                        if o["kind"] == "ClusterQueue" and o["metadata"]["name"] == names.TRAINER_QUEUE]
    assert trainer_queue["spec"]["resourceGroups"][0]["flavors"][0]["name"] == "moe-rl-trainer"


def test_a_trainer_gang_is_admitted_only_after_the_autoscaler_provisioned_all_of_it(templates):
    """A run that cannot get all its nodes holds none: Kueue creates a gang's pods only once its admission check
    passed, and the check is a ProvisioningRequest for the whole gang, served by the Cluster Autoscaler."""
    template = templates["prod"]
    objects = kubernetes_objects(template)
    queues = {o["metadata"]["name"]: o for o in objects if o["kind"] == "ClusterQueue"}
    # Every flavor of the trainer queue (no onFlavors); the rollout queue (Deployments, no gang) has none.
    assert queues[names.TRAINER_QUEUE]["spec"]["admissionChecksStrategy"] == {
        "admissionChecks": [{"name": "moe-rl-gang"}]}
    assert "admissionChecksStrategy" not in queues[names.ROLLOUT_QUEUE]["spec"]
    (check,) = [o for o in objects if o["kind"] == "AdmissionCheck"]
    assert check["metadata"]["name"] == "moe-rl-gang"
    assert check["spec"] == {"controllerName": "kueue.x-k8s.io/provisioning-request", "parameters": {
        "apiGroup": "kueue.x-k8s.io", "kind": "ProvisioningRequestConfig", "name": "moe-rl-gang"}}
    (config,) = [o for o in objects if o["kind"] == "ProvisioningRequestConfig"]
    # One request for every GPU pod of the gang, scaled up in one step or not at all.
    assert config["spec"]["provisioningClassName"] == "best-effort-atomic-scale-up.autoscaling.x-k8s.io"
    assert config["spec"]["managedResources"] == ["nvidia.com/gpu"]
    assert config["spec"]["retryStrategy"]["backoffLimitCount"] == 8
    # The autoscaler serves ProvisioningRequests: the flag, JSON content type, its RBAC and the CRD it reads.
    args = helm_charts(template)["cluster-autoscaler"]["Values"]["extraArgs"]
    assert (args["enable-provisioning-requests"], args["kube-api-content-type"]) == (True, "application/json")
    (crd,) = [o for o in objects if o["kind"] == "CustomResourceDefinition"]
    assert crd["metadata"]["name"] == "provisioningrequests.autoscaling.x-k8s.io"
    assert [v["name"] for v in crd["spec"]["versions"] if v["served"] and v["storage"]] == ["v1"]
    # From the release the autoscaler's pinned image is built from.
    tag = KUBERNETES_PINS["1.35"].cluster_autoscaler_image_tag
    assert f"cluster-autoscaler-{tag.lstrip('v')} (" in crd["metadata"]["annotations"]["moe-rl/source"]
    (binding,) = [o for o in objects if o["kind"] == "ClusterRoleBinding"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "cluster-autoscaler", "namespace": "kube-system"}]
    (role,) = [o for o in objects if o["kind"] == "ClusterRole"]
    assert {"provisioningrequests", "provisioningrequests/status"} <= set(role["rules"][0]["resources"])
    # Order: the API is served before Kueue and the autoscaler start (Kueue skips its provisioning controller
    # otherwise); the check exists before the queue naming it.
    manifests = resources_of(template, "Custom::AWSCDK-EKS-KubernetesResource")
    (api,) = [k for k, r in manifests.items() if "CustomResourceDefinition" in join_string(r["Properties"]["Manifest"])]
    (check_id,) = [k for k, r in manifests.items() if '"AdmissionCheck"' in join_string(r["Properties"]["Manifest"])]
    charts = {r["Properties"]["Release"]: (k, r) for k, r in resources_of(template, "Custom::AWSCDK-EKS-HelmChart").items()}
    for name in ("kueue", "cluster-autoscaler"):
        assert api in charts[name][1]["DependsOn"], name
    assert charts["kueue"][0] in manifests[check_id]["DependsOn"]
    (trainer_queues,) = [r for r in manifests.values()
                         if '"kind":"LocalQueue","metadata":{"name":"moe-rl-trainer"' in join_string(r["Properties"]["Manifest"]).replace(" ", "")]
    assert check_id in trainer_queues["DependsOn"]
