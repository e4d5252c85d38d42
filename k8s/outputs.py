"""Values that exist only after `cdk deploy`: read from its outputs file (`cdk deploy --outputs-file FILE`).

The file maps stack name -> {output key: value}. One file may hold several stacks (`--all`); the stack of an
environment is the one whose ECR repositories live in that environment's account and region.
"""
from __future__ import annotations

import ipaddress
import json
import re
from dataclasses import dataclass
from pathlib import Path

from moe_rl_eks.core import cluster
from moe_rl_eks.core.environment import EnvironmentConfig
from moe_rl_eks.core.run import RunConfig
from moe_rl_eks.core.schema import ConfigError

_ECR_URI = re.compile(r"(\d{12})\.dkr\.ecr\.([a-z0-9-]+)\.amazonaws\.com/[a-z0-9]+(?:[._/-][a-z0-9]+)*")
_BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")
_AMP_ENDPOINT = re.compile(r"https://aps-workspaces\.([a-z0-9-]+)\.amazonaws\.com/workspaces/ws-[0-9a-f-]+/?")


@dataclass(frozen=True)
class StackOutputs:
    stack: str
    bucket_name: str  # the artifact bucket: the only one the run's Pod Identity roles may use
    trainer_repository_uri: str
    rollout_repository_uri: str
    orchestrator_repository_uri: str
    prometheus_endpoint: str | None  # the workspace URL, no trailing slash; None when the stack has none
    scraper_cidrs: tuple[str, ...]  # the managed scraper's subnets (with the workspace); () without one


def load_outputs(path: str | Path, env: EnvironmentConfig) -> StackOutputs:
    """The outputs of `env`'s stack in `path`, checked against the environment's account and region."""
    source = str(path)
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ConfigError(source, "", None,
                          "outputs file not found; write it with `cdk deploy --outputs-file`") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(source, "", None, f"not valid JSON: {exc}") from None
    if not isinstance(data, dict) or not all(isinstance(v, dict) for v in data.values()):
        raise ConfigError(source, "", None, "expected {stack name: {output key: value}} as `cdk deploy` writes it")
    homes = {name: _stack_home(outs.get(cluster.OUTPUT_TRAINER_REPOSITORY_URI)) for name, outs in data.items()}
    ours = {name: data[name] for name, home in homes.items() if home == (env.account, env.region)}
    if len(ours) != 1:
        found = ", ".join(f"{name} in {home or 'no repository'}" for name, home in homes.items()) or "no stacks"
        raise ConfigError(source, cluster.OUTPUT_TRAINER_REPOSITORY_URI, None,
                          f"expected exactly one stack with repositories in account {env.account}, region {env.region} "
                          f"(environment {env.name!r}); found: {found}")
    (stack, outs), = ours.items()
    uris = {}
    for key in (cluster.OUTPUT_TRAINER_REPOSITORY_URI, cluster.OUTPUT_ROLLOUT_REPOSITORY_URI,
                cluster.OUTPUT_ORCHESTRATOR_REPOSITORY_URI):
        value = outs.get(key)
        if _stack_home(value) != (env.account, env.region):
            raise ConfigError(source, f"{stack}.{key}", value,
                              f"expected an ECR repository URI in {env.account}.dkr.ecr.{env.region}.amazonaws.com")
        uris[key] = value
    endpoint = outs.get(cluster.OUTPUT_PROMETHEUS_ENDPOINT)
    if endpoint is not None:
        match = _AMP_ENDPOINT.fullmatch(str(endpoint))
        if not match or match.group(1) != env.region:
            raise ConfigError(source, f"{stack}.{cluster.OUTPUT_PROMETHEUS_ENDPOINT}", endpoint,
                              f"expected https://aps-workspaces.{env.region}.amazonaws.com/workspaces/ws-...")
        endpoint = endpoint.rstrip("/")
    scraper_cidrs = _scraper_cidrs(source, stack, outs.get(cluster.OUTPUT_SCRAPER_CIDRS), env, scraped=endpoint is not None)
    bucket = outs.get(cluster.OUTPUT_BUCKET_NAME)
    if not isinstance(bucket, str) or not _BUCKET.fullmatch(bucket):
        raise ConfigError(source, f"{stack}.{cluster.OUTPUT_BUCKET_NAME}", bucket, "expected the artifact bucket's name")
    return StackOutputs(stack, bucket, uris[cluster.OUTPUT_TRAINER_REPOSITORY_URI], uris[cluster.OUTPUT_ROLLOUT_REPOSITORY_URI],
                        uris[cluster.OUTPUT_ORCHESTRATOR_REPOSITORY_URI], endpoint, scraper_cidrs)


def _scraper_cidrs(source: str, stack: str, value: object, env: EnvironmentConfig, *, scraped: bool) -> tuple[str, ...]:
    """The scraper subnets' CIDRs: required with a Prometheus workspace, each inside the environment's VPC."""
    field = f"{stack}.{cluster.OUTPUT_SCRAPER_CIDRS}"
    if not scraped:
        return ()
    vpc = ipaddress.ip_network(env.vpc_cidr)
    try:
        cidrs = tuple(value.split(",")) if isinstance(value, str) and value else ()
        nets = [ipaddress.ip_network(c) for c in cidrs]
    except ValueError:
        nets, cidrs = [], ()
    if not cidrs or not all(n.version == 4 and n.subnet_of(vpc) for n in nets):
        raise ConfigError(source, field, value, f"expected the comma-separated CIDRs of the scraper's subnets inside "
                          f"the VPC {env.vpc_cidr} (a stack with a Prometheus workspace writes them)")
    return cidrs


def _stack_home(uri: object) -> tuple[str, str] | None:
    match = _ECR_URI.fullmatch(uri) if isinstance(uri, str) else None
    return (match.group(1), match.group(2)) if match else None


def check_run_storage(run: RunConfig, outputs: StackOutputs, source: str) -> None:
    """Every S3 location of ``run`` is one its pods' roles may use: the stack's bucket, under the prefix granted to
    the role that reads or writes it. Anything else would pass every other check and fail at run time with
    AccessDenied."""
    weights = run.rl.weights
    if weights.kind == "s3":
        if weights.bucket != outputs.bucket_name:
            raise ConfigError(source, "rl.weights.bucket", weights.bucket,
                              f"the trainer and rollout roles may use only the stack's bucket "
                              f"{outputs.bucket_name!r} ({outputs.stack}.{cluster.OUTPUT_BUCKET_NAME})")
        if f"{weights.prefix.strip('/')}/" != cluster.WEIGHTS_PREFIX:
            raise ConfigError(source, "rl.weights.prefix", weights.prefix,
                              f"the trainer may write and rollout servers read only {cluster.WEIGHTS_PREFIX!r}")
    for split in ("train", "eval"):
        value = getattr(run.rl.data, split)
        for i, uri in enumerate(run.rl.data.locations(split)):
            if not uri.startswith("s3://"):
                continue
            field = f"rl.data.{split}" if isinstance(value, str) else f"rl.data.{split}[{i}]"
            bucket, _, key = uri[len("s3://"):].partition("/")
            if bucket == outputs.bucket_name and key.startswith(cluster.PROMPTS_PREFIX):
                continue
            raise ConfigError(source, field, uri,
                              f"the orchestrator's role may read only s3://{outputs.bucket_name}/"
                              f"{cluster.PROMPTS_PREFIX}... ({outputs.stack}.{cluster.OUTPUT_BUCKET_NAME}); the "
                              f"bucket is also linked at {cluster.FSX_MOUNT_PATH}/, so "
                              f"{cluster.FSX_MOUNT_PATH}/{cluster.PROMPTS_PREFIX}... reads the same files")
