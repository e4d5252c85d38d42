"""`moerl preflight --env NAME`: can this AWS account and region hold the environment, before `cdk deploy`?

Read-only calls with the caller's credentials (boto3's usual chain), a table, exit 1 on any blocker:
- the credentials belong to the environment's account (STS GetCallerIdentity);
- per pool: the instance type is offered in the GPU availability zone (DescribeInstanceTypeOfferings) and has
  the EFA interfaces the catalog expects (DescribeInstanceTypes);
- per vCPU quota the pools draw on (Service Quotas, On-Demand or Spot of the family): the quota covers every
  pool's max_size together; Capacity Block pools draw on their block instead;
- per configured reservation (DescribeCapacityReservations): it exists, is active or scheduled, is in the GPU
  zone, is for the pool's type, is a Capacity Block when the pool says CAPACITY_BLOCK, and holds max_size;
- the Kubernetes version is in EKS standard support (DescribeClusterVersions), and the VPC CNI add-on version the
  stack pins is offered for it (DescribeAddonVersions);
- with `--after-deploy`: the stack is complete, its outputs exist, and the bucket and ECR repositories they
  name exist.
"""
from __future__ import annotations

import argparse
import datetime as dt
import re
import sys
from dataclasses import dataclass
from typing import Any, Iterable, Literal

from moe_rl_eks.core import cluster
from moe_rl_eks.core.catalog import CATALOG
from moe_rl_eks.core.environment import EnvironmentConfig, NodePoolConfig, load_cdk_json, select_environment
from moe_rl_eks.core.schema import ConfigError

Status = Literal["ok", "warn", "blocker"]
# vCPU quotas of the EC2 families in the catalog (Service Quotas, service code ec2), On-Demand and Spot.
VCPU_QUOTAS: dict[str, dict[str, tuple[str, str]]] = {
    "p": {"ON_DEMAND": ("L-417A185B", "Running On-Demand P instances"),
          "SPOT": ("L-7212CCBC", "All P Spot Instance Requests")},
    "g": {"ON_DEMAND": ("L-DB2E81BA", "Running On-Demand G and VT instances"),
          "SPOT": ("L-3819A6DF", "All G and VT Spot Instance Requests")},
}
USABLE_RESERVATION_STATES = ("active", "scheduled")
# Warn when standard support ends this soon: a cluster created now would move to extended support.
SUPPORT_WARNING_DAYS = 90
COMPLETE_STACK_STATES = ("CREATE_COMPLETE", "UPDATE_COMPLETE", "UPDATE_ROLLBACK_COMPLETE")


@dataclass(frozen=True)
class Finding:
    check: str
    subject: str
    status: Status
    detail: str


@dataclass(frozen=True)
class AwsClients:
    """The boto3 clients preflight reads through. Capacity reservations have their own EC2 client so a test can
    answer that one call (moto has no DescribeCapacityReservations) while moto serves the rest."""
    sts: Any
    ec2: Any
    capacity: Any
    quotas: Any
    eks: Any
    cloudformation: Any = None
    s3: Any = None
    ecr: Any = None

    @classmethod
    def for_region(cls, region: str, session: Any = None) -> "AwsClients":
        import boto3
        session = session or boto3.session.Session()
        ec2 = session.client("ec2", region_name=region)
        return cls(sts=session.client("sts", region_name=region), ec2=ec2, capacity=ec2,
                   quotas=session.client("service-quotas", region_name=region), eks=session.client("eks", region_name=region),
                   cloudformation=session.client("cloudformation", region_name=region),
                   s3=session.client("s3", region_name=region), ecr=session.client("ecr", region_name=region))


def _error_code(exc: Exception) -> str:
    return getattr(exc, "response", {}).get("Error", {}).get("Code", type(exc).__name__)


# --- before deploy ------------------------------------------------------------------------------------------

def check_account(env: EnvironmentConfig, aws: AwsClients) -> Finding:
    account = aws.sts.get_caller_identity()["Account"]
    if account != env.account:
        return Finding("account", account, "blocker", f"these credentials are for account {account}; environment "
                       f"{env.name!r} deploys to {env.account}")
    return Finding("account", account, "ok", "credentials match the environment")


def check_pool_type(role: str, pool: NodePoolConfig, env: EnvironmentConfig, aws: AwsClients) -> list[Finding]:
    subject = f"{role}: {pool.instance_type}"
    offered = aws.ec2.describe_instance_type_offerings(
        LocationType="availability-zone",
        Filters=[{"Name": "location", "Values": [env.gpu_availability_zone]},
                 {"Name": "instance-type", "Values": [pool.instance_type]}])["InstanceTypeOfferings"]
    findings = [Finding("offered in zone", subject, "ok" if offered else "blocker",
                        f"offered in {env.gpu_availability_zone}" if offered else
                        f"not offered in {env.gpu_availability_zone}; choose gpu_availability_zone where it is")]
    described = aws.ec2.describe_instance_types(InstanceTypes=[pool.instance_type])["InstanceTypes"][0]
    network = described.get("NetworkInfo", {})
    efa = network.get("EfaInfo", {}).get("MaximumEfaInterfaces", 0) if network.get("EfaSupported") else 0
    expected = CATALOG[pool.instance_type].efa_interfaces
    if pool.efa and efa != expected:
        findings.append(Finding("efa interfaces", subject, "blocker", f"EC2 reports {efa} EFA interfaces, the catalog "
                                f"expects {expected}: the launch template would be wrong"))
    else:
        findings.append(Finding("efa interfaces", subject, "ok",
                                f"{efa} EFA interfaces" + ("" if pool.efa else " (pool has efa: false)")))
    return findings


def vcpu_quota_needs(env: EnvironmentConfig) -> dict[tuple[str, str], list[tuple[str, int]]]:
    """(quota code, quota name) -> [(pool role, vCPUs at max_size)] for every pool that draws on a quota."""
    needs: dict[tuple[str, str], list[tuple[str, int]]] = {}
    for role, pool in env.pools().items():
        if pool.capacity_type == "CAPACITY_BLOCK":
            continue  # runs in its block; checked against the reservation
        family = pool.instance_type[0]
        if family not in VCPU_QUOTAS:
            raise ValueError(f"{role}_pool.instance_type {pool.instance_type!r}: no vCPU quota known for family "
                             f"{family!r}; known: {', '.join(VCPU_QUOTAS)}")
        quota = VCPU_QUOTAS[family][pool.capacity_type]
        needs.setdefault(quota, []).append((role, pool.max_size * CATALOG[pool.instance_type].vcpus))
    return needs


def check_quotas(env: EnvironmentConfig, aws: AwsClients) -> list[Finding]:
    findings = []
    for (code, name), pools in vcpu_quota_needs(env).items():
        need = sum(v for _, v in pools)
        who = " + ".join(f"{role} {vcpus}" for role, vcpus in pools)
        try:
            value = aws.quotas.get_service_quota(ServiceCode="ec2", QuotaCode=code)["Quota"]["Value"]
        except Exception as exc:
            findings.append(Finding("vcpu quota", f"{code} {name}", "blocker", f"cannot read the quota: {_error_code(exc)}"))
            continue
        ok = value >= need
        findings.append(Finding("vcpu quota", f"{code} {name}", "ok" if ok else "blocker",
                                f"{value:g} vCPUs, max sizes need {need} ({who})" +
                                ("" if ok else "; request an increase in Service Quotas")))
    return findings


def check_reservation(role: str, pool: NodePoolConfig, env: EnvironmentConfig, aws: AwsClients) -> Finding | None:
    rid = pool.capacity_reservation_id
    if rid is None:
        return None
    subject = f"{role}: {rid}"
    try:
        found = aws.capacity.describe_capacity_reservations(CapacityReservationIds=[rid])["CapacityReservations"]
    except Exception as exc:
        return Finding("reservation", subject, "blocker", f"not found in {env.region}: {_error_code(exc)}")
    if not found:
        return Finding("reservation", subject, "blocker", f"not found in {env.region}")
    cr = found[0]
    problems = []
    if cr["State"] not in USABLE_RESERVATION_STATES:
        problems.append(f"state {cr['State']} (needs {' or '.join(USABLE_RESERVATION_STATES)})")
    if cr["AvailabilityZone"] != env.gpu_availability_zone:
        problems.append(f"in {cr['AvailabilityZone']}, the GPU zone is {env.gpu_availability_zone}")
    if cr["InstanceType"] != pool.instance_type:
        problems.append(f"for {cr['InstanceType']}, the pool runs {pool.instance_type}")
    block = cr.get("ReservationType") == "capacity-block"
    if (pool.capacity_type == "CAPACITY_BLOCK") != block:
        problems.append(f"reservation type {cr.get('ReservationType', 'default')} with capacity_type {pool.capacity_type}")
    if problems:
        return Finding("reservation", subject, "blocker", "; ".join(problems))
    window = ""
    if cr.get("StartDate") and cr.get("EndDate"):
        window = f", {cr['StartDate']:%Y-%m-%d %H:%M} to {cr['EndDate']:%Y-%m-%d %H:%M} UTC"
    detail = f"{cr['State']}, {cr['TotalInstanceCount']} x {cr['InstanceType']} in {cr['AvailabilityZone']}{window}"
    if cr["TotalInstanceCount"] < pool.max_size:
        return Finding("reservation", subject, "warn", f"{detail}; max_size {pool.max_size} exceeds it")
    return Finding("reservation", subject, "ok", detail)


def check_kubernetes_version(env: EnvironmentConfig, aws: AwsClients, today: dt.date) -> Finding:
    subject = f"EKS {env.kubernetes_version}"
    versions = aws.eks.describe_cluster_versions(clusterVersions=[env.kubernetes_version], includeAll=True)["clusterVersions"]
    if not versions:
        return Finding("kubernetes version", subject, "blocker", f"EKS does not offer {env.kubernetes_version} in {env.region}")
    info = versions[0]
    end = info.get("endOfStandardSupportDate")
    end_text = f"standard support ends {end:%Y-%m-%d}" if end else "no end of standard support announced"
    if info.get("versionStatus") != "STANDARD_SUPPORT":
        return Finding("kubernetes version", subject, "blocker", f"{info.get('versionStatus')} ({end_text}): a new "
                       "cluster would pay extended support; set kubernetes_version to a version in standard support")
    if end and (end.date() - today).days < SUPPORT_WARNING_DAYS:
        return Finding("kubernetes version", subject, "warn", f"{end_text}, in {(end.date() - today).days} days")
    return Finding("kubernetes version", subject, "ok", end_text)


def check_vpc_cni(env: EnvironmentConfig, aws: AwsClients) -> Finding:
    # The stack pins the VPC CNI add-on (efa-only interfaces need a recent one); EKS offers each add-on version for
    # some Kubernetes versions only, and a pin it does not offer fails the deploy half-way.
    subject = f"vpc-cni {cluster.VPC_CNI_VERSION}"
    offered, token = [], None
    while True:
        page = aws.eks.describe_addon_versions(addonName="vpc-cni", kubernetesVersion=env.kubernetes_version,
                                               **({"nextToken": token} if token else {}))
        offered += [v["addonVersion"] for addon in page.get("addons", []) for v in addon.get("addonVersions", [])]
        token = page.get("nextToken")
        if not token:
            break
    if cluster.VPC_CNI_VERSION in offered:
        return Finding("eks add-on", subject, "ok", f"offered for Kubernetes {env.kubernetes_version}")
    newest = ", ".join(offered[:3]) or "none"
    return Finding("eks add-on", subject, "blocker", f"not offered for Kubernetes {env.kubernetes_version} (offered: "
                   f"{newest}{', ...' if len(offered) > 3 else ''})")


# --- after deploy -------------------------------------------------------------------------------------------

def check_deployed(env: EnvironmentConfig, stack: str, aws: AwsClients) -> list[Finding]:
    try:
        described = aws.cloudformation.describe_stacks(StackName=stack)["Stacks"][0]
    except Exception as exc:
        return [Finding("stack", stack, "blocker", f"not found in {env.region}: {_error_code(exc)}; run cdk deploy")]
    status = described["StackStatus"]
    findings = [Finding("stack", stack, "ok" if status in COMPLETE_STACK_STATES else "blocker", status)]
    outputs = {o["OutputKey"]: o["OutputValue"] for o in described.get("Outputs", [])}
    repositories = [cluster.OUTPUT_TRAINER_REPOSITORY_URI, cluster.OUTPUT_ROLLOUT_REPOSITORY_URI,
                    cluster.OUTPUT_ORCHESTRATOR_REPOSITORY_URI]
    required = [cluster.OUTPUT_CLUSTER_NAME, cluster.OUTPUT_BUCKET_NAME, *repositories]
    if env.observability.prometheus:
        required.append(cluster.OUTPUT_PROMETHEUS_ENDPOINT)
    missing = [key for key in required if key not in outputs]
    findings.append(Finding("stack outputs", stack, "blocker" if missing else "ok",
                            f"missing {', '.join(missing)}" if missing else ", ".join(required)))
    bucket = outputs.get(cluster.OUTPUT_BUCKET_NAME)
    if bucket:
        try:
            aws.s3.head_bucket(Bucket=bucket)
            findings.append(Finding("bucket", bucket, "ok", "exists"))
        except Exception as exc:
            findings.append(Finding("bucket", bucket, "blocker", f"not reachable: {_error_code(exc)}"))
    for key in repositories:
        uri = outputs.get(key)
        if uri:
            findings.append(_check_repository(uri, aws))
    return findings


def _check_repository(uri: str, aws: AwsClients) -> Finding:
    match = re.fullmatch(r"(\d{12})\.dkr\.ecr\.[a-z0-9-]+\.amazonaws\.com/(.+)", uri)
    if not match:
        return Finding("ecr repository", uri, "blocker", "not an ECR repository URI")
    try:
        aws.ecr.describe_repositories(registryId=match.group(1), repositoryNames=[match.group(2)])
    except Exception as exc:
        return Finding("ecr repository", uri, "blocker", f"not found: {_error_code(exc)}")
    return Finding("ecr repository", uri, "ok", "exists")


# --- driver -------------------------------------------------------------------------------------------------

def run_preflight(env: EnvironmentConfig, aws: AwsClients, *, today: dt.date, after_deploy_stack: str | None = None) -> list[Finding]:
    findings = [check_account(env, aws)]
    for role, pool in env.pools().items():
        findings += check_pool_type(role, pool, env, aws)
    findings += check_quotas(env, aws)
    findings += [f for role, pool in env.pools().items() if (f := check_reservation(role, pool, env, aws))]
    findings.append(check_kubernetes_version(env, aws, today))
    findings.append(check_vpc_cni(env, aws))
    if after_deploy_stack:
        findings += check_deployed(env, after_deploy_stack, aws)
    return findings


def format_table(findings: Iterable[Finding]) -> str:
    rows = [("CHECK", "SUBJECT", "STATUS", "DETAIL")] + [(f.check, f.subject, f.status.upper(), f.detail) for f in findings]
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    return "\n".join(f"{r[0]:{widths[0]}}  {r[1]:{widths[1]}}  {r[2]:{widths[2]}}  {r[3]}" for r in rows)


def add_environment_arguments(parser: argparse.ArgumentParser) -> None:
    """--env and --cdk-json, as every command that works on one environment of an account takes them."""
    parser.add_argument("--env", required=True, help="environment name in cdk.json")
    parser.add_argument("--cdk-json", default="cdk.json", help="the cdk.json holding the environments (default ./cdk.json)")


def environment_from(args: argparse.Namespace) -> EnvironmentConfig | None:
    """The environment ``args`` name; None, with the reason printed, when there is none."""
    try:
        return select_environment(load_cdk_json(args.cdk_json), args.env)
    except (ConfigError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return None


def main(argv: list[str], aws: AwsClients | None = None) -> int:
    parser = argparse.ArgumentParser(prog="moerl preflight", description=__doc__.split("\n\n")[0])
    add_environment_arguments(parser)
    parser.add_argument("--after-deploy", action="store_true", help="also check the deployed stack, bucket and repositories")
    parser.add_argument("--stack", help="stack name for --after-deploy (default MoeRl-<env>, as app.py names it)")
    args = parser.parse_args(argv)
    env = environment_from(args)
    if env is None:
        return 2
    from botocore.exceptions import BotoCoreError, ClientError
    aws = aws or AwsClients.for_region(env.region)
    stack = (args.stack or f"MoeRl-{env.name}") if args.after_deploy else None
    try:
        findings = run_preflight(env, aws, today=dt.datetime.now(dt.timezone.utc).date(), after_deploy_stack=stack)
    except (BotoCoreError, ClientError) as exc:
        # No credentials, an expired session, or a call the credentials may not make: nothing to tabulate.
        print(f"error: preflight for {env.name!r} ({env.account}, {env.region}) could not read the account: {exc}",
              file=sys.stderr)
        return 2
    print(format_table(findings))
    blockers = sum(f.status == "blocker" for f in findings)
    print(f"\npreflight {env.name} ({env.account}, {env.region}): " + (f"{blockers} blocker(s)" if blockers else "ready"))
    return 1 if blockers else 0
