"""`moerl scale-pool` against moto's EKS (node groups found by their role label, then resized); moto 5.2.5 has no
DescribeCapacityReservations, answered with botocore's Stubber."""
from __future__ import annotations

import datetime as dt
from pathlib import Path

import boto3
import pytest
from botocore.stub import Stubber
from moto import mock_aws

from moe_rl_eks.core.environment import load_cdk_json, select_environment
from moe_rl_eks.tools.scale_pool import ScaleClients, ScaleRefused, main, scale_pool

CDK_JSON = Path(__file__).resolve().parents[2] / "cdk.json"
PROD = select_environment(load_cdk_json(CDK_JSON), "prod")
RESERVATION = PROD.trainer_pool.capacity_reservation_id
CLUSTER = "moe-rl-prod"


@pytest.fixture
def aws(monkeypatch):
    for name, value in (("AWS_ACCESS_KEY_ID", "testing"), ("AWS_SECRET_ACCESS_KEY", "testing"),
                        ("AWS_DEFAULT_REGION", PROD.region)):
        monkeypatch.setenv(name, value)
    with mock_aws():
        eks = boto3.client("eks", region_name=PROD.region)
        eks.create_cluster(name=CLUSTER, roleArn="arn:aws:iam::123456789012:role/cluster",
                           resourcesVpcConfig={"subnetIds": ["subnet-1"]})
        for name, role in (("TrainerPoolNodegroup-abc", "trainer"), ("RolloutPoolNodegroup-def", "rollout"),
                           ("system", "system")):
            eks.create_nodegroup(clusterName=CLUSTER, nodegroupName=name, subnets=["subnet-1"],
                                 nodeRole="arn:aws:iam::123456789012:role/node", labels={"moe-rl/role": role},
                                 scalingConfig={"minSize": 0, "desiredSize": 0, "maxSize": 16})
        ec2 = boto3.client("ec2", region_name=PROD.region)
        stub = Stubber(ec2)
        with stub:
            yield ScaleClients(ec2=ec2, eks=eks), stub
            stub.assert_no_pending_responses()


def _reservation(stub: Stubber, state: str, count: int = 4) -> None:
    stub.add_response("describe_capacity_reservations", {"CapacityReservations": [{
        "CapacityReservationId": RESERVATION, "State": state, "TotalInstanceCount": count,
        "InstanceType": "p5en.48xlarge", "AvailabilityZone": PROD.gpu_availability_zone,
        "StartDate": dt.datetime(2026, 12, 3, 11, 30, tzinfo=dt.timezone.utc)}]},
        {"CapacityReservationIds": [RESERVATION]})


def _scaling(clients: ScaleClients, name: str) -> dict:
    return clients.eks.describe_nodegroup(clusterName=CLUSTER, nodegroupName=name)["nodegroup"]["scalingConfig"]


def test_active_block_scales_the_role_labelled_node_group_only(aws):
    clients, stub = aws
    _reservation(stub, "active")
    done = scale_pool(PROD, "trainer", 4, clients, cluster_name=CLUSTER)
    assert done == "moe-rl-prod/TrainerPoolNodegroup-abc (trainer): min and desired 4, max 16"
    assert _scaling(clients, "TrainerPoolNodegroup-abc") == {"minSize": 4, "desiredSize": 4, "maxSize": 16}
    assert _scaling(clients, "RolloutPoolNodegroup-def")["desiredSize"] == 0


def test_back_to_zero_needs_no_reservation_lookup(aws):
    clients, _ = aws  # no stubbed response: a describe call would fail the stub
    scale_pool(PROD, "trainer", 0, clients, cluster_name=CLUSTER)
    assert _scaling(clients, "TrainerPoolNodegroup-abc")["desiredSize"] == 0


@pytest.mark.parametrize("state, count, nodes, message", [
    ("scheduled", 4, 4, f"reservation {RESERVATION} is scheduled (starts 2026-12-03 11:30 UTC): nodes can launch "
                        "only into an active one"),
    ("active", 2, 4, f"--nodes: 4 is more than reservation {RESERVATION} holds (2)"),
])
def test_inactive_or_small_block_is_refused_and_nothing_changes(aws, state, count, nodes, message):
    clients, stub = aws
    _reservation(stub, state, count)
    with pytest.raises(ScaleRefused, match=message.replace("(", r"\(").replace(")", r"\)")):
        scale_pool(PROD, "trainer", nodes, clients, cluster_name=CLUSTER)
    assert _scaling(clients, "TrainerPoolNodegroup-abc")["desiredSize"] == 0


def test_pools_without_a_reservation_and_sizes_above_max_are_refused(aws):
    clients, _ = aws
    with pytest.raises(ScaleRefused, match="rollout_pool has no capacity_reservation_id: the Cluster Autoscaler"):
        scale_pool(PROD, "rollout", 1, clients, cluster_name=CLUSTER)
    with pytest.raises(ScaleRefused, match=r"--nodes: 17 is not allowed; between 0 and trainer_pool.max_size \(16\)"):
        scale_pool(PROD, "trainer", 17, clients, cluster_name=CLUSTER)


def test_cli_refuses_with_the_reason_and_exit_1(aws, capsys):
    clients, stub = aws
    _reservation(stub, "scheduled")
    assert main(["--env", "prod", "--role", "trainer", "--nodes", "4", "--cdk-json", str(CDK_JSON)], aws=clients) == 1
    assert capsys.readouterr().err.startswith(f"refused: reservation {RESERVATION} is scheduled")


def test_cli_prints_the_node_group_it_scaled(aws, capsys):
    clients, stub = aws
    _reservation(stub, "active")
    code = main(["--env", "prod", "--role", "trainer", "--nodes", "2", "--cdk-json", str(CDK_JSON),
                 "--cluster", CLUSTER], aws=clients)
    assert code == 0
    assert capsys.readouterr().out.strip() == f"{CLUSTER}/TrainerPoolNodegroup-abc (trainer): min and desired 2, max 16"
