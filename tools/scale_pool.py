"""`moerl scale-pool --env NAME --role ROLE --nodes N`: size a reserved GPU pool once its reservation can hold it.

A Capacity Block pool is created at 0 nodes (core.environment refuses more): its instances exist only while the
block is active, and a node group created before then fails and rolls the stack back. When the block is active,
this command sets the pool's node group to N nodes, minimum and desired both, so the Cluster Autoscaler does not
remove nodes of a block that is paid for anyway; `--nodes 0` hands the pool back to the autoscaler at 0.

It refuses, before changing anything: a pool without a reservation (the autoscaler sizes those), N above the pool's
max_size or the reservation's instance count, and N > 0 while the reservation is not active. The node group is
found on the cluster by its `moe-rl/role` label. Calls: EC2 DescribeCapacityReservations, EKS ListNodegroups,
DescribeNodegroup and UpdateNodegroupConfig.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from typing import Any

from moe_rl_eks.core.environment import EnvironmentConfig
from moe_rl_eks.core.labels import ROLE_LABEL

from .preflight import add_environment_arguments, environment_from


class ScaleRefused(Exception):
    """The pool cannot be scaled as asked; the message says why and what would work."""


@dataclass(frozen=True)
class ScaleClients:
    """The boto3 clients the command uses; EC2 only for DescribeCapacityReservations (moto lacks it)."""
    ec2: Any
    eks: Any

    @classmethod
    def for_region(cls, region: str) -> "ScaleClients":
        import boto3
        session = boto3.session.Session()
        return cls(ec2=session.client("ec2", region_name=region), eks=session.client("eks", region_name=region))


def default_cluster_name(env: EnvironmentConfig) -> str:
    return f"moe-rl-{env.name}"  # as infra/stack.py names an environment's cluster


def find_nodegroup(eks: Any, cluster_name: str, role: str) -> dict:
    """The cluster's one node group labelled ``moe-rl/role=<role>`` (DescribeNodegroup's ``nodegroup``)."""
    matches = []
    for page in eks.get_paginator("list_nodegroups").paginate(clusterName=cluster_name):
        for name in page["nodegroups"]:
            group = eks.describe_nodegroup(clusterName=cluster_name, nodegroupName=name)["nodegroup"]
            if group.get("labels", {}).get(ROLE_LABEL) == role:
                matches.append(group)
    if len(matches) != 1:
        found = ", ".join(g["nodegroupName"] for g in matches) or "none"
        raise ScaleRefused(f"cluster {cluster_name!r}: expected one node group labelled {ROLE_LABEL}={role}, "
                           f"found {found}")
    return matches[0]


def scale_pool(env: EnvironmentConfig, role: str, nodes: int, aws: ScaleClients, *, cluster_name: str) -> str:
    """Check the reservation and the sizes, then update the node group; returns what was done."""
    pools = env.pools()
    if role not in pools:
        raise ScaleRefused(f"--role: {role!r} is not a pool of environment {env.name!r}; pools: {', '.join(pools)}")
    pool = pools[role]
    rid = pool.capacity_reservation_id
    if rid is None:
        raise ScaleRefused(f"{role}_pool has no capacity_reservation_id: the Cluster Autoscaler sizes pools without "
                           "a reservation from the pods that ask for them")
    if not 0 <= nodes <= pool.max_size:
        raise ScaleRefused(f"--nodes: {nodes} is not allowed; between 0 and {role}_pool.max_size ({pool.max_size})")
    if nodes:
        found = aws.ec2.describe_capacity_reservations(CapacityReservationIds=[rid])["CapacityReservations"]
        if not found:
            raise ScaleRefused(f"reservation {rid} not found in {env.region}")
        cr = found[0]
        if cr["State"] != "active":
            start = f" (starts {cr['StartDate']:%Y-%m-%d %H:%M} UTC)" if cr.get("StartDate") else ""
            raise ScaleRefused(f"reservation {rid} is {cr['State']}{start}: nodes can launch only into an active "
                               "one; run this again once it is")
        if nodes > cr["TotalInstanceCount"]:
            raise ScaleRefused(f"--nodes: {nodes} is more than reservation {rid} holds ({cr['TotalInstanceCount']})")
    group = find_nodegroup(aws.eks, cluster_name, role)
    aws.eks.update_nodegroup_config(clusterName=cluster_name, nodegroupName=group["nodegroupName"],
                                    scalingConfig={"minSize": nodes, "desiredSize": nodes})
    return f"{cluster_name}/{group['nodegroupName']} ({role}): min and desired {nodes}, max {pool.max_size}"


def main(argv: list[str], aws: ScaleClients | None = None) -> int:
    parser = argparse.ArgumentParser(prog="moerl scale-pool", description=__doc__.split("\n\n")[0])
    add_environment_arguments(parser)
    parser.add_argument("--role", required=True, help="the pool: trainer or rollout")
    parser.add_argument("--nodes", required=True, type=int, help="nodes to hold (0 hands the pool back)")
    parser.add_argument("--cluster", help="cluster name (default moe-rl-<env>, as the stack names it)")
    args = parser.parse_args(argv)
    env = environment_from(args)
    if env is None:
        return 2
    from botocore.exceptions import BotoCoreError, ClientError
    try:
        done = scale_pool(env, args.role, args.nodes, aws or ScaleClients.for_region(env.region),
                          cluster_name=args.cluster or default_cluster_name(env))
    except ScaleRefused as exc:
        print(f"refused: {exc}", file=sys.stderr)
        return 1
    except (BotoCoreError, ClientError) as exc:
        print(f"error: scale-pool for {env.name!r} ({env.account}, {env.region}): {exc}", file=sys.stderr)
        return 2
    print(done)
    return 0
