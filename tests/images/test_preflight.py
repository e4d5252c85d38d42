"""`moerl preflight` against moto's server on 127.0.0.1 (STS, EC2 offerings and instance types, S3, ECR,
CloudFormation). moto 5.2.5 lacks four calls, answered with botocore's Stubber: EC2 DescribeCapacityReservations,
Service Quotas GetServiceQuota for ec2 (moto knows only vpc quotas), EKS DescribeClusterVersions and EKS
DescribeAddonVersions (moto has no EKS add-ons)."""
from __future__ import annotations

import dataclasses
import datetime as dt
import json
import socket
from pathlib import Path

import boto3
import pytest
from botocore.stub import Stubber
from moto.server import ThreadedMotoServer

from moe_rl_eks.core import cluster
from moe_rl_eks.tools import preflight
from moe_rl_eks.core.environment import load_cdk_json, select_environment
from moe_rl_eks.tools.preflight import AwsClients, main, run_preflight

REGION = "us-east-1"
CDK_JSON = Path(__file__).resolve().parents[2] / "cdk.json"
MOTO_ACCOUNT = "123456789012"  # the account moto answers for
TODAY = dt.date(2026, 12, 1)
FAR = dt.datetime(2027, 12, 1, tzinfo=dt.timezone.utc)
VERSION = select_environment(load_cdk_json(CDK_JSON), "dev").kubernetes_version


@pytest.fixture(scope="module")
def endpoint():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    yield f"http://127.0.0.1:{port}"
    server.stop()


def _client(service: str, endpoint: str | None = None):
    return boto3.client(service, region_name=REGION, endpoint_url=endpoint, aws_access_key_id="testing",
                        aws_secret_access_key="testing")


class Aws:
    """Clients to moto, plus stubbed clients for the three calls moto lacks."""

    def __init__(self, endpoint: str):
        self.stubbed = {name: _client(service) for name, service in
                        (("capacity", "ec2"), ("quotas", "service-quotas"), ("eks", "eks"))}
        self.stubs = {name: Stubber(client) for name, client in self.stubbed.items()}
        self.clients = AwsClients(sts=_client("sts", endpoint), ec2=_client("ec2", endpoint), **self.stubbed,
                                  cloudformation=_client("cloudformation", endpoint), s3=_client("s3", endpoint),
                                  ecr=_client("ecr", endpoint))

    def quota(self, code: str, value: float) -> None:
        self.stubs["quotas"].add_response("get_service_quota", {"Quota": {"QuotaCode": code, "Value": value}},
                                          {"ServiceCode": "ec2", "QuotaCode": code})

    def kubernetes(self, version: str, status: str, end: dt.datetime = FAR) -> None:
        self.stubs["eks"].add_response(
            "describe_cluster_versions",
            {"clusterVersions": [{"clusterVersion": version, "versionStatus": status, "endOfStandardSupportDate": end}]},
            {"clusterVersions": [version], "includeAll": True})

    def vpc_cni(self, version: str, offered: list[str]) -> None:
        self.stubs["eks"].add_response(
            "describe_addon_versions",
            {"addons": [{"addonName": "vpc-cni", "addonVersions": [{"addonVersion": v} for v in offered]}]},
            {"addonName": "vpc-cni", "kubernetesVersion": version})

    def reservation(self, rid: str, **fields) -> None:
        self.stubs["capacity"].add_response("describe_capacity_reservations",
                                            {"CapacityReservations": [{"CapacityReservationId": rid, **fields}]},
                                            {"CapacityReservationIds": [rid]})

    def __enter__(self):
        for stub in self.stubs.values():
            stub.activate()
        return self

    def __exit__(self, *exc):
        for stub in self.stubs.values():
            stub.assert_no_pending_responses()  # every stubbed call was made
            stub.deactivate()


def dev_environment(**changes):
    """The repository's dev environment, in moto's account."""
    env = select_environment(load_cdk_json(CDK_JSON), "dev")
    return dataclasses.replace(env, account=MOTO_ACCOUNT, **changes)


def by_check(findings):
    return {(f.check, f.subject): f for f in findings}


def test_dev_environment_is_ready_when_quotas_cover_both_pools(endpoint):
    env = dev_environment()
    with Aws(endpoint) as aws:
        aws.quota("L-DB2E81BA", 96)  # rollout: 2 x g6e.12xlarge x 48 vCPUs
        aws.quota("L-417A185B", 384)  # trainer: 2 x p5.48xlarge x 192 vCPUs
        aws.kubernetes(VERSION, "STANDARD_SUPPORT")
        aws.vpc_cni(VERSION, ["v1.23.0-eksbuild.1", cluster.VPC_CNI_VERSION])
        findings = run_preflight(env, aws.clients, today=TODAY)
    assert [f for f in findings if f.status != "ok"] == []
    found = by_check(findings)
    assert found[("efa interfaces", "trainer: p5.48xlarge")].detail == "32 EFA interfaces"
    assert found[("vcpu quota", "L-417A185B Running On-Demand P instances")].detail == \
        "384 vCPUs, max sizes need 384 (trainer 384)"


def test_blockers_name_zone_quota_reservation_and_support(endpoint):
    # p5e.48xlarge is not offered in us-east-1a (moto's copy of EC2's offerings); the Capacity Block sits in
    # another zone; the P quota is one node short; the version is (here, as if) in extended support.
    trainer = dataclasses.replace(dev_environment().trainer_pool, instance_type="p5e.48xlarge", max_size=2,
                                  capacity_type="CAPACITY_BLOCK", capacity_reservation_id="cr-0123456789abcdef0")
    rollout = dataclasses.replace(dev_environment().rollout_pool, instance_type="p5.48xlarge", efa=True, max_size=2)
    env = dev_environment(trainer_pool=trainer, rollout_pool=rollout)
    with Aws(endpoint) as aws:
        aws.quota("L-417A185B", 192)  # only the rollout pool draws on it (the trainer runs in its block)
        aws.reservation("cr-0123456789abcdef0", State="active", AvailabilityZone="us-east-1b",
                        InstanceType="p5e.48xlarge", ReservationType="capacity-block", TotalInstanceCount=2)
        aws.kubernetes(VERSION, "EXTENDED_SUPPORT", dt.datetime(2026, 7, 29, tzinfo=dt.timezone.utc))
        aws.vpc_cni(VERSION, ["v1.23.0-eksbuild.1", "v1.22.4-eksbuild.1", "v1.22.3-eksbuild.2", "v1.21.0-eksbuild.1"])
        found = by_check(run_preflight(env, aws.clients, today=TODAY))
    blockers = {key: f.detail for key, f in found.items() if f.status == "blocker"}
    assert blockers == {
        ("offered in zone", "trainer: p5e.48xlarge"): "not offered in us-east-1a; choose gpu_availability_zone where it is",
        ("vcpu quota", "L-417A185B Running On-Demand P instances"):
            "192 vCPUs, max sizes need 384 (rollout 384); request an increase in Service Quotas",
        ("reservation", "trainer: cr-0123456789abcdef0"): "in us-east-1b, the GPU zone is us-east-1a",
        ("kubernetes version", f"EKS {VERSION}"): "EXTENDED_SUPPORT (standard support ends 2026-07-29): a new cluster "
            "would pay extended support; set kubernetes_version to a version in standard support",
        ("eks add-on", f"vpc-cni {cluster.VPC_CNI_VERSION}"): f"not offered for Kubernetes {VERSION} (offered: "
            "v1.23.0-eksbuild.1, v1.22.4-eksbuild.1, v1.22.3-eksbuild.2, ...)",
    }


def test_reservation_state_type_and_size(endpoint):
    trainer = dataclasses.replace(dev_environment().trainer_pool, max_size=4,
                                  capacity_reservation_id="cr-0123456789abcdef0")
    env = dev_environment(trainer_pool=trainer)
    cases = [
        (dict(State="expired", ReservationType="default", TotalInstanceCount=4), "blocker",
         "state expired (needs active or scheduled)"),
        (dict(State="active", ReservationType="capacity-block", TotalInstanceCount=4), "blocker",
         "reservation type capacity-block with capacity_type ON_DEMAND"),
        (dict(State="scheduled", ReservationType="default", TotalInstanceCount=2), "warn",
         "scheduled, 2 x p5.48xlarge in us-east-1a; max_size 4 exceeds it"),
    ]
    for fields, status, detail in cases:
        with Aws(endpoint) as aws:
            aws.reservation("cr-0123456789abcdef0", AvailabilityZone="us-east-1a", InstanceType="p5.48xlarge", **fields)
            finding = preflight.check_reservation("trainer", trainer, env, aws.clients)
        assert (finding.status, finding.detail) == (status, detail)


def test_wrong_account_is_a_blocker(endpoint):
    env = dataclasses.replace(dev_environment(), account="111111111111")
    finding = preflight.check_account(env, Aws(endpoint).clients)
    assert finding.status == "blocker"
    assert finding.detail == "these credentials are for account 123456789012; environment 'dev' deploys to 111111111111"


def test_standard_support_ending_soon_warns(endpoint):
    with Aws(endpoint) as aws:
        aws.kubernetes(VERSION, "STANDARD_SUPPORT", dt.datetime(2027, 1, 15, tzinfo=dt.timezone.utc))
        finding = preflight.check_kubernetes_version(dev_environment(), aws.clients, TODAY)
    assert (finding.status, finding.detail) == ("warn", "standard support ends 2027-01-15, in 45 days")


def _deploy(aws: Aws, stack: str, *, rollout_repository: bool) -> dict[str, str]:
    """What `cdk deploy` leaves behind, made in moto: a bucket, ECR repositories, a stack with outputs."""
    c = aws.clients
    c.s3.create_bucket(Bucket=f"{stack.lower()}-artifacts")
    uris = {}
    for name in ("trainer", "rollout", "orchestrator"):
        repo = f"{stack.lower()}/{name}"
        uris[name] = f"{MOTO_ACCOUNT}.dkr.ecr.{REGION}.amazonaws.com/{repo}"
        if name != "rollout" or rollout_repository:
            c.ecr.create_repository(repositoryName=repo)
    outputs = {"ClusterName": "moe-rl-dev", "ArtifactBucketName": f"{stack.lower()}-artifacts",
               "TrainerRepositoryUri": uris["trainer"], "RolloutRepositoryUri": uris["rollout"],
               "OrchestratorRepositoryUri": uris["orchestrator"],
               "PrometheusEndpoint": "https://aps-workspaces.us-east-1.amazonaws.com/workspaces/ws-1/"}
    template = {"Resources": {"Topic": {"Type": "AWS::SNS::Topic"}},
                "Outputs": {k: {"Value": v} for k, v in outputs.items()}}
    c.cloudformation.create_stack(StackName=stack, TemplateBody=json.dumps(template))
    return uris


def test_after_deploy_finds_stack_outputs_bucket_and_repositories(endpoint):
    aws = Aws(endpoint)
    _deploy(aws, "MoeRl-ok", rollout_repository=True)
    findings = preflight.check_deployed(dev_environment(), "MoeRl-ok", aws.clients)
    assert [(f.check, f.status) for f in findings] == [
        ("stack", "ok"), ("stack outputs", "ok"), ("bucket", "ok"), ("ecr repository", "ok"), ("ecr repository", "ok"),
        ("ecr repository", "ok")]


def test_after_deploy_blocks_on_missing_repository_and_stack(endpoint):
    aws = Aws(endpoint)
    uris = _deploy(aws, "MoeRl-partial", rollout_repository=False)
    found = by_check(preflight.check_deployed(dev_environment(), "MoeRl-partial", aws.clients))
    assert found[("ecr repository", uris["rollout"])].status == "blocker"
    assert found[("ecr repository", uris["rollout"])].detail.startswith("not found: RepositoryNotFoundException")
    (missing,) = preflight.check_deployed(dev_environment(), "MoeRl-absent", aws.clients)
    assert (missing.check, missing.status) == ("stack", "blocker")


def test_cli_prints_a_table_and_exits_1_on_blockers(endpoint, tmp_path, capsys):
    cdk = json.loads(CDK_JSON.read_text())
    cdk["context"]["environments"]["dev"]["account"] = MOTO_ACCOUNT
    (tmp_path / "cdk.json").write_text(json.dumps(cdk))
    with Aws(endpoint) as aws:
        aws.quota("L-DB2E81BA", 0)
        aws.quota("L-417A185B", 384)
        aws.kubernetes(VERSION, "STANDARD_SUPPORT")
        aws.vpc_cni(VERSION, [cluster.VPC_CNI_VERSION])
        code = main(["--env", "dev", "--cdk-json", str(tmp_path / "cdk.json")], aws=aws.clients)
    out = capsys.readouterr().out
    assert code == 1
    assert out.splitlines()[0].split() == ["CHECK", "SUBJECT", "STATUS", "DETAIL"]
    assert "L-DB2E81BA Running On-Demand G and VT instances  BLOCKER  0 vCPUs, max sizes need 96 (rollout 96)" in out
    assert out.rstrip().endswith(f"preflight dev ({MOTO_ACCOUNT}, us-east-1): 1 blocker(s)")


def test_cli_names_an_unknown_environment(capsys):
    assert main(["--env", "staging", "--cdk-json", str(CDK_JSON)]) == 2
    assert "known environments: dev, prod" in capsys.readouterr().err


def test_cli_without_credentials_says_so(endpoint, monkeypatch, tmp_path, capsys):
    # boto3's own credential chain, pointed at moto and away from any real endpoint or instance metadata.
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    assert main(["--env", "dev", "--cdk-json", str(CDK_JSON)]) == 2
    err = capsys.readouterr().err
    assert "error: preflight for 'dev' (111111111111, us-east-1) could not read the account: Unable to locate " \
           "credentials" in err


def test_vpc_cni_versions_are_read_across_pages(endpoint):
    with Aws(endpoint) as aws:
        eks = aws.stubs["eks"]
        eks.add_response("describe_addon_versions",
                         {"addons": [{"addonName": "vpc-cni", "addonVersions": [{"addonVersion": "v1.23.0-eksbuild.1"}]}],
                          "nextToken": "page-2"},
                         {"addonName": "vpc-cni", "kubernetesVersion": VERSION})
        eks.add_response("describe_addon_versions",
                         {"addons": [{"addonName": "vpc-cni", "addonVersions": [{"addonVersion": cluster.VPC_CNI_VERSION}]}]},
                         {"addonName": "vpc-cni", "kubernetesVersion": VERSION, "nextToken": "page-2"})
        finding = preflight.check_vpc_cni(dev_environment(), aws.clients)
    assert (finding.status, finding.detail) == ("ok", f"offered for Kubernetes {VERSION}")
